"""The OpenAI Agents SDK under OnwardRunner, on in-process models (no server): every agent the run reaches
is durable however it is reached, a model call the SDK retries is one step, the wrapped model's retry advice
is kept, and a tool's output reaches the model as under ``Runner``. Each test runs a real job on a SQLite
file whose first attempt fails after the run (or is cut short), and counts model calls and tool runs."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.test_clients import run_twice

pytest.importorskip("agents")

from agents import (  # noqa: E402
    Agent,
    HandoffInputData,
    MaxTurnsExceeded,
    Model,
    ModelResponse,
    ModelRetryAdvice,
    ModelRetryAdviceRequest,
    ModelRetrySettings,
    ModelSettings,
    RunContextWrapper,
    Runner,
    ToolGuardrailFunctionOutput,
    ToolInputGuardrailData,
    ToolOutputGuardrailData,
    ToolOutputGuardrailTripwireTriggered,
    ToolOutputText,
    function_tool,
    handoff,
    retry_policies,
    set_tracing_disabled,
    tool_input_guardrail,
    tool_output_guardrail,
)
from agents.usage import Usage  # noqa: E402
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText  # noqa: E402
from pydantic import BaseModel  # noqa: E402

from onward import Job, step  # noqa: E402
from onward.integrations.openai_agents import OnwardRunner  # noqa: E402
from onward.log import QUIET  # noqa: E402
from onward.store import open_store  # noqa: E402

set_tracing_disabled(True)


def items(input: Any) -> list[Any]:
    return input if isinstance(input, list) else [{"role": "user", "content": input}]


def tool_call(name: str, args: dict[str, Any], call_id: str) -> ResponseFunctionToolCall:
    return ResponseFunctionToolCall(type="function_call", name=name, arguments=json.dumps(args), call_id=call_id,
                                    id="fc_" + call_id, status="completed")


def message(text: str) -> ResponseOutputMessage:
    return ResponseOutputMessage(type="message", id="m1", role="assistant", status="completed",
                                 content=[ResponseOutputText(type="output_text", text=text, annotations=[])])


def answer(output: Any) -> ModelResponse:
    return ModelResponse(output=[output], usage=Usage(), response_id=None)


def outputs(input: Any, prefix: str) -> list[Any]:
    """The outputs of the tool calls whose id starts with ``prefix`` the model is sent, in order."""
    return [i["output"] for i in items(input) if isinstance(i, dict) and i.get("type") == "function_call_output"
            and str(i.get("call_id", "")).startswith(prefix)]


class ScriptedModel(Model):
    """Calls ``tool`` with ``args`` once, then answers with the tool's output; counts its calls in ``calls``."""

    def __init__(self, name: str, calls: list[str], tool: str, args: dict[str, Any]) -> None:
        self.name, self.calls, self.tool, self.args = name, calls, tool, args
        self.inputs: list[Any] = []

    async def get_response(self, system_instructions: Any, input: Any, *args: Any, **kwargs: Any) -> ModelResponse:
        self.calls.append(self.name)
        self.inputs.append(input)
        done = outputs(input, self.name + "-")
        if self.tool and not done:
            return answer(tool_call(self.tool, self.args, f"{self.name}-1"))
        return answer(message(f"{self.name}: {done[-1] if done else 'nothing'}"))

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


def step_names(db: Path) -> list[str]:
    store = open_store(str(db), create=False)
    task_id = store.task_id("t")
    assert task_id is not None
    names = [r.name for r in store.steps(task_id)]
    store.close()
    return names


def final_outputs_of_two_attempts(tmp_path: Path, agent: Agent) -> list[Any]:
    """``OnwardRunner.run(agent, "hello")``'s final output in a task's first attempt, which then fails, and
    in the second, which replays (``run_twice``)."""
    async def run() -> Any:
        return (await OnwardRunner.run(agent, "hello")).final_output
    return run_twice(tmp_path, run, is_async=True)


def refused_in_a_task(tmp_path: Path, *runs: Callable[[], Awaitable[Any]]) -> list[str]:
    """Await each of ``runs`` in one task of a fresh job (one attempt); the ``UsageError`` messages raised."""
    from onward.errors import UsageError

    refused: list[str] = []
    job = Job(str(tmp_path / f"refusals{len(list(tmp_path.glob('refusals*.db')))}.db"), max_attempts=1,
              log_level=QUIET)

    @job.task
    async def t(name: str, ctx: object) -> str:
        for run in runs:
            try:
                await run()
            except UsageError as e:
                refused.append(str(e))
        return "done"

    job.add(["t"])
    assert job.run().exit_code == 0
    job.close()
    return refused


# --- every agent the run reaches is durable ----------------------------------------------------------
def test_an_agent_reached_through_a_handoff_object_is_durable(tmp_path: Path) -> None:
    calls: list[str] = []
    handed: list[str] = []
    filtered: list[int] = []

    @function_tool
    def multiply(expression: str) -> str:
        """Multiply 'a * b'."""
        calls.append("tool")
        a, b = (int(x) for x in expression.split("*"))
        return str(a * b)

    def on_handoff(ctx: RunContextWrapper[Any]) -> None:
        handed.append("b")

    def keep_all(data: HandoffInputData) -> HandoffInputData:
        filtered.append(len(data.new_items))
        return data

    b = Agent(name="b", instructions="B", model=ScriptedModel("b", calls, "multiply", {"expression": "6 * 7"}),
              tools=[multiply])
    a = Agent(name="a", instructions="A", model=ScriptedModel("a", calls, "go_to_b", {}),
              handoffs=[handoff(b, tool_name_override="go_to_b", on_handoff=on_handoff, input_filter=keep_all)])

    async def run() -> Any:
        result = await OnwardRunner.run(a, "6 * 7?")
        return result.final_output, result.last_agent.name
    first, replayed = run_twice(tmp_path, run, is_async=True)
    assert first == replayed == ("b: 42", "b")
    assert calls == ["a", "b", "tool", "b"]  # once each: the second attempt replayed B's calls too
    assert step_names(tmp_path / "job.db") == ["openai_agents.model", "openai_agents.model",
                                               "openai_agents.tool.multiply", "openai_agents.model"]
    # The handoff's own settings still apply, on both attempts (they are not calls to record).
    assert handed == ["b", "b"] and len(filtered) == 2



def test_an_agent_used_as_a_tool_is_one_step(tmp_path: Path) -> None:
    calls: list[str] = []
    b = Agent(name="b", model=ScriptedModel("b", calls, "", {}))
    a = Agent(name="a", model=ScriptedModel("a", calls, "ask_b", {"input": "hi"}),
              tools=[b.as_tool("ask_b", "Ask B.")])

    first, replayed = final_outputs_of_two_attempts(tmp_path, a)
    assert first == replayed == "a: b: nothing"
    assert calls == ["a", "b", "a"]  # B's nested run is recorded as the tool's output: replayed, not run
    assert step_names(tmp_path / "job.db") == ["openai_agents.model", "openai_agents.tool.ask_b",
                                               "openai_agents.model"]

# --- the SDK's own retries of a model call -----------------------------------------------------
class Overloaded(Exception):
    """What a provider raises for a call worth trying again (a 429)."""


class FlakyModel(ScriptedModel):
    """A ScriptedModel whose first call fails with Overloaded, which its retry advice says to retry; it
    counts failed tries as "fail" in ``calls`` and its end-of-run cleanups in ``cleanups``."""

    def __init__(self, calls: list[str], fail: int = 1) -> None:
        super().__init__("m", calls, "", {})
        self.fail = fail
        self.cleanups = 0

    async def get_response(self, system_instructions: Any, input: Any, *args: Any, **kwargs: Any) -> ModelResponse:
        if self.fail:
            self.fail -= 1
            self.calls.append("fail")
            raise Overloaded("try again")
        return await super().get_response(system_instructions, input, *args, **kwargs)

    def get_retry_advice(self, request: ModelRetryAdviceRequest) -> ModelRetryAdvice | None:
        if isinstance(request.error, Overloaded):
            return ModelRetryAdvice(suggested=True, retry_after=0)
        return None

    async def _cleanup_on_run_end(self, owner: object) -> None:
        self.cleanups += 1


def provider_suggested() -> ModelSettings:
    return ModelSettings(retry=ModelRetrySettings(max_retries=2, policy=retry_policies.provider_suggested()))


def test_the_wrapped_models_retry_advice_and_cleanup_are_used(tmp_path: Path) -> None:
    calls: list[str] = []
    model = FlakyModel(calls)
    agent = Agent(name="m", model=model, model_settings=provider_suggested())

    first, replayed = final_outputs_of_two_attempts(tmp_path, agent)
    # The provider's advice retried the failed try, as under Runner; the answer is replayed after.
    assert first == replayed == "m: nothing"
    assert calls == ["fail", "m"]
    assert model.cleanups == 2  # once per run


def step_kinds(db: Path) -> list[tuple[str, str]]:
    store = open_store(str(db), create=False)
    task_id = store.task_id("t")
    assert task_id is not None
    kinds = [(r.name, r.kind) for r in store.steps(task_id)]
    store.close()
    return kinds


class KeyedFlakyModel(FlakyModel):
    """A FlakyModel that notes the idempotency key each try carries."""

    def __init__(self, calls: list[str], fail: int = 1) -> None:
        super().__init__(calls, fail)
        self.keys: list[str] = []

    async def get_response(self, system_instructions: Any, input: Any, model_settings: ModelSettings, *args: Any,
                           **kwargs: Any) -> ModelResponse:
        self.keys.append(str((model_settings.extra_headers or {}).get("Idempotency-Key", "")))
        return await super().get_response(system_instructions, input, model_settings, *args, **kwargs)


def test_a_model_call_the_runner_retries_is_one_step(tmp_path: Path) -> None:
    calls: list[str] = []
    model = KeyedFlakyModel(calls)
    agent = Agent(name="m", model=model, model_settings=provider_suggested())

    first, replayed = final_outputs_of_two_attempts(tmp_path, agent)
    assert first == replayed == "m: nothing"
    assert calls == ["fail", "m"]  # the second attempt replayed the answer, without a try
    assert step_kinds(tmp_path / "job.db") == [("openai_agents.model", "value")]  # the try that failed is not
    assert len(model.keys) == 2 and model.keys[0] == model.keys[1] != ""  # one step: one key for its tries


def test_a_model_call_whose_every_try_failed_replays_its_error_without_a_retry(tmp_path: Path) -> None:
    calls: list[str] = []
    agent = Agent(name="m", model=FlakyModel(calls, fail=3), model_settings=provider_suggested())

    @step
    def fallback() -> str:
        calls.append("fallback")
        return "fallback"

    async def run() -> Any:
        try:
            return (await OnwardRunner.run(agent, "hello")).final_output
        except Overloaded:
            return fallback()
    first, replayed = run_twice(tmp_path, run, is_async=True)
    assert first == replayed == "fallback"
    # Three tries (max_retries=2), then the error, replayed on the second attempt: no try, no retry.
    assert calls == ["fail", "fail", "fail", "fallback"]
    assert step_kinds(tmp_path / "job.db") == [("openai_agents.model", "error"), ("fallback", "value")]


def test_a_model_call_whose_every_try_failed_runs_again_when_the_attempt_failed_with_it(tmp_path: Path) -> None:
    """The model step follows every step's rule: an error the attempt failed with is dropped as it ends, so
    the next attempt (a task retry) calls the model again rather than replaying the error for ever."""
    calls: list[str] = []
    agent = Agent(name="m", model=FlakyModel(calls, fail=3), model_settings=provider_suggested())
    job = Job(str(tmp_path / "job.db"), retry_delay=0, max_attempts=2, log_level=QUIET)

    @job.task
    async def t(name: str, ctx: object) -> Any:
        return (await OnwardRunner.run(agent, "hello")).final_output

    job.add(["t"])
    assert job.run().exit_code == 0 and job.result("t") == "m: nothing"
    job.close()
    assert calls == ["fail", "fail", "fail", "m"]  # three tries, the attempt failed, the next one called again
    assert step_kinds(tmp_path / "job.db") == [("openai_agents.model", "value")]


@pytest.mark.parametrize("fail", [1, 3])
def test_a_streamed_model_call_the_runner_retries_is_one_step(tmp_path: Path, fail: int) -> None:
    """Streamed (the SDK's testing model): the tries of a call are one step, as in a run; one that failed
    every try is recorded when the result's events end, and replays as its error without a try."""
    from agents.testing import ModelStep, ScriptedModel
    from agents.testing.model import assistant_message

    calls: list[str] = []

    def respond(call: Any) -> Any:
        if calls.count("fail") < fail:
            calls.append("fail")
            return ModelStep.raise_error(Overloaded("try again"),
                                         retry_advice=ModelRetryAdvice(suggested=True, retry_after=0))
        calls.append("m")
        return [assistant_message("m: hi")]

    agent = Agent(name="m", model=ScriptedModel([ModelStep.respond(respond)] * 8),
                  model_settings=provider_suggested())

    @step
    def fallback() -> str:
        calls.append("fallback")
        return "fallback"

    async def run() -> Any:
        result = OnwardRunner.run_streamed(agent, "hello")
        try:
            return [e.type async for e in result.stream_events()][-1], result.final_output
        except Overloaded:
            return fallback()
    first, replayed = run_twice(tmp_path, run, is_async=True)
    assert first == replayed
    if fail == 1:
        assert first == ("run_item_stream_event", "m: hi") and calls == ["fail", "m"]
        assert step_kinds(tmp_path / "job.db") == [("openai_agents.model.stream", "value")]
    else:
        assert first == "fallback" and calls == ["fail", "fail", "fail", "fallback"]
        assert step_kinds(tmp_path / "job.db") == [("openai_agents.model.stream", "error"), ("fallback", "value")]


def test_a_streamed_call_whose_events_cannot_be_rebuilt_fails_its_first_run(tmp_path: Path) -> None:
    from agents.testing import ModelStep, ScriptedModel
    from agents.testing.model import assistant_message
    from openai.types.responses import ResponseCompletedEvent

    class Completed(ResponseCompletedEvent):
        """An event class outside the openai package: a replay could not rebuild it."""

    class Rewrapping(ScriptedModel):
        async def stream_response(self, *args: Any, **kwargs: Any) -> Any:
            async for event in super().stream_response(*args, **kwargs):
                yield Completed(**event.model_dump()) if isinstance(event, ResponseCompletedEvent) else event

    agent = Agent(name="m", model=Rewrapping([ModelStep(output=[assistant_message("hi")])]))
    job = Job(str(tmp_path / "job.db"), max_attempts=1, log_level=QUIET)

    @job.task
    async def t(name: str, ctx: object) -> Any:
        result = OnwardRunner.run_streamed(agent, "hello")
        return [e.type async for e in result.stream_events()]

    job.add(["t"])
    assert job.run().exit_code != 0
    task = job.store.task("t")
    job.close()
    assert task is not None and "StoreError" in (task.error or "") and "outside openai" in (task.error or "")
    assert step_kinds(tmp_path / "job.db") == []  # nothing recorded that a replay would fail on


# --- a tool's output reaches the model as under Runner ------------------------------------------
class Reading:
    """A tool's return the SDK str()s for the model, and JSON cannot hold."""

    def __init__(self, degrees: int) -> None:
        self.degrees = degrees

    def __str__(self) -> str:
        return f"it is {self.degrees} degrees"


class Weather(BaseModel):
    city: str
    celsius: float


@pytest.mark.parametrize(("returned", "sent"), [
    (Reading(21), "it is 21 degrees"),
    (Weather(city="Oslo", celsius=3.5), "city='Oslo' celsius=3.5"),
    ({"city": "Oslo", "celsius": 3.5}, "{'city': 'Oslo', 'celsius': 3.5}"),
    ((1, 2), "(1, 2)"),
    (42, "42"),
    (ToolOutputText(text="sunny"), None),  # a structured output: content items, not text
    # NaN and infinity are not JSON: taken for JSON all the same, they failed the step's record, and the task
    (float("nan"), "nan"),
    ({"mean": float("nan"), "max": float("inf")}, "{'mean': nan, 'max': inf}"),
])
def test_a_tools_output_reaches_the_model_as_under_runner(tmp_path: Path, returned: Any, sent: str | None) -> None:
    calls: list[str] = []

    @function_tool
    def weather() -> Any:
        """The weather."""
        calls.append("tool")
        return returned

    def make() -> Agent[Any]:
        return Agent(name="m", model=ScriptedModel("m", calls, "weather", {}), tools=[weather])

    plain = asyncio.run(Runner.run(make(), "weather?")).final_output
    assert (sent is None or plain == f"m: {sent}") and calls == ["m", "tool", "m"]

    async def run() -> Any:
        return (await OnwardRunner.run(make(), "weather?")).final_output
    first, replayed = run_twice(tmp_path, run, is_async=True)
    assert first == replayed == plain  # the model was sent the same text, on the first run as on replay
    assert calls == ["m", "tool", "m"] * 2  # the tool ran once in the task


# --- a session's reads and writes are steps ------------------------------------------------------------
def two_runs_with_a_session(agent: Agent, session: Any, sync: bool = False) -> Any:
    """Two runs of ``agent`` on ``session`` (a conversation of two messages); the final outputs. ``sync``:
    by ``run_sync``, in a sync task."""
    if sync:
        return lambda: [OnwardRunner.run_sync(agent, text, session=session).final_output for text in ("hello", "again")]

    async def run() -> list[Any]:
        return [(await OnwardRunner.run(agent, text, session=session)).final_output for text in ("hello", "again")]
    return run


@pytest.mark.parametrize("sync", [False, True], ids=["run", "run_sync"])
def test_a_sessions_reads_and_writes_are_steps_so_a_retried_task_writes_nothing_twice(tmp_path: Path,
                                                                                      sync: bool) -> None:
    """Before, a session was refused inside a task: the SDK writes each turn to it, so an attempt after a crash
    would have found the first attempt's turns there and added them again. Its reads and writes are now
    steps: the second attempt replays them (and the model and tool calls) and writes nothing."""
    from agents import SQLiteSession

    calls: list[str] = []
    tool_runs: list[int] = []

    @function_tool
    def add(a: int, b: int) -> int:
        tool_runs.append(a + b)
        return a + b

    agent = Agent(name="m", model=ScriptedModel("m", calls, "add", {"a": 1, "b": 2}), tools=[add])
    session = SQLiteSession("conversation", str(tmp_path / "session.db"))
    first, replayed = run_twice(tmp_path, two_runs_with_a_session(agent, session, sync), is_async=not sync)
    assert first == replayed == ["m: 3", "m: 3"]
    assert calls == ["m", "m", "m"] and tool_runs == [3]  # paid once, in the first attempt
    # The session holds the conversation once, as a plain run on a fresh session leaves it.
    plain_session = SQLiteSession("conversation", str(tmp_path / "plain.db"))
    plain_agent = Agent(name="m", model=ScriptedModel("m", [], "add", {"a": 1, "b": 2}), tools=[add])
    assert asyncio.run(two_runs_with_a_session(plain_agent, plain_session)()) == first
    items = asyncio.run(session.get_items())
    assert items == asyncio.run(plain_session.get_items())
    assert [i.get("role") or i.get("type") for i in items] == [
        "user", "function_call", "function_call_output", "assistant", "user", "assistant"]
    names = step_names(tmp_path / "job.db")
    assert names.count("openai_agents.session.get_items") == 2
    assert names.count("openai_agents.session.add_items") == names.count("openai_agents.session.tail") == 5, names


def test_a_streamed_run_with_a_session_writes_nothing_twice(tmp_path: Path) -> None:
    """``run_streamed`` reads and writes the session from the runner's own task: the same steps."""
    from agents import SQLiteSession
    from agents.testing import ModelStep
    from agents.testing import ScriptedModel as TestingModel
    from agents.testing.model import assistant_message, function_call

    calls: list[int] = []

    async def model(call: Any) -> list[Any]:
        calls.append(len(call.input))
        asked = [i for i in call.input if isinstance(i, dict) and i.get("role") == "user"]
        if len(outputs(call.input, "c")) < len(asked):
            return [function_call("square", {"n": 3}, call_id=f"c{len(asked)}")]
        return [assistant_message(f"done after {len(call.input)} items")]

    @function_tool
    def square(n: int) -> int:
        return n * n

    agent = Agent(name="a", model=TestingModel([ModelStep.respond(model)] * 16), tools=[square])
    session = SQLiteSession("conversation", str(tmp_path / "session.db"))

    async def run() -> list[Any]:
        finals = []
        for text in ("hello", "again"):
            result = OnwardRunner.run_streamed(agent, text, session=session)
            async for _ in result.stream_events():
                pass
            finals.append(result.final_output)
        return finals
    assert run_twice(tmp_path, run, is_async=True) == [["done after 3 items", "done after 7 items"]] * 2
    assert calls == [1, 3, 5, 7]  # the second attempt replayed them, with the session's reads
    assert [i.get("role") or i.get("type") for i in asyncio.run(session.get_items())] == [
        "user", "function_call", "function_call_output", "assistant"] * 2


def test_a_session_that_takes_the_runs_context_still_gets_it(tmp_path: Path) -> None:
    """The SDK hands a session whose every method takes ``wrapper`` the run's context: so does onward's."""
    seen: list[Any] = []

    class Remembering:
        session_id = "remembering"
        session_settings = None

        def __init__(self) -> None:
            self.items: list[Any] = []

        async def get_items(self, limit: int | None = None, *, wrapper: Any = None) -> list[Any]:
            seen.append(wrapper.context if wrapper is not None else None)
            return list(self.items)

        async def add_items(self, items: list[Any], *, wrapper: Any = None) -> None:
            self.items += items

        async def pop_item(self, *, wrapper: Any = None) -> Any:
            return self.items.pop() if self.items else None

        async def clear_session(self, *, wrapper: Any = None) -> None:
            self.items.clear()

    agent = Agent(name="m", model=ScriptedModel("m", [], "", {}))
    session = Remembering()

    async def run() -> Any:
        return (await OnwardRunner.run(agent, "hello", session=session, context="the context")).final_output
    assert run_twice(tmp_path, run, is_async=True) == ["m: nothing", "m: nothing"]
    # Read with the context: the history, and the tail before each of the two writes; all three replayed by the
    # second attempt.
    assert seen == ["the context"] * 3
    assert [i.get("role") for i in session.items] == ["user", "assistant"]


def test_a_session_error_is_not_recorded_so_the_next_attempt_writes_for_real(tmp_path: Path) -> None:
    """A session is storage: its errors pass (a server restarting). As for any step, an error that ended the
    attempt is not kept: replayed, it would fail every attempt the same way."""
    from agents import SQLiteSession

    class Flaky(SQLiteSession):
        writes = 0

        async def add_items(self, items: list[Any]) -> None:
            self.writes += 1
            if self.writes == 1:
                raise ConnectionError("the session's server is restarting")
            await super().add_items(items)

    calls: list[str] = []
    agent = Agent(name="m", model=ScriptedModel("m", calls, "", {}))
    session = Flaky("conversation", str(tmp_path / "session.db"))
    job = Job(str(tmp_path / "job.db"), retry_delay=0, max_attempts=2, log_level=QUIET)

    @job.task
    async def t(name: str, ctx: object) -> str:
        return str((await OnwardRunner.run(agent, "hello", session=session)).final_output)

    job.add(["t"])
    summary = job.run()
    job.close()
    assert summary.exit_code == 0 and summary.done == 1
    assert session.writes == 3  # the failed write, then the question and the answer in the second attempt
    assert [i.get("role") for i in asyncio.run(session.get_items())] == ["user", "assistant"]
    assert step_names(tmp_path / "job.db").count("openai_agents.session.add_items") == 2


def test_a_session_the_sdk_treats_apart_is_refused_inside_a_task_and_left_untouched(tmp_path: Path) -> None:
    """A compacting session calls the model itself (outside the task's record), and the SDK handles an
    ``OpenAIConversationsSession`` (a conversation the server keeps) by its class: a durable wrapper would
    hide both from it. Refused inside a task, before any call; outside one, the SDK's as under Runner."""
    from agents import OpenAIConversationsSession, SQLiteSession
    from openai import AsyncOpenAI

    class Compacting(SQLiteSession):
        compactions = 0

        async def run_compaction(self, args: Any = None) -> None:
            self.compactions += 1

    calls: list[str] = []
    session = Compacting("conversation", str(tmp_path / "session.db"))
    agent = Agent(name="m", model=ScriptedModel("m", calls, "", {}))
    # A conversation kept by the server: refused before anything is sent (the client's address takes nothing).
    kept = OpenAIConversationsSession(conversation_id="conv_1",
                                      openai_client=AsyncOpenAI(api_key="none", base_url="http://127.0.0.1:9"))
    refused = refused_in_a_task(tmp_path, lambda: OnwardRunner.run(agent, "hello", session=session),
                                lambda: asyncio.to_thread(OnwardRunner.run_sync, agent, "hello", session=session),
                                lambda: OnwardRunner.run(agent, "hello", session=kept))
    assert len(refused) == 3 and all("Compacting as session=" in r for r in refused[:2]), refused
    assert "OpenAIConversationsSession as session=" in refused[2], refused
    assert calls == [] and asyncio.run(session.get_items()) == []
    # Outside a task the session is the SDK's, as under Runner.
    assert asyncio.run(OnwardRunner.run(agent, "hello", session=session)).final_output == "m: nothing"
    assert len(asyncio.run(session.get_items())) == 2


# --- tools that are not function tools ------------------------------------------------------------------
def test_a_computer_tool_is_refused_inside_a_task(tmp_path: Path) -> None:
    from agents import ComputerTool


    calls: list[str] = []

    def make_computer(*, run_context: Any) -> Any:
        calls.append("computer")
        raise AssertionError("not reached: the run is refused before it starts")

    agent = Agent(name="m", model=ScriptedModel("m", calls, "", {}), tools=[ComputerTool(computer=make_computer)])
    refused = refused_in_a_task(tmp_path, lambda: OnwardRunner.run(agent, "click"))
    assert len(refused) == 1 and "ComputerTool" in refused[0]
    assert calls == []  # no model call, no computer


def test_a_sandbox_agent_is_refused_inside_a_task(tmp_path: Path) -> None:
    """The runner adds a SandboxAgent's capability tools (a shell's exec_command, ...) when the run starts:
    they were not steps, and a resumed run ran the sandbox's commands again (once per attempt)."""
    from agents import RunConfig
    from agents.sandbox import SandboxAgent, SandboxRunConfig
    from agents.sandbox.capabilities import Shell
    from agents.sandbox.sandboxes.unix_local import UnixLocalSandboxClient


    calls: list[str] = []
    sandboxed = SandboxAgent(name="s", model=ScriptedModel("s", calls, "exec_command", {"cmd": "true"}),
                             capabilities=[Shell()])
    plain = Agent(name="m", model=ScriptedModel("m", calls, "", {}), handoffs=[sandboxed])
    config = RunConfig(sandbox=SandboxRunConfig(client=UnixLocalSandboxClient()))
    # As the starting agent, and as a handoff's target.
    refused = refused_in_a_task(tmp_path, *(lambda agent=agent: OnwardRunner.run(agent, "run it", run_config=config)
                                            for agent in (sandboxed, plain)))
    assert len(refused) == 2 and all("SandboxAgent ('s')" in r for r in refused)
    assert calls == []  # no model call, no command


def test_a_hosted_tools_call_is_part_of_the_model_calls_step(tmp_path: Path) -> None:
    from agents import WebSearchTool
    from openai.types.responses.response_function_web_search import ActionSearch, ResponseFunctionWebSearch

    calls: list[str] = []

    class Searching(ScriptedModel):
        """Answers with the web search the server made (a hosted tool: inside the model call) and a message."""

        async def get_response(self, system_instructions: Any, input: Any, *args: Any, **kwargs: Any) -> ModelResponse:
            self.calls.append(self.name)
            search = ResponseFunctionWebSearch(id="ws1", type="web_search_call", status="completed",
                                               action=ActionSearch(type="search", query="weather oslo"))
            return ModelResponse(output=[search, message("sunny")], usage=Usage(), response_id=None)

    agent = Agent(name="m", model=Searching("m", calls, "", {}), tools=[WebSearchTool()])

    async def run() -> Any:
        result = await OnwardRunner.run(agent, "weather?")
        return result.final_output, [type(i.raw_item).__name__ for i in result.new_items]
    first, replayed = run_twice(tmp_path, run, is_async=True)
    assert first == replayed == ("sunny", ["ResponseFunctionWebSearch", "ResponseOutputMessage"])
    assert calls == ["m"]  # the search came with the model call's answer: replayed with it
    assert step_names(tmp_path / "job.db") == ["openai_agents.model"]


# --- human-in-the-loop approvals ----------------------------------------------------------------------
def approval_agent(calls: list[str]) -> tuple[Agent[Any], ScriptedModel]:
    @function_tool(needs_approval=True)
    def pay(amount: int) -> str:
        """Pay an amount."""
        calls.append("tool")
        return f"paid {amount}"

    model = ScriptedModel("m", calls, "pay", {"amount": 5})
    return Agent(name="m", model=model, tools=[pay]), model


def test_an_approved_tool_call_resumes_from_the_run_state_and_replays(tmp_path: Path) -> None:
    calls: list[str] = []
    plain, plain_model = approval_agent(calls)
    result = asyncio.run(Runner.run(plain, "pay 5"))
    state = result.to_state()
    state.approve(state.get_interruptions()[0])
    assert asyncio.run(Runner.run(plain, state)).final_output == "m: paid 5"
    calls.clear()

    agent, model = approval_agent(calls)

    async def run() -> Any:
        result = await OnwardRunner.run(agent, "pay 5")
        assert [i.name for i in result.interruptions] == ["pay"]
        state = result.to_state()  # the SDK copies the tool call of the (recorded) model answer into it
        state.approve(state.get_interruptions()[0])
        return (await OnwardRunner.run(agent, state)).final_output
    first, replayed = run_twice(tmp_path, run, is_async=True)
    assert first == replayed == "m: paid 5"
    assert calls == ["m", "tool", "m"]  # the second attempt replayed all three
    assert step_names(tmp_path / "job.db") == ["openai_agents.model", "openai_agents.tool.pay", "openai_agents.model"]
    # The model was sent the tool call as under Runner: the fields of the provider's answer, no others.
    assert model.inputs[-1] == plain_model.inputs[-1]


def test_a_run_state_rebuilt_from_json_is_refused_inside_a_task(tmp_path: Path) -> None:
    from agents import RunState


    calls: list[str] = []
    agent, _ = approval_agent(calls)

    async def resume_a_rebuilt_state() -> None:
        result = await OnwardRunner.run(agent, "pay 5")
        # Its agent is the one passed to from_string, not a durable clone: its calls would not be steps.
        state = await RunState.from_string(agent, result.to_state().to_string())
        state.approve(state.get_interruptions()[0])
        await OnwardRunner.run(agent, state)
    refused = refused_in_a_task(tmp_path, resume_a_rebuilt_state)
    assert len(refused) == 1 and "RunState" in refused[0]
    assert calls == ["m"]  # the approved tool did not run outside the task's record, nor the model after it


# --- guardrails and max_turns: the same outcome on replay ---------------------------------------------
class Product(BaseModel):
    value: int


def guarded_agent(calls: list[str], seen: list[Any], input_rejects: bool, output_behavior: str) -> Agent:
    """An agent whose one tool (it returns a pydantic model) has an input guardrail that rejects the call
    or lets it through, and an output guardrail that lets, rejects or trips on the output; ``seen`` gets
    what each guardrail was given."""
    @tool_input_guardrail
    def check_input(data: ToolInputGuardrailData) -> ToolGuardrailFunctionOutput:
        seen.append(("input", data.context.tool_arguments))
        if input_rejects:
            return ToolGuardrailFunctionOutput.reject_content("not that one")
        return ToolGuardrailFunctionOutput.allow()

    @tool_output_guardrail
    def check_output(data: ToolOutputGuardrailData) -> ToolGuardrailFunctionOutput:
        seen.append(("output", data.output))
        if output_behavior == "reject":
            return ToolGuardrailFunctionOutput.reject_content(f"withheld {data.output}")
        if output_behavior == "raise":
            return ToolGuardrailFunctionOutput.raise_exception(output_info=str(data.output))
        return ToolGuardrailFunctionOutput.allow()

    @function_tool(tool_input_guardrails=[check_input], tool_output_guardrails=[check_output])
    def multiply(expression: str) -> Product:
        """Multiply 'a * b'."""
        calls.append("tool")
        a, b = (int(x) for x in expression.split("*"))
        return Product(value=a * b)

    return Agent(name="m", model=ScriptedModel("m", calls, "multiply", {"expression": "6 * 7"}), tools=[multiply])


@pytest.mark.parametrize(("input_rejects", "output_behavior", "outcome", "runs"), [
    (True, "allow", "m: not that one", ["m", "m"]),
    (False, "reject", "m: withheld value=42", ["m", "tool", "m"]),
    (False, "raise", ("tripped", "value=42"), ["m", "tool"]),
])
def test_tool_guardrails_give_the_same_outcome_on_replay(tmp_path: Path, input_rejects: bool, output_behavior: str,
                                                         outcome: Any, runs: list[str]) -> None:
    calls: list[str] = []
    seen: list[Any] = []
    agent = guarded_agent(calls, seen, input_rejects, output_behavior)

    async def run() -> Any:
        try:
            return (await OnwardRunner.run(agent, "6 * 7?")).final_output
        except ToolOutputGuardrailTripwireTriggered as e:
            return "tripped", e.output.output_info
    first, replayed = run_twice(tmp_path, run, is_async=True)
    assert first == replayed == outcome
    assert calls == runs  # the second attempt made no call: the guardrails ran again on the replayed ones
    # Each guardrail was given the same on both attempts: the output guardrail, the tool's recorded output
    # (the text the SDK sends the model for a pydantic model), not the object the tool returned.
    assert seen[:len(seen) // 2] == seen[len(seen) // 2:]
    if not input_rejects:
        assert ("output", "value=42") in seen


def test_max_turns_exceeded_replays_the_same_outcome(tmp_path: Path) -> None:
    calls: list[str] = []

    class Looping(Model):
        """Calls the tool every turn, never answers."""

        async def get_response(self, system_instructions: Any, input: Any, *args: Any, **kwargs: Any) -> ModelResponse:
            calls.append("m")
            return answer(tool_call("multiply", {"expression": "1 * 1"}, f"c{len(calls)}"))

        def stream_response(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError

    @function_tool
    def multiply(expression: str) -> str:
        """Multiply 'a * b'."""
        calls.append("tool")
        return "1"

    agent = Agent(name="m", model=Looping(), tools=[multiply])

    async def run() -> Any:
        try:
            return (await OnwardRunner.run(agent, "loop", max_turns=3)).final_output
        except MaxTurnsExceeded as e:
            assert e.run_data is not None
            return str(e), len(e.run_data.new_items)
    first, replayed = run_twice(tmp_path, run, is_async=True)
    assert first == replayed == ("Max turns (3) exceeded", 6)
    assert calls == ["m", "tool"] * 3  # the second attempt made no call

    # With an error handler for max_turns, its final output.
    calls.clear()
    (tmp_path / "handled").mkdir()

    async def handled() -> Any:
        return (await OnwardRunner.run(agent, "loop", max_turns=3, error_handlers={
            "max_turns": lambda data: f"stopped after {len(data.run_data.new_items)} items"})).final_output
    first, replayed = run_twice(tmp_path / "handled", handled, is_async=True)
    assert first == replayed == "stopped after 6 items"
    assert calls == ["m", "tool"] * 3
