"""Pydantic AI agents made durable: ``OnwardAgent(agent)`` runs like ``agent``, except that inside an onward
task each model request and each tool call (function tools, MCP tools, any toolset's call) is a durable
step: recorded when it returns, replayed on resume, never paid for twice.

    from pydantic_ai import Agent
    from onward.integrations.pydantic_ai import OnwardAgent

    agent = OnwardAgent(Agent("openai:gpt-5", tools=[...]))

    @job.task
    def research(task, ctx):
        return agent.run_sync(task).output        # also await agent.run(...), agent.run_stream(...)

How: like Pydantic AI's own DBOS and Temporal wrappers, the run's model is wrapped (``OnwardModel``: a
request, or a whole streamed request, is one step whose value is the ``ModelResponse``) and so is every
leaf toolset (``OnwardToolset``: a tool call is one step named after the tool, its value the tool's return
as JSON). Unlike them there is no workflow to register and no server: the wrapping is applied per run,
and only inside a task; outside a task the run is the wrapped agent's own. A streamed request inside a task
is drained within its step and replayed to the run's stream as events, as the DBOS wrapper does.

Needs ``pip install 'onward[pydantic-ai]'``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, get_args

try:
    import pydantic_ai  # noqa: F401 - fail here, with the extra to install, rather than at the first run
except ImportError:
    raise ImportError("onward.integrations.pydantic_ai needs pydantic-ai: pip install 'onward[pydantic-ai]'") from None

from pydantic import TypeAdapter
from pydantic_ai.agent import AbstractAgent, WrapperAgent
from pydantic_ai.messages import ModelMessage, ModelResponse, ToolReturn, UserContent
from pydantic_ai.models import (
    CompletedStreamedResponse,
    Model,
    ModelRequestParameters,
    StreamedResponse,
    infer_model,
)
from pydantic_ai.models.wrapper import WrapperModel
from pydantic_ai.settings import ModelSettings
from pydantic_ai.tools import RunContext
from pydantic_ai.toolsets import AbstractToolset, WrapperToolset
from pydantic_core import to_jsonable_python

from ..steps import active_context
from .calls import IDEMPOTENCY_HEADER, durable_call_async

_RESPONSE: TypeAdapter[ModelResponse] = TypeAdapter(ModelResponse)
_TOOL_RETURN: TypeAdapter[ToolReturn] = TypeAdapter(ToolReturn)


def _encode_response(response: ModelResponse) -> Any:
    return _RESPONSE.dump_python(response, mode="json")


def _decode_response(data: Any) -> ModelResponse:
    return _RESPONSE.validate_python(data)


def _with_key(settings: ModelSettings | None, key: str | None) -> ModelSettings | None:
    """The settings plus the step's ``Idempotency-Key`` header (models that send ``extra_headers`` pass it on
    to the server, which may answer a call re-sent after a crash from its cache)."""
    if key is None:
        return settings
    merged: dict[str, Any] = dict(settings or {})
    merged["extra_headers"] = {IDEMPOTENCY_HEADER: key, **(merged.get("extra_headers") or {})}
    return merged  # type: ignore[return-value]


class OnwardModel(WrapperModel):
    """A model whose requests, inside an onward task, are durable steps (``pydantic_ai.model.request``)."""

    async def request(self, messages: list[ModelMessage], model_settings: ModelSettings | None,
                      model_request_parameters: ModelRequestParameters) -> ModelResponse:
        return await durable_call_async(
            "pydantic_ai.model.request",
            lambda key: self.wrapped.request(messages, _with_key(model_settings, key), model_request_parameters),
            _encode_response, _decode_response)

    @asynccontextmanager
    async def request_stream(self, messages: list[ModelMessage], model_settings: ModelSettings | None,
                             model_request_parameters: ModelRequestParameters,
                             run_context: RunContext[Any] | None = None) -> AsyncIterator[StreamedResponse]:
        if active_context() is None:
            async with self.wrapped.request_stream(messages, model_settings, model_request_parameters,
                                                   run_context) as streamed:
                yield streamed
            return

        async def drained(key: str | None) -> ModelResponse:
            # The whole stream is the step: its final response is what is recorded (a stream cut by a crash
            # records nothing and is requested again).
            async with self.wrapped.request_stream(messages, _with_key(model_settings, key),
                                                   model_request_parameters, run_context) as streamed:
                async for _ in streamed:
                    pass
            return streamed.get()

        response = await durable_call_async("pydantic_ai.model.request", drained, _encode_response,
                                            _decode_response)
        yield CompletedStreamedResponse(response, model_request_parameters=model_request_parameters,
                                        replay_events=True)


def _classes(tp: Any) -> tuple[type, ...]:
    """The classes a type annotation (unions, ``Annotated``) is made of."""
    if isinstance(tp, type):
        return (tp,)
    return tuple(c for arg in get_args(tp) for c in _classes(arg))


# What a tool may return that Pydantic AI sends the model as content, not as JSON (an image, a document, ...):
# the kinds of a user prompt's content, as this version of Pydantic AI has them.
_CONTENT: TypeAdapter[Any] = TypeAdapter(UserContent)
_CONTENT_CLASSES = tuple(c for c in _classes(UserContent) if c is not str)


def _encode_item(item: Any) -> Any:
    if isinstance(item, _CONTENT_CLASSES):
        return {"content": _CONTENT.dump_python(item, mode="json")}
    return {"value": to_jsonable_python(item, inf_nan_mode="null")}


def _encode_tool_result(result: Any) -> Any:
    if isinstance(result, ToolReturn):  # its parts go to different places: keep it a ToolReturn
        return {"tool_return": _TOOL_RETURN.dump_python(result, mode="json")}
    if isinstance(result, _CONTENT_CLASSES):
        return _encode_item(result)
    if isinstance(result, list | tuple) and any(isinstance(item, _CONTENT_CLASSES) for item in result):
        return {"contents": [_encode_item(item) for item in result]}
    return {"value": to_jsonable_python(result, inf_nan_mode="null")}


def _decode_tool_result(data: Any) -> Any:
    if "tool_return" in data:
        return _TOOL_RETURN.validate_python(data["tool_return"])
    if "contents" in data:
        return [_decode_tool_result(item) for item in data["contents"]]
    if "content" in data:
        return _CONTENT.validate_python(data["content"])
    return data["value"]


@dataclass
class OnwardToolset(WrapperToolset[Any]):
    """A toolset whose tool calls, inside an onward task, are durable steps named ``pydantic_ai.tool.NAME``.
    A tool's return value is recorded as JSON (``pydantic_core.to_jsonable_python``, a NaN or an infinity as
    null, as Pydantic AI sends it the model; a ``ToolReturn``, and
    multimodal content such as ``BinaryContent`` or ``ImageUrl``, alone or in a list, with Pydantic AI's
    own types) and handed back as decoded from that record on the first run as on replay: a model or
    dataclass a tool returns comes back as its JSON, which is what the model is sent either way; an image
    comes back as the image (a ``BinaryContent`` of an image as Pydantic AI's ``BinaryImage``)."""

    async def call_tool(self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: Any) -> Any:
        return await durable_call_async(
            f"pydantic_ai.tool.{name}", lambda key: self.wrapped.call_tool(name, tool_args, ctx, tool),
            _encode_tool_result, _decode_tool_result)

    def visit_and_replace(self, visitor: Any) -> AbstractToolset[Any]:
        if visitor is _make_durable:
            return self  # already durable: wrapping its leaf again would record each call twice
        return super().visit_and_replace(visitor)


def _make_durable(leaf: AbstractToolset[Any]) -> AbstractToolset[Any]:
    return OnwardToolset(leaf)


def durable_toolset(toolset: AbstractToolset[Any]) -> AbstractToolset[Any]:
    """``toolset`` with every leaf toolset (the ones that run tools: function tools, MCP servers, ...)
    wrapped in ``OnwardToolset``; leaves already wrapped are kept as they are."""
    if isinstance(toolset, OnwardToolset):
        return toolset
    return toolset.visit_and_replace(_make_durable)


def _overridden_model(agent: AbstractAgent[Any, Any]) -> Any:
    """The model set by an ``agent.override(model=...)`` around this run (tests do that), if any: the
    override onward sets for the run would otherwise hide it. (Read from the Agent's own context variable;
    None when the agent has none.)"""
    var = getattr(agent, "_override_model", None)
    option = var.get() if var is not None else None
    return getattr(option, "value", None)


class OnwardAgent(WrapperAgent[Any, Any]):
    """``agent`` whose model requests and tool calls are durable steps inside an onward task; ``run``,
    ``run_sync``, ``run_stream`` and ``iter`` work as the agent's own (they all run through ``iter``)."""

    def __init__(self, wrapped: AbstractAgent[Any, Any]) -> None:
        super().__init__(wrapped)

    @asynccontextmanager
    async def iter(self, user_prompt: Any = None, *, model: Any = None,
                   toolsets: Sequence[AbstractToolset[Any]] | None = None, **kwargs: Any) -> AsyncIterator[Any]:
        if active_context() is None:
            async with self.wrapped.iter(user_prompt, model=model, toolsets=toolsets, **kwargs) as run:
                yield run
            return
        chosen = model if model is not None else _overridden_model(self.wrapped)
        if chosen is None:
            chosen = self.wrapped.model
        if chosen is None:
            # Let the agent raise its own error for a run without a model.
            async with self.wrapped.iter(user_prompt, toolsets=toolsets, **kwargs) as run:
                yield run
            return
        inner = infer_model(chosen)
        durable_model: Model = inner if isinstance(inner, OnwardModel) else OnwardModel(inner)
        # An override's toolsets replace the agent's and the run's alike: pass both, wrapped. (``tools=[]``:
        # the agent's function tools are in its toolsets.)
        durable_toolsets = [durable_toolset(t) for t in (*self.wrapped.toolsets, *(toolsets or ()))]
        with self.wrapped.override(model=durable_model, toolsets=durable_toolsets, tools=[]):
            async with self.wrapped.iter(user_prompt, **kwargs) as run:
                yield run
