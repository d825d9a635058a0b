"""`python -m jupyter_pagedkv COMMAND ...` run in this process, as a user types it: tests reach the
benchmarks' command lines through the package's own entry point, never by importing `bench/`."""
from __future__ import annotations

import contextlib
import io
import sys


def run_command(argv: list[str]) -> tuple[int, str]:
    """(exit status, stdout and stderr together); `sys.argv` is restored afterwards."""
    from jupyter_pagedkv.__main__ import main

    out, saved = io.StringIO(), sys.argv
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = main(argv)
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
        finally:
            sys.argv = saved
    return code, out.getvalue()
