"""The one helper every integration shares: run a framework's call as a durable step (recorded when it
returns, replayed on resume), and a stream of chunks as one step committed when the stream ends.

A call is recorded as what ``encode`` makes of its result (JSON) and handed back as ``decode`` of the
record, on the first run as on replay, so both paths return equal objects of the framework's own types.
Outside a task (or inside another step's body) the call is made as it is.

Streams: a stream step takes its call index when the stream is opened; each chunk is handed to the caller
as it arrives and kept; the chunks are committed as the step's value when the caller reaches the end of the
stream. A stream the caller leaves before its end (``break``, ``close()``, an exception in the caller)
records nothing: on resume that call runs again. An error raised by the call is recorded like a step's
error: one raised when the stream is opened is raised again there on replay; one the stream raises after
some chunks is recorded with those chunks, and a replayed stream yields them and then raises it from the
caller's iteration, so that a task that caught it inside its loop takes the same path.
"""

from __future__ import annotations

import base64
import importlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, Generic, TypeVar

from ..errors import StoreError
from ..step_log import StepLog
from ..step_records import (
    ERROR,
    JSON,
    MODEL_CALL_JSON,
    VALUE,
    Frame,
    decode_error,
    encode_error,
    idempotency_key,
    recordable,
    unframe,
)
from ..steps import (
    StepContext,
    StepSpec,
    active_context,
    current_step_key,
    load_journal,
    run_step,
    run_step_async,
)
from ..store.base import StepRecord
from ..threads import off_loop

T = TypeVar("T")
IDEMPOTENCY_HEADER = "Idempotency-Key"
# The serializer of an error record holding the chunks a stream yielded before it raised the error.
STREAM_ERROR = "stream-error"


# --- SDK response objects <-> JSON ------------------------------------------------------------------------
class ModelCodec:
    """Pydantic models of one SDK package (``openai``, ``anthropic``) to JSON and back: the record names the
    model's class, and replay rebuilds it with the SDK's own ``construct`` (which builds nested models and
    unions as the SDK does for a server's answer), so the rebuilt object equals the original (``==``).
    Only classes of that package are ever rebuilt from a record."""

    def __init__(self, package: str) -> None:
        self.package = package

    def encode(self, obj: Any) -> dict[str, Any]:
        if not hasattr(obj, "model_dump"):
            # Not the SDK's object: a server that answered 200 with a body that is not its JSON (an HTML page
            # of a gateway, a bare `null`), which the SDK hands back as it parsed it. Recorded as it is, and
            # replayed so, as the plain SDK returns it (the record refuses what is not JSON, saying so).
            return {"raw": obj}
        cls = type(obj)
        return {"type": f"{cls.__module__}:{cls.__qualname__}",
                "data": obj.model_dump(mode="json", by_alias=True, exclude_unset=True)}

    def decode(self, record: Any) -> Any:
        if isinstance(record, dict) and "raw" in record and "type" not in record:
            return record["raw"]
        try:
            return self.model_class(record["type"]).construct(**record["data"])
        except (KeyError, TypeError) as e:
            raise StoreError(f"a recorded {self.package} call is not in the expected form ({e!r})") from None

    def model_class(self, name: Any) -> Any:
        module, _, qualname = str(name).partition(":")
        if module != self.package and not module.startswith(self.package + "."):
            raise StoreError(f"a recorded {self.package} call names the class {name!r}, outside {self.package}")
        try:
            obj: Any = importlib.import_module(module)
            for part in qualname.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError):
            raise StoreError(f"a recorded {self.package} call names the class {name!r}, which this version of"
                             f" {self.package} does not have") from None
        if not (isinstance(obj, type) and hasattr(obj, "construct")):
            raise StoreError(f"a recorded {self.package} call names {name!r}, not a model class")
        return obj

    def encode_chunks(self, chunks: list[Any]) -> dict[str, Any]:
        """A stream's chunks: each class named once, each chunk as [class index, data]."""
        types: list[str] = []
        out = []
        for chunk in chunks:
            record = self.encode(chunk)
            if record["type"] not in types:
                types.append(record["type"])
            out.append([types.index(record["type"]), record["data"]])
        return {"types": types, "chunks": out}

    def decode_chunks(self, record: Any) -> list[Any]:
        try:
            classes = [self.model_class(name) for name in record["types"]]
            return [classes[i].construct(**data) for i, data in record["chunks"]]
        except (KeyError, TypeError, IndexError, ValueError) as e:
            raise StoreError(f"a recorded {self.package} stream is not in the expected form ({e!r})") from None


# How a stream's record begins (``encode_chunks`` as the JSON serializer writes it), and a call's record
# does not: a call with or without ``stream=True`` has one step name (records written before the two were
# told apart must still replay), so the record's form is what tells them apart.
_STREAM_RECORD = b'{"types":'


def is_stream_record(record: StepRecord) -> bool:
    """``record`` is a stream's (its chunks, or the error it raised after some), not a call's value. An error
    raised when the call was made is either's."""
    f = unframe(record.data)
    if record.kind == ERROR:
        return f.serializer == STREAM_ERROR
    return f.payload.startswith(_STREAM_RECORD)


def recorded_as_stream(record: StepRecord) -> str | None:
    """The mismatch of a call without ``stream=True`` (``StepSpec.mismatch``)."""
    return "without stream=True, where a stream was recorded" if is_stream_record(record) else None


def recorded_as_call(record: StepRecord) -> str | None:
    """The mismatch of a call with ``stream=True``."""
    if record.kind == ERROR or is_stream_record(record):
        return None
    return "with stream=True, where a call without it was recorded"


def with_idempotency_key(kwargs: dict[str, Any], key: str) -> dict[str, Any]:
    """``kwargs`` of an SDK call plus the step's key as an ``Idempotency-Key`` header (unless the caller set
    one): a server that deduplicates answers the call re-sent after a crash from its cache."""
    headers = dict(kwargs.get("extra_headers") or {})
    if not any(h.lower() == IDEMPOTENCY_HEADER.lower() for h in headers):
        headers[IDEMPOTENCY_HEADER] = key
    return {**kwargs, "extra_headers": headers}


# --- one call, one step -----------------------------------------------------------------------------------
def durable_call(name: str, call: Callable[[str | None], T], encode: Callable[[T], Any],
                 decode: Callable[[Any], T], mismatch: Callable[[StepRecord], str | None] | None = None) -> T:
    """``call(key)`` as the durable step ``name``: inside a task, recorded as ``encode(result)`` (JSON) and
    returned as ``decode`` of the record; ``key`` is the step's idempotency key (None outside a task).
    ``mismatch``: what makes a record of that name another call's (``StepSpec.mismatch``)."""
    ctx = active_context()
    if ctx is None:
        return call(None)
    recorded = run_step(ctx, StepSpec(name, mismatch=mismatch, serializer=MODEL_CALL_JSON),
                        lambda: encode(call(current_step_key())), (), {})
    return decode(recorded)


async def durable_call_async(name: str, call: Callable[[str | None], Awaitable[T]], encode: Callable[[T], Any],
                             decode: Callable[[Any], T],
                             mismatch: Callable[[StepRecord], str | None] | None = None,
                             at: Callable[[StepContext], int | None] | None = None) -> T:
    """``durable_call`` for a coroutine: the commit waits in a thread, not on the event loop. ``at``: the
    call index reserved for this call in the task's journal (``StepLog.reserve``), if any."""
    ctx = active_context()
    if ctx is None:
        return await call(None)

    async def body() -> Any:
        return encode(await call(current_step_key()))
    index = at(ctx) if at is not None else None
    return decode(await run_step_async(ctx, StepSpec(name, mismatch=mismatch, serializer=MODEL_CALL_JSON), body, (), {},
                                       at=index))


# --- a stream, one step -----------------------------------------------------------------------------------
class _StreamStep:
    """The bookkeeping of one stream step: its index, its key, what it has seen."""

    def __init__(self, log: StepLog, name: str, index: int) -> None:
        self.log, self.name, self.index = log, name, index
        self.key = idempotency_key(log.task, name, index)
        self.started = time.monotonic()
        self.chunks: list[Any] = []

    def commit(self, encode: Callable[[list[Any]], Any]) -> None:
        self.log.record(self.index, self.name, VALUE, MODEL_CALL_JSON.name, time.monotonic() - self.started,
                        MODEL_CALL_JSON.dumps(encode(self.chunks)))

    def fail(self, e: BaseException) -> None:
        """The call raised ``e`` before it returned a stream."""
        kind, data = encode_error(e)
        self.log.record(self.index, self.name, ERROR, kind, time.monotonic() - self.started, data, e)

    def fail_midway(self, e: BaseException, encode: Callable[[list[Any]], Any]) -> None:
        """The stream raised ``e`` after the chunks seen so far: both are the record, so that a replay
        yields the same chunks before it raises the same error."""
        kind, data = encode_error(e)
        record = {"chunks": encode(self.chunks), "error": {"serializer": kind, "data": base64.b64encode(data).decode()}}
        self.log.record(self.index, self.name, ERROR, STREAM_ERROR, time.monotonic() - self.started,
                        MODEL_CALL_JSON.dumps(record), e)


class _Recorded:
    """A stream step's record: the chunks' record, and the error the stream raised after them (if any)."""

    def __init__(self, chunks: Any, error: BaseException | None = None) -> None:
        self.chunks, self.error = chunks, error


def _open(ctx: StepContext, name: str) -> tuple[_StreamStep | None, _Recorded | None]:
    """Take the stream's call index: (the step to run, None) or (None, what was recorded)."""
    log = ctx.step_log
    index, record = log.begin(name, VALUE, recorded_as_call)
    if record is not None:
        f = log.replayed_one(record)
        if record.kind != ERROR:
            return None, _Recorded(JSON.loads(f.payload))
        if f.serializer != STREAM_ERROR:
            raise log.replayed_error(record, f)  # raised when the stream was opened: raised there again
        try:
            data = JSON.loads(f.payload)
            error = data["error"]
            inner = Frame(error["serializer"], f.seconds, f.attempt, f.fence, base64.b64decode(error["data"]))
            return None, _Recorded(data["chunks"], log.note_error(record.index, decode_error(inner)))
        except (KeyError, TypeError, ValueError) as e:
            raise StoreError(f"a recorded stream error is not in the expected form ({e!r})") from None
    ctx.check()  # stopping or cancelled: do not pay for a call whose result could not be kept
    return _StreamStep(log, name, index), None


class RecordingStream(Generic[T]):
    """A stream whose chunks are handed on as they arrive and committed as one step at its end. Other
    attributes (``response``, ...) are the wrapped stream's."""

    def __init__(self, stream: Any, step: _StreamStep, encode: Callable[[list[Any]], Any]) -> None:
        self._stream, self._step, self._encode = stream, step, encode
        self._iterator: Iterator[T] | None = None

    def __iter__(self) -> RecordingStream[T]:
        return self

    def __next__(self) -> T:
        if self._iterator is None:
            self._iterator = iter(self._stream)
        try:
            chunk = next(self._iterator)
        except StopIteration:
            self._step.commit(self._encode)
            raise
        except BaseException as e:
            if recordable(e):
                self._step.fail_midway(e, self._encode)
            raise
        self._step.chunks.append(chunk)
        return chunk

    def __enter__(self) -> RecordingStream[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stream.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _not_recorded(stream: object, name: str) -> AttributeError:
    """What a replayed stream says of an attribute the SDK's stream has (``response``, ...): only the chunks
    were recorded, and an HTTP response that was never received cannot be made up."""
    if name.startswith("__"):
        return AttributeError(name)
    return AttributeError(f"{type(stream).__name__} has no {name!r}: a replayed stream holds the recorded chunks"
                          f" only (iterate it, close() it, use it in a with block); the SDK stream's other"
                          f" attributes (response, ...) exist only while the call is made")


class ReplayedStream(Generic[T]):
    """A recorded stream's chunks, yielded again without a call, then the error the stream raised after
    them, if it did."""

    def __init__(self, chunks: list[T], error: BaseException | None = None) -> None:
        self._chunks, self._error = iter(chunks), error

    def __iter__(self) -> ReplayedStream[T]:
        return self

    def __next__(self) -> T:
        try:
            return next(self._chunks)
        except StopIteration:
            if self._error is not None:
                error, self._error = self._error, None
                raise error from None
            raise

    def __enter__(self) -> ReplayedStream[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def close(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        raise _not_recorded(self, name)


class AsyncRecordingStream(Generic[T]):
    """``RecordingStream`` for an async stream: the commit waits in a thread."""

    def __init__(self, stream: Any, step: _StreamStep, encode: Callable[[list[Any]], Any]) -> None:
        self._stream, self._step, self._encode = stream, step, encode
        self._iterator: AsyncIterator[T] | None = None

    def __aiter__(self) -> AsyncRecordingStream[T]:
        return self

    async def __anext__(self) -> T:
        if self._iterator is None:
            self._iterator = self._stream.__aiter__()
        try:
            chunk = await self._iterator.__anext__()
        except StopAsyncIteration:
            await off_loop(self._step.commit, self._encode)
            raise
        except BaseException as e:
            if recordable(e):
                await off_loop(self._step.fail_midway, e, self._encode)
            raise
        self._step.chunks.append(chunk)
        return chunk

    async def __aenter__(self) -> AsyncRecordingStream[T]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._stream.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class AsyncReplayedStream(Generic[T]):
    """``ReplayedStream`` for ``async for``: the same chunks, then the same error."""

    def __init__(self, chunks: list[T], error: BaseException | None = None) -> None:
        self._replayed = ReplayedStream(chunks, error)

    def __aiter__(self) -> AsyncReplayedStream[T]:
        return self

    async def __anext__(self) -> T:
        try:
            return next(self._replayed)
        except StopIteration:
            raise StopAsyncIteration from None

    async def __aenter__(self) -> AsyncReplayedStream[T]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass

    async def close(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        raise _not_recorded(self, name)


def durable_stream(name: str, call: Callable[[str | None], Any], encode: Callable[[list[Any]], Any],
                   decode: Callable[[Any], list[Any]]) -> Any:
    """``call(key)`` returns a stream (an iterable of chunks with ``close()``): inside a task, the stream
    step ``name``; on replay a ``ReplayedStream`` of the recorded chunks."""
    ctx = active_context()
    if ctx is None:
        return call(None)
    if not ctx.step_log.loaded:
        ctx.step_log.load()
    step, recorded = _open(ctx, name)
    if step is None:
        assert recorded is not None
        return ReplayedStream(decode(recorded.chunks), recorded.error)
    try:
        stream = call(step.key)
    except BaseException as e:
        if recordable(e):
            step.fail(e)
        raise
    return RecordingStream(stream, step, encode)


async def durable_stream_async(name: str, call: Callable[[str | None], Awaitable[Any]],
                               encode: Callable[[list[Any]], Any], decode: Callable[[Any], list[Any]]) -> Any:
    """``durable_stream`` for an async stream (``async for``)."""
    ctx = active_context()
    if ctx is None:
        return await call(None)
    await load_journal(ctx.step_log)
    step, recorded = _open(ctx, name)
    if step is None:
        assert recorded is not None
        return AsyncReplayedStream(decode(recorded.chunks), recorded.error)
    try:
        stream = await call(step.key)
    except BaseException as e:
        if recordable(e):
            await off_loop(step.fail, e)
        raise
    return AsyncRecordingStream(stream, step, encode)
