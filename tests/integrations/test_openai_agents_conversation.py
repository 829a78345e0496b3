"""OpenAI Agents SDK runs under OnwardRunner that keep the conversation on the server (Responses API:
``previous_response_id``, ``auto_previous_response_id``, ``conversation_id``), their worker SIGKILLed and
resumed. The model is the stub server (tests/integrations/conftest.py), which keeps the responses and
conversations it is sent and logs what each call continued and sent; the run's function tool logs its calls
too, so the counts survive the kills. The runs are forked from a process that imported the SDK once
(tests/kill_loop.py)."""

from __future__ import annotations

import json
import random
import textwrap
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from onward.step_records import unframe
from onward.store import open_store
from tests.integrations.conftest import Stub
from tests.kill_loop import ForkServer, KillPlan, integrity, json_lines, kill_until_done

pytest.importorskip("agents")

QUESTION = "Multiply 2 3 5 7 11 13 17"  # 6 tool calls, then the answer: 7 model calls
FACTORS = [2, 3, 5, 7, 11, 13, 17]
PLAN = KillPlan(random_kills=4, commit_kills=2, max_new=2, max_pause=0.04, nth=(2, 6))
DEVELOPER = {"role": "developer", "content": "You multiply with the calculator."}

# The agent: the stub model through the SDK's Responses model, one function tool, run by OnwardRunner in a
# task that keeps the conversation on the server as MODE says (STATE: the response or conversation to go on).
AGENT = '''
import json, sys
from agents import Agent, OpenAIResponsesModel, function_tool, set_tracing_disabled
from openai import AsyncOpenAI
from onward import Job
from onward.integrations.openai_agents import OnwardRunner

db, base_url, tool_log, mode, state, question = sys.argv[1:7]
set_tracing_disabled(True)
job = Job(db, max_attempts=1000, retry_delay=0, heartbeat=1.0)


@function_tool
def calculator(expression: str) -> str:
    """Multiply two integers: 'a * b'."""
    with open(tool_log, "a") as f:
        f.write(json.dumps({"expression": expression}) + "\\n")
    a, b = (int(x) for x in expression.split("*"))
    return str(a * b)


agent = Agent(name="multiplier", instructions="Multiply with the calculator, two numbers at a time.",
              tools=[calculator],
              model=OpenAIResponsesModel("stub", AsyncOpenAI(base_url=base_url, api_key="stub", max_retries=0)))
KEPT = {"previous_response_id": {"previous_response_id": state}, "conversation_id": {"conversation_id": state},
        "auto_previous_response_id": {"auto_previous_response_id": True}}[mode]


@job.task
async def solve(question, ctx):
    return str((await OnwardRunner.run(agent, question, max_turns=32, **KEPT)).final_output)


job.add([question])
sys.exit(job.run().exit_code)
'''


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ForkServer]:
    s = ForkServer(tmp_path, ["onward", "onward.integrations.openai_agents", "openai"])
    yield s
    s.close()


def post(stub: Stub, path: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(stub.base_url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def conversation_items(stub: Stub, conversation: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{stub.base_url}/conversations/{conversation}/items", timeout=30) as response:
        return list(json.loads(response.read())["data"])


def start_state(stub: Stub, mode: str) -> str:
    """The server-side state a run goes on from: a response, a conversation, or none."""
    if mode == "previous_response_id":
        return str(post(stub, "/responses", {"model": "stub", "input": [DEVELOPER]})["id"])
    if mode == "conversation_id":
        return str(post(stub, "/conversations", {"items": [DEVELOPER]})["id"])
    return ""


def key(item: dict[str, Any]) -> str:
    return f"{item.get('type') or 'message'}:{item.get('call_id') or item.get('role') or ''}"


def check_conversation(stub: Stub, mode: str, state: str, calls: list[dict[str, Any]],
                       recorded: list[str]) -> int:
    """What the server saw of one run (its calls, in order; ``recorded``: the response ids of the run's
    recorded model steps) is one consistent conversation; returns the number of calls sent again."""
    per_turn = Counter(c["turn"] for c in calls)
    assert sorted(per_turn) == list(range(len(FACTORS)))
    for c in calls:
        # Each call sends only what the server has not got from the run: the question, then one tool output.
        assert c["sent"] == (["message:user"] if c["turn"] == 0 else [f"function_call_output:call_{c['turn']}"]), c
        if mode == "conversation_id":
            assert c["conversation"] == state and c["previous_response_id"] is None, c
        else:
            # Each call goes on from the response the run recorded for the turn before (the first turn: from
            # the response it was given), never from one whose answer the run did not keep.
            before = recorded[c["turn"] - 1] if c["turn"] > 0 else (state or None)
            assert c["previous_response_id"] == before, (c, recorded)
            assert c["conversation"] is None
    # Each recorded answer is one the server made for that turn.
    made = {c["response_id"]: c["turn"] for c in calls}
    assert [made.get(r) for r in recorded] == list(range(len(FACTORS))), (recorded, made)
    # A call sent again carries the first one's idempotency key: a server that deduplicates sends it once.
    assert all(len({c["key"] for c in calls if c["turn"] == t}) == 1 for t in per_turn)
    repeats = sum(n - 1 for n in per_turn.values())
    if mode == "conversation_id":
        # Every call the server got was added to the conversation (its input, then its output): a call sent
        # again after a kill adds its one input and one output once more, nothing else is there twice.
        items = conversation_items(stub, state)
        expected = [key(DEVELOPER)] + [k for t in range(len(FACTORS)) for k in
                                       (["message:user"] if t == 0 else [f"function_call_output:call_{t}"])
                                       + ([f"function_call:call_{t + 1}"] if t + 1 < len(FACTORS)
                                          else ["message:assistant"])]
        assert sorted(set(map(key, items))) == sorted(expected)
        assert len(items) == len(expected) + 2 * repeats, [key(i) for i in items]
    return repeats


@pytest.mark.parametrize("mode", ["previous_response_id", "auto_previous_response_id", "conversation_id"])
def test_server_side_conversation_is_consistent_across_kills(server: ForkServer, tmp_path: Path, slow_stub: Stub,
                                                             mode: str, seed: int) -> None:
    rng = random.Random(seed)
    agent = tmp_path / "agent.py"
    agent.write_text(textwrap.dedent(AGENT))

    def argv(db: Path, tools: Path, state: str) -> list[str]:
        return [str(agent), str(db), slow_stub.base_url, str(tools), mode, state, QUESTION]

    def recorded_ids(db: Path) -> tuple[Any, list[str]]:
        store = open_store(str(db), create=False)
        try:
            task_id = store.task_id(QUESTION)
            assert task_id is not None
            records = store.steps(task_id)
            assert [r.name for r in records] == (["openai_agents.model", "openai_agents.tool.calculator"]
                                                 * (len(FACTORS) - 1) + ["openai_agents.model"])
            return store.result(QUESTION), [json.loads(unframe(r.data).payload)["response_id"] for r in records
                                            if r.name == "openai_agents.model"]
        finally:
            store.close()

    # The reference: one uninterrupted run.
    reference_db, state = tmp_path / "reference.db", start_state(slow_stub, mode)
    before = slow_stub.count()
    code = server.start(argv(reference_db, tmp_path / "reference-tools", state)).wait(120)
    assert code == 0, server.stderr.read_text()[-3000:]
    expected, recorded = recorded_ids(reference_db)
    product = 1
    for factor in FACTORS:
        product *= factor
    assert expected is not None and expected.data == f"The product is {product}.".encode()
    assert check_conversation(slow_stub, mode, state, slow_stub.calls()[before:], recorded) == 0

    db, tools, state = tmp_path / "agent.db", tmp_path / "tools", start_state(slow_stub, mode)
    before = slow_stub.count()

    def progress() -> int:  # the distinct calls made so far: a call made again is no progress
        return len({c["turn"] for c in slow_stub.calls()[before:]}) + len({c["expression"] for c in json_lines(tools)})
    done = kill_until_done(server, argv(db, tools, state), progress, db, PLAN, rng)
    calls = slow_stub.calls()[before:]
    result, recorded = recorded_ids(db)
    repeats = check_conversation(slow_stub, mode, state, calls, recorded)
    print(f"{mode}: kills {done.kills} ({done.in_commit} inside a commit); model calls {len(calls)},"
          f" {repeats} sent again")
    assert result == expected
    tool_repeats = sum(n - 1 for n in Counter(c["expression"] for c in json_lines(tools)).values())
    assert repeats + tool_repeats <= done.kills  # at most the one call in flight at each kill
    assert integrity(db) == "ok"
