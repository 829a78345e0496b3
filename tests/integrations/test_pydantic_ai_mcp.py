"""MCP tool calls in a Pydantic AI agent made durable with ``OnwardAgent``: a 21-call agent (11 model
requests to a ``FunctionModel``, 10 calls of a tool served by a real MCP server over stdio: a script
written with the ``mcp`` package, started by Pydantic AI's ``MCPToolset``), run as a worker process,
SIGKILLed at seeded random moments (some inside a commit) and resumed. The MCP server and the model log
every call they get: each call was made once, plus at most one repeat per kill, and the answer is that of
an uninterrupted run."""

from __future__ import annotations

import random
import shutil
import textwrap
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from onward.store import open_store
from tests.kill_loop import ForkServer, KillPlan, integrity, json_lines, kill_until_done

pytest.importorskip("pydantic_ai")
pytest.importorskip("fastmcp", reason="Pydantic AI's MCP toolsets need its [mcp] extra")
pytest.importorskip("mcp.server.mcpserver")

QUESTION = "multiply 2 to 11"
FACTORS = list(range(2, 12))  # 10 MCP tool calls, then the answer: 11 model requests
PLAN = KillPlan(random_kills=2, commit_kills=2, max_new=2, max_pause=0.03, nth=(2, 6))
TORTURE_PLAN = KillPlan(random_kills=14, commit_kills=6, max_new=1, max_pause=0.03, nth=(2, 4))

# The MCP server: one tool, multiply, each call appended to the file named by its one argument.
SERVER = '''
import json, os, sys
from mcp.server.mcpserver import MCPServer

log = sys.argv[1]
server = MCPServer("calculator")


@server.tool()
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    with open(log, "a") as f:
        f.write(json.dumps({"a": a, "b": b, "pid": os.getpid()}) + "\\n")
    return a * b


if __name__ == "__main__":
    server.run("stdio")
'''

# The agent: a FunctionModel that multiplies FACTORS one tool call at a time (each request it gets appended
# to a file), the MCP server as its only toolset, made durable by OnwardAgent.
AGENT = '''
import json, sys
from fastmcp.client.transports import PythonStdioTransport
from pydantic_ai import Agent
from pydantic_ai.mcp import MCPToolset
from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import FunctionModel
from onward import Job
from onward.integrations.pydantic_ai import OnwardAgent

db, server, tool_log, model_log = sys.argv[1:5]
FACTORS = %(factors)r


def model(messages, info):
    returns = [p.content for m in messages for p in m.parts if isinstance(p, ToolReturnPart)]
    with open(model_log, "a") as f:
        f.write(json.dumps({"turn": len(returns)}) + "\\n")
    if len(returns) < len(FACTORS):
        product = int(returns[-1]) if returns else 1
        return ModelResponse(parts=[ToolCallPart("multiply", {"a": product, "b": FACTORS[len(returns)]})])
    return ModelResponse(parts=[TextPart(f"the product is {returns[-1]}")])


toolset = MCPToolset(PythonStdioTransport(server, args=[tool_log]))
agent = OnwardAgent(Agent(FunctionModel(model), toolsets=[toolset]))
job = Job(db, max_attempts=1000, retry_delay=0, heartbeat=1.0)


@job.task
def solve(question, ctx):
    return agent.run_sync(question).output


job.add([sys.argv[5]])
sys.exit(job.run().exit_code)
'''




@pytest.fixture
def server(tmp_path: Path) -> Iterator[ForkServer]:
    s = ForkServer(tmp_path, ["onward.integrations.pydantic_ai", "pydantic_ai.mcp", "pydantic_ai.models.function",
                              "fastmcp.client.transports"])
    yield s
    s.close()


def test_mcp_tool_calls_are_steps_paid_once_across_kills(server: ForkServer, tmp_path: Path, seed: int) -> None:
    kill_and_check(server, PLAN, tmp_path, seed)


@pytest.mark.torture
def test_mcp_tool_calls_paid_once_across_twenty_kills(server: ForkServer, tmp_path: Path, seed: int) -> None:
    kill_and_check(server, TORTURE_PLAN, tmp_path, seed)


def kill_and_check(server: ForkServer, plan: KillPlan, tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    mcp_server, agent = tmp_path / "calculator.py", tmp_path / "agent.py"
    mcp_server.write_text(SERVER)
    agent.write_text(textwrap.dedent(AGENT % {"factors": FACTORS}))

    def argv(db: Path, tools: Path, models: Path) -> list[str]:
        return [str(agent), str(db), str(mcp_server), str(tools), str(models), QUESTION]

    # The reference: one uninterrupted run.
    reference_db = tmp_path / "reference.db"
    code = server.start(argv(reference_db, tmp_path / "reference-tools", tmp_path / "reference-models")).wait(120)
    assert code == 0, server.stderr.read_text()[-3000:]
    reference = open_store(str(reference_db), create=False)
    expected = reference.result(QUESTION)
    reference.close()
    product = 1
    for factor in FACTORS:
        product *= factor
    assert expected is not None and expected.data == f"the product is {product}".encode()
    assert len(json_lines(tmp_path / "reference-tools")) == len(FACTORS)

    db, tools, models = tmp_path / "agent.db", tmp_path / "tools", tmp_path / "models"
    done = kill_until_done(server, argv(db, tools, models),
                           lambda: len(json_lines(tools)) + len(json_lines(models)), db,
                           plan, rng)
    tool_calls, model_calls = json_lines(tools), json_lines(models)
    print(f"kills {done.kills} ({done.in_commit} inside a commit); model requests {len(model_calls)};"
          f" MCP tool calls {len(tool_calls)}")
    assert done.in_commit == (plan.commit_kills if shutil.which("strace") else 0)
    assert done.kills >= plan.commit_kills + 1

    store = open_store(str(db), create=False)
    try:
        assert store.result(QUESTION) == expected
        task_id = store.task_id(QUESTION)
        assert task_id is not None
        records = store.steps(task_id)
    finally:
        store.close()
    # Each MCP tool call is a step of its own, between the model requests.
    assert [r.name for r in records] == ["pydantic_ai.model.request", "pydantic_ai.tool.multiply"] * len(FACTORS) + [
        "pydantic_ai.model.request"]
    # Every call was made, once, plus at most one repeat per kill: the one in flight when it came.
    per_tool_call = Counter((c["a"], c["b"]) for c in tool_calls)
    per_turn = Counter(c["turn"] for c in model_calls)
    assert sorted(b for _, b in per_tool_call) == FACTORS
    assert sorted(per_turn) == list(range(len(FACTORS) + 1))
    repeats = sum(n - 1 for n in per_tool_call.values()) + sum(n - 1 for n in per_turn.values())
    assert repeats <= done.kills
    assert integrity(db) == "ok"
