"""OpenAI Agents SDK runs under OnwardRunner whose worker is SIGKILLed and resumed, for what the wrapper
reaches beyond an agent's own function tools: the tools of an agent's MCP servers (a real MCP server over
stdio, started by the SDK's ``MCPServerStdio``). The model is the stub server (tests/integrations/conftest.py),
through the SDK's chat-completions model; the stub and the tools log every call they get, so the counts
survive the kills. The runs are forked from a process that imported the SDK once (tests/kill_loop.py)."""

from __future__ import annotations

import random
import shutil
import textwrap
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from onward.store import open_store
from tests.integrations.conftest import Stub
from tests.kill_loop import ForkServer, KillPlan, integrity, json_lines, kill_until_done

pytest.importorskip("agents")
pytest.importorskip("mcp.server.mcpserver")

QUESTION = "Multiply 2 3 5 7 11 13 17"  # 6 tool calls, then the answer: 7 model calls
FACTORS = [2, 3, 5, 7, 11, 13, 17]
PLAN = KillPlan(random_kills=3, commit_kills=2, max_new=2, max_pause=0.04, nth=(2, 6))

# The MCP server: one tool, calculator ('a * b', as the stub model calls it), each call appended to the file
# named by its one argument.
MCP_SERVER = '''
import json, os, sys
from mcp.server.mcpserver import MCPServer

log = sys.argv[1]
server = MCPServer("calculator")


@server.tool()
def calculator(expression: str) -> str:
    """Multiply two integers: 'a * b'."""
    with open(log, "a") as f:
        f.write(json.dumps({"expression": expression, "pid": os.getpid()}) + "\\n")
    a, b = (int(x) for x in expression.split("*"))
    return str(a * b)


if __name__ == "__main__":
    server.run("stdio")
'''

# The agent: the stub model, the MCP server as its only tools, run by OnwardRunner in a task.
MCP_AGENT = '''
import sys
from agents import Agent, OpenAIChatCompletionsModel, set_tracing_disabled
from agents.mcp import MCPServerStdio
from openai import AsyncOpenAI
from onward import Job
from onward.integrations.openai_agents import OnwardRunner

db, base_url, server, tool_log, question = sys.argv[1:6]
set_tracing_disabled(True)
job = Job(db, max_attempts=1000, retry_delay=0, heartbeat=1.0)


@job.task
async def solve(question, ctx):
    params = {"command": sys.executable, "args": [server, tool_log]}
    async with MCPServerStdio(params=params, client_session_timeout_seconds=30) as calculator:
        agent = Agent(name="multiplier", instructions="Multiply with the calculator, two numbers at a time.",
                      mcp_servers=[calculator],
                      model=OpenAIChatCompletionsModel("stub", AsyncOpenAI(base_url=base_url, api_key="stub")))
        return str((await OnwardRunner.run(agent, question, max_turns=32)).final_output)


job.add([question])
sys.exit(job.run().exit_code)
'''


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ForkServer]:
    s = ForkServer(tmp_path, ["onward", "onward.integrations.openai_agents", "agents.mcp", "openai"])
    yield s
    s.close()


def test_mcp_tool_calls_are_steps_paid_once_across_kills(server: ForkServer, tmp_path: Path, slow_stub: Stub,
                                                         seed: int) -> None:
    rng = random.Random(seed)
    mcp_server, agent = tmp_path / "calculator.py", tmp_path / "agent.py"
    mcp_server.write_text(MCP_SERVER)
    agent.write_text(textwrap.dedent(MCP_AGENT))

    def argv(db: Path, tools: Path) -> list[str]:
        return [str(agent), str(db), slow_stub.base_url, str(mcp_server), str(tools), QUESTION]

    # The reference: one uninterrupted run.
    reference_db = tmp_path / "reference.db"
    code = server.start(argv(reference_db, tmp_path / "reference-tools")).wait(120)
    assert code == 0, server.stderr.read_text()[-3000:]
    reference = open_store(str(reference_db), create=False)
    expected = reference.result(QUESTION)
    reference.close()
    product = 1
    for factor in FACTORS:
        product *= factor
    assert expected is not None and expected.data == f"The product is {product}.".encode()
    assert len(json_lines(tmp_path / "reference-tools")) == len(FACTORS) - 1
    before = slow_stub.count()
    assert before == len(FACTORS)

    db, tools = tmp_path / "agent.db", tmp_path / "tools"

    def progress() -> int:  # the distinct calls made so far: a call made again is no progress
        return (len({c["turn"] for c in slow_stub.calls()[before:]})
                + len({c["expression"] for c in json_lines(tools)}))
    done = kill_until_done(server, argv(db, tools), progress, db, PLAN, rng)
    model_calls, tool_calls = slow_stub.calls()[before:], json_lines(tools)
    print(f"kills {done.kills} ({done.in_commit} inside a commit); model calls {len(model_calls)};"
          f" MCP tool calls {len(tool_calls)}")
    assert done.in_commit == (PLAN.commit_kills if shutil.which("strace") else 0)

    store = open_store(str(db), create=False)
    try:
        assert store.result(QUESTION) == expected
        task_id = store.task_id(QUESTION)
        assert task_id is not None
        records = store.steps(task_id)
    finally:
        store.close()
    # Every call was made, once, plus at most one repeat per kill: the one in flight when it came.
    per_tool_call = Counter(c["expression"] for c in tool_calls)
    per_turn = Counter(c["turn"] for c in model_calls)
    assert len(per_tool_call) == len(FACTORS) - 1
    assert sorted(per_turn) == list(range(len(FACTORS)))
    repeats = sum(n - 1 for n in per_tool_call.values()) + sum(n - 1 for n in per_turn.values())
    assert repeats <= done.kills
    # Each MCP tool call is a step of its own, between the model calls.
    assert [r.name for r in records] == (["openai_agents.model", "openai_agents.tool.calculator"]
                                         * (len(FACTORS) - 1) + ["openai_agents.model"])
    assert integrity(db) == "ok"
