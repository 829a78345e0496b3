"""The step journal of one attempt (``StepLog``): the task's recorded steps loaded once, replayed from
memory in call order, extended durably as steps run for real. It reaches the store only through a store
call run in the worker loop's next group commit (``Loop.store_call``), and knows nothing else of the loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from . import crashpoints
from .errors import Fenced, OnwardError, StepDrift, StoreError
from .results import check_stored_size
from .step_records import (
    CHECKPOINT,
    ERROR,
    KIND_WORDS,
    VALUE,
    WAIT,
    Frame,
    decode_error,
    frame,
    is_legacy_error,
    ordinals,
    unframe,
)
from .store.base import Claim, StepRecord, Store
from .waits import received_payload, timeout_payload

# Replay policies (``@job.task(replay=...)``).
STRICT, PREFIX = "strict", "prefix"
REPLAY_POLICIES = (STRICT, PREFIX)

T = TypeVar("T")

# A store call run in the worker loop's next group commit (``Loop.store_call``): how steps reach the store.
StoreCall = Callable[[Callable[[Store], Any]], Any]


class StepLog:
    """The recorded steps of one task as one attempt sees them: loaded once, replayed from memory in call
    order, extended durably as steps run for real. Thread-safe: a task may call steps from several
    threads (each needs the task's context, e.g. through ``contextvars.copy_context().run``)."""

    def __init__(self, claim: Claim, worker_id: int, policy: str, store_call: StoreCall,
                 beat: Callable[[], None]) -> None:
        self._store_call = store_call
        self._beat = beat  # a step replayed or recorded is progress
        self.worker_id = worker_id
        self.policy = policy
        self.task = claim.name
        self.task_id = claim.task_id
        self.fence = claim.fence
        self.attempt = claim.attempt
        self._lock = threading.Lock()
        self.loaded = False
        self.reading: object = None  # the read an async task's calls share (steps.load_journal)
        self._history: list[StepRecord] = []  # every record loaded, then those this attempt wrote
        self._pending: dict[int, StepRecord] = {}  # index -> a loaded record not yet reached
        self._position = 0  # the index of the last call handed out
        self._names: dict[str, int] = {}  # calls of each name so far, for ``name#n``
        self._checkpoint: tuple[int, bytes] | None = None  # the latest checkpoint: index, payload
        self._clock_offset = 0.0  # store clock minus local clock, for durable sleeps
        self.replayed = 0
        self.saved = 0.0
        self.recorded = 0
        self._replay_told = False
        self._errors: dict[int, BaseException] = {}  # index -> the error this attempt recorded or replayed there
        self.failure: OnwardError | None = None  # drift or fencing: every later step call fails the same way
        self.store_fault: StoreError | None = None  # the store failed a call: this attempt is given back

    # -- talking to the store (always through the worker loop) --
    def _call(self, fn: Callable[[Store], T | None], refused: str) -> T:
        """Run ``fn`` in the worker loop's next group commit. ``fn`` returns None when the store refused
        the write (the fence moved on): then this attempt is over, ``Fenced`` from here on. (``fn`` itself
        never raises: it runs on the loop's thread, inside the batch of every task's writes.)"""
        try:
            value = self._store_call(fn)
        except Fenced as e:
            self.failure = e
            raise
        except StoreError as e:
            # The store could not take the call (a server restarting, a lock held past the timeout, a disk
            # fault): not the task's failure. Every later step call fails the same way, and the attempt is
            # given back uncounted (``ended_by_store_fault``); the next one loads the steps afresh, which also
            # settles a commit whose answer was lost (it may have gone through).
            self.store_fault = self.failure = e
            raise
        if value is None:
            self.failure = Fenced(f"task {self.task!r} was taken over: {refused}")
            raise Fenced(str(self.failure))
        return value

    def ended_by_store_fault(self, error: BaseException) -> bool:
        """Whether the attempt ended with ``error`` because the store failed one of its step calls: that
        error itself (or one raised again by a later step call), or one raised from it or while handling it."""
        fault = self.store_fault
        return fault is not None and (isinstance(error, StoreError) or _raised_from(error, fault))

    def load(self) -> None:
        """Read the task's records (once per attempt). Blocks for one round trip through the loop."""
        with self._lock:
            if self.loaded:
                return
            task_id, fence = self.task_id, self.fence

            def read(store: Store) -> tuple[list[StepRecord], float] | None:
                records = store.steps(task_id)
                if records and records[-1].kind == ERROR and _legacy(records[-1]):
                    # Written by an earlier version, which left the error an attempt failed with in place
                    # and ran that step again at the next load: do as it would have done.
                    if not store.drop_steps(task_id, fence, records[-1].index):
                        return None
                    records.pop()
                return records, store.now()

            records, now = self._call(read, "its steps were not read")
            self._clock_offset = now - time.time()
            self._history = records
            self._pending = {r.index: r for r in records}
            for r in records:
                if r.kind == CHECKPOINT:
                    self._checkpoint = (r.index, unframe(r.data).payload)
            self.loaded = True

    def store_now(self) -> float:
        return time.time() + self._clock_offset

    def reserve(self, count: int) -> list[int]:
        """Hand out the next ``count`` call indices at once, for calls that will run concurrently: each is
        then begun at its own (``begin(..., at=index)``), in whatever order they come, so that a call's
        position does not depend on how long the others took. One that never comes leaves its index
        unrecorded, on every attempt alike."""
        if self.failure is not None:
            raise type(self.failure)(str(self.failure))
        with self._lock:
            first = self._position + 1
            self._position += count
        return list(range(first, first + count))

    def begin(self, name: str, kind: str, mismatch: Callable[[StepRecord], str | None] | None = None,
              at: int | None = None) -> tuple[int, StepRecord | None]:
        """Hand out the next call index (or ``at``, one ``reserve`` handed out); return it with the record to
        replay there, if any. ``mismatch`` tells what makes a record of this name another call's (drift
        too), None when it fits."""
        if self.failure is not None:
            raise type(self.failure)(str(self.failure))
        with self._lock:
            if at is None:
                self._position += 1
                index = self._position
            else:
                index = at
            self._names[name] = count = self._names.get(name, 0) + 1
            record = self._pending.pop(index, None)
            if record is None:
                return index, None
            why = None
            if record.name == name and (record.kind == kind or (kind == VALUE and record.kind == ERROR)):
                why = None if mismatch is None else mismatch(record)
                if why is None:
                    return index, record
        # The same name, another kind of call (a step named "sleep" where a durable sleep was recorded):
        # said on both sides, or the message names sleep#1 twice.
        show_kind = record.name == name and KIND_WORDS.get(kind, kind) != KIND_WORDS.get(record.kind, record.kind)
        if why is None and show_kind:
            why = KIND_WORDS.get(kind, kind)
        self._drift(index, f"{name}#{count}" + (f" ({why})" if why else ""), record, show_kind)
        return index, None

    def _drift(self, index: int, called: str, record: StepRecord, show_kind: bool = False) -> None:
        history = sorted(self._history, key=lambda r: r.index)
        recorded = next(label for r, label in zip(history, ordinals(history), strict=True) if r.index == record.index)
        if show_kind:
            recorded += f" ({KIND_WORDS.get(record.kind, record.kind)})"
        message = (f"task {self.task!r}: call {index} is {called}, but the recorded history has {recorded} there"
                   " (the code changed, or the task does not call its steps in a fixed order)")
        if self.policy != PREFIX:
            self.failure = StepDrift(message + '; fix the code and `onward retry` it, or register the task with'
                                     ' replay="prefix" to drop the recorded steps from there on')
            raise type(self.failure)(str(self.failure))
        dropped = sum(1 for i in self._pending if i >= index) + 1
        task_id, fence, attempt, worker = self.task_id, self.fence, self.attempt, self.worker_id

        def drop(store: Store) -> bool | None:
            # Blocks an asyncio task's event loop for one commit: drift is rare enough not to matter.
            if not store.drop_steps(task_id, fence, index):
                return None
            store.log_event("replay", task_id=task_id, worker_id=worker, attempt=attempt,
                            detail=f"replay=prefix: dropped {dropped} recorded steps from call {index} on: {message}")
            return True

        self._call(drop, "its recorded steps were not dropped")
        with self._lock:
            self._pending = {i: r for i, r in self._pending.items() if i < index}
            self._history = [r for r in self._history if r.index < index]
            if self._checkpoint is not None and self._checkpoint[0] >= index:
                self._checkpoint = next(((r.index, unframe(r.data).payload) for r in reversed(self._history)
                                         if r.kind == CHECKPOINT), None)

    def replayed_one(self, record: StepRecord) -> Frame:
        f = unframe(record.data)
        with self._lock:
            self.replayed += 1
            if record.kind == VALUE:
                self.saved += f.seconds
        self._beat()
        return f

    def replayed_error(self, record: StepRecord, f: Frame) -> BaseException:
        """The error recorded at ``record``, to raise again (``end_failed`` knows it)."""
        return self.note_error(record.index, decode_error(f))

    def note_error(self, index: int, error: BaseException) -> BaseException:
        """``error`` is the one recorded at ``index``: raised by this attempt, or replayed."""
        with self._lock:
            self._errors[index] = error
        return error

    def end_failed(self, error: BaseException) -> None:
        """The attempt failed with ``error``. If the task's last record is a step error (or a wait's timeout)
        and ``error`` is that error (or was raised from it, or while handling it), drop that record: the
        step ended the attempt, and the next attempt runs it again (waits again). A step error the task handled stays recorded (its
        step ran to its end), even when the worker dies right after: only an attempt that failed with it
        drops it. An error with records after it stays too: dropping it would drop them."""
        if self.failure is not None or not self.loaded:
            return
        with self._lock:
            last = max((r.index for r in self._history), default=None)
            recorded = self._errors.get(last) if last is not None else None
        if last is None or recorded is None or not _raised_from(error, recorded):
            return
        task_id, fence = self.task_id, self.fence

        def drop(store: Store) -> bool:
            return store.drop_steps(task_id, fence, last)

        try:
            self._store_call(drop)
        except OnwardError:
            return  # the worker stopped or lost the claim: the record stays, replayed as the error next time
        with self._lock:
            self._history = [r for r in self._history if r.index != last]
            self._errors.pop(last, None)

    def record(self, index: int, name: str, kind: str, serializer: str, seconds: float,
               payload: bytes | Callable[[float], bytes], error: BaseException | None = None,
               replacing: bool = False) -> bytes:
        """Commit one record (durable when this returns). ``payload`` may be a function of the store's
        clock, evaluated inside the commit (durable sleeps record their deadline that way). ``error``: the
        exception an error record holds. ``replacing``: the record replayed at ``index`` is replaced. Returns
        the payload written."""
        if not callable(payload):
            check_stored_size(f"the value of step {name!r}", len(payload))
        task_id, fence, attempt, worker = self.task_id, self.fence, self.attempt, self.worker_id
        note = self._replay_note()

        def write(store: Store) -> bytes | None:
            now = store.now()
            body = payload(now) if callable(payload) else payload
            record = StepRecord(index, name, kind, frame(serializer, seconds, attempt, fence, body), now)
            if not store.record_step(task_id, fence, record):
                return None
            if note:
                store.log_event("replayed", task_id=task_id, worker_id=worker, attempt=attempt, detail=note)
            return body

        written = self._call(write, f"step {name} was not recorded")
        if crashpoints.ARMED:  # the step's record is committed; the step call has not returned yet
            crashpoints.hit("step_recorded")
        with self._lock:
            self.recorded += 1
            if replacing:
                self._history = [r for r in self._history if r.index != index]
            self._history.append(StepRecord(index, name, kind, frame(serializer, seconds, attempt, fence, written),
                                            0.0))
            if kind == CHECKPOINT:
                self._checkpoint = (index, written)
            if error is not None:
                self._errors[index] = error
        self._beat()
        return written

    def receive(self, index: int, key: str, timeout: float | None) -> tuple[bytes | None, float | None]:
        """A wait reached for real (no record at ``index``): in one store call, take the value sent for
        ``key`` or, once the wait's deadline passed, its timeout, and record it (durable when this returns).
        Returns (the record's payload, None), or (None, the deadline) when the task must park and wait;
        the deadline (store clock; None: none) is the one recorded when it parked on ``key`` before, else
        now + ``timeout``."""
        task_id, fence, attempt = self.task_id, self.fence, self.attempt

        def look(store: Store) -> tuple[bytes | None, float | None] | None:
            value, until = store.mail(task_id, key)
            now = store.now()
            if value is not None:
                payload = received_payload(value)
            else:
                if timeout is not None:
                    # At most the whole timeout from now: a deadline further ahead was set before the store's
                    # clock went back (see Store.wake_due), and would make the wait last that much longer.
                    until = now + timeout if until is None else min(until, now + timeout)
                if until is None or now < until:
                    return None, until
                payload = timeout_payload(timeout)
            record = StepRecord(index, key, WAIT, frame("json", 0.0, attempt, fence, payload), now)
            if not store.record_wait(task_id, fence, record, key):
                return None
            return payload, None

        payload, until = self._call(look, f"wait {key} was not recorded")
        if crashpoints.ARMED:  # the wait's outcome is committed, or the task is about to park (nothing committed)
            crashpoints.hit("wait_parking" if payload is None else "wait_recorded")
        if payload is not None:
            with self._lock:
                self.recorded += 1
                self._history.append(StepRecord(index, key, WAIT, frame("json", 0.0, attempt, fence, payload), 0.0))
            self._beat()
        return payload, until

    def _replay_note(self) -> str | None:
        """Once per attempt, when the first step runs for real after replayed ones: a journal line."""
        with self._lock:
            if self._replay_told or not self.replayed:
                return None
            self._replay_told = True
            return f"replayed {_steps(self.replayed)} (saved {self.saved:.1f} s)"

    def restore(self) -> bytes | None:
        """The latest checkpoint's payload; replay moves on to the call after it."""
        with self._lock:
            if self._checkpoint is None:
                return None
            index, payload = self._checkpoint
            if index > self._position:
                # Steps recorded before the checkpoint are covered by it: skip them.
                for i in [i for i in self._pending if i <= index]:
                    r = self._pending.pop(i)
                    self.replayed += 1
                    if r.kind == VALUE:
                        self.saved += unframe(r.data).seconds
                self._position = index
            return payload

    def finish(self) -> None:
        """At the end of an attempt that resumed (replayed steps): one journal line with what it recorded and
        replayed. Attempts that replayed nothing write none: that line would cost every task a commit."""
        if not self.loaded or not self.replayed or self.failure is not None:
            return
        note = self._replay_note()
        task_id, attempt, worker = self.task_id, self.attempt, self.worker_id
        total = len(self._history)
        detail = (f"steps: {self.recorded} recorded by this attempt, {self.replayed} replayed"
                  f" (saved {self.saved:.1f} s), {total} in all")

        def log(store: Store) -> None:
            if note:
                store.log_event("replayed", task_id=task_id, worker_id=worker, attempt=attempt, detail=note)
            store.log_event("steps", task_id=task_id, worker_id=worker, attempt=attempt, detail=detail)

        try:
            self._store_call(log)
        except OnwardError:
            pass  # the worker stopped: the journal line is a nicety, the records are what matter


def _legacy(record: StepRecord) -> bool:
    try:
        return is_legacy_error(unframe(record.data))
    except StoreError:
        return False


def _raised_from(error: BaseException, cause: BaseException) -> bool:
    """``error`` is ``cause``, or was raised from it or while handling it (its ``__cause__`` or
    ``__context__``, at any depth)."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        if e is cause:
            return True
        seen.add(id(e))
        stack += [e.__cause__, e.__context__]
    return False


def _steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"
