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
  raised again on replay, so a task that caught it takes the same path. An attempt that fails with that
  error while it is the last record drops it as it ends (``StepLog.end_failed``), so the next attempt runs
  the step again (task retries retry the failed call); a handled error stays, even across a worker's death.
  onward's own exceptions (cancellation, fencing, drift) are never recorded.
- *Nesting.* While a step body runs, steps it calls are plain calls: the outer step is the unit recorded.
- *Stopping.* A step about to run for real first checks the attempt: when the worker is stopping (SIGTERM)
  or the attempt was cancelled, it raises ``Cancelled`` instead of paying for a call whose result could
  not be kept; the task is given back and the next run replays up to there.

The record format lives in ``onward.step_records``, the journal of one attempt in ``onward.step_log``; this
module is the API on top of them (``@step``, ``run_step``, durable sleep and checkpoints).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, overload

from .config import is_number
from .durations import doubling
from .errors import OnwardError, UsageError
from .step_log import REPLAY_POLICIES, STRICT, StepLog
from .step_records import (
    CHECKPOINT,
    ERROR,
    JSON,
    PICKLE,
    SLEEP,
    VALUE,
    Serializer,
    StepError,
    encode_error,
    idempotency_key,
    recordable,
)
from .store.base import StepRecord
from .threads import off_loop

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


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



def current_step_key() -> str:
    """The idempotency key of the step whose body is running (also ``ctx.idempotency_key``): pass it to a
    remote API that deduplicates requests, and a step re-run after a crash is not charged twice."""
    call = _RUNNING_STEP.get()
    if call is None:
        raise UsageError("no step is running here: an idempotency key exists only inside a step's body")
    return call.key


# --- the step decorator -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepSpec:
    name: str
    max_attempts: int = 1
    retry_on: tuple[type[BaseException], ...] = (Exception,)
    backoff: float = 1.0
    max_backoff: float = 60.0
    serializer: Serializer = JSON
    # What makes a record of this name at this step's position another call's (None: nothing does), as
    # ``StepLog.begin`` takes it: e.g. a durable client's call without ``stream`` finding a stream recorded.
    mismatch: Callable[[StepRecord], str | None] | None = None

    def __post_init__(self) -> None:
        # A name is compared with the recorded history on replay, and stored: a number (123) was recorded
        # as text and then never matched its own record again (the task failed for good on its first
        # replay); a NUL or a lone surrogate could be stored by one backend and not the other.
        if not isinstance(self.name, str) or not self.name:
            raise UsageError(f"a step's name must be a non-empty str, not {self.name!r}")
        if "\0" in self.name:
            raise UsageError(f"a step's name cannot contain a NUL character: {self.name!r}")
        try:
            self.name.encode("utf-8")
        except UnicodeEncodeError:
            raise UsageError(f"a step's name is not valid Unicode: {self.name!r}") from None
        # Checked where the step is declared: a NaN backoff was taken, and made every retry's wait NaN (an
        # error deep in the task's thread at its first failure); True tries was a slip taken for 1.
        if not isinstance(self.max_attempts, int) or isinstance(self.max_attempts, bool) or self.max_attempts < 1:
            raise UsageError(f"step {self.name!r}: max_attempts must be a whole number, at least 1 (got {self.max_attempts!r})")
        for what in ("backoff", "max_backoff"):
            value = getattr(self, what)
            if not is_number(value) or not math.isfinite(value) or value < 0:
                raise UsageError(f"step {self.name!r}: {what} must be a finite number of seconds, 0 or more"
                                 f" (got {value!r:.60})")
        if not all(isinstance(kind, type) and issubclass(kind, BaseException)
                                        for kind in self.retry_on):
            raise UsageError(f"step {self.name!r}: retry_on must be an exception class or a tuple of them"
                             f" (got {self.retry_on!r:.60})")
        serializer_name = getattr(self.serializer, "name", None)
        # Written at the head of every record, before a space: a name holding a space or a line break (or one
        # that is not text) made every record unreadable on replay, "not in onward's format", for good.
        if not isinstance(serializer_name, str) or not serializer_name or not serializer_name.isprintable() \
                or any(c.isspace() for c in serializer_name):
            raise UsageError(f"step {self.name!r}: a serializer's name must be a non-empty str of printable"
                             f" characters without spaces (got {serializer_name!r:.60})")
        if not (callable(getattr(self.serializer, "dumps", None)) and callable(getattr(self.serializer, "loads", None))):
            raise UsageError(f"step {self.name!r}: a serializer needs dumps(value) -> bytes and loads(bytes)"
                             f" (got {self.serializer!r:.60})")

    def delay(self, failures: int) -> float:
        """The wait before the next try, after ``failures`` failed tries: backoff, 2*backoff, 4*backoff..."""
        return float(doubling(self.backoff, failures - 1, self.max_backoff))


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


def replay(log: StepLog, spec: StepSpec, record: StepRecord) -> Any:
    """The value recorded at ``record``, or its error raised again (``StepLog.end_failed`` knows it)."""
    f = log.replayed_one(record)
    if record.kind == ERROR:
        raise log.replayed_error(record, f)
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


class StepRun:
    """A step call reached for real (no record at its position): its call index and key, the time its
    first try began, and the two ways it ends, each committing the step's record (durable when it returns;
    an asyncio caller runs them in a thread). What makes a try and when to try again is the caller's:
    ``run_step``'s retry loop, or a framework that retries a call by calling again (``openai_agents``)."""

    def __init__(self, log: StepLog, spec: StepSpec, index: int) -> None:
        self.log, self.spec, self.index = log, spec, index
        self.key = idempotency_key(log.task, spec.name, index)
        self.started = time.monotonic()

    @contextlib.contextmanager
    def body(self) -> Iterator[None]:
        """While a try of the body runs: ``current_step_key()`` is this step's, and steps called from the
        body are plain calls (the outer step is what is recorded)."""
        token = _RUNNING_STEP.set(StepCall(self.spec.name, self.index, self.key))
        try:
            yield
        finally:
            _RUNNING_STEP.reset(token)

    def failed(self, e: BaseException) -> None:
        """No try follows the one that raised ``e``: record it as the step's outcome (onward's own exceptions,
        cancellation, fencing, drift, are not a step's outcome and are not recorded)."""
        if recordable(e):
            kind, data = encode_error(e)
            self.log.record(self.index, self.spec.name, ERROR, kind, time.monotonic() - self.started, data, e)

    def returned(self, value: Any) -> Any:
        """Record ``value``; return it as replay will (decoded from the record)."""
        payload = self.spec.serializer.dumps(value)
        self.log.record(self.index, self.spec.name, VALUE, self.spec.serializer.name,
                        time.monotonic() - self.started, payload)
        return _as_recorded(self.spec, value, payload)


def begin_step(ctx: StepContext, spec: StepSpec, at: int | None = None) -> StepRun | StepRecord:
    """Take the step's call index in the loaded journal (the next one, or ``at``, reserved for it with
    ``StepLog.reserve``): the record to replay there (``replay``), or the ``StepRun`` to run it for real."""
    log = ctx.step_log
    index, record = log.begin(spec.name, VALUE, spec.mismatch, at)
    if record is not None:
        return record
    ctx.check()  # stopping or cancelled: do not pay for a call whose result could not be kept
    return StepRun(log, spec, index)


def run_step(ctx: StepContext, spec: StepSpec, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    log = ctx.step_log
    if not log.loaded:
        log.load()
    run = begin_step(ctx, spec)
    if isinstance(run, StepRecord):
        return replay(log, spec, run)
    tries = 1
    try:
        with run.body():
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
        run.failed(e)
        raise
    return run.returned(value)


async def load_journal(log: StepLog) -> None:
    """Read a task's journal (``StepLog.load``, in a thread) for a call of an async task. The calls made while it
    is read share the one read and go on in the order they began to wait for it, which is the order they were
    made, so each takes its position in that order. With a read each, steps started together
    (``asyncio.gather``) as an attempt's first calls took their positions in the order their reads came back,
    and a resumed task got another call's recorded value, or drifted."""
    if log.loaded:
        return
    import asyncio  # here: the path that runs commands loads no asyncio (BENCHMARKS.md, start-up)

    loop = asyncio.get_running_loop()
    reading = log.reading
    if not isinstance(reading, asyncio.Task) or reading.get_loop() is not loop or reading.done():
        reading = log.reading = loop.create_task(off_loop(log.load))
    # Shielded: a call cancelled while it waits must not cancel the read the others wait for.
    await asyncio.shield(reading)


async def run_step_async(ctx: StepContext, spec: StepSpec, fn: Callable[..., Any], args: Any,
                         kwargs: Any, at: int | None = None) -> Any:
    log = ctx.step_log
    if not log.loaded:
        await load_journal(log)
    run = begin_step(ctx, spec, at)
    if isinstance(run, StepRecord):
        return replay(log, spec, run)
    tries = 1
    try:
        with run.body():
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
        await off_loop(run.failed, e)
        raise
    # The commit blocks a thread, not the event loop: other asyncio tasks run on (and share the fsync).
    return await off_loop(run.returned, value)


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
    how the value is stored (JSON by default). Each setting is checked where the function is decorated
    (``StepSpec``)."""
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
    """A durable sleep's deadline on the store's clock: recorded on the first run, read back on replay. A
    recorded deadline more than ``seconds`` ahead of the store's clock was set before that clock went back (a
    VM resumed from an older snapshot, an NTP step): it is recorded again, ``seconds`` from now, so that the
    sleep lasts at most its length once more instead of as long as the clock went back."""
    index, record = log.begin("sleep", SLEEP)
    replacing = record is not None
    if record is not None:
        deadline = float(JSON.loads(log.replayed_one(record).payload))
        if deadline - log.store_now() <= seconds:
            return deadline

    def commit() -> float:
        payload = log.record(index, "sleep", SLEEP, JSON.name, seconds,
                             lambda now: JSON.dumps(min(deadline, now + seconds) if replacing else now + seconds),
                             replacing=replacing)
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


# The durable-step API, with the names from step_records and step_log that its users pass or catch.
__all__ = ["step", "current_step_key", "Serializer", "JSON", "PICKLE", "StepError", "StepLog", "REPLAY_POLICIES",
           "STRICT", "idempotency_key"]
