"""Durations for people (``42s``, ``12m05s``, ``3h07m``): in ``onward status``, its ``--watch`` view and
``onward run``'s progress bar. A leaf module, so that the plain status loads nothing else for it."""

from __future__ import annotations


def duration(seconds: float) -> str:
    """A duration for people: ``42s``, ``12m05s``, ``3h07m``."""
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
