"""A 50-step agent loop SIGKILLed at seeded random moments until it finishes.

The agent (a Python worker process) alternates 25 model calls, to a stub of an OpenAI-compatible chat API
served by this test on 127.0.0.1, and 25 tool calls, whose side effect is a line appended to a log. Each
run is killed once it has made some new progress plus a random few milliseconds (so kills land inside step
bodies, between steps and inside commits), and some runs are killed by strace at their N-th fdatasync,
i.e. inside a commit. At the end:

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
import shutil
import signal
import sqlite3
import subprocess
import sys
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
from tests.conftest import wait_for

SRC = str(Path(__file__).resolve().parents[2] / "src")
TURNS = 25  # 25 model calls + 25 tool calls = 50 steps
RANDOM_KILLS = 14
COMMIT_KILLS = 4

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
    return [sys.executable, str(script), str(db), stub.url, str(effects)]


def effects_of(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut by the kill
    return out


def test_agent_loop_killed_at_random_moments_never_pays_twice(tmp_path: Path, stub: ModelStub, seed: int) -> None:
    rng = random.Random(seed)
    script = tmp_path / "agent.py"
    script.write_text(textwrap.dedent(AGENT % {"turns": TURNS}))
    env = dict(os.environ, PYTHONPATH=SRC)
    task = "plan a trip to the sea"

    # The reference: one uninterrupted run.
    reference_db = tmp_path / "reference.db"
    subprocess.run(agent_argv(script, reference_db, stub, tmp_path / "reference-effects"), env=env, check=True,
                   timeout=120, capture_output=True)
    reference = open_store(str(reference_db), create=False)
    expected = reference.result(task)
    reference.close()
    assert expected is not None
    with stub.lock:
        stub.calls.clear()

    db = tmp_path / "agent.db"
    effects = tmp_path / "effects"
    argv = agent_argv(script, db, stub, effects)
    strace = shutil.which("strace")
    if strace is None and os.environ.get("CI") == "true":
        pytest.fail("strace is needed for the kills inside commits")
    plan = ["random"] * RANDOM_KILLS + (["commit"] * COMMIT_KILLS if strace else [])
    rng.shuffle(plan)
    kills = 0
    finished = False
    for kind in plan:
        if kind == "commit" and strace is not None:
            # strace kills the worker as it enters its N-th fdatasync: inside a commit (a step record's, a
            # claim's or the completion's).
            nth = rng.randint(2, 8)
            p = subprocess.Popen([strace, "-f", "-qq", "-o", "/dev/null", "-e", "trace=fdatasync",
                                  "-e", f"inject=fdatasync:signal=KILL:when={nth}", *argv],
                                 env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            p.wait(timeout=120)
        else:
            p = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            progress = stub.count() + len(effects_of(effects))
            target = progress + rng.randint(1, 5)  # some new step bodies must have started
            wait_for(lambda: p.poll() is not None or stub.count() + len(effects_of(effects)) >= target, 60,
                     "the agent to make progress")
            time.sleep(rng.uniform(0, 0.015))  # then a random moment: in a body, a commit, between steps
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)
        if p.returncode == 0:
            finished = True
            break
        kills += 1
        assert integrity(db) == "ok"
    if not finished:
        subprocess.run(argv, env=env, check=True, timeout=120, capture_output=True)
    assert kills >= RANDOM_KILLS // 2  # the run was really interrupted, many times
    print(f"kills: {kills}; model calls: {stub.count()}; tool executions: {len(effects_of(effects))}")

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
    runs = [(e["key"], e["t"]) for e in effects_of(effects)]
    for what, executions in (("model call", calls), ("tool run", runs)):
        for key, started in executions:
            assert key in committed, f"a {what} with a key no step has: {key}"
            assert started < committed[key], f"a {what} for a step after its result was committed"
    # Each step body ran once, plus at most once more for each kill (the one in flight when it came).
    assert len(calls) >= TURNS and len(runs) >= TURNS
    assert len(calls) - TURNS + len(runs) - TURNS <= kills
    assert integrity(db) == "ok"


def integrity(db: Path) -> str:
    if not db.exists():
        return "ok"
    c = sqlite3.connect(db)
    try:
        return str(c.execute("PRAGMA integrity_check").fetchone()[0])
    finally:
        c.close()
