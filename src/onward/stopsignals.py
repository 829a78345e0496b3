"""The signals that stop onward (a worker, its set-up, a supervisor): SIGTERM, SIGINT, and SIGHUP (a closed
terminal), unless SIGHUP is ignored.

A process started with SIGHUP ignored (``nohup onward run …``, or a parent that asked so) keeps it ignored:
onward puts no handler over that ignore, so the terminal closing does not stop the work, as ``nohup`` means,
and what onward starts (workers, tasks) inherits the ignore, as children of ``nohup`` do. Asked where a
handler is installed, not once at start: every place that takes the signals over asks this module, and none
of them changes SIGHUP while it is ignored, so the answer stays what the process was started with.
"""

from __future__ import annotations

import signal

# SIGHUP too: a worker or supervisor started from a terminal gets it when the terminal closes.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def stop_signals() -> tuple[signal.Signals, ...]:
    """``STOP_SIGNALS``, without SIGHUP while it is ignored."""
    if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
        return tuple(sig for sig in STOP_SIGNALS if sig != signal.SIGHUP)
    return STOP_SIGNALS
