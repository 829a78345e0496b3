"""A reader that goes away early (`onward list | head`, `onward status | head -1`) is not an error worth a
traceback: what is left to write goes nowhere."""

from __future__ import annotations

import os
import sys


def quiet_broken_pipe() -> None:
    """After a BrokenPipeError on stdout: point stdout at /dev/null, so that the flush at exit fails no more."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except OSError:
        pass
