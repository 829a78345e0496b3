"""A 50-step agent loop SIGKILLed at seeded random moments until it finishes.

The agent (a Python worker process) alternates 25 model calls, to a stub of an OpenAI-compatible chat API
served by this test on 127.0.0.1, and 25 tool calls, whose side effect is a line appended to a log. Each
run is killed once it has made some new progress plus a random few milliseconds (so kills land inside step
bodies, between steps and inside commits), and some runs are killed by strace at their N-th fdatasync,
i.e. inside a commit (the kill loop: tests/kill_loop.py, shared with tests/integrations). At the end:

- the final result equals that of an uninterrupted run against the same stub;
- every step has one record, and no step body ran again after its record was committed (every model call
  and every tool side effect carries the step's idempotency key and its time);
- so the stub saw no repeated call for a committed step, and at most one extra call per kill;
- the store passes integrity_check.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import textwrap
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from onward.steps import idempotency_key
from onward.store import open_store
from tests.kill_loop import ForkServer, KillPlan, integrity, json_lines, kill_until_done

SRC = str(Path(__file__).resolve().parents[2] / "src")
TURNS = 25  # 25 model calls + 25 tool calls = 50 steps
PLAN = KillPlan(random_kills=14, commit_kills=4, max_new=5, max_pause=0.015)

AGENT = r'''
import hashlib, json, os, sys, time, urllib.request
from onward import Job, current_step_key, step

db, base_url, effects = sys.argv[1], sys.argv[2], sys.argv[3]
job = Job(db, max_attempts=1000, retry_delay=0, heartbeat=1.0, log_level=0)

@step(name="llm")
def llm(messages):
    body = json.dumps({"model": "stub", "messages": messages}).encode()
    request = urllib.request.Request(base_url + "/v1/chat/completions", data=body, method="POST", headers={
        "Content-Type": "application/json", "Idempotency-Key": current_step_key()})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)["choices"][0]["message"]["content"]

@step(name="tool")
def tool(command):
    started = time.time()
    # The side effect: one line per execution of this step body, with its key and start time.
    with open(effects, "a") as f:
        f.write(json.dumps({"key": current_step_key(), "t": started, "pid": os.getpid()}) + "\n")
    return hashlib.sha256(command.encode()).hexdigest()[:16]

@job.task
def agent(task, ctx):
    messages = [{"role": "user", "content": task}]
    for _ in range(%(turns)d):
        reply = llm(messages)
        messages.append({"role": "assistant", "content": reply})
        messages.append({"role": "tool", "content": tool(reply)})
    return hashlib.sha256(json.dumps(messages).encode()).hexdigest()

job.add(["plan a trip to the sea"])
sys.exit(job.run().exit_code)
'''


class ModelStub:
    """A chat-completions endpoint whose answer is a function of the conversation, counting every call."""

    def __init__(self, delay: float) -> None:
        self.calls: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server API
                received = time.time()
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub.lock:
                    stub.calls.append({"key": self.headers.get("Idempotency-Key"), "t": received,
                                       "turn": len(body["messages"]) // 2})
                time.sleep(delay)  # a model takes its time: kills land inside calls too
                digest = hashlib.sha256(json.dumps(body["messages"]).encode()).hexdigest()[:12]
                answer = {"choices": [{"message": {"role": "assistant", "content": f"next: {digest}"}}]}
                data = json.dumps(answer).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the caller was killed while it waited: that is the fault under test

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def count(self) -> int:
        with self.lock:
            return len(self.calls)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub() -> Iterator[ModelStub]:
    s = ModelStub(delay=0.01)
    yield s
    s.close()


def agent_argv(script: Path, db: Path, stub: ModelStub, effects: Path) -> list[str]:
    return [str(script), str(db), stub.url, str(effects)]




def test_agent_loop_killed_at_random_moments_never_pays_twice(tmp_path: Path, stub: ModelStub, seed: int) -> None:
    rng = random.Random(seed)
    script = tmp_path / "agent.py"
    script.write_text(textwrap.dedent(AGENT % {"turns": TURNS}))
    task = "plan a trip to the sea"
    server = ForkServer(tmp_path, ["onward"], env=dict(os.environ, PYTHONPATH=SRC))
    try:
        # The reference: one uninterrupted run.
        reference_db = tmp_path / "reference.db"
        assert server.start(agent_argv(script, reference_db, stub, tmp_path / "reference-effects")).wait(120) == 0
        reference = open_store(str(reference_db), create=False)
        expected = reference.result(task)
        reference.close()
        assert expected is not None
        with stub.lock:
            stub.calls.clear()

        db = tmp_path / "agent.db"
        effects = tmp_path / "effects"
        done = kill_until_done(server, agent_argv(script, db, stub, effects),
                               lambda: stub.count() + len(json_lines(effects)), db, PLAN, rng)
    finally:
        server.close()
    kills = done.kills
    assert kills >= PLAN.random_kills // 2  # the run was really interrupted, many times
    print(f"kills: {kills} ({done.in_commit} inside a commit); model calls: {stub.count()};"
          f" tool executions: {len(json_lines(effects))}")

    store = open_store(str(db), create=False)
    try:
        assert store.result(task) == expected  # the same answer as the uninterrupted run
        task_id = store.task_id(task)
        assert task_id is not None
        records = store.steps(task_id)
    finally:
        store.close()
    assert [(r.index, r.name) for r in records] == [(i + 1, "llm" if i % 2 == 0 else "tool")
                                                     for i in range(2 * TURNS)]
    committed = {idempotency_key(task, r.name, r.index): r.at for r in records}
    assert len(committed) == 2 * TURNS  # every step its own key

    calls = [(c["key"], c["t"]) for c in stub.calls]
    runs = [(e["key"], e["t"]) for e in json_lines(effects)]
    for what, executions in (("model call", calls), ("tool run", runs)):
        for key, started in executions:
            assert key in committed, f"a {what} with a key no step has: {key}"
            assert started < committed[key], f"a {what} for a step after its result was committed"
    # Each step body ran once, plus at most once more for each kill (the one in flight when it came).
    assert len(calls) >= TURNS and len(runs) >= TURNS
    assert len(calls) - TURNS + len(runs) - TURNS <= kills
    assert integrity(db) == "ok"

