"""Grading and authoring: checks run in check cells, one module of checks per lab
(``lab00``, ``lab01``, ...), the lab generator, the gradebook and the papermill runner.

    from course_lib.grading import lab00
    lab00.check_ping_pong(ping_pong)        # ✓ Exercise 0.1 passed, or a message to act on
"""
