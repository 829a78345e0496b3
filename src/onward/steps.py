"""Durable steps: a task's calls (model calls, tool calls) recorded in the store as they return, and
replayed from memory when the task runs again after a crash.

    from onward import step

    @step                                   # also @step(max_attempts=3, retry_on=(TimeoutError,), backoff=0.5)
    def ask_model(messages): ...

Inside a task, calling a step either returns its recorded value (the call completed in an earlier attempt)
or runs the body and commits the value before returning it. Outside any task a step is a plain call.

How it works, and why:

- *Identity.* A step is named by its name and its position among the task's recorded calls: the 7th call
  of the task, the 3rd call of ``llm`` (shown ``llm#3``). Arguments are not part of the identity: replay
  expects the same calls in the same order, which holds when every input that varies (time, randomness,
  remote answers) comes from steps. A call whose name (or kind) differs from the record at its position
  is *drift*: the attempt fails with ``StepDrift`` naming both; a recorded value is never handed to another
  step. Drift counts as a failed attempt, retried with backoff up to the task's max attempts (so that fixed
  code deployed meanwhile picks up where it stopped, as Temporal retries a workflow task); a retried
  attempt that drifts again replays recorded values only, so it costs nothing and repeats no side effect.
  With ``replay="prefix"`` the recorded steps from the drift on are dropped and the task runs on.
- *Loading once.* The first step call of an attempt reads the task's records (one round trip through the
  worker loop, ``Loop.store_call``); replay then works from memory.
- *Recording.* A step's value is serialized (JSON by default; ``serializer=PICKLE`` or your own), framed
  (below) and written with ``Store.record_step`` under the claim's fence, inside the worker loop's next
  group commit: the step returns only once its record is durable, and steps of concurrent tasks share one
  fsync. A refused write (the task was taken over) raises ``Fenced`` and the attempt stops. The value a step
  returns is always the one decoded from its record, on the first run as on replay, so both paths see the
  same value (a tuple comes back as a list under JSON, either way).
- *Errors.* An exception that escapes a step body (after its retries) is recorded too (kind ``error``) and
  raised again on replay, so a task that caught it takes the same path. The last record being an error
  means the attempt most likely ended because of it: the next attempt drops that one record and runs the
  step again (task retries retry the failed call). onward's own exceptions (cancellation, fencing, drift)
  are never recorded.
- *Nesting.* While a step body runs, steps it calls are plain calls: the outer step is the unit recorded.
- *Stopping.* A step about to run for real first checks the attempt: when the worker is stopping (SIGTERM)
  or the attempt was cancelled, it raises ``Cancelled`` instead of paying for a call whose result could
  not be kept; the task is given back and the next run replays up to there.

A record's ``data`` is ``b"<serializer> <seconds> <attempt> <fence>\\n"`` followed by the payload: the
serializer's name (checked on replay), the seconds the body took (the time a replay saves), and the attempt
and fence that recorded it (``onward status`` counts records of earlier claims as replayed).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import hashlib
import inspect
import json
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, overload

from .errors import Fenced, OnwardError, StepDrift, StoreError, UsageError
from .store.base import Claim, StepRecord, Store

# Record kinds (StepRecord.kind).
VALUE, ERROR, CHECKPOINT, SLEEP = "value", "error", "checkpoint", "sleep"
# Replay policies (``@job.task(replay=...)``).
STRICT, PREFIX = "strict", "prefix"
REPLAY_POLICIES = (STRICT, PREFIX)

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

# A store call run in the worker loop's next group commit (``Loop.store_call``): how steps reach the store.
StoreCall = Callable[[Callable[[Store], Any]], Any]


class StepContext(Protocol):
    """What the step machinery needs of a task's context (``onward.context`` implements it)."""

    @property
    def step_log(self) -> StepLog: ...

    def check(self) -> None: ...

    def pause(self, seconds: float, note: str | None = None) -> None: ...

    async def apause(self, seconds: float, note: str | None = None) -> None: ...


# The context of the task running in this thread or asyncio task; set by the attempt while the task
# function runs. ContextVars follow asyncio tasks and asyncio.to_thread, not threads a task starts itself.
CURRENT: contextvars.ContextVar[StepContext | None] = contextvars.ContextVar("onward_task", default=None)


@dataclass(frozen=True)
class StepCall:
    """The step whose body is running in this context."""

    name: str
    index: int
    key: str


_RUNNING_STEP: contextvars.ContextVar[StepCall | None] = contextvars.ContextVar("onward_step", default=None)


class StepError(OnwardError):
    """A recorded step error replayed when its original exception could not be rebuilt: carries its type
    name and message."""


# --- serializers ------------------------------------------------------------------------------------------
class Serializer(Protocol):
    """Turns step values into bytes and back. ``name`` is written with every record and checked on replay."""

    name: str

    def dumps(self, value: Any) -> bytes: ...

    def loads(self, data: bytes) -> Any: ...


class JsonSerializer:
    name = "json"

    def dumps(self, value: Any) -> bytes:
        try:
            return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
        except (TypeError, ValueError) as e:
            raise UsageError(f"a step returned a value that is not JSON ({e}); pass serializer=onward.steps.PICKLE"
                             " or your own to @step") from None

    def loads(self, data: bytes) -> Any:
        return json.loads(data)


class PickleSerializer:
    """Any picklable value. Only load stores you trust: unpickling runs code named by the data."""

    name = "pickle"

    def dumps(self, value: Any) -> bytes:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)

    def loads(self, data: bytes) -> Any:
        return pickle.loads(data)


JSON: Serializer = JsonSerializer()
PICKLE: Serializer = PickleSerializer()


# --- records ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Frame:
    """A record's data, unpacked."""

    serializer: str
    seconds: float
    attempt: int
    fence: int
    payload: bytes


def frame(serializer: str, seconds: float, attempt: int, fence: int, payload: bytes) -> bytes:
    return b"%s %.6f %d %d\n" % (serializer.encode(), seconds, attempt, fence) + payload


def unframe(data: bytes) -> Frame:
    head, sep, payload = data.partition(b"\n")
    parts = head.split(b" ")
    if not sep or len(parts) != 4:
        raise StoreError("a step record is not in onward's format (written by something else?)")
    return Frame(parts[0].decode(), float(parts[1]), int(parts[2]), int(parts[3]), payload)


def ordinals(records: Sequence[StepRecord]) -> list[str]:
    """``name#n`` for each record: the n-th call of that name."""
    seen: dict[str, int] = {}
    out = []
    for r in records:
        seen[r.name] = seen.get(r.name, 0) + 1
        out.append(f"{r.name}#{seen[r.name]}")
    return out


def summarize(records: Sequence[StepRecord], fence: int | None) -> dict[str, Any]:
    """For status: how many steps a task has recorded, how many of them came from earlier claims than
    ``fence`` (replayed, or about to be, by the current attempt), and the time those took originally."""
    replayed, saved = 0, 0.0
    for r in records:
        try:
            f = unframe(r.data)
        except (StoreError, ValueError):
            continue
        if fence is not None and f.fence < fence:
            replayed += 1
            if r.kind == VALUE:
                saved += f.seconds
    return {"recorded": len(records), "replayed": replayed, "saved_seconds": round(saved, 3)}


def idempotency_key(task: str, name: str, index: int) -> str:
    """Stable for (task, step name, call index); different for any other step."""
    digest = hashlib.sha256(f"{task}\0{name}\0{index}".encode("utf-8", "surrogatepass")).hexdigest()
    return "onward-" + digest[:32]


def current_step_key() -> str:
    """The idempotency key of the step whose body is running (also ``ctx.idempotency_key``): pass it to a
    remote API that deduplicates requests, and a step re-run after a crash is not charged twice."""
    call = _RUNNING_STEP.get()
    if call is None:
        raise UsageError("no step is running here: an idempotency key exists only inside a step's body")
    return call.key


def _encode_error(e: BaseException) -> tuple[str, bytes]:
    try:
        data = pickle.dumps(e, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(data)  # some exceptions pickle but cannot be rebuilt (their __init__ wants other args)
        return "pickle", data
    except Exception:
        return "json", json.dumps({"type": f"{type(e).__module__}.{type(e).__qualname__}",
                                   "message": str(e)}).encode()


def _decode_error(f: Frame) -> BaseException:
    if f.serializer == "pickle":
        try:
            e = pickle.loads(f.payload)
            if isinstance(e, BaseException):
                return e
        except Exception:
            pass
        return StepError("a recorded step error could not be rebuilt")
    info = json.loads(f.payload)
    return StepError(f"{info['type']}: {info['message']}")


# --- one attempt's history --------------------------------------------------------------------------------
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
        self.failure: OnwardError | None = None  # drift or fencing: every later step call fails the same way

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
        if value is None:
            self.failure = Fenced(f"task {self.task!r} was taken over: {refused}")
            raise Fenced(str(self.failure))
        return value

    def load(self) -> None:
        """Read the task's records (once per attempt). Blocks for one round trip through the loop."""
        with self._lock:
            if self.loaded:
                return
            task_id, fence = self.task_id, self.fence

            def read(store: Store) -> tuple[list[StepRecord], float] | None:
                records = store.steps(task_id)
                if records and records[-1].kind == ERROR:
                    # The previous attempt most likely ended because of this error: run that step again.
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

    def begin(self, name: str, kind: str) -> tuple[int, StepRecord | None]:
        """Hand out the next call index; return it with the record to replay there, if any."""
        if self.failure is not None:
            raise type(self.failure)(str(self.failure))
        with self._lock:
            self._position += 1
            index = self._position
            self._names[name] = count = self._names.get(name, 0) + 1
            record = self._pending.pop(index, None)
            if record is None or (record.name == name and (
                    record.kind == kind or (kind == VALUE and record.kind == ERROR))):
                return index, record
        self._drift(index, f"{name}#{count}", record)
        return index, None

    def _drift(self, index: int, called: str, record: StepRecord) -> None:
        history = sorted(self._history, key=lambda r: r.index)
        recorded = next(label for r, label in zip(history, ordinals(history), strict=True) if r.index == record.index)
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

    def record(self, index: int, name: str, kind: str, serializer: str, seconds: float,
               payload: bytes | Callable[[float], bytes]) -> bytes:
        """Commit one record (durable when this returns). ``payload`` may be a function of the store's
        clock, evaluated inside the commit (durable sleeps record their deadline that way). Returns the
        payload written."""
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
        with self._lock:
            self.recorded += 1
            self._history.append(StepRecord(index, name, kind, frame(serializer, seconds, attempt, fence, written),
                                            0.0))
            if kind == CHECKPOINT:
                self._checkpoint = (index, written)
        self._beat()
        return written

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


def _steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


# --- the step decorator -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepSpec:
    name: str
    max_attempts: int = 1
    retry_on: tuple[type[BaseException], ...] = (Exception,)
    backoff: float = 1.0
    max_backoff: float = 60.0
    serializer: Serializer = JSON

    def delay(self, failures: int) -> float:
        """The wait before the next try, after ``failures`` failed tries: backoff, 2*backoff, 4*backoff..."""
        return float(min(self.backoff * 2 ** (failures - 1), self.max_backoff))


def active_context() -> StepContext | None:
    """The task context steps record into, or None for a plain call (outside a task, or inside a step)."""
    if _RUNNING_STEP.get() is not None:
        return None
    return CURRENT.get()


def in_step() -> bool:
    """True while a step's body runs in this context."""
    return _RUNNING_STEP.get() is not None


def not_in_step(what: str) -> None:
    if _RUNNING_STEP.get() is not None:
        # On replay the body does not run, so whatever it recorded would shift every later position.
        raise UsageError(f"{what} cannot be called inside a step's body")


def _retryable(spec: StepSpec, e: BaseException, tries: int) -> bool:
    return tries < spec.max_attempts and isinstance(e, spec.retry_on) and not isinstance(e, OnwardError)


def _recordable(e: BaseException) -> bool:
    return isinstance(e, Exception) and not isinstance(e, OnwardError)


def _replay(log: StepLog, spec: StepSpec, record: StepRecord) -> Any:
    f = log.replayed_one(record)
    if record.kind == ERROR:
        raise _decode_error(f)
    if f.serializer != spec.serializer.name:
        raise UsageError(f"step {spec.name} was recorded with serializer {f.serializer!r} but now uses"
                         f" {spec.serializer.name!r}")
    return spec.serializer.loads(f.payload)


_SAME_THROUGH_JSON = (str, int, float, bool, type(None))


def _as_recorded(spec: StepSpec, value: Any, payload: bytes) -> Any:
    """The value as replay will return it: decoded from the record (skipped for JSON scalars, which come
    back equal and of the same type)."""
    if spec.serializer is JSON and type(value) in _SAME_THROUGH_JSON:
        return value
    return spec.serializer.loads(payload)


def run_step(ctx: StepContext, spec: StepSpec, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    log = ctx.step_log
    if not log.loaded:
        log.load()
    index, record = log.begin(spec.name, VALUE)
    if record is not None:
        return _replay(log, spec, record)
    ctx.check()  # stopping or cancelled: do not pay for a call whose result could not be kept
    token = _RUNNING_STEP.set(StepCall(spec.name, index, idempotency_key(log.task, spec.name, index)))
    started = time.monotonic()
    tries = 1
    try:
        while True:
            try:
                value = fn(*args, **kwargs)
                break
            except BaseException as e:
                if not _retryable(spec, e, tries):
                    raise
                ctx.pause(spec.delay(tries), f"step {spec.name}: retry {tries} of {spec.max_attempts - 1}")
                tries += 1
    except BaseException as e:
        _RUNNING_STEP.reset(token)
        if _recordable(e):
            kind, data = _encode_error(e)
            log.record(index, spec.name, ERROR, kind, time.monotonic() - started, data)
        raise
    _RUNNING_STEP.reset(token)
    payload = spec.serializer.dumps(value)
    log.record(index, spec.name, VALUE, spec.serializer.name, time.monotonic() - started, payload)
    return _as_recorded(spec, value, payload)


async def run_step_async(ctx: StepContext, spec: StepSpec, fn: Callable[..., Any], args: Any,
                         kwargs: Any) -> Any:
    log = ctx.step_log
    if not log.loaded:
        await asyncio.to_thread(log.load)
    index, record = log.begin(spec.name, VALUE)
    if record is not None:
        return _replay(log, spec, record)
    ctx.check()
    token = _RUNNING_STEP.set(StepCall(spec.name, index, idempotency_key(log.task, spec.name, index)))
    started = time.monotonic()
    tries = 1
    try:
        while True:
            try:
                value = fn(*args, **kwargs)
                if inspect.isawaitable(value):
                    value = await value
                break
            except BaseException as e:
                if not _retryable(spec, e, tries):
                    raise
                await ctx.apause(spec.delay(tries), f"step {spec.name}: retry {tries} of {spec.max_attempts - 1}")
                tries += 1
    except BaseException as e:
        _RUNNING_STEP.reset(token)
        if _recordable(e):
            kind, data = _encode_error(e)
            await asyncio.to_thread(log.record, index, spec.name, ERROR, kind, time.monotonic() - started, data)
        raise
    _RUNNING_STEP.reset(token)
    payload = spec.serializer.dumps(value)
    # The commit blocks a thread, not the event loop: other asyncio tasks run on (and share the fsync).
    await asyncio.to_thread(log.record, index, spec.name, VALUE, spec.serializer.name,
                            time.monotonic() - started, payload)
    return _as_recorded(spec, value, payload)


@overload
def step(fn: F) -> F: ...
@overload
def step(*, name: str | None = None, max_attempts: int = 1,
         retry_on: type[BaseException] | tuple[type[BaseException], ...] = (Exception,), backoff: float = 1.0,
         max_backoff: float = 60.0, serializer: Serializer = JSON) -> Callable[[F], F]: ...


def step(fn: Any = None, *, name: str | None = None, max_attempts: int = 1,
         retry_on: type[BaseException] | tuple[type[BaseException], ...] = (Exception,), backoff: float = 1.0,
         max_backoff: float = 60.0, serializer: Serializer = JSON) -> Any:
    """Make a function (sync or ``async``) a durable step: inside a task its value is recorded when it
    returns and replayed when the task runs again; outside a task it is a plain call.

    ``name`` (default: the function's qualified name, ``Class.method`` or ``function``) identifies the step in the recorded history: renaming
    the function makes a resumed task drift, so pin a name on steps whose code may move. ``max_attempts``,
    ``retry_on`` and ``backoff``: the body is retried in place on those exceptions, waiting backoff,
    2*backoff, ... (at most ``max_backoff``) seconds; only the final outcome is recorded. ``serializer``:
    how the value is stored (JSON by default)."""
    if max_attempts < 1:
        raise UsageError(f"max_attempts must be at least 1 (got {max_attempts})")
    if backoff < 0 or max_backoff < 0:
        raise UsageError("backoff cannot be negative")
    retry = retry_on if isinstance(retry_on, tuple) else (retry_on,)

    def decorate(f: F) -> F:
        spec = StepSpec(name or f.__qualname__.rsplit("<locals>.", 1)[-1], max_attempts, retry, backoff, max_backoff, serializer)
        if inspect.iscoroutinefunction(f):
            @functools.wraps(f)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                ctx = active_context()
                if ctx is None:
                    return await f(*args, **kwargs)
                return await run_step_async(ctx, spec, f, args, kwargs)
            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            ctx = active_context()
            if ctx is None:
                return f(*args, **kwargs)
            return run_step(ctx, spec, f, args, kwargs)
        return wrapper  # type: ignore[return-value]

    return decorate(fn) if fn is not None else decorate


# --- durable sleep and checkpoints (behind ctx.sleep / ctx.checkpoint / ctx.restore) ----------------------
# Each returns what it can answer from memory, or a function that commits, for the caller to run in place
# (a sync task) or in a thread (an asyncio task, so that the event loop does not wait on the fsync).
def sleep_deadline(log: StepLog, seconds: float) -> float | Callable[[], float]:
    """A durable sleep's deadline on the store's clock: recorded on the first run, read back on replay."""
    index, record = log.begin("sleep", SLEEP)
    if record is not None:
        return float(JSON.loads(log.replayed_one(record).payload))

    def commit() -> float:
        payload = log.record(index, "sleep", SLEEP, JSON.name, seconds, lambda now: JSON.dumps(now + seconds))
        return float(JSON.loads(payload))
    return commit


def checkpoint(log: StepLog, value: Any) -> Callable[[], object] | None:
    index, record = log.begin("checkpoint", CHECKPOINT)
    if record is not None:
        log.replayed_one(record)  # replaying through a checkpoint keeps the recorded one
        return None
    payload = JSON.dumps(value)
    return lambda: log.record(index, "checkpoint", CHECKPOINT, JSON.name, 0.0, payload)


def restore(log: StepLog, default: Any) -> Any:
    payload = log.restore()
    return default if payload is None else JSON.loads(payload)


__all__ = ["step", "current_step_key", "Serializer", "JSON", "PICKLE", "StepError", "StepLog", "REPLAY_POLICIES"]
