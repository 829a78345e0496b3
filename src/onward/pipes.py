"""A reader that goes away early (`onward list | head`, `onward status | head -1`) is not an error worth a
traceback: what is left to write goes nowhere. Nor is stdout on a full disk, nor no memory left: one line,
exit 75."""

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


def out_of_memory_line(e: MemoryError) -> str:
    """The one line for a command that ran out of memory (exit 75, unavailable right now, as ``ENOMEM`` is).
    What the command held is let go first: the tracebacks of ``e`` and of the errors it was raised while
    handling keep every frame's locals alive (a worker's results, a report's rows), and saying the line
    takes memory too."""
    import traceback

    seen: set[int] = set()
    error: BaseException | None = e
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__context__
    return "out of memory"
