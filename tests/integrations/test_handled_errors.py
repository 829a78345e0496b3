"""A step error the task handled stays recorded when the worker dies right after it: only the step in
flight at the kill runs again. (It used to be dropped at the next load as "the last record, most likely
the one that ended the attempt": a tool that had raised and been handled ran twice, a side effect repeated.)
An error the attempt failed with is still run again by the next attempt, and a trailing error record left
by an earlier version of onward is still dropped at load as that version would have."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from onward import Job, TaskContext, step
from onward.log import QUIET
from onward.step_records import ERROR_PICKLE, LEGACY_ERROR_PICKLE, frame, unframe

SRC = str(Path(__file__).resolve().parents[2] / "src")

WORKER = '''
import asyncio, os, signal, sys
from onward import Job, step

db, mode = sys.argv[1], sys.argv[2]
runs, crashed = db + ".runs", db + ".crashed"

def note(line):
    with open(runs, "a") as f:
        f.write(line + "\\n")

def kill_once():
    if not os.path.exists(crashed):
        open(crashed, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)

job = Job(db, max_attempts=3, retry_delay=0)

if mode in ("sync", "async"):
    @step(name="book")
    def book(seat):
        note(f"book {seat}")  # a side effect: a reservation attempt sent
        if seat == "99Z":
            raise LookupError("no such seat")
        return f"seat {seat}"

    @step(name="ask")
    def ask(why):
        note("ask")
        kill_once()  # the worker dies inside the step after the handled error
        return "12B"

    if mode == "sync":
        @job.task
        def t(task, ctx):
            try:
                return book("99Z")
            except LookupError as e:
                return book(ask(str(e)))
    else:
        @job.task
        async def t(task, ctx):
            try:
                return book("99Z")
            except LookupError as e:
                await asyncio.sleep(0)
                return book(ask(str(e)))
else:
    from pydantic_ai import Agent, ModelRetry
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart, ToolReturnPart, RetryPromptPart
    from pydantic_ai.models.function import FunctionModel
    from onward.integrations.pydantic_ai import OnwardAgent

    def respond(messages, info):
        note("model")
        parts = [p for m in messages for p in m.parts]
        # The tool's ModelRetry comes back as a retry prompt (or, in some versions, a tool return).
        retried = [p for p in parts if isinstance(p, RetryPromptPart)
                   or (isinstance(p, ToolReturnPart) and "no such seat" in str(p.content))]
        if any(isinstance(p, ToolReturnPart) and "seat 12B" in str(p.content) for p in parts):
            return ModelResponse(parts=[TextPart("booked")])
        if retried:
            kill_once()  # the worker dies inside the model request after the tool's ModelRetry
            return ModelResponse(parts=[ToolCallPart("book", {"seat": "12B"}, tool_call_id="b")])
        return ModelResponse(parts=[ToolCallPart("book", {"seat": "99Z"}, tool_call_id="a")])

    agent = Agent(FunctionModel(respond))

    @agent.tool_plain
    def book(seat: str) -> str:
        note(f"book {seat}")
        if seat == "99Z":
            raise ModelRetry("no such seat, pick another")
        return f"seat {seat}"

    durable_agent = OnwardAgent(agent)

    @job.task
    def t(task, ctx):
        return durable_agent.run_sync(task).output

job.add(["t"])
sys.exit(job.run().exit_code)
'''


@pytest.mark.parametrize("mode", ["sync", "async", "pydantic_ai"])
def test_a_handled_step_error_is_not_run_again_after_a_kill(tmp_path: Path, mode: str) -> None:
    if mode == "pydantic_ai":
        pytest.importorskip("pydantic_ai")
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    db = str(tmp_path / "job.db")
    env = dict(os.environ, PYTHONPATH=SRC)
    first = subprocess.run([sys.executable, str(script), db, mode], env=env, capture_output=True, timeout=60)
    assert first.returncode == -9, first.stderr.decode()  # killed inside the step after the handled error
    second = subprocess.run([sys.executable, str(script), db, mode], env=env, capture_output=True, timeout=60)
    assert second.returncode == 0, second.stderr.decode()
    ran = Path(db + ".runs").read_text().splitlines()
    # The tool that raised ran once; only the step in flight at the kill ran twice.
    assert ran.count("book 99Z") == 1, ran
    assert ran.count("book 12B") == 1, ran
    in_flight = "ask" if mode != "pydantic_ai" else "model"
    expected = 2 if mode != "pydantic_ai" else 4  # pydantic_ai: 3 requests, the second one twice
    assert ran.count(in_flight) == expected, ran


def test_the_error_an_attempt_failed_with_runs_again(tmp_path: Path) -> None:
    ran: list[str] = []
    job = Job(str(tmp_path / "job.db"), max_attempts=3, retry_delay=0, log_level=QUIET)

    @step(name="flaky")
    def flaky(attempt: int) -> str:
        ran.append(f"flaky {attempt}")
        if attempt == 1:
            raise ConnectionError("unreachable")
        return "ok"

    @job.task
    def t(task: str, ctx: TaskContext) -> str:
        return flaky(ctx.attempt)

    job.add(["t"])
    assert job.run().exit_code == 0 and job.result("t") == "ok"
    job.close()
    assert ran == ["flaky 1", "flaky 2"]


@pytest.mark.parametrize("written_by", ["this version", "an earlier version"])
def test_a_handled_error_stays_when_the_attempt_fails_otherwise(tmp_path: Path, written_by: str) -> None:
    """The task handles the step's error, then fails with another one: the error is that step's outcome and
    replays. Earlier versions left the error an attempt failed with in place and dropped a trailing one at
    the next load; a record of theirs (named the legacy way) is still dropped, so that a task in flight
    across an upgrade runs that step again as it would have."""
    url = str(tmp_path / "job.db")
    ran: list[str] = []
    attempts: list[int] = []

    @step(name="lookup")
    def lookup() -> str:
        ran.append("lookup")
        raise KeyError("not in the index")

    def task(name: str, ctx: TaskContext) -> str:
        try:
            source = lookup()
        except KeyError:
            source = "web"
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("a bug after the handled error")
        return source

    job = Job(url, max_attempts=1, retry_delay=0, log_level=QUIET)
    job.task(task)
    job.add(["t"])
    assert job.run().exit_code != 0
    job.close()
    if written_by == "an earlier version":
        with sqlite3.connect(url) as db:
            [(data,)] = db.execute("SELECT data FROM steps").fetchall()
            f = unframe(data)
            assert f.serializer == ERROR_PICKLE
            db.execute("UPDATE steps SET data = ?", (frame(LEGACY_ERROR_PICKLE, f.seconds, f.attempt, f.fence,
                                                           f.payload),))
    job = Job(url, max_attempts=1, retry_delay=0, log_level=QUIET)
    job.task(task)
    assert job.store.retry(["t"]) == 1
    assert job.run().exit_code == 0 and job.result("t") == "web"
    job.close()
    assert ran == (["lookup"] if written_by == "this version" else ["lookup", "lookup"])
