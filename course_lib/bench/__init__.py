"""Benchmarks, measured as ratios against torch's built-ins in one job:
``python -m course_lib.bench <what>`` (see ``__main__``)."""
