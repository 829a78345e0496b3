"""Each integration's example agent (examples/agents/), a 21-call agent (11 model calls, 10 tool calls),
run as a real worker process against the stub and SIGKILLed at seeded random moments, some of them by
strace at the N-th fdatasync (inside a commit), then resumed until done. At the end:

- the answer equals that of an uninterrupted run;
- every step has one record, model and tool calls alternating;
- every model call (one per turn of the conversation) and every tool execution happened at least once,
  and all the repeats together are at most one per kill (only the call in flight at a kill runs again);
- every model call carried the idempotency key of a recorded step;
- the store passes integrity_check.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from onward.steps import idempotency_key
from onward.store import open_store
from tests.conftest import wait_for
from tests.integrations.conftest import EXAMPLES, Stub

QUESTION = "Multiply 2 3 5 7 11 13 17 19 23 29 31"
MODEL_CALLS, TOOL_CALLS = 11, 10
RANDOM_KILLS, COMMIT_KILLS = 2, 1

# example, its model step's name, its tool step's name, the stub's base URL it wants
CASES = {
    "openai": ("openai_agent.py", "openai.chat.completions.create", "calculator", "/v1"),
    "anthropic": ("anthropic_agent.py", "anthropic.messages.create", "calculator", ""),
    "pydantic_ai": ("pydantic_ai_agent.py", "pydantic_ai.model.request", "pydantic_ai.tool.calculator_tool", "/v1"),
    "openai_agents": ("openai_agents_agent.py", "openai_agents.model", "openai_agents.tool.calculator_tool", "/v1"),
}


def tool_runs(path: Path) -> list[str]:
    if not path.exists():
        return []
    import json
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line)["expression"])
        except ValueError:
            pass  # a line cut by the kill
    return out


def integrity(db: Path) -> str:
    if not db.exists():
        return "ok"
    c = sqlite3.connect(db)
    try:
        return str(c.execute("PRAGMA integrity_check").fetchone()[0])
    finally:
        c.close()


@pytest.mark.parametrize("case", sorted(CASES))
def test_agent_killed_at_random_moments_pays_each_call_once(case: str, tmp_path: Path, slow_stub: Stub,
                                                            seed: int) -> None:
    pytest.importorskip({"openai_agents": "agents"}.get(case, case))
    script, model_step, tool_step, suffix = CASES[case]
    rng = random.Random(seed)

    def argv(db: Path, tools: Path) -> list[str]:
        return [sys.executable, str(EXAMPLES / script), "--db", str(db), "--base-url", slow_stub.url + suffix,
                "--tool-log", str(tools), QUESTION]

    # The reference: one uninterrupted run.
    reference_db = tmp_path / "reference.db"
    subprocess.run(argv(reference_db, tmp_path / "reference-tools"), check=True, timeout=120, capture_output=True)
    reference = open_store(str(reference_db), create=False)
    expected = reference.result(QUESTION)
    reference.close()
    assert expected is not None
    assert len(tool_runs(tmp_path / "reference-tools")) == TOOL_CALLS
    before = slow_stub.count()
    assert before == MODEL_CALLS

    db, tools = tmp_path / "agent.db", tmp_path / "tools"
    strace = shutil.which("strace")
    if strace is None and os.environ.get("CI") == "true":
        pytest.fail("strace is needed for the kills inside commits")
    plan = ["random"] * RANDOM_KILLS + (["commit"] * COMMIT_KILLS if strace else [])
    rng.shuffle(plan)

    def progress() -> int:
        return slow_stub.count() - before + len(tool_runs(tools))

    kills = 0
    finished = False
    for kind in plan:
        if kind == "commit" and strace is not None:
            nth = rng.randint(2, 8)  # the worker dies entering its N-th fdatasync: inside a commit
            p = subprocess.Popen([strace, "-f", "-qq", "-o", "/dev/null", "-e", "trace=fdatasync",
                                  "-e", f"inject=fdatasync:signal=KILL:when={nth}", *argv(db, tools)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            p.wait(timeout=120)
        else:
            p = subprocess.Popen(argv(db, tools), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            target = progress() + rng.randint(1, 6)  # some new calls must have started
            wait_for(lambda: p.poll() is not None or progress() >= target, 60, "the agent to make progress")
            time.sleep(rng.uniform(0, 0.04))  # then a random moment: in a call, a commit, between steps
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)
        if p.returncode == 0:
            finished = True
            break
        kills += 1
        assert integrity(db) == "ok"
    if not finished:
        subprocess.run(argv(db, tools), check=True, timeout=120, capture_output=True)
    calls = slow_stub.calls()[before:]
    runs = tool_runs(tools)
    print(f"{case}: kills {kills}; model calls {len(calls)}; tool executions {len(runs)}")
    assert kills >= 1

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
    assert repeats <= kills
    # Each model call was sent with the idempotency key of the step it belongs to.
    keys = {idempotency_key(QUESTION, r.name, r.index) for r in records if r.name == model_step}
    assert {c["key"] for c in calls} <= keys
    assert integrity(db) == "ok"
