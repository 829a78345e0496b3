"""The threads Python tasks run in: a pool of daemon threads for plain functions, and one asyncio event
loop thread for every ``async def`` task of a worker.
"""

from __future__ import annotations

import asyncio
import contextvars
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from .proc import start_thread

T = TypeVar("T")


class ThreadPool:
    """Daemon threads that run task functions: a worker that exits must not wait for a stuck task."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` in an idle thread, or a new one (see ``start_thread`` for when none can start)."""
        with self._lock:
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1
        if not spawn:
            self._jobs.put(job)
            return
        start_thread(threading.Thread(target=self._work, args=(job,), name="onward-task", daemon=True))

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
            start_thread(self._thread)
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


_OFF_LOOP = ThreadPool()  # the threads ``off_loop`` runs calls in, for every event loop of this process


async def off_loop(fn: Callable[..., T], /, *args: Any) -> T:
    """``asyncio.to_thread(fn, *args)``, except when no thread can be started (a pids cgroup or ulimit -u
    used up): then ``fn`` runs here, on the event loop's thread, once (the loop's other tasks wait for it).
    ``asyncio.to_thread`` raised ``RuntimeError: can't start new thread`` into the task (a durable step of
    an async task: its attempt failed and counted for a shortfall of the machine), and could not be tried
    again: its executor had queued the call before it found no thread to run it, to run whenever one
    starts, so a call made in place would have run twice."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    context = contextvars.copy_context()

    def settle(outcome: Callable[[], None]) -> None:
        if not future.done():  # the awaiting task may have been cancelled meanwhile
            outcome()

    def job() -> None:
        try:
            value = context.run(fn, *args)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task, as to_thread does
            error = e
            outcome = lambda: future.set_exception(error)  # noqa: E731
        else:
            outcome = lambda: future.set_result(value)  # noqa: E731
        try:
            loop.call_soon_threadsafe(settle, outcome)
        except RuntimeError:  # the loop was closed meanwhile (the worker left): nobody waits for it
            pass

    try:
        _OFF_LOOP.submit(job)
    except OSError:  # no thread could start (``start_thread``), and nothing was queued
        return fn(*args)
    return await future
