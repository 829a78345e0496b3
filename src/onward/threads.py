"""The threads Python tasks run in: a pool of daemon threads for plain functions, and one asyncio event
loop thread for every ``async def`` task of a worker.
"""

from __future__ import annotations

import asyncio
import errno
import queue
import threading
from collections.abc import Callable


def _start_thread(thread: threading.Thread) -> None:
    """Start ``thread``; when none can be started (out of memory or processes), raise ``OSError`` EAGAIN as
    a failed fork does: a shortage of the worker, not a task's fault (the runner gives the attempt back)."""
    try:
        thread.start()
    except RuntimeError as e:  # "can't start new thread": pthread_create failed
        raise OSError(errno.EAGAIN, f"cannot start a thread: {e}") from None


class ThreadPool:
    """Daemon threads that run task functions: a worker that exits must not wait for a stuck task."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` in an idle thread, or a new one (see ``_start_thread`` for when none can start)."""
        with self._lock:
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1
        if not spawn:
            self._jobs.put(job)
            return
        _start_thread(threading.Thread(target=self._work, args=(job,), name="onward-task", daemon=True))

    def _work(self, job: Callable[[], None]) -> None:
        while True:
            job()
            with self._lock:
                self._idle += 1
            job = self._jobs.get()


class EventLoopThread:
    """One asyncio event loop in a daemon thread, running every ``async def`` task of a worker. The worker
    loop (leases, heartbeats, signals) stays on its own thread, so a busy event loop cannot starve it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="onward-async", daemon=True)
        try:
            _start_thread(self._thread)
        except OSError:
            self.loop.close()
            raise

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def close(self) -> None:
        def stop() -> None:
            for task in asyncio.all_tasks(self.loop):
                task.cancel()  # what is left was abandoned (reported released): let it unwind
            self.loop.call_later(0.1, self.loop.stop)
        self.loop.call_soon_threadsafe(stop)
        self._thread.join(timeout=2.0)
        if not self._thread.is_alive():
            self.loop.close()
