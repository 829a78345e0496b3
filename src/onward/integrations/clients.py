"""A model SDK's client whose model calls are durable steps (``onward.integrations.openai.durable`` and
``onward.integrations.anthropic.durable``): attribute access walks the client as it is, and only the
methods named in ``SdkSpec.calls`` are replaced, by ones that run as steps inside a task. Everything else
(other resources, ``with_raw_response``, ``close``, ...) is the client's own object."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .calls import (
    ModelCodec,
    durable_call,
    durable_call_async,
    durable_stream,
    durable_stream_async,
    recorded_as_stream,
    with_idempotency_key,
)

# Methods that return a client: what they return is made durable too.
_CLIENT_FACTORIES = {"with_options", "copy"}


@dataclass(frozen=True)
class SdkSpec:
    """One SDK: its package (the only one whose classes replay rebuilds) and its model-call methods."""

    package: str
    calls: frozenset[tuple[str, ...]]
    async_clients: tuple[type, ...]  # the SDK's async client classes: their calls return awaitables

    @property
    def codec(self) -> ModelCodec:
        return ModelCodec(self.package)


class DurableResource:
    """A client, or one of its resources, seen through ``spec``: the model calls below it are steps."""

    def __init__(self, target: Any, spec: SdkSpec, path: tuple[str, ...] = (), is_async: bool | None = None) -> None:
        self._target, self._spec, self._path = target, spec, path
        self._async = isinstance(target, spec.async_clients) if is_async is None else is_async

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        path = (*self._path, name)
        if path in self._spec.calls:
            return durable_method(value, self._spec, ".".join((self._spec.package, *path)), self._async)
        if any(call[:len(path)] == path for call in self._spec.calls):
            return DurableResource(value, self._spec, path, self._async)
        if not self._path and name in _CLIENT_FACTORIES and callable(value):
            return functools.wraps(value)(lambda *a, **k: DurableResource(value(*a, **k), self._spec))
        return value

    @property
    def wrapped(self) -> Any:
        """The SDK's own object."""
        return self._target

    def __repr__(self) -> str:
        return f"<durable {self._target!r}>"

    # A client used as a context manager closes its connections at the end, as the SDK's does.
    def __enter__(self) -> DurableResource:
        self._target.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._target.__exit__(*exc)

    async def __aenter__(self) -> DurableResource:
        await self._target.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> Any:
        return await self._target.__aexit__(*exc)


def durable_method(method: Callable[..., Any], spec: SdkSpec, name: str, is_async: bool) -> Callable[..., Any]:
    """``method`` (an SDK create call, sync or async) as a step named ``name`` (``openai.chat.completions.
    create``): its result recorded with the SDK's classes, ``stream=True`` recorded chunk by chunk. Both
    have that one name; a stream found where a call was recorded (or the other way round) is drift."""
    codec = spec.codec

    def call_with(key: str | None, kwargs: dict[str, Any]) -> Any:
        return method(**(kwargs if key is None else with_idempotency_key(kwargs, key)))

    if is_async:
        @functools.wraps(method)
        async def async_create(**kwargs: Any) -> Any:
            if kwargs.get("stream"):
                return await durable_stream_async(name, lambda key: call_with(key, kwargs), codec.encode_chunks,
                                                  codec.decode_chunks)
            return await durable_call_async(name, lambda key: call_with(key, kwargs), codec.encode, codec.decode,
                                            recorded_as_stream)
        return async_create

    @functools.wraps(method)
    def create(**kwargs: Any) -> Any:
        if kwargs.get("stream"):
            return durable_stream(name, lambda key: call_with(key, kwargs), codec.encode_chunks, codec.decode_chunks)
        return durable_call(name, lambda key: call_with(key, kwargs), codec.encode, codec.decode, recorded_as_stream)
    return create
