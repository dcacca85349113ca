"""What runs beside a submission while the gradebook grades it (the student's side).

A small fixed program and nothing of the grader: :mod:`~course_lib.submission.collector`
runs the notebook's cells and the requests the judge sends,
:mod:`~course_lib.submission.calls` binds and runs one request (its harness arrives by
value from the judge), :mod:`~course_lib.submission.plain` is the only form an answer
leaves in, and :mod:`course_lib.submission.grading` is what ``course_lib.grading`` is
inside the sandbox: a stand-in. This package imports the runtime, never the grader.
"""
