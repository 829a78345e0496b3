"""Speaking systemd's sd_notify protocol: READY, STATUS, WATCHDOG and STOPPING datagrams to $NOTIFY_SOCKET.

Standard library only. ``onward supervise`` listens on the same protocol, so a worker behaves the same
under systemd and under onward's own supervisor.
"""

from __future__ import annotations

import os
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    import socket  # loaded only when a supervisor listens (Notifier): its enums cost a worker's start-up some ms

# A custom sd_notify field (sd_notify(3): custom fields start with X_, systemd ignores them): the worker
# settled a task. ``onward supervise`` reads it; see ``onward.supervise``.
PROGRESS_FIELD = "X_ONWARD_PROGRESS"
# With READY=1, the absolute path of the keep-awake marker the worker keeps: a supervisor that could not read it
# from the command line (a wrapper: `sh -c "exec onward run ..."`) lets it go when it gives up, and has its
# keeper remove it should it be killed outright, as for `onward run` given directly.
MARKER_FIELD = "X_ONWARD_KEEP_AWAKE"


class Notifier:
    """Sends sd_notify messages; every method is a no-op when no supervisor listens."""

    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        self._address: str | bytes | None = None
        self._sock: socket.socket | None = None
        if address:
            # '@' names a socket in the abstract namespace, spelled with a leading NUL byte.
            self._address = "\0" + address[1:] if address.startswith("@") else address
            import socket

            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._dont_wait = socket.MSG_DONTWAIT
        # Send WATCHDOG=1 at most every quarter period: often enough to survive one late turn of the loop,
        # rarely enough that the hot loop does not pay a syscall per task.
        self._watchdog_every = (watchdog_usec / 1e6 / 4) if watchdog_usec else 0.0
        self._last_watchdog = 0.0
        self._progress_sent = False
        self._kept: list[str] = []  # messages that must not be lost, waiting for room (see send)

    @property
    def watchdog_every(self) -> float | None:
        """How often the loop calling ``watchdog()`` must wake, whatever else it waits for: a loop that
        wakes at least this often sends WATCHDOG=1 at least every half period (systemd asks for that).
        None without a watchdog."""
        return self._watchdog_every or None

    @classmethod
    def from_env(cls) -> Notifier:
        address = os.environ.get("NOTIFY_SOCKET")
        usec: int | None = None
        try:
            usec = int(os.environ.get("WATCHDOG_USEC", "")) or None
            # systemd sets WATCHDOG_PID for the main process only; a child that inherited the variable
            # must not pretend to be the watched process.
            watched_pid = os.environ.get("WATCHDOG_PID")
            if watched_pid and int(watched_pid) != os.getpid():
                usec = None
        except ValueError:
            usec = None
        return cls(address, usec)

    def send(self, message: str, keep: bool = False) -> None:
        """Send ``message`` without ever blocking. A supervisor that does not read (``onward supervise``
        SIGSTOPped alone) lets its socket's queue fill, and a blocking send then held the worker's loop,
        whose leases ran out while it waited (libsystemd's ``sd_notify`` blocks: systemd, PID 1, always
        reads). A message the queue has no room for is dropped, or, with ``keep`` (READY=1, STOPPING=1,
        progress: each said once), kept and sent before any later one, at the next send or ``watchdog()``
        call. WATCHDOG=1 and STATUS= are dropped: a full queue of unread heartbeats loses nothing by one
        more left out, and the next STATUS= replaces this one."""
        if self._sock is None or self._address is None:
            return
        if keep:
            self._kept.append(message)
            self._flush()
        elif self._flush():  # not before the kept ones: READY=1 must come first
            self._deliver(message)

    def _flush(self) -> bool:
        """Send the kept messages, in order, as far as the queue takes them; True once none is left."""
        while self._kept:
            if self._deliver(self._kept[0]) is None:
                return False
            self._kept.pop(0)
        return True

    def _deliver(self, message: str) -> bool | None:
        """One datagram, never blocking: True if sent, None if the supervisor's queue is full (try again
        later), False if it cannot be sent at all (no supervisor listens there any more)."""
        assert self._sock is not None and self._address is not None
        try:
            self._sock.sendto(message.encode(), self._dont_wait, self._address)
        except BlockingIOError:
            return None
        except OSError:
            # The supervisor may be restarting or gone; a lost notification must never stop the work.
            return False
        return True

    def ready(self, marker: str | None = None) -> None:
        """Tell the supervisor the worker is up, and the keep-awake marker it keeps (``MARKER_FIELD``) if any; a
        path with a line break in it cannot be told (a field is one line) and is left out."""
        said = f"\n{MARKER_FIELD}={os.path.abspath(marker)}" if marker and "\n" not in marker else ""
        self.send(f"READY=1\nMAINPID={os.getpid()}{said}", keep=True)

    def status(self, text: str) -> None:
        self.send("STATUS=" + text.replace("\n", " "))

    def watchdog(self) -> None:
        """Called at every turn of the worker's loop: sends WATCHDOG=1 when due, and what ``send`` kept."""
        if self._kept:
            self._flush()
        if not self._watchdog_every:
            return
        now = time.monotonic()
        if now - self._last_watchdog >= self._watchdog_every:
            self._last_watchdog = now
            self.send("WATCHDOG=1")

    def progress(self) -> None:
        """Tell the supervisor, once per process, that this worker settled a task (committed its outcome):
        ``onward supervise`` then restarts it without backoff and does not count its death as a crash loop."""
        if not self._progress_sent:
            self._progress_sent = True
            self.send(PROGRESS_FIELD + "=1", keep=True)

    def stopping(self) -> None:
        self.send("STOPPING=1", keep=True)

    def close(self) -> None:
        if self._sock is not None:
            self._flush()  # one last try: a supervisor that stays stopped sees the exit instead
            self._sock.close()
            self._sock = None
