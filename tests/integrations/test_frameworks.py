"""Pydantic AI and the OpenAI Agents SDK wrapped for onward, in a real job on a SQLite file: each model
request and tool call is a step, replayed on the second attempt without a call; ``run``, ``run_sync`` and
``run_stream`` work; outside a task the wrappers are the frameworks' own runs."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.conftest import Stub
from tests.integrations.test_clients import run_twice

QUESTION = "Multiply 2 3 5 7"


# --- Pydantic AI --------------------------------------------------------------------------------------
def pydantic_agent(calls: dict[str, int]) -> Any:
    """A Pydantic AI agent on a FunctionModel (sync and streamed) that multiplies with a tool."""
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart, ToolReturnPart
    from pydantic_ai.models.function import DeltaToolCall, FunctionModel

    def move(messages: list[Any]) -> tuple[str, str]:
        done = [p.content for m in messages for p in m.parts if isinstance(p, ToolReturnPart)]
        numbers = [2, 3, 5, 7]
        value = done[-1] if done else "2"
        if len(done) + 1 < len(numbers):
            return "call", f"{value} * {numbers[len(done) + 1]}"
        return "answer", f"The product is {value}."

    def respond(messages: list[Any], info: Any) -> ModelResponse:
        calls["model"] += 1
        kind, text = move(messages)
        if kind == "call":
            return ModelResponse(parts=[ToolCallPart("calculator", {"expression": text})])
        return ModelResponse(parts=[TextPart(text)])

    async def stream(messages: list[Any], info: Any) -> Any:
        calls["model"] += 1
        kind, text = move(messages)
        if kind == "call":
            yield {0: DeltaToolCall(name="calculator", json_args=json.dumps({"expression": text}))}
        else:
            for word in text.split(" "):
                yield word + " "

    agent = Agent(FunctionModel(respond, stream_function=stream))

    @agent.tool_plain
    def calculator(expression: str) -> str:
        calls["tool"] += 1
        a, b = (int(x) for x in expression.split("*"))
        return str(a * b)
    return agent


def test_pydantic_ai_run_sync_and_run_replay_without_calls(tmp_path: Path) -> None:
    from onward.integrations.pydantic_ai import OnwardAgent

    calls = {"model": 0, "tool": 0}
    agent = OnwardAgent(pydantic_agent(calls))
    first, replayed = run_twice(tmp_path / "sync", lambda: agent.run_sync(QUESTION).all_messages())
    assert calls == {"model": 4, "tool": 3}  # once each: the second attempt replayed them
    assert replayed[-1].parts[0].content == "The product is 210."
    # The model's responses are the recorded ones, equal field by field (timestamps and tool call ids
    # included); the agent stamps each with its run's fresh ids, and the requests with the time of the run.
    def responses(messages: list[Any]) -> list[Any]:
        return [replace(m, run_id=None, conversation_id=None) for m in messages if m.kind == "response"]
    assert len(responses(replayed)) == 4 and responses(replayed) == responses(first)

    async def run() -> str:
        return (await agent.run(QUESTION)).output
    first, replayed = run_twice(tmp_path / "async", run, is_async=True)
    assert first == replayed == "The product is 210."
    assert calls == {"model": 8, "tool": 6}


def test_pydantic_ai_run_stream_replays(tmp_path: Path) -> None:
    from onward.integrations.pydantic_ai import OnwardAgent

    calls = {"model": 0, "tool": 0}
    agent = OnwardAgent(pydantic_agent(calls))

    async def stream() -> str:
        async with agent.run_stream(QUESTION) as result:
            return "".join([piece async for piece in result.stream_text(delta=True)])
    first, replayed = run_twice(tmp_path, stream, is_async=True)
    assert first.strip() == replayed.strip() == "The product is 210."
    assert calls == {"model": 4, "tool": 3}


def test_pydantic_ai_outside_a_task_is_the_wrapped_agent() -> None:
    from onward.integrations.pydantic_ai import OnwardAgent

    calls = {"model": 0, "tool": 0}
    plain = pydantic_agent(calls)
    agent = OnwardAgent(plain)
    assert agent.run_sync(QUESTION).output == plain.run_sync(QUESTION).output == "The product is 210."
    assert calls == {"model": 8, "tool": 6}


def test_pydantic_ai_wraps_every_leaf_toolset_once() -> None:
    pytest.importorskip("pydantic_ai")
    from pydantic_ai.toolsets import CombinedToolset, FunctionToolset

    from onward.integrations.pydantic_ai import OnwardToolset, durable_toolset

    leaves = [FunctionToolset([]), FunctionToolset([])]
    wrapped: Any = durable_toolset(CombinedToolset(leaves))
    found: list[Any] = []
    wrapped.apply(found.append)
    assert found == leaves  # apply reaches the leaves through the wrappers
    assert isinstance(wrapped, CombinedToolset) and all(isinstance(t, OnwardToolset) for t in wrapped.toolsets)
    again: Any = durable_toolset(wrapped)
    assert all(isinstance(t, OnwardToolset) and not isinstance(t.wrapped, OnwardToolset) for t in again.toolsets)


# --- OpenAI Agents SDK --------------------------------------------------------------------------------
def agents_agent(stub: Stub, tools: list[str]) -> Any:
    pytest.importorskip("agents")
    from agents import Agent, OpenAIChatCompletionsModel, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)

    @function_tool
    def calculator(expression: str) -> str:
        """Multiply 'a * b'."""
        tools.append(expression)
        a, b = (int(x) for x in expression.split("*"))
        return str(a * b)

    # A client per event loop: httpx's pool belongs to the loop that opened it.
    return lambda: Agent(name="m", tools=[calculator],
                         model=OpenAIChatCompletionsModel("stub", AsyncOpenAI(base_url=stub.base_url, api_key="k")))


def test_openai_agents_run_and_run_sync_replay_without_calls(tmp_path: Path, stub: Stub) -> None:
    from onward.integrations.openai_agents import OnwardRunner

    tools: list[str] = []
    make = agents_agent(stub, tools)
    def run_sync() -> Any:
        agent = make()
        tool, invoke, model = agent.tools[0], agent.tools[0].on_invoke_tool, agent.model
        output = OnwardRunner.run_sync(agent, QUESTION).final_output
        # The agent given is not changed: the run used durable clones of it.
        assert agent.tools[0] is tool and tool.on_invoke_tool is invoke and agent.model is model
        return output
    first, replayed = run_twice(tmp_path / "sync", run_sync)
    assert first == replayed == "The product is 210."
    assert stub.count() == 4 and tools == ["2 * 3", "6 * 5", "30 * 7"]

    async def run() -> Any:
        return (await OnwardRunner.run(make(), QUESTION)).final_output
    first, replayed = run_twice(tmp_path / "async", run, is_async=True)
    assert first == replayed == "The product is 210."
    assert stub.count() == 8 and len(tools) == 6
    assert all(c["key"] and c["key"].startswith("onward-") for c in stub.calls())


def test_openai_agents_outside_a_task_is_the_plain_runner(stub: Stub) -> None:
    from onward.integrations.openai_agents import OnwardRunner

    tools: list[str] = []
    make = agents_agent(stub, tools)
    assert OnwardRunner.run_sync(make(), QUESTION).final_output == "The product is 210."
    assert asyncio.run(OnwardRunner.run(make(), QUESTION)).final_output == "The product is 210."
    assert stub.count() == 8 and len(tools) == 6
    assert all(c["key"] is None for c in stub.calls())


def test_pydantic_ai_toolsets_given_per_run_are_steps_too(tmp_path: Path) -> None:
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.messages import ToolReturn
    from pydantic_ai.models.test import TestModel
    from pydantic_ai.toolsets import FunctionToolset

    from onward.integrations.pydantic_ai import OnwardAgent

    looked_up: list[str] = []

    def lookup(city: str) -> Any:  # a ToolReturn (not named: annotations are resolved in the module)
        """The weather in a city."""
        looked_up.append(city)
        return ToolReturn(return_value=f"sunny in {city}", metadata={"source": "stub"})

    model = TestModel()  # calls every tool once, then answers with what they returned
    agent = OnwardAgent(Agent(model))
    def run() -> Any:
        result = agent.run_sync("weather?", toolsets=[FunctionToolset([lookup])])
        returned = [p for m in result.all_messages() for p in m.parts if p.part_kind == "tool-return"]
        return result.output, [(p.content, p.metadata) for p in returned]
    first, replayed = run_twice(tmp_path, run)
    assert first == replayed and "sunny in" in first[0]
    # A ToolReturn comes back a ToolReturn: its value to the model, its metadata kept aside.
    assert replayed[1] == [("sunny in a", {"source": "stub"})]
    assert len(looked_up) == 1  # the tool ran once: the second attempt replayed its recorded return
    from onward.store import open_store

    store = open_store(str(tmp_path / "job.db"), create=False)
    task_id = store.task_id("t")
    assert task_id is not None
    names = [r.name for r in store.steps(task_id)]
    store.close()
    assert names == ["pydantic_ai.model.request", "pydantic_ai.tool.lookup", "pydantic_ai.model.request"]


def test_openai_agents_streamed_run_replays_without_calls(tmp_path: Path, stub: Stub) -> None:
    """A streamed run (the stub streams server-sent events through the SDK's chat-completions model): each
    model call a step of its events, each tool call a step; the second attempt replays the same events."""
    from onward.integrations.openai_agents import OnwardRunner

    tools: list[str] = []
    make = agents_agent(stub, tools)

    async def run() -> Any:
        result = OnwardRunner.run_streamed(make(), QUESTION)
        events = [e.data.type if e.type == "raw_response_event" else e.type async for e in result.stream_events()]
        return result.final_output, events
    first, replayed = run_twice(tmp_path, run, is_async=True)
    assert first == replayed and first[0] == "The product is 210."
    assert "response.output_text.delta" in first[1] and "run_item_stream_event" in first[1]
    assert stub.count() == 4 and tools == ["2 * 3", "6 * 5", "30 * 7"]  # the second attempt made no call
    assert all(c["key"] and c["key"].startswith("onward-") and c["stream"] for c in stub.calls())


def test_pydantic_ai_a_model_override_around_the_run_is_kept(tmp_path: Path) -> None:
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelResponse, TextPart
    from pydantic_ai.models.function import FunctionModel
    from pydantic_ai.models.test import TestModel

    from onward.integrations.pydantic_ai import OnwardAgent

    calls: list[int] = []

    def respond(messages: list[Any], info: Any) -> ModelResponse:
        calls.append(1)
        return ModelResponse(parts=[TextPart("from the overriding model")])

    agent = OnwardAgent(Agent(TestModel(custom_output_text="from the agent's own model")))

    def run() -> str:
        with agent.override(model=FunctionModel(respond)):  # what a test of the agent would do
            return agent.run_sync(QUESTION).output
    first, replayed = run_twice(tmp_path, run)
    assert first == replayed == "from the overriding model"
    assert calls == [1]  # asked once: the second attempt replayed it


def test_pydantic_ai_a_tool_returning_nan_sends_the_model_what_it_sends_without_onward(tmp_path: Path) -> None:
    """A tool returning NaN or infinity: Pydantic AI sends the model null; under OnwardAgent the tool's step
    took the NaN for JSON, its record refused it, and every attempt failed."""
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart, ToolReturnPart
    from pydantic_ai.models.function import FunctionModel

    from onward.integrations.pydantic_ai import OnwardAgent

    sent: list[str] = []
    tool_runs: list[str] = []

    def respond(messages: list[Any], info: Any) -> ModelResponse:
        returned = [p for m in messages for p in m.parts if isinstance(p, ToolReturnPart)]
        if not returned:
            return ModelResponse(parts=[ToolCallPart("stats", {}, tool_call_id="a")])
        sent.append(returned[-1].model_response_str())  # the text a model is sent
        return ModelResponse(parts=[TextPart("done")])

    agent = Agent(FunctionModel(respond))

    @agent.tool_plain
    def stats() -> Any:
        tool_runs.append("stats")
        return {"mean": float("nan"), "values": [1.5, float("inf")]}

    agent.run_sync("go")
    plain = sent.pop()
    assert plain == '{"mean":null,"values":[1.5,null]}'
    durable = OnwardAgent(agent)
    first, replayed = run_twice(tmp_path, lambda: durable.run_sync("go").output)
    assert first == replayed == "done"
    assert sent == [plain]  # the model was asked once (the replay made no request), and was sent the same
    assert tool_runs == ["stats", "stats"]  # the plain run's, and the durable run's once


@pytest.mark.parametrize("returns", ["image", "list"])
def test_pydantic_ai_a_tool_returning_an_image_sends_the_model_an_image(tmp_path: Path, returns: str) -> None:
    """A tool returning BinaryContent (or a list with an ImageUrl) reaches the model as that content, on the
    first run as on replay, as it does without onward; it reached it as a JSON dict of base64 text."""
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent, BinaryContent, ImageUrl
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart, ToolReturnPart
    from pydantic_ai.models.function import FunctionModel

    from onward.integrations.pydantic_ai import OnwardAgent

    seen: list[Any] = []
    tool_runs: list[str] = []
    image = BinaryContent(data=b"\x89PNG\r\n\x1a\nfake", media_type="image/png")

    def respond(messages: list[Any], info: Any) -> ModelResponse:
        returned = [p for m in messages for p in m.parts if isinstance(p, ToolReturnPart)]
        if not returned:
            return ModelResponse(parts=[ToolCallPart("screenshot", {}, tool_call_id="a")])
        seen.append(returned[-1].content)
        return ModelResponse(parts=[TextPart("done")])

    agent = Agent(FunctionModel(respond))

    @agent.tool_plain
    def screenshot() -> Any:
        tool_runs.append("screenshot")
        return image if returns == "image" else ["the page:", ImageUrl(url="https://example.com/page.png")]

    agent.run_sync("look")
    plain = seen.pop()
    durable = OnwardAgent(agent)

    def body() -> Any:
        result = durable.run_sync("look")
        return [p.content for m in result.all_messages() for p in m.parts if isinstance(p, ToolReturnPart)][-1]

    first, replayed = run_twice(tmp_path, body)
    assert seen == [first]  # the model was asked once (the replay made no request), and saw...
    assert first == plain or (returns == "image" and isinstance(first, BinaryContent) and first.data == image.data
                              and first.media_type == image.media_type)  # ...what it sees without onward
    assert replayed == first
    assert tool_runs == ["screenshot", "screenshot"]  # the plain run's, and the durable run's once
    if returns == "image":
        assert isinstance(first, BinaryContent)
    else:
        assert first[0] == "the page:" and isinstance(first[1], ImageUrl)
