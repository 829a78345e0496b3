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

# "FD,PID,BACKEND": the read end of a pipe, inherited from the supervisor PID (our parent), which writes one
# byte when the restart delay is over, or closes it when no restart will need this worker; BACKEND is
# "sqlite" or "postgres", the store module worth loading meanwhile. Any other value (or a parent other than PID) is
# ignored: the worker then starts at once, as without a supervisor.
START_GATE = "ONWARD_START_GATE"
GO = b"g"


class Gate:
    """The start gate of one restarted worker (see ``START_GATE``): a pipe whose read end the
    worker inherits; ``open`` lets it go. Closing the write end without the go (when no restart follows, or
    when the supervisor dies) lets the worker exit having done nothing."""

    def __init__(self, backend: str) -> None:
        self._read, self._write = os.pipe2(os.O_CLOEXEC)  # the read end is passed on by Popen's pass_fds
        self.value = f"{self._read},{os.getpid()},{backend}"
        self.passed = (self._read,)

    def started(self) -> None:
        """The worker has the read end (or failed to start): ours is closed."""
        os.close(self._read)

    def open(self) -> None:
        with contextlib.suppress(OSError):  # a worker that died meanwhile is found dead by the watch
            os.write(self._write, GO)
        self.close()

    def close(self) -> None:
        if self._write >= 0:
            os.close(self._write)
            self._write = -1
