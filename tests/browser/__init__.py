"""The browser tests as a package (``browser.conftest``, ``browser.notebook``): a plain
``conftest`` or ``notebook`` module here would take the place of tests/conftest.py, or of
Jupyter's own ``notebook``, for every other test of the session."""
