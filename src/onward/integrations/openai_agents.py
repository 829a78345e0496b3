"""The OpenAI Agents SDK made durable: ``OnwardRunner.run(agent, input)`` (and ``run_sync``) is
``agents.Runner``'s, except that inside an onward task every model call (``Model.get_response``) and every
function-tool call is a durable step: recorded when it returns, replayed on resume, never paid for twice.
So are a session's reads and writes (``session=``).

    from agents import Agent
    from onward.integrations.openai_agents import OnwardRunner

    @job.task
    def triage(task, ctx):
        return OnwardRunner.run_sync(agent, task).final_output

How: for the run, the starting agent and the agents it can hand off to (as an ``Agent`` or through a
``Handoff`` object) are cloned with their function tools' invocations, and those of their MCP servers'
tools, wrapped (a step named ``openai_agents.tool.NAME``, its value the tool's output as JSON, or as the text the SDK sends the model
when JSON would not give the model the same text) and their models wrapped (``OnwardModel``: a step named
``openai_agents.model``, its value the ``ModelResponse``; the tries of a call the runner retries are that
one step); a model named by a string is wrapped through the run's model provider. The agents passed in
are not changed. The tools the SDK runs in this process without their being function tools (a custom
tool, a local shell, a shell's local executor, an apply_patch editor) are steps too, named the same way.
``OnwardRunner.run_streamed`` is durable the same way, each streamed model call a step of its events
(``openai_agents.model.stream``). A session is wrapped (``DurableSession``), each of its reads and writes a
step. Outside a task the run is ``agents.Runner``'s own. Inside one, a run given a session the SDK treats
apart (``OpenAIConversationsSession``, a compacting session), whose agents have a ``ComputerTool`` (a
replay cannot rebuild the computer's state) or are a ``SandboxAgent`` (its capabilities' tools are added
by the runner, not as steps, and its workspace is outside the record) raises ``UsageError``.

Needs ``pip install 'onward[openai-agents]'``.
"""

from __future__ import annotations

import contextvars
import copy
import dataclasses
import inspect
import json
import weakref
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

try:
    import agents  # noqa: F401 - fail here, with the extra to install, rather than at the first run
except ImportError:
    raise ImportError("onward.integrations.openai_agents needs openai-agents: pip install 'onward[openai-agents]'") from None

from agents import (
    Agent,
    ApplyPatchTool,
    ComputerTool,
    CustomTool,
    FunctionTool,
    Handoff,
    ItemHelpers,
    LocalShellTool,
    Model,
    ModelProvider,
    ModelResponse,
    ModelRetryAdvice,
    ModelRetryAdviceRequest,
    ModelRetryNormalizedError,
    ModelSettings,
    OpenAIConversationsSession,
    RunConfig,
    Runner,
    RunState,
    ShellResult,
    ShellTool,
    is_openai_responses_compaction_aware_session,
)
from agents.editor import ApplyPatchResult
from agents.sandbox import SandboxAgent
from openai.types.responses import ResponseFunctionToolCall
from pydantic import TypeAdapter
from pydantic_core import to_jsonable_python

from ..errors import UsageError
from ..step_log import StepLog
from ..step_records import ERROR, MODEL_CALL_JSON, recordable
from ..steps import StepContext, StepRun, StepSpec, active_context, begin_step, load_journal, replay
from ..store.base import StepRecord
from ..threads import off_loop
from .calls import IDEMPOTENCY_HEADER, ModelCodec, durable_call_async

_RESPONSE: TypeAdapter[ModelResponse] = TypeAdapter(ModelResponse)


def _encode_response(response: ModelResponse) -> Any:
    # By alias and without the fields the provider did not send: the output items are the openai SDK's
    # models, whose fields may have an alias (``async_`` is ``async`` on the wire) and whose unset fields
    # are left out of the input items the SDK sends back. A dump by field name came back with ``async_``
    # as an unknown extra key and every optional field set to None: the next request's input items then
    # carried them, and the SDK refused to copy such a tool call into a RunState (its approvals fail with
    # "Cannot safely copy pending tool approvals").
    return _RESPONSE.dump_python(response, mode="json", by_alias=True, exclude_unset=True)


def _decode_response(data: Any) -> ModelResponse:
    # by_name too: a record written before the dump was by alias holds ``async_``, the field's name.
    return _RESPONSE.validate_python(data, by_alias=True, by_name=True)


MODEL_STEP = "openai_agents.model"
_MODEL = StepSpec(MODEL_STEP, serializer=MODEL_CALL_JSON)
_STREAM = StepSpec("openai_agents.model.stream", serializer=MODEL_CALL_JSON)
_EVENTS = ModelCodec("openai")  # a streamed call's events: the Responses API's event types


def _keyed(settings: ModelSettings, run: StepRun) -> ModelSettings:
    """The step's key as a header, for a server that deduplicates: the same on every try."""
    return dataclasses.replace(settings, extra_headers={IDEMPOTENCY_HEADER: run.key, **(settings.extra_headers or {})})


def _streamed_output(events: list[Any]) -> list[Any]:
    """The output items of a streamed answer, as the runner reads them: the completed response's, or the
    items of its ``output_item.done`` events when that is empty."""
    done = [e for e in events if getattr(e, "type", None) == "response.completed"]
    output = list(getattr(getattr(done[-1], "response", None), "output", None) or []) if done else []
    return output or [e.item for e in events if getattr(e, "type", None) == "response.output_item.done"]


# Advice for an error replayed from the record: the runner already tried that call as often as it would,
# so the abort marker vetoes a retry the policy would otherwise make (again, and without a call).
_FINAL = ModelRetryAdvice(suggested=False, reason="the recorded outcome of this model call",
                          normalized=ModelRetryNormalizedError(is_abort=True))


@dataclass
class _Try:
    """A model call whose last try failed: the runner may try it again, as the same step."""

    ctx: StepContext
    input: Any
    error: BaseException
    run: StepRun | None = None  # the step run for real; None: the error is the step's record, replayed

    def record(self) -> None:
        """Record the error as the step's outcome: no try followed it."""
        if self.run is not None:
            self.run.failed(self.error)


class DurableRun:
    """One run's durable clones (by the id of the agent cloned, and of the clone), and the models whose last
    try failed during the run. The runner retries a failed model call by calling the model again; the
    tries are one step, so a failed try is recorded only once no try follows it: when the model is called
    for another request, or at the run's end (``settle``). A model registers with the run that calls it
    (``_RUN``), not the one that made it: a run resumed from a ``RunState`` calls the models of the clones
    of the run that returned the state."""

    def __init__(self) -> None:
        self.agents: dict[int, Agent[Any]] = {}
        self.failed: list[OnwardModel] = []

    def settle(self) -> None:
        for model in self.failed:
            failed, model.failed = model.failed, None
            if failed is not None:
                failed.record()
        self.failed.clear()


# The run whose ``Runner.run`` is going on (set by ``OnwardRunner``; the runner's tasks inherit it).
_RUN: contextvars.ContextVar[DurableRun | None] = contextvars.ContextVar("onward_openai_agents_run", default=None)


class OnwardModel(Model):
    """A model whose ``get_response`` calls, inside an onward task, are durable steps: one step per call,
    whatever the number of tries the runner makes of it (recorded: the outcome of the last)."""

    def __init__(self, wrapped: Model) -> None:
        self.wrapped = wrapped
        self.failed: _Try | None = None
        self.replayed_errors: list[BaseException] = []

    async def get_response(self, system_instructions: Any, input: Any, model_settings: ModelSettings, *args: Any,
                           **kwargs: Any) -> ModelResponse:
        ctx = active_context()
        if ctx is None:
            return await self.wrapped.get_response(system_instructions, input, model_settings, *args, **kwargs)
        run = await self._begin(ctx, input, _MODEL)
        if isinstance(run, StepRecord):
            answer = _decode_response(self._replay(ctx, input, _MODEL, run))
            _reserve_tool_steps(ctx.step_log, answer.output)
            return answer
        try:
            with run.body():
                response = await self.wrapped.get_response(system_instructions, input, _keyed(model_settings, run),
                                                           *args, **kwargs)
        except BaseException as e:
            if recordable(e):
                self._failed(_Try(ctx, input, e, run))
            raise
        answer = _decode_response(await off_loop(run.returned, _encode_response(response)))
        _reserve_tool_steps(ctx.step_log, answer.output)
        return answer

    async def stream_response(self, system_instructions: Any, input: Any, model_settings: ModelSettings, *args: Any,
                              **kwargs: Any) -> AsyncIterator[Any]:
        """A streamed call (``Runner.run_streamed``) as the step ``openai_agents.model.stream``: its events are
        handed on as they come and recorded when the stream ends; a replay yields the recorded events."""
        ctx = active_context()
        if ctx is None:
            async for event in self.wrapped.stream_response(system_instructions, input, model_settings, *args,
                                                            **kwargs):
                yield event
            return
        run = await self._begin(ctx, input, _STREAM)
        if isinstance(run, StepRecord):
            events = _EVENTS.decode_chunks(self._replay(ctx, input, _STREAM, run))
            for event in events:
                yield event
            _reserve_tool_steps(ctx.step_log, _streamed_output(events))
            return
        events = []
        stream: Any = None
        try:
            # The stream's code runs as it is iterated: inside the step's body each time (steps it calls are
            # plain calls, as in get_response), never across a yield, which would leak the body's context
            # variable into the runner's task.
            with run.body():
                stream = self.wrapped.stream_response(system_instructions, input, _keyed(model_settings, run), *args,
                                                      **kwargs).__aiter__()
            while True:
                with run.body():
                    try:
                        event = await stream.__anext__()
                    except StopAsyncIteration:
                        break
                events.append(event)
                yield event
        except BaseException as e:
            # An error after some events: the error alone is the record (a replay raises it before any event).
            if recordable(e):
                self._failed(_Try(ctx, input, e, run))
            raise
        finally:
            if stream is not None and hasattr(stream, "aclose"):  # left before its end: the runner closed this one
                await stream.aclose()
        # The runner acts on the answer (runs its tools) only once this generator ends: after the commit.
        # Rebuilt once first: events of a class outside the openai package fail their first run here
        # (StoreError) rather than every replay.
        record = _EVENTS.encode_chunks(events)
        _EVENTS.decode_chunks(record)
        await off_loop(run.returned, record)
        _reserve_tool_steps(ctx.step_log, _streamed_output(events))

    async def _begin(self, ctx: StepContext, input: Any, spec: StepSpec) -> StepRun | StepRecord:
        """The step of this call: the record to replay, or the step to run (a new one, or the one whose last
        try failed, which the runner tries again with the very same input list)."""
        failed, self.failed = self.failed, None
        if failed is not None and failed.ctx is ctx and failed.input is input:
            if failed.run is None:  # no call: the record is the call's outcome, whatever the tries
                self.failed = failed
                raise failed.error
            ctx.check()  # stopping or cancelled: do not pay for a try whose result could not be kept
            return failed.run
        if failed is not None:
            await off_loop(failed.record)
        await load_journal(ctx.step_log)
        return begin_step(ctx, spec)

    def _replay(self, ctx: StepContext, input: Any, spec: StepSpec, record: StepRecord) -> Any:
        try:
            return replay(ctx.step_log, spec, record)
        except BaseException as e:
            if record.kind == ERROR:  # the recorded outcome: raised again, and not retried
                self.replayed_errors = [e]
                self._failed(_Try(ctx, input, e))
            raise

    def _failed(self, failed: _Try) -> None:
        """The call's last try failed: recorded when no try follows it (see ``DurableRun``)."""
        self.failed = failed
        run = _RUN.get()
        if run is not None and self not in run.failed:
            run.failed.append(self)

    # Everything else a Model offers is the wrapped model's: the runner asks it for retry advice (a
    # provider's retry-after, replay safety) and has it release run-scoped resources at the run's end.
    def get_retry_advice(self, request: ModelRetryAdviceRequest) -> ModelRetryAdvice | None:
        if any(request.error is e for e in self.replayed_errors):
            return _FINAL
        return self.wrapped.get_retry_advice(request)

    async def _cleanup_on_run_end(self, owner: object) -> None:
        await self.wrapped._cleanup_on_run_end(owner)

    async def close(self) -> None:
        await self.wrapped.close()

    def __getattr__(self, name: str) -> Any:
        # Attributes of the model's own class (an OpenAIResponsesModel's ``model``, ...); not ``wrapped``
        # itself, which an object being unpickled or copied does not have yet.
        if name == "wrapped":
            raise AttributeError(name)
        return getattr(self.wrapped, name)


class OnwardModelProvider(ModelProvider):
    """The run's model provider, its models wrapped in ``OnwardModel``."""

    def __init__(self, wrapped: ModelProvider) -> None:
        self.wrapped = wrapped

    def get_model(self, model_name: str | None) -> Model:
        return OnwardModel(self.wrapped.get_model(model_name))

    async def aclose(self) -> None:
        close = getattr(self.wrapped, "aclose", None)
        if close is not None:
            await close()


@dataclass
class _Reserved:
    """The call indices reserved for the tool steps of the model's answers so far, until each step runs."""

    calls: dict[Any, int] = field(default_factory=dict)  # a tool call's call_id -> its step's index
    operations: list[tuple[Any, int]] = field(default_factory=list)  # an apply_patch operation -> its index


_RESERVED: weakref.WeakKeyDictionary[StepLog, _Reserved] = weakref.WeakKeyDictionary()  # per attempt
_ONE_STEP_CALLS = frozenset({"function_call", "custom_tool_call", "shell_call", "local_shell_call"})


def _reserve_tool_steps(log: StepLog, output: list[Any]) -> None:
    """Reserve the call indices of the tool steps an answer's ``output`` asks for, in its order (one per tool
    call, one per operation of an apply_patch call), on the first run as on replay. The SDK runs a turn's function
    tools concurrently, and beside them each other kind (custom, shell, local shell, apply_patch) one call
    after another: a step that follows another of its kind (a second shell call, an apply_patch call's
    second operation) began once the first one's commit returned, after steps of other kinds that began
    meanwhile, but on replay it begins at once. Taking the next index as each step began made a resumed
    turn drift (``StepDrift``, the task failed for good). An index reserved for a call that does not run
    (a handoff, a rejected call) stays unrecorded. An answer with one tool step at most reserves nothing:
    that step's index is the next one either way (as recorded before reservations)."""
    wanted: list[tuple[bool, Any]] = []  # (an apply_patch operation, its key or the call's id)
    for item in output:
        kind = _field(item, "type")
        if kind in _ONE_STEP_CALLS and _field(item, "call_id"):
            wanted.append((False, _field(item, "call_id")))
        elif kind == "apply_patch_call":
            operations = _field(item, "operations")
            if not isinstance(operations, list) or not operations:
                operations = [_field(item, "operation")]
            wanted += [(True, _operation_key(op)) for op in operations if op is not None]
    if len(wanted) > 1:
        reserved = _RESERVED.setdefault(log, _Reserved())
        for (operation, key), index in zip(wanted, log.reserve(len(wanted)), strict=True):
            if operation:
                reserved.operations.append((key, index))
            else:
                reserved.calls[key] = index


def _field(item: Any, name: str) -> Any:
    return item.get(name) if isinstance(item, Mapping) else getattr(item, name, None)


def _operation_key(operation: Any) -> tuple[str, str, Any]:
    """An apply_patch operation as the editor is given it (the SDK drops a delete's diff)."""
    kind = str(_field(operation, "type"))
    return kind, str(_field(operation, "path")), None if kind == "delete_file" else _field(operation, "diff")


def _reserved_call(ctx: StepContext, call_id: Any) -> int | None:
    reserved = _RESERVED.get(ctx.step_log)
    return None if reserved is None or not call_id else reserved.calls.pop(call_id, None)


def _reserved_operation(ctx: StepContext, operation: Any) -> int | None:
    """The index reserved for the first operation not run yet that is ``operation``: the SDK runs an
    answer's apply_patch calls, and each call's operations, in order."""
    reserved = _RESERVED.get(ctx.step_log)
    if reserved is not None:
        key = _operation_key(operation)
        for i, (reserved_key, index) in enumerate(reserved.operations):
            if reserved_key == key:
                del reserved.operations[i]
                return index
    return None


_REFUSED = object()  # the SDK refuses a tool's output (it does not fit the tool's declared output schema)
_MISSING = object()


def _sent_to_model(tool: FunctionTool, tool_call: Any, output: Any) -> Any:
    """What the SDK sends the model for ``output`` of ``tool``: its function_call_output, made by the SDK's
    own rules (a string as it is, structured outputs as content items, a declared output schema as its
    JSON, anything else ``str(output)``)."""
    # ``_output_type_adapter`` is private (openai-agents 0.24.0 has no public one; its own tool execution
    # passes the same attribute here): read defensively, a tool without it is sent as without a schema.
    try:
        return ItemHelpers.tool_call_output_item(
            tool_call, output, output_json_schema=tool.output_json_schema,
            output_type_adapter=getattr(tool, "_output_type_adapter", None))["output"]
    except Exception:
        return _REFUSED


def _through_json(value: Any) -> Any:
    try:
        # No NaN or infinity: the step's record refuses them (they are not JSON), and the tool failed.
        return json.loads(json.dumps(to_jsonable_python(value), allow_nan=False))
    except (ValueError, TypeError):  # pydantic_core's PydanticSerializationError is a ValueError
        return _MISSING


def _tool_record(tool: FunctionTool, tool_call: Any, output: Any) -> Any:
    """The tool's output as recorded, and handed to the SDK on the first run as on replay: its JSON if the
    SDK makes of that what it makes of the output itself (plain data), else the text the SDK would send
    the model (an object it would ``str()``, a pydantic model, a dataclass). Either way the model is sent
    what ``Runner`` sends it, and the output need not be JSON-able."""
    sent = _sent_to_model(tool, tool_call, output)
    for candidate in (_through_json(output), _through_json(sent)):
        if candidate is not _MISSING and _sent_to_model(tool, tool_call, candidate) == sent:
            return candidate
    return str(output)


def durable_tool(tool: Any) -> Any:
    """A copy of ``tool`` whose invocations are steps: a function tool, and the tools that run in this
    process without being function tools (custom, local shell, shell with a local executor, apply_patch).
    Hosted tools (web and file search, code interpreter, hosted MCP, a hosted shell, ...) run inside the
    model call, which is a step already: they are kept as they are. A computer tool is refused."""
    if isinstance(tool, ComputerTool):
        raise UsageError("OnwardRunner.run does not take a ComputerTool inside a task: its actions drive a"
                         " computer whose state a replay cannot rebuild (a resumed run would replay the"
                         " recorded screenshots while the screen shows something else). Run it outside a"
                         " task, or make each action a function tool")
    if isinstance(tool, FunctionTool):
        invoke = tool.on_invoke_tool
        name = f"openai_agents.tool.{tool.name}"

        async def durable_invoke(ctx: Any, arguments: str) -> Any:
            tool_call = getattr(ctx, "tool_call", None) or ResponseFunctionToolCall(
                type="function_call", name=tool.name, arguments=arguments, call_id="")
            return await durable_call_async(name, lambda key: invoke(ctx, arguments),
                                            lambda output: _tool_record(tool, tool_call, output), _same,
                                            at=lambda c: _reserved_call(c, getattr(ctx, "tool_call_id", None)))

        return _copy_with(tool, on_invoke_tool=durable_invoke)
    # The SDK runs these tools itself (not through a FunctionTool's on_invoke_tool), from the call in the
    # model's answer: replaying the model call without making the tool's call a step would run the command,
    # the patch or the custom tool again on resume. Each is wrapped where the SDK calls user code, and its
    # record is what the SDK makes of the output, so the model is sent the same on replay. An error the
    # code raises is recorded like any step's and raised again on replay, where the SDK turns it into the
    # failed output it sends the model.
    if isinstance(tool, CustomTool):
        return _copy_with(tool, on_invoke_tool=_durable_callable(
            tool.on_invoke_tool, tool.name, lambda out: out if isinstance(out, str) else str(out), _same,
            lambda c, ctx, input: _reserved_call(c, getattr(ctx, "tool_call_id", None))))
    if isinstance(tool, LocalShellTool):
        return _copy_with(tool, executor=_durable_callable(tool.executor, tool.name, _through_text, _same,
                                                           _request_call))
    if isinstance(tool, ShellTool) and tool.executor is not None:  # a hosted environment has no executor
        return _copy_with(tool, executor=_durable_callable(tool.executor, tool.name, _shell_record, _shell_result,
                                                           _request_call))
    if isinstance(tool, ApplyPatchTool):
        return _copy_with(tool, editor=_DurableEditor(tool.editor, tool.name))
    return tool


def _copy_with(tool: Any, **changes: Any) -> Any:
    """A shallow copy of ``tool`` (or handoff) with ``changes`` set on it: the user's own is never changed."""
    durable = copy.copy(tool)
    for name, value in changes.items():
        setattr(durable, name, value)
    return durable


def _same(data: Any) -> Any:
    return data


def _through_text(output: Any) -> Any:
    """A local shell executor's output: the SDK sends it as it is (it should be text)."""
    data = _through_json(output)
    return data if data == output else str(output)


_SHELL_RESULT: TypeAdapter[ShellResult] = TypeAdapter(ShellResult)


def _shell_record(output: Any) -> Any:
    """A shell executor's output: a ``ShellResult`` (its fields), or text (the SDK ``str()``s anything else)."""
    if isinstance(output, ShellResult):
        return {"shell_result": _SHELL_RESULT.dump_python(output, mode="json")}
    return output if isinstance(output, str) else str(output)


def _shell_result(data: Any) -> Any:
    if isinstance(data, dict):
        return _SHELL_RESULT.validate_python(data["shell_result"])
    return data


def _request_call(ctx: StepContext, request: Any) -> int | None:
    """A shell or local shell executor's request: the index reserved for its call."""
    return _reserved_call(ctx, getattr(getattr(request, "data", None), "call_id", None))


def _durable_callable(call: Any, tool_name: str, encode: Any, decode: Any, reserved: Any) -> Any:
    """``call`` (sync or async; the SDK awaits what it returns when it is awaitable) as a step named
    ``openai_agents.tool.NAME``, at the index ``reserved(ctx, *args)`` if it gives one."""
    name = f"openai_agents.tool.{tool_name}"

    async def durable(*args: Any) -> Any:
        async def once(key: str | None) -> Any:
            out = call(*args)
            return await out if inspect.isawaitable(out) else out
        return await durable_call_async(name, once, encode, decode, at=lambda ctx: reserved(ctx, *args))
    return durable


def _patch_record(result: Any) -> Any:
    """An apply_patch editor's result as the SDK reads it (``ApplyPatchResult``, a mapping, text or None)."""
    if result is None or isinstance(result, str):
        return result
    if isinstance(result, ApplyPatchResult):
        return {"status": result.status, "output": result.output}
    if isinstance(result, Mapping):
        status, output = result.get("status"), result.get("output")
        return {"status": status if status in ("completed", "failed") else None,
                "output": None if output is None else str(output)}
    return str(result)


def _patch_result(data: Any) -> Any:
    return ApplyPatchResult(**data) if isinstance(data, dict) else data


class _DurableEditor:
    """An apply_patch editor whose operations are steps (``openai_agents.tool.apply_patch``, one each)."""

    def __init__(self, editor: Any, tool_name: str) -> None:
        self.editor = editor
        self.create_file = _durable_callable(editor.create_file, tool_name, _patch_record, _patch_result,
                                             _reserved_operation)
        self.update_file = _durable_callable(editor.update_file, tool_name, _patch_record, _patch_result,
                                             _reserved_operation)
        self.delete_file = _durable_callable(editor.delete_file, tool_name, _patch_record, _patch_result,
                                             _reserved_operation)

    def __getattr__(self, name: str) -> Any:
        if name == "editor":
            raise AttributeError(name)
        return getattr(self.editor, name)


_ORIGINAL = "_onward_original_agent"  # on a clone: the agent it was cloned from


def durable_agent(agent: Agent[Any], run: DurableRun | None = None) -> Agent[Any]:
    """A clone of ``agent`` (and of every agent it hands off to, as an ``Agent`` or a ``Handoff``) with durable
    tools and model, kept in ``run`` (which maps each agent of the run, and each clone, to the clone)."""
    run = DurableRun() if run is None else run
    memo = run.agents
    if id(agent) in memo:
        return memo[id(agent)]
    if isinstance(agent, SandboxAgent):
        raise UsageError(f"OnwardRunner.run does not take a SandboxAgent ({agent.name!r}) inside a task: the"
                         " runner adds its capabilities' tools (exec_command, apply_patch, ...) when the run"
                         " starts, so their calls are not steps, and its sandbox's workspace is state outside"
                         " the task's record: a resumed run would run the commands again. Run it outside a"
                         " task, or give a plain Agent function tools")
    clone = agent.clone()
    setattr(clone, _ORIGINAL, agent)  # marks it durable (see _refuse_foreign_state)
    memo[id(agent)] = memo[id(clone)] = clone  # before the handoffs: agents may hand off to each other
    clone.tools = [durable_tool(t) for t in agent.tools]
    _durable_mcp_tools(clone)
    if isinstance(agent.model, Model) and not isinstance(agent.model, OnwardModel):
        clone.model = OnwardModel(agent.model)
    clone.handoffs = [durable_agent(h, run) if isinstance(h, Agent) else durable_handoff(h, run)
                      for h in agent.handoffs]
    return clone


def _durable_mcp_tools(clone: Agent[Any]) -> None:
    """Make the clone's MCP tools durable too. The SDK lists an agent's MCP servers' tools as function tools
    at run time (``get_all_tools`` calls ``get_mcp_tools`` every turn), so they are not in ``agent.tools``
    and a call of one (a side effect on the server) would run again on resume. The clone's
    ``get_mcp_tools`` returns the SDK's own tools (their approval policy, guardrails, error handling and
    meta kept), each with its invocation a step like a function tool's."""
    get_mcp_tools = clone.get_mcp_tools  # the class's method, bound to the clone

    async def durable_get_mcp_tools(run_context: Any) -> list[Any]:
        return [durable_tool(t) for t in await get_mcp_tools(run_context)]

    # An instance attribute: the clone is this run's own, and ``Agent.clone`` (dataclasses.replace) would
    # not carry it over to a clone of the clone, which then lists its servers' tools as the SDK does.
    setattr(clone, "get_mcp_tools", durable_get_mcp_tools)  # noqa: B010 - mypy refuses assigning to a method


def durable_handoff(handoff: Any, run: DurableRun) -> Any:
    """A copy of ``handoff`` that hands off to the durable clone of the agent it returns. The handoff's own
    ``on_invoke_handoff`` still runs (its ``on_handoff`` callback, its input checks), as do its
    ``input_filter`` and the rest of its settings, which the copy keeps."""
    if not isinstance(handoff, Handoff):
        return handoff
    invoke = handoff.on_invoke_handoff

    async def durable_invoke(ctx: Any, input_json: str) -> Any:
        target = await invoke(ctx, input_json)
        return durable_agent(target, run) if isinstance(target, Agent) else target

    durable = _copy_with(handoff, on_invoke_handoff=durable_invoke)
    # The runner reads the target through this weak reference too (to register its tools before the
    # handoff): point it at the clone, which ``run`` keeps alive.
    # Private, with no public equivalent in openai-agents 0.24.0 (the SDK's own turn resolution reads it too);
    # absent from versions before it.
    ref = getattr(handoff, "_agent_ref", None)
    target = ref() if ref is not None else None
    if isinstance(target, Agent):
        durable._agent_ref = weakref.ref(durable_agent(target, run))
    return durable


def durable_run_config(config: RunConfig | None) -> RunConfig:
    config = config if config is not None else RunConfig()
    if isinstance(config.model, Model):
        return dataclasses.replace(config, model=OnwardModel(config.model))
    return dataclasses.replace(config, model_provider=OnwardModelProvider(config.model_provider))


def _refuse_foreign_state(input: Any) -> None:
    """``Runner.run`` resumes a ``RunState`` with the state's own current agent, not the agent it is given.
    A state a durable run returned (``result.to_state()``) holds that run's durable clones; one rebuilt
    with ``RunState.from_string(agent, ...)`` / ``from_json`` holds the agents passed in, whose model and
    tool calls would not be steps: after a crash, the approved tool and every model call after it would
    run again. It cannot be given durable clones instead: the SDK binds an approval to the very agent
    object the state holds. So it is refused inside a task. ``_current_agent`` is the SDK's private
    attribute (there is no public one in openai-agents 0.24.0, whose own code reads it): read defensively,
    and a state without it is let through."""
    if not isinstance(input, RunState):
        return
    agent = getattr(input, "_current_agent", None)
    if isinstance(agent, Agent) and not hasattr(agent, _ORIGINAL):
        raise UsageError("OnwardRunner.run cannot resume inside a task a RunState whose agent is not one"
                         " of a durable run (a state rebuilt with RunState.from_string/from_json): its"
                         " model and tool calls would not be steps. Resume the state of the result of"
                         " OnwardRunner.run in the same task (result.to_state()); the task replays that"
                         " run after a crash")


SESSION_STEP = "openai_agents.session"


class DurableSession:
    """A session (``session=``) whose reads and writes, inside an onward task, are durable steps
    (``openai_agents.session.get_items``, ``.tail`` and ``.add_items``, ``.pop_tail`` and ``.pop_item``,
    ``.clear_session``):
    the items read are recorded and replayed, and a write is not made again, whether its record was
    committed or a kill came before that (see ``add_items``). Without it, a
    run resumed after a crash would find the first attempt's turns in the session, add them again and send
    the model the duplicated conversation. The SDK reads and writes a session in a fixed order between
    turns, so the steps replay in order with the model and tool calls. ``session_id`` and
    ``session_settings`` are the wrapped session's; a session whose methods take the run's ``wrapper``
    still gets it."""

    def __init__(self, wrapped: Any) -> None:
        self.wrapped = wrapped
        self.session_id = wrapped.session_id
        self.session_settings = getattr(wrapped, "session_settings", None)

    async def get_items(self, limit: int | None = None, *, wrapper: Any = None) -> list[Any]:
        items: list[Any] = await self._step("get_items", self.wrapped.get_items, wrapper, limit)
        return items

    async def add_items(self, items: list[Any], *, wrapper: Any = None) -> None:
        """Two steps: what the session ends with before the write (``.tail``), then the write
        (``.add_items``). A kill after the session took the write and before its record was committed
        leaves the first recorded and not the second: the next attempt reads the same last items again and
        finds the write there rather than make it twice. The items read are the last ``len(items)``, or
        more where those are the very items written (see ``_window``): the write must change what is read."""
        if active_context() is None or not items:
            await self._step("add_items", self.wrapped.add_items, wrapper, items)
            return
        written = to_jsonable_python(items)
        read_here = False

        def unchanged_by_it(window: list[Any], size: int) -> bool:
            return (window + written)[-size:] == window

        async def tail() -> Any:
            nonlocal read_here
            read_here = True  # not replayed: no write of these items was made before, by any attempt
            return await self._window(wrapper, len(items), unchanged_by_it)
        before = await self._step("tail", tail, None)

        async def write() -> str:
            if not read_here:
                seen, size = _window_read(before, len(items))
                now = to_jsonable_python(await self._call(self.wrapped.get_items, wrapper, size))
                if now != seen and now == (seen + written)[-size:]:
                    return "found made"  # by the attempt a kill ended, before it could record it
            await self._call(self.wrapped.add_items, wrapper, items)
            return "made"
        await self._step("add_items", write, None)

    async def pop_item(self, *, wrapper: Any = None) -> Any:
        """Two steps as a write's: the session's last items before the pop (``.pop_tail``: two, or more
        while they are all the same item), then the pop (``.pop_item``). A kill after the session took the
        pop and before its record leaves the next attempt to find the last item gone, and to return it as
        the pop did, rather than remove one more."""
        if active_context() is None:
            return await self._step("pop_item", self.wrapped.pop_item, wrapper)
        read_here = False

        def unchanged_by_it(window: list[Any], size: int) -> bool:
            # One item less at the end and the one before the window come in: the same window only where
            # every item is the same (the one before the window is not read, so it may be that one too).
            return all(item == window[0] for item in window)

        async def tail() -> Any:
            nonlocal read_here
            read_here = True
            return await self._window(wrapper, 2, unchanged_by_it)
        before = await self._step("pop_tail", tail, None)

        async def pop() -> Any:
            if not read_here:
                seen, size = _window_read(before, 2)
                if seen:
                    now = to_jsonable_python(await self._call(self.wrapped.get_items, wrapper, size))
                    if now == seen[:-1] or (len(now) == size and now != seen and now[1:] == seen[:-1]):
                        return seen[-1]  # popped by the attempt a kill ended, before it could record it
            return await self._call(self.wrapped.pop_item, wrapper)
        popped: Any = await self._step("pop_item", pop, None)
        return popped

    async def _window(self, wrapper: Any, size: int, unchanged_by_it: Callable[[list[Any], int], bool]) -> Any:
        """The session's last ``size`` items, as a ``.tail`` or ``.pop_tail`` step records them; twice as
        many, and so on, while ``unchanged_by_it(items, size)`` says the change to come would leave them as
        they are (the same items written again, say), until the session holds fewer (the whole session is
        read then, and any change shows). A window wider than ``size`` is recorded with its width."""
        first = size
        while True:
            window = to_jsonable_python(await self._call(self.wrapped.get_items, wrapper, size))
            if len(window) < size or not unchanged_by_it(window, size):
                return window if size == first else {"window": window, "size": size}
            size *= 2

    async def clear_session(self, *, wrapper: Any = None) -> None:
        await self._step("clear_session", self.wrapped.clear_session, wrapper)

    async def _step(self, name: str, method: Any, wrapper: Any, *args: Any) -> Any:
        async def call(key: str | None) -> Any:
            return await self._call(method, wrapper, *args)
        return await durable_call_async(f"{SESSION_STEP}.{name}", call, to_jsonable_python, lambda data: data)

    @staticmethod
    async def _call(method: Any, wrapper: Any, *args: Any) -> Any:
        value = method(*args, **({"wrapper": wrapper} if wrapper is not None and _takes_wrapper(method) else {}))
        return await value if inspect.isawaitable(value) else value


def _window_read(recorded: Any, size: int) -> tuple[list[Any], int]:
    """The items a ``.tail`` or ``.pop_tail`` step recorded and how many it asked for: ``size``, or the
    width recorded with a wider window (``DurableSession._window``)."""
    if isinstance(recorded, dict):
        return list(recorded["window"]), int(recorded["size"])
    return list(recorded), size


def _takes_wrapper(method: Any) -> bool:
    """Whether a session's method takes the run's context (``wrapper=``), as the SDK asks of a session."""
    try:
        parameter = inspect.signature(method).parameters.get("wrapper")
    except (TypeError, ValueError):
        return False
    return parameter is not None and parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                        inspect.Parameter.KEYWORD_ONLY)


def _durable_session(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with its session (``session=``) made a ``DurableSession``. Refused (``UsageError``): a
    session the SDK treats apart, by its class or by what it offers beyond reads and writes, which a wrapper
    would hide from it: an ``OpenAIConversationsSession`` (the conversation is kept by the server, which the
    SDK tells apart from local items) and a session that compacts its history (``run_compaction``: it calls
    the model itself, outside the task's record)."""
    session = kwargs.get("session")
    if session is None or isinstance(session, DurableSession):
        return kwargs
    if isinstance(session, OpenAIConversationsSession) or is_openai_responses_compaction_aware_session(session):
        kind = type(session).__name__
        raise UsageError(f"OnwardRunner.run does not take a {kind} as session= inside a task: the SDK treats it"
                         " apart (a conversation kept by the server, or compacted by a model call), which a"
                         " durable session would hide. Use a session that only stores items (SQLiteSession),"
                         " or keep the conversation in the task: pass the previous result's to_input_list()"
                         " plus the new message as the input")
    return {**kwargs, "session": DurableSession(session)}


class OnwardRunner:
    """``agents.Runner`` whose model and function-tool calls are durable steps inside an onward task."""

    @classmethod
    async def run(cls, starting_agent: Agent[Any], input: Any, *, run_config: RunConfig | None = None,
                  **kwargs: Any) -> Any:
        if active_context() is None:
            return await Runner.run(starting_agent, input, run_config=run_config, **kwargs)
        kwargs = _durable_session(kwargs)
        _refuse_foreign_state(input)
        run = DurableRun()
        token = _RUN.set(run)
        try:
            return await Runner.run(durable_agent(starting_agent, run), input,
                                    run_config=durable_run_config(run_config), **kwargs)
        finally:
            _RUN.reset(token)
            await off_loop(run.settle)

    @classmethod
    def run_sync(cls, starting_agent: Agent[Any], input: Any, *, run_config: RunConfig | None = None,
                 **kwargs: Any) -> Any:
        if active_context() is None:
            return Runner.run_sync(starting_agent, input, run_config=run_config, **kwargs)
        kwargs = _durable_session(kwargs)
        _refuse_foreign_state(input)
        run = DurableRun()
        token = _RUN.set(run)
        try:
            return Runner.run_sync(durable_agent(starting_agent, run), input,
                                   run_config=durable_run_config(run_config), **kwargs)
        finally:
            _RUN.reset(token)
            run.settle()

    @classmethod
    def run_streamed(cls, starting_agent: Agent[Any], input: Any, *, run_config: RunConfig | None = None,
                     **kwargs: Any) -> Any:
        """``Runner.run_streamed``, durable inside a task: each streamed model call is a step whose events
        are recorded when its stream ends, and replayed; tools are steps as in ``run``. The calls whose
        every try failed are recorded when the result's ``stream_events()`` ends (consume it to its end)."""
        if active_context() is None:
            return Runner.run_streamed(starting_agent, input, run_config=run_config, **kwargs)
        kwargs = _durable_session(kwargs)
        _refuse_foreign_state(input)
        run = DurableRun()
        token = _RUN.set(run)  # the runner's task, created here, inherits it
        try:
            result = Runner.run_streamed(durable_agent(starting_agent, run), input,
                                         run_config=durable_run_config(run_config), **kwargs)
        finally:
            _RUN.reset(token)
        stream_events = result.stream_events

        async def settled_stream_events() -> AsyncIterator[Any]:
            try:
                async for event in stream_events():
                    yield event
            finally:
                if result.is_complete:
                    await off_loop(run.settle)

        setattr(result, "stream_events", settled_stream_events)  # noqa: B010 - mypy refuses assigning to a method
        return result
