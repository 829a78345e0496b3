"""A reader that goes away early (`onward list | head`, `onward status | head -1`) is not an error worth a
traceback: what is left to write goes nowhere. Nor is stdout on a full disk: one line, exit 75."""

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


def unavailable_line(e: OSError, doing: str = "") -> str | None:
    """The one line that says an OSError of the machine rather than of the input (``UNAVAILABLE_ERRNOS``: no
    descriptor left, no memory, a full or failing disk: the command exits 75), or None for any other, which
    the caller raises again. Stdout may be what failed, so it is pointed at /dev/null first: the flush at
    exit must not fail again. ``doing``: what failed, when the error cannot say it (a flush has no file)."""
    from .errors import UNAVAILABLE_ERRNOS

    if e.errno not in UNAVAILABLE_ERRNOS:
        return None
    quiet_broken_pipe()
    if doing:
        return f"{doing}: {e.strerror}"
    return f"{e.strerror}: {e.filename}" if e.filename else str(e.strerror)
