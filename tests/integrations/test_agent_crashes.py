"""Each integration's example agent (examples/agents/), a 21-call agent (11 model calls, 10 tool calls),
run as a real worker process against the stub and SIGKILLed at seeded random moments (8 times, 2 of them
by strace at the N-th fdatasync, inside a commit; 30 times, 8 inside a commit, under ``make torture``), then
resumed until done. At the end:

- the answer equals that of an uninterrupted run;
- every step has one record, model and tool calls alternating;
- every model call (one per turn of the conversation) and every tool execution happened at least once,
  and all the repeats together are at most one per kill (only the call in flight at a kill runs again);
- every model call carried the idempotency key of a recorded step;
- the store passes integrity_check after every kill.

The runs are forked from a process that imported the SDK once (tests/kill_loop.py): a kill-and-resume
cycle costs a fork, not an interpreter start and the SDK's imports.
"""

from __future__ import annotations

import random
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from onward.steps import idempotency_key
from onward.store import open_store
from tests.integrations.conftest import EXAMPLES, Stub
from tests.kill_loop import ForkServer, KillPlan, integrity, json_lines, kill_until_done
from tests.reliability import record

QUESTION = "Multiply 2 3 5 7 11 13 17 19 23 29 31"
MODEL_CALLS, TOOL_CALLS = 11, 10
PLAN = KillPlan(random_kills=6, commit_kills=2, max_new=2, max_pause=0.04, nth=(2, 6))
TORTURE_PLAN = KillPlan(random_kills=22, commit_kills=8, max_new=1, max_pause=0.03, nth=(2, 4))

# example, its model step's name, its tool step's name, the stub's base URL it wants, what it imports
CASES = {
    "openai": ("openai_agent.py", "openai.chat.completions.create", "calculator", "/v1",
               ["openai", "onward.integrations.openai"]),
    "anthropic": ("anthropic_agent.py", "anthropic.messages.create", "calculator", "",
                  ["anthropic", "onward.integrations.anthropic"]),
    "pydantic_ai": ("pydantic_ai_agent.py", "pydantic_ai.model.request", "pydantic_ai.tool.calculator_tool", "/v1",
                    ["pydantic_ai", "pydantic_ai.models.openai", "pydantic_ai.providers.openai",
                     "onward.integrations.pydantic_ai"]),
    "openai_agents": ("openai_agents_agent.py", "openai_agents.model", "openai_agents.tool.calculator_tool", "/v1",
                      ["agents", "openai", "onward.integrations.openai_agents"]),
}


def tool_runs(path: Path) -> list[str]:
    return [run["expression"] for run in json_lines(path)]


@pytest.fixture(params=sorted(CASES))
def case(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, ForkServer]]:
    name = request.param
    pytest.importorskip({"openai_agents": "agents"}.get(name, name))
    server = ForkServer(tmp_path, ["onward", *CASES[name][4]])
    yield name, server
    server.close()


def test_agent_killed_at_random_moments_pays_each_call_once(case: tuple[str, ForkServer], tmp_path: Path,
                                                            slow_stub: Stub, seed: int) -> None:
    kill_and_check(*case, PLAN, tmp_path, slow_stub, seed)


@pytest.mark.torture
def test_agent_killed_thirty_times_pays_each_call_once(case: tuple[str, ForkServer], tmp_path: Path,
                                                       slow_stub: Stub, seed: int) -> None:
    kill_and_check(*case, TORTURE_PLAN, tmp_path, slow_stub, seed)


def kill_and_check(name: str, server: ForkServer, plan: KillPlan, tmp_path: Path, stub: Stub, seed: int) -> None:
    script, model_step, tool_step, suffix, _ = CASES[name]
    rng = random.Random(seed)

    def argv(db: Path, tools: Path) -> list[str]:
        return [str(EXAMPLES / script), "--db", str(db), "--base-url", stub.url + suffix, "--tool-log", str(tools),
                QUESTION]

    # The reference: one uninterrupted run.
    reference_db = tmp_path / "reference.db"
    assert server.start(argv(reference_db, tmp_path / "reference-tools")).wait(120) == 0, server.stderr.read_text()
    reference = open_store(str(reference_db), create=False)
    expected = reference.result(QUESTION)
    reference.close()
    assert expected is not None
    assert len(tool_runs(tmp_path / "reference-tools")) == TOOL_CALLS
    before = stub.count()
    assert before == MODEL_CALLS

    db, tools = tmp_path / "agent.db", tmp_path / "tools"
    done = kill_until_done(server, argv(db, tools), lambda: stub.count() - before + len(tool_runs(tools)), db,
                           plan, rng)
    calls = stub.calls()[before:]
    runs = tool_runs(tools)
    print(f"{name}: kills {done.kills} ({done.in_commit} inside a commit); model calls {len(calls)};"
          f" tool executions {len(runs)}")
    assert done.in_commit == (plan.commit_kills if shutil.which("strace") else 0)
    assert done.kills >= plan.commit_kills + 1

    store = open_store(str(db), create=False)
    try:
        assert store.result(QUESTION) == expected  # the answer of the uninterrupted run
        task_id = store.task_id(QUESTION)
        assert task_id is not None
        records = store.steps(task_id)
    finally:
        store.close()
    assert [(r.index, r.name) for r in records] == [
        (i + 1, model_step if i % 2 == 0 else tool_step) for i in range(MODEL_CALLS + TOOL_CALLS)]
    # Every model call (one per turn) and every tool execution happened, each once plus at most one
    # repeat per kill: the call in flight when it came.
    per_turn = Counter(c["turn"] for c in calls)
    per_expression = Counter(runs)
    assert sorted(per_turn) == list(range(MODEL_CALLS))
    assert len(per_expression) == TOOL_CALLS
    repeats = sum(n - 1 for n in per_turn.values()) + sum(n - 1 for n in per_expression.values())
    assert repeats <= done.kills
    record("kills", backend="sqlite", case=f"{name} agent (11 model calls, 10 tool calls), SIGKILL at random moments"
           " and inside commits", seed=seed, kills=done.kills, in_commit=done.in_commit, repeated_calls=repeats)
    # Each model call was sent with the idempotency key of the step it belongs to.
    keys = {idempotency_key(QUESTION, r.name, r.index) for r in records if r.name == model_step}
    assert {c["key"] for c in calls} <= keys
    assert integrity(db) == "ok"
