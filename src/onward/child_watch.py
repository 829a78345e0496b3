"""Watching one supervised child: its exit (a pidfd, and ``waitid`` without reaping), the sd_notify
datagrams it sends (from its own pid only), and its watchdog, kept as systemd keeps it. ``onward.supervise``
drives these; the protocol is described there.

Start timeout and watchdog. A child that is to say ``READY=1`` (``onward run``) is starting until it does,
for at most the start timeout (systemd's ``TimeoutStartSec=``, ``Type=notify``); one still starting then
gets its process group SIGKILLed and is restarted (cause ``start timeout: no READY=1 for S s``). Its
watchdog is armed at its ``READY=1``, as systemd arms ``WatchdogSec=`` once a service is up, or at an
earlier ``WATCHDOG=1``, as systemd does too: a start-up longer than the watchdog (opening a large store, a
slow connection to the database server) is bounded by the start timeout alone. Any other command counts
as started as soon as it runs (``Type=simple``): no start timeout, its watchdog armed at its start. With
``watchdog=S``, a child that sends no ``WATCHDOG=1`` for S seconds, counted from when the watchdog was
armed or from its last heartbeat, gets its process group SIGKILLed and is restarted (cause
``watchdog: no heartbeat for S s``). The heartbeat must come from the worker's main loop, so a loop stuck in
a deadlock or a C call holding the GIL stops it. ``onward run``'s loop wakes at least every quarter of
``WATCHDOG_USEC`` (``Notifier.watchdog_every``), whatever its ``--heartbeat``, so a short watchdog is fed.

Freeze safety. A sandbox pause (SIGSTOP of the whole tree, a cgroup freezer, a VM snapshot) stops the
supervisor together with its child, while the clock runs on. After the thaw the child's last heartbeat looks
old, but it was not the child's fault. The supervisor's loop wakes at least every ``tick`` seconds (a tenth
of a second or less), and measures how much later than asked it woke up. A lateness above the pause
threshold (one second, or half the watchdog period if that is shorter) means the supervisor itself was not
running: it logs ``supervisor resumed after N s pause`` and re-arms the watchdog, giving the child a fresh
full period to send its next heartbeat. A child that stopped alone (the supervisor kept running) shows no
such gap and is killed as wedged. The check runs before the deadline is looked at, so the order in which the
two processes thaw does not matter. All times are ``time.monotonic()``: it runs on through SIGSTOP and
freezers (hence the check); where a VM suspend stops it too, there is no gap to see and none to forgive.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterator

_NOTIFY_MAX = 4096  # systemd reads at most this much of one datagram (NOTIFY_BUFFER_MAX)
_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid


class Watchdog:
    """The deadlines of one child: its start timeout while it is starting (``start_timeout`` seconds, 0 for
    none; None when it counts as started at once) and its watchdog (``period`` seconds, or None for none),
    armed once it is started (its ``READY=1``) or by its first ``WATCHDOG=1``, re-armed by each ``READY=1``
    and ``WATCHDOG=1`` (and after a pause of the supervisor itself), fired at once by ``WATCHDOG=trigger``,
    both disarmed for good once a stop begins, as systemd does; and its stop timeout (systemd's
    ``TimeoutStopSec``), which runs from the stop the supervisor passed on (``stop``)."""

    def __init__(self, period: float | None, now: float, start_timeout: float | None = None) -> None:
        self.period = period
        self.start_timeout = start_timeout
        self.stopping = False
        self.start_from = self.armed_at = now
        self.start_deadline = now + start_timeout if start_timeout else None
        self.deadline = now + period if period and start_timeout is None else None
        self.stop_timeout = 0.0
        self.stop_from = now
        self.stop_deadline: float | None = None

    @property
    def armed(self) -> bool:
        return self.deadline is not None or self.start_deadline is not None

    def started(self, now: float) -> None:
        """The child said ``READY=1``: its start is over, its watchdog runs from now."""
        self.start_deadline = None
        self.heard(now)

    def heard(self, now: float) -> None:
        """A heartbeat (``WATCHDOG=1``): the watchdog runs again from now, armed if it was not yet."""
        if self.period and not self.stopping:
            self.armed_at, self.deadline = now, now + self.period

    def rearm(self, now: float) -> None:
        """After a pause of the supervisor itself: a fresh full period for whatever deadline runs."""
        if self.deadline is not None:
            self.armed_at, self.deadline = now, now + (self.period or 0)
        if self.start_deadline is not None:
            self.start_from, self.start_deadline = now, now + (self.start_timeout or 0)
        if self.stop_deadline is not None:
            self.stop_deadline = now + self.stop_timeout

    def trigger(self, now: float) -> None:
        if self.period and not self.stopping:
            self.deadline = now

    def disarm(self) -> None:
        self.stopping = True
        self.deadline = self.start_deadline = None

    def stop(self, now: float, timeout: float) -> None:
        """A stop was passed on to the child: disarmed, and it has ``timeout`` seconds (0: no limit) to exit,
        counted from the first stop (a second SIGTERM gives it no more time)."""
        self.disarm()
        if timeout and self.stop_deadline is None:
            self.stop_timeout, self.stop_from, self.stop_deadline = timeout, now, now + timeout

    def _next(self) -> float | None:
        deadlines = [d for d in (self.deadline, self.start_deadline, self.stop_deadline) if d is not None]
        return min(deadlines) if deadlines else None

    def expired(self, now: float) -> bool:
        deadline = self._next()
        return deadline is not None and now >= deadline

    def wait(self, tick: float, now: float) -> float:
        """How long the supervisor may sleep: a tick, or less when a deadline comes first."""
        deadline = self._next()
        return tick if deadline is None else max(0.0, min(tick, deadline - now))

    def cause(self, now: float) -> str:
        if self.stop_deadline is not None and now >= self.stop_deadline:
            return f"stop timeout: still running {now - self.stop_from:.1f} s after the stop was passed on"
        if self.start_deadline is not None and now >= self.start_deadline:
            return f"start timeout: no READY=1 for {now - self.start_from:.1f} s"
        return f"watchdog: no heartbeat for {now - self.armed_at:.1f} s"


def exit_fd(pid: int) -> int | None:
    """A descriptor that becomes readable when the child exits, so an exit is seen at once (recovery time
    is the point of a supervisor); None where pidfds are missing, and then the loop's tick notices."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def exited(pid: int) -> bool:
    """Whether the child has exited, without reaping it (its pid keeps pinning its process group id)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None


def receive(notify: socket.socket, child_pid: int) -> Iterator[dict[str, str]]:
    """The pending sd_notify datagrams from the child's own pid, each as a dict of its ``KEY=VALUE`` lines.
    Datagrams from other processes, and truncated ones, are dropped (systemd drops them too)."""
    while True:
        try:
            data, ancdata, flags, _ = notify.recvmsg(_NOTIFY_MAX, socket.CMSG_SPACE(_UCRED.size))
        except BlockingIOError:
            return
        sender = None
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                sender = _UCRED.unpack(payload[:_UCRED.size])[0]
        if sender != child_pid or flags & socket.MSG_TRUNC:
            continue
        message: dict[str, str] = {}
        for line in data.decode("utf-8", "replace").splitlines():
            key, sep, value = line.partition("=")
            if sep:
                message[key] = value
        yield message
