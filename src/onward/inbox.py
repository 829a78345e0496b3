"""What other threads hand to the worker loop: finished attempts, and store calls from tasks' threads.

Only the loop's thread talks to the store (its connection is not shared, and steps of many tasks share one
group commit) and only its turning feeds the watchdog. So an attempt's thread that has an outcome, or a
task's thread that wants a step recorded, does not touch the store: it drops the item here and wakes the
loop through a pipe the loop's selector watches (the same pipe serves as the signal wake-up fd). The loop
takes everything at the start of a turn and commits it together with its next claims.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from .attempt import Attempt, Outcome
from .errors import Fenced
from .store.base import Store

TYPE_CHECKING = False
if TYPE_CHECKING:  # loaded at the first store call (a Python task's step): a worker of commands makes none
    from concurrent.futures import Future

T = TypeVar("T")
StoreCall = tuple[Callable[[Store], Any], "Future[Any]"]


class LoopInbox:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._finished: deque[tuple[Attempt, Outcome]] = deque()
        self._calls: deque[StoreCall] = deque()
        self._taken_calls: list[StoreCall] = []  # taken by the loop, not yet run in a commit
        self._refusing = False
        self._closed = False
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        # The loop's own thread posts too (a command's exit is seen there): it looks at the inbox before it
        # waits again (``has_finished``), so it needs no wake-up through the pipe, a write and a read per task.
        self.loop_thread = threading.get_ident()

    # --- from any thread -----------------------------------------------------------------------------
    def post(self, attempt: Attempt, outcome: Outcome) -> None:
        """Hand a finished attempt to the loop; once the loop has closed the inbox, drop it (the worker gave
        back what was still running on its way out)."""
        with self._lock:
            if self._closed:
                return
            self._finished.append((attempt, outcome))
            if threading.get_ident() != self.loop_thread:
                self.wake()  # under the lock: close() cannot close the pipe between the look and the write

    def has_finished(self) -> bool:
        """Whether an attempt was posted and not taken yet (the loop asks before it waits)."""
        return bool(self._finished)

    def has_calls(self) -> bool:
        """Whether store calls wait for the loop's next commit."""
        return bool(self._calls or self._taken_calls)

    def store_call(self, fn: Callable[[Store], T]) -> T:
        """Have the loop run ``fn(store)`` in its next group commit; block until that commit is durable
        and return the value (or raise what ``fn`` or the commit raised)."""
        from concurrent.futures import Future  # with the logging module it loads, some 5 ms of start-up

        future: Future[T] = Future()
        with self._lock:
            if self._refusing or self._closed:
                raise Fenced("the worker has stopped; nothing more can be recorded for this attempt")
            self._calls.append((fn, future))
            self.wake()
        return future.result()

    def wake(self) -> None:
        try:
            os.write(self.wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full: the loop is already due to wake up

    # --- from the loop's thread ----------------------------------------------------------------------
    def drain_wakeups(self) -> None:
        """Empty the pipe once the selector reported it readable."""
        try:
            while os.read(self.wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def take_finished(self) -> list[tuple[Attempt, Outcome]]:
        """The attempts finished since the last take; the store calls waiting now are set aside for
        ``take_calls``, so the commit that settles these outcomes also runs those calls."""
        with self._lock:
            finished = list(self._finished)
            self._finished.clear()
            self._taken_calls = list(self._calls)
            self._calls.clear()
        return finished

    def take_calls(self) -> list[StoreCall]:
        calls, self._taken_calls = self._taken_calls, []
        return calls

    def refuse_calls(self) -> None:
        """On the way out: the store calls still waiting fail (``Fenced``), and so does any later one."""
        with self._lock:
            self._refusing = True
            for _, future in [*self._calls, *self._taken_calls]:
                future.set_exception(Fenced("the worker stopped before this was recorded"))
            self._calls.clear()
            self._taken_calls = []

    def close(self) -> None:
        with self._lock:
            self._closed = True
        os.close(self.wake_r)
        os.close(self.wake_w)
