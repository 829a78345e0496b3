"""Durations for people (``42s``, ``12m05s``, ``3h07m``): in ``onward status``, its ``--watch`` view and
``onward run``'s progress bar; and the one doubling backoff of retries and restarts. A leaf module, so that
the plain status loads nothing else for it."""

from __future__ import annotations


def duration(seconds: float) -> str:
    """A duration for people: ``42s``, ``12m05s``, ``3h07m``."""
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


# 2.0 ** 1023 is the largest power of two a float holds; 2 ** 1024 as an int no longer converts to one.
_MOST_DOUBLINGS = 1023


def doubling(first: float, times: int, cap: float) -> float:
    """``first * 2 ** times``, at most ``cap``: the wait after ``times`` doublings, for any ``times`` (a task's
    1,025th attempt, a supervisor's 1,025th fast restart in a row). ``first * 2 ** times`` with an int power
    raised ``OverflowError`` from ``times`` 1,024 on; a float power this large is at most infinite, which
    the cap takes in."""
    return min(first * 2.0 ** min(max(times, 0), _MOST_DOUBLINGS), cap)
