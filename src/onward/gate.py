"""The start gate between ``onward supervise`` and the ``onward run`` worker it restarts.

The supervisor starts the next worker ahead of need (a standby, once the current worker is up; or, when
there is none, as soon as the last worker is gone, while the restart delay runs), with ``START_GATE`` in its
environment: the worker loads its code and starts its spawner, then waits for the go
(``onward.entry.wait_at_gate``) before it does anything else. The delay then spaces the work, as before,
but no longer the new interpreter's start-up, which was most of a restart. ``Gate`` is the supervisor's end.
"""

from __future__ import annotations

import contextlib
import os

# "FD,PID,BACKEND,WAKE": FD, the read end of a pipe inherited from the supervisor PID (our parent), which
# writes one byte (GO) when the restart delay is over, or closes it when no restart will need this worker;
# BACKEND, "sqlite" or "postgres", the store module worth loading meanwhile; WAKE, the read end of a second
# pipe, on which the supervisor writes one byte (WAKEUP) when this worker's restart has begun: the delay
# runs, then the go comes. Woken, the worker may prepare what reads nothing but the store's own state and
# writes nothing (connect to its server: onward.entry). Any other value (or a parent other than PID) is
# ignored: the worker then starts at once, as without a supervisor. WAKE is the last field, and optional, so
# that a worker of an onward that knows only the first three still finds its gate (and takes BACKEND for
# "sqlite", which only costs it loading psycopg after the go).
START_GATE = "ONWARD_START_GATE"
GO = b"g"
WAKEUP = b"w"


class Gate:
    """The start gate of one restarted worker (see ``START_GATE``): two pipes whose read ends the worker
    inherits; ``wake`` says its restart has begun, ``open`` lets it go. Closing the write ends without the
    go (when no restart follows, or when the supervisor dies) lets the worker exit having done nothing."""

    def __init__(self, backend: str) -> None:
        # The read ends are passed on by Popen's pass_fds.
        self._read, self._write = os.pipe2(os.O_CLOEXEC)
        self._wake_read, self._wake_write = os.pipe2(os.O_CLOEXEC)
        self.value = f"{self._read},{os.getpid()},{backend},{self._wake_read}"
        self.passed = (self._read, self._wake_read)

    def started(self) -> None:
        """The worker has the read ends (or failed to start): ours are closed."""
        os.close(self._read)
        os.close(self._wake_read)

    def wake(self) -> None:
        """Say the worker's restart has begun (once)."""
        if self._wake_write >= 0:
            with contextlib.suppress(OSError):  # a worker that died meanwhile is found dead later
                os.write(self._wake_write, WAKEUP)
            os.close(self._wake_write)
            self._wake_write = -1

    def open(self) -> None:
        with contextlib.suppress(OSError):  # a worker that died meanwhile is found dead by the watch
            os.write(self._write, GO)
        self.close()

    def close(self) -> None:
        for end in (self._write, self._wake_write):
            if end >= 0:
                os.close(end)
        self._write = self._wake_write = -1
