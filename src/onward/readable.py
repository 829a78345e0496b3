"""The descriptors the worker loop waits on, each with what to call when it is readable: ``selectors``'
``EpollSelector`` cut down to what the loop uses.

Why not ``selectors``: the loop registers three descriptors per command (its stdout and stderr pipes and its
pidfd) and unregisters them at its exit. Each of those calls goes through a key object, a lookup of the
file object's descriptor and a dictionary of keys, about 40 Python calls a command; here each is one
dictionary operation and one ``epoll_ctl``. The behaviour the loop relies on is kept: registering a
descriptor twice raises KeyError, unregistering one that was closed meanwhile only forgets it (the kernel
dropped it from the epoll set with its last reference), a wait interrupted by a signal returns nothing,
and the callbacks of one wait are the ones registered when it returned, called in the kernel's order.
"""

from __future__ import annotations

import select
from collections.abc import Callable


class ReadableFds:
    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._callbacks: dict[int, Callable[[], None]] = {}

    def register(self, fd: int, callback: Callable[[], None]) -> None:
        if fd in self._callbacks:
            raise KeyError(f"descriptor {fd} is registered already")
        self._epoll.register(fd, select.EPOLLIN)
        self._callbacks[fd] = callback

    def unregister(self, fd: int) -> None:
        del self._callbacks[fd]
        try:
            self._epoll.unregister(fd)
        except OSError:
            pass  # closed since it was registered: the kernel forgot it then

    def wait(self, timeout: float) -> list[Callable[[], None]]:
        """The callbacks of the descriptors readable within ``timeout`` seconds (also at end of file, or an
        error: the callback's read finds out which)."""
        # (epoll_wait counts whole milliseconds: Python's poll rounds a timeout up, so no wait is shorter than
        # asked, and a loop never turns early, then again.)
        try:
            events = self._epoll.poll(max(timeout, 0.0), max(len(self._callbacks), 1))
        except InterruptedError:
            return []
        callbacks = self._callbacks
        return [callbacks[fd] for fd, _ in events if fd in callbacks]

    def close(self) -> None:
        self._epoll.close()
        self._callbacks.clear()
