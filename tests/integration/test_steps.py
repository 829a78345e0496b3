"""Durable steps (`onward.step`, `ctx.step/checkpoint/restore/sleep/idempotency_key`), sync and async,
in-process on real stores and as worker processes stopped and killed with real signals.

Every wait polls a condition with a deadline; the only fixed waits are the ones under test (a step's
backoff, a durable sleep).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from onward import AsyncTaskContext, Job, StepDrift, TaskContext, UsageError, current_step_key, step
from onward.errors import StoreMissing
from onward.log import QUIET
from onward.step_records import unframe
from onward.steps import PICKLE, idempotency_key
from onward.store import is_postgres_url, open_store
from tests.conftest import because, run_onward, wait_for

SRC = str(Path(__file__).resolve().parents[2] / "src")


@pytest.fixture
def db(store_url: str) -> str:
    """Every backend whose module exists (the PostgreSQL one may not be written yet)."""
    if is_postgres_url(store_url):
        pytest.importorskip("onward.store.postgres", reason="the PostgreSQL backend is not there yet")
    return store_url


def new_job(url: str, **kwargs: Any) -> Job:
    kwargs.setdefault("retry_delay", 0.01)
    return Job(url, log_level=QUIET, **kwargs)


def records(url: str, task: str) -> list[tuple[int, str, str]]:
    store = open_store(url, create=False)
    try:
        task_id = store.task_id(task)
        return [(r.index, r.name, r.kind) for r in store.steps(task_id)] if task_id is not None else []
    finally:
        store.close()


def events(url: str, task: str) -> list[tuple[str, str]]:
    store = open_store(url, create=False)
    try:
        return [(e.kind, e.detail or "") for e in store.events(task=task)]
    finally:
        store.close()


# --- replay -----------------------------------------------------------------------------------------------
def test_steps_replay_after_a_failed_attempt_without_running_again(db: str) -> None:
    ran: list[int] = []
    job = new_job(db)

    @step
    def square(i: int) -> int:
        ran.append(i)
        return i * i

    @job.task
    def handle(task: str, ctx: TaskContext) -> list[int]:
        out = [square(i) for i in range(5)]
        if ctx.attempt == 1:
            raise RuntimeError("crash after five steps")
        return out + [square(5)]

    job.add(["t"])
    summary = job.run()
    assert (summary.done, summary.retried) == (1, 1)
    assert job.result("t") == [0, 1, 4, 9, 16, 25]
    assert ran == [0, 1, 2, 3, 4, 5]  # the five recorded steps ran once, in attempt 1
    assert [name for _, name, _ in records(db, "t")] == ["square"] * 6
    journal = events(db, "t")
    assert ("replayed", "replayed 5 steps (saved 0.0 s)") in journal
    assert any(kind == "steps" and "1 recorded by this attempt, 5 replayed" in d for kind, d in journal)
    job.close()


def test_a_step_outside_a_task_is_a_plain_call_and_nested_steps_are_not_recorded(db: str) -> None:
    ran: list[str] = []

    @step
    def inner() -> str:
        ran.append("inner")
        return "i"

    @step
    def outer() -> str:
        ran.append("outer")
        return inner() + "o"

    assert outer() == "io"  # no task: plain calls
    job = new_job(db)

    @job.task
    def handle(task: str, ctx: TaskContext) -> str:
        value = outer()
        if ctx.attempt == 1:
            raise RuntimeError("again")
        return value

    ran.clear()
    job.add(["t"])
    job.run()
    assert job.result("t") == "io"
    assert ran == ["outer", "inner"]
    assert records(db, "t") == [(1, "outer", "value")]
    job.close()


def test_returned_value_is_the_recorded_one_on_first_run_and_on_replay(db: str) -> None:
    seen: list[Any] = []
    job = new_job(db)

    @step
    def pair() -> tuple[int, int]:
        return (1, 2)

    @step(serializer=PICKLE)
    def rich() -> set[int]:
        return {3, 4}

    @job.task
    def handle(task: str, ctx: TaskContext) -> str:
        seen.append((pair(), rich()))
        if ctx.attempt == 1:
            raise RuntimeError("again")
        return "ok"

    job.add(["t"])
    job.run()
    assert seen == [([1, 2], {3, 4}), ([1, 2], {3, 4})]  # JSON makes the tuple a list, both times
    job.close()


def test_a_value_json_cannot_hold_fails_with_a_clear_error(db: str) -> None:
    job = new_job(db, max_attempts=1)

    @step
    def bad() -> object:
        return object()

    job.task(lambda task, ctx: bad())
    job.add(["t"])
    job.run()
    row = job.store.task("t")
    assert row is not None and row.state == "failed"
    assert "not JSON" in (row.error or "") and "serializer" in (row.error or "")
    job.close()


def test_a_step_value_json_would_change_fails_instead_of_replaying_another_value(db: str) -> None:
    """A step returning {1: "a"} was recorded as {"1": "a"}: the first run saw an int key, a replay after a
    crash would see a string one. Refused like any value JSON cannot hold."""
    job = new_job(db, max_attempts=1)

    @step
    def keyed() -> object:
        return {1: "a"}

    job.task(lambda task, ctx: keyed())
    job.add(["t"])
    job.run()
    row = job.store.task("t")
    assert row is not None and row.state == "failed"
    assert "not JSON" in (row.error or "") and "key 1 is not a string" in (row.error or ""), row.error
    job.close()


@pytest.mark.parametrize("name", [123, "", "a\x00b", "\ud800"])
def test_a_step_name_that_cannot_be_recorded_as_given_fails_the_attempt_clearly(db: str, name: object) -> None:
    """A number as a step's name was recorded as text and then never matched its own record on replay (the
    task failed for good on a "drift" with no change of code); a NUL failed on PostgreSQL only."""
    job = new_job(db, max_attempts=1)
    job.task(lambda task, ctx: ctx.step(name, lambda: 1))
    job.add(["t"])
    job.run()
    row = job.store.task("t")
    assert row is not None and row.state == "failed" and "a step's name" in (row.error or ""), row
    job.close()


def test_ctx_step_records_without_a_decorator(db: str) -> None:
    ran: list[int] = []
    job = new_job(db)

    def fetch(n: int, *, scale: int) -> int:
        ran.append(n)
        return n * scale

    @job.task
    def handle(task: str, ctx: TaskContext) -> int:
        total = sum(ctx.step("fetch", fetch, n, scale=10) for n in range(3))
        if ctx.attempt == 1:
            raise RuntimeError("again")
        return total

    job.add(["t"])
    job.run()
    assert job.result("t") == 30
    assert ran == [0, 1, 2]
    assert records(db, "t") == [(1, "fetch", "value"), (2, "fetch", "value"), (3, "fetch", "value")]
    job.close()


# --- errors -----------------------------------------------------------------------------------------------
def test_a_caught_step_error_is_replayed_and_the_last_error_is_retried(db: str) -> None:
    ran: list[str] = []
    job = new_job(db, max_attempts=3)

    @step(name="lookup")
    def lookup() -> str:
        ran.append("lookup")
        raise KeyError("not in the index")

    @step(name="fallback")
    def fallback() -> str:
        ran.append("fallback")
        return "web"

    @step(name="answer")
    def answer(source: str, attempt: int) -> str:
        ran.append("answer")
        if attempt == 1:
            raise ConnectionError("model unreachable")
        return f"from {source}"

    @job.task
    def handle(task: str, ctx: TaskContext) -> str:
        try:
            source = lookup()
        except KeyError:
            source = fallback()
        return answer(source, ctx.attempt)

    job.add(["t"])
    job.run()
    assert job.result("t") == "from web"
    # lookup's error was caught by the task: replayed (raised again from the record) in attempt 2.
    # answer's error ended attempt 1: its record was dropped and the step ran again.
    assert ran == ["lookup", "fallback", "answer", "answer"]
    assert records(db, "t") == [(1, "lookup", "error"), (2, "fallback", "value"), (3, "answer", "value")]
    job.close()


class Api:
    class RateLimited(Exception):
        """An exception class nested in a class (as Django's ``Model.DoesNotExist``): its qualified name has a dot."""


def test_a_caught_error_of_a_nested_class_is_replayed_as_that_class(db: str) -> None:
    """The error records' unpickler refused every dotted name, so an error of a class nested in a class was
    replayed as StepError: the task's ``except`` that caught it the first time missed it on resume, and the
    task failed where it had gone on."""
    seen: list[str] = []
    job = new_job(db, max_attempts=2)

    @step(name="call")
    def call() -> None:
        raise Api.RateLimited("slow down")

    @job.task
    def handle(task: str, ctx: TaskContext) -> str:
        try:
            call()
        except Api.RateLimited as e:
            seen.append(f"caught {type(e).__qualname__}: {e}")
        ctx.step("after", lambda: 1)  # the error is not the last record: replayed, not run again
        if ctx.attempt == 1:
            raise RuntimeError("end the first attempt")
        return "went on"

    job.add(["t"])
    job.run()
    assert job.result("t") == "went on"
    assert seen == ["caught Api.RateLimited: slow down"] * 2
    assert records(db, "t")[0] == (1, "call", "error")
    job.close()


LAZY_MODULE = """
class ParseError(ValueError):
    def __init__(self, msg, pos):
        super().__init__(f"{msg} at {pos}")
        self.pos = pos


def fail():
    raise ParseError("bad", 7)
"""

LAZY_TASK = """
import os, signal, sys
from onward import Job, step
from onward.log import QUIET

job = Job(sys.argv[1], max_attempts=1, log_level=QUIET)


@step(name="parse")
def parse():
    import lazymod  # imported only here, in the step's body, which a replay does not run
    lazymod.fail()


@job.task
def t(task, ctx):
    try:
        parse()
        out = "parsed"
    except ValueError as e:
        out = f"{type(e).__module__}.{type(e).__qualname__}: {e}, pos {e.pos}"
    ctx.step("after", lambda: 1)  # the error is not the last record: replayed, not run again
    if os.environ.get("KILL"):
        os.kill(os.getpid(), signal.SIGKILL)
    return out + (", imported" if "lazymod" in sys.modules else ", not imported")


job.add(["t"])
job.run()
print(job.result("t"))
"""


def test_an_error_whose_module_the_step_imported_itself_replays_caught_by_the_same_base(tmp_path: Path) -> None:
    """A step that imports a module in its body and raises that module's error (tomllib.TOMLDecodeError, a
    ValueError): the record named a class of a module the replaying worker had not imported, so it came back
    as StepError, and the task that had caught it as a ValueError failed on resume. Now it comes back as a
    stand-in of the same name, derived from the nearest base that is loaded, with its args and attributes;
    and the module is still not imported by the replay."""
    (tmp_path / "lazymod.py").write_text(LAZY_MODULE)
    (tmp_path / "task.py").write_text(LAZY_TASK)
    db = str(tmp_path / "s.db")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(Path(__file__).resolve().parents[2] / "src")])}
    first = subprocess.run([sys.executable, str(tmp_path / "task.py"), db], env={**env, "KILL": "1"}, timeout=60,
                           capture_output=True, text=True)
    assert first.returncode == -signal.SIGKILL, first.stderr
    assert records(db, "t") == [(1, "parse", "error"), (2, "after", "value")]
    second = subprocess.run([sys.executable, str(tmp_path / "task.py"), db], env=env, timeout=60,
                            capture_output=True, text=True)
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == "lazymod.ParseError: bad at 7, pos 7, not imported", second.stderr


def test_an_error_record_may_not_reach_past_a_module_or_a_class() -> None:
    """A dotted name is followed only through classes, in their own namespaces: ``os.path.join`` (a module's
    module's function) is refused as before."""
    import pickle

    from onward.step_records import _load_error

    with pytest.raises(pickle.UnpicklingError, match="may not name os.path.join"):
        _load_error(b"cos\npath.join\n(S'a'\nS'b'\ntR.")
    with pytest.raises(pickle.UnpicklingError, match="may not name"):
        _load_error(b"c" + __name__.encode() + b"\nApi.__init__\n(tR.")
    # The stand-in's maker takes exception classes only, for the class and for its bases.
    with pytest.raises(pickle.UnpicklingError, match="may not name os.system"):
        _load_error(b"conward.step_records\n_exception_class\n(S'os'\nS'system'\n((S'os'\nS'system'\ntttR.")


# --- drift ------------------------------------------------------------------------------------------------
def _drifting_job(url: str, replay: str, ran: list[str], version: dict[str, int]) -> Job:
    job = new_job(url, max_attempts=1)

    @step(name="plan")
    def plan() -> str:
        ran.append("plan")
        return "p"

    @step(name="search")
    def search() -> str:
        ran.append("search")
        return "s"

    @step(name="fetch")
    def fetch() -> str:
        ran.append("fetch")
        return "f"

    @job.task(replay=replay)
    def handle(task: str, ctx: TaskContext) -> str:
        first = plan()
        if version["v"] == 1:
            search()
            raise RuntimeError("crash after search")
        return first + fetch()

    return job


def test_drift_fails_each_attempt_naming_both_steps_and_never_hands_a_value_over(db: str) -> None:
    ran: list[str] = []
    version = {"v": 1}
    job = _drifting_job(db, "strict", ran, version)
    job.add(["t"])
    job.run()
    version["v"] = 2  # the code changed: a different step where `search` was recorded
    assert job.store.retry(["t"]) == 1
    summary = job.run(max_attempts=2)
    assert (summary.done, summary.failed, summary.retried) == (0, 1, 1)  # drift counts toward max attempts
    row = job.store.task("t")
    assert row is not None and row.state == "failed"
    assert row.error is not None and row.error.startswith("StepDrift: task 't': call 2 is fetch#1, but the recorded"
                                                          " history has search#1 there")
    assert 'replay="prefix"' in row.error
    assert ran == ["plan", "search"]  # plan replayed, fetch never ran
    assert records(db, "t") == [(1, "plan", "value"), (2, "search", "value")]
    job.close()


def test_drift_between_two_kinds_of_one_name_says_which_kind_each_is(db: str) -> None:
    """A step named "sleep" where a durable sleep was recorded: the message named ``sleep#1`` on both sides,
    and did not say what differed."""
    job = new_job(db, max_attempts=1)
    version = {"v": 1}

    @job.task
    def handle(task: str, ctx: TaskContext) -> str:
        if version["v"] == 1:
            ctx.sleep(0.01)
            raise RuntimeError("end the first attempt")
        ctx.step("sleep", lambda: "v")
        return "ok"

    job.add(["t"])
    job.run()
    version["v"] = 2
    assert job.store.retry(["t"]) == 1
    job.run()
    row = job.store.task("t")
    assert row is not None and row.state == "failed"
    assert (row.error or "").startswith("StepDrift: task 't': call 1 is sleep#1 (a step), but the recorded history"
                                        " has sleep#1 (a durable sleep) there"), row.error
    job.close()


def test_drift_caught_by_the_task_still_fails_the_attempt(db: str) -> None:
    job = new_job(db, max_attempts=1)
    version = {"v": 1}

    @step(name="a")
    def a() -> int:
        return 1

    @step(name="b")
    def b() -> int:
        return 2

    @job.task
    def handle(task: str, ctx: TaskContext) -> str:
        try:
            (a if version["v"] == 1 else b)()
        except StepDrift:
            return "swallowed"
        if version["v"] == 1:
            raise RuntimeError("again")
        return "ok"

    job.add(["t"])
    job.run()
    version["v"] = 2
    job.store.retry(["t"])
    job.run()
    row = job.store.task("t")
    assert row is not None and row.state == "failed" and (row.error or "").startswith("StepDrift:")
    job.close()


def test_prefix_policy_keeps_the_matching_prefix_and_runs_on(db: str) -> None:
    ran: list[str] = []
    version = {"v": 1}
    job = _drifting_job(db, "prefix", ran, version)
    job.add(["t"])
    job.run()
    version["v"] = 2
    job.store.retry(["t"])
    summary = job.run()
    assert summary.done == 1
    assert job.result("t") == "pf"
    assert ran == ["plan", "search", "fetch"]
    assert records(db, "t") == [(1, "plan", "value"), (2, "fetch", "value")]
    assert any(kind == "replay" and "dropped 1 recorded steps from call 2" in d and "search#1" in d
               for kind, d in events(db, "t"))
    job.close()


def test_unknown_replay_policy_is_refused(tmp_path: Path) -> None:
    job = new_job(str(tmp_path / "s.db"))
    with pytest.raises(UsageError, match="replay must be one of strict, prefix"):
        job.task(replay="loose")
    job.close()


# --- checkpoints ------------------------------------------------------------------------------------------
def test_checkpoint_and_restore_resume_a_loop_from_its_state(db: str) -> None:
    work: list[int] = []
    job = new_job(db)

    @job.task
    def handle(task: str, ctx: TaskContext) -> list[int]:
        state = ctx.restore({"i": 0, "squares": []})
        while state["i"] < 10:
            i = state["i"]
            work.append(i)
            state = {"i": i + 1, "squares": state["squares"] + [i * i]}
            ctx.checkpoint(state)
            if i == 5 and ctx.attempt == 1:
                raise RuntimeError("crash after checkpoint 6")
        return state["squares"]

    job.add(["t"])
    job.run()
    assert job.result("t") == [i * i for i in range(10)]
    assert work == list(range(10))  # nothing before the checkpoint was done again
    job.close()


def test_restore_skips_the_steps_its_checkpoint_covers_and_replays_the_rest(db: str) -> None:
    ran: list[int] = []
    job = new_job(db)

    @step(name="llm")
    def llm(turn: int) -> str:
        ran.append(turn)
        return f"reply {turn}"

    @job.task
    def handle(task: str, ctx: TaskContext) -> list[str]:
        state = ctx.restore({"turn": 0, "messages": []})
        while state["turn"] < 4:
            reply = llm(state["turn"])
            if state["turn"] == 2 and ctx.attempt == 1:
                raise RuntimeError("crash between a step and its checkpoint")
            state = {"turn": state["turn"] + 1, "messages": state["messages"] + [reply]}
            ctx.checkpoint(state)
        return state["messages"]

    job.add(["t"])
    job.run()
    assert job.result("t") == ["reply 0", "reply 1", "reply 2", "reply 3"]
    assert ran == [0, 1, 2, 3]  # turn 2's step was recorded before the crash: replayed, not re-run
    job.close()


def test_checkpoint_inside_a_step_body_is_refused(tmp_path: Path) -> None:
    job = new_job(str(tmp_path / "s.db"), max_attempts=1)

    @job.task
    def handle(task: str, ctx: TaskContext) -> None:
        ctx.step("outer", lambda: ctx.checkpoint({"x": 1}))

    job.add(["t"])
    job.run()
    row = job.store.task("t")
    assert row is not None and "ctx.checkpoint cannot be called inside a step's body" in (row.error or "")
    job.close()


# --- idempotency keys -------------------------------------------------------------------------------------
def test_idempotency_keys_are_stable_across_reruns_and_differ_between_steps(db: str, tmp_path: Path) -> None:
    sent: list[tuple[int, str, str]] = []  # (attempt, step, key) as a remote API would see them
    job = new_job(db)

    @step(name="charge")
    def charge(attempt: int, n: int) -> str:
        sent.append((attempt, f"charge#{n}", current_step_key()))
        if attempt == 1 and n == 3:
            raise ConnectionError("the response was lost")
        return "charged"

    @job.task
    def handle(task: str, ctx: TaskContext) -> list[str]:
        keys = [ctx.step("notify", lambda: ctx.idempotency_key)]
        for n in (1, 2, 3):
            charge(ctx.attempt, n)
        with pytest.raises(UsageError, match="only inside a step"):
            ctx.idempotency_key  # noqa: B018 - outside a step there is none
        return keys

    job.add(["order-7"])
    job.run()
    assert [(a, s) for a, s, _ in sent] == [(1, "charge#1"), (1, "charge#2"), (1, "charge#3"), (2, "charge#3")]
    keys = [k for _, _, k in sent]
    assert keys[2] == keys[3]  # the re-run of the same step sends the same key
    assert len(set(keys[:3] + job.result("order-7"))) == 4  # every step has its own
    assert keys[0] == idempotency_key("order-7", "charge", 2)  # task, step name and call index, nothing else
    job.close()

    # Another store, another worker: the same task's steps get the same keys.
    other = new_job(str(tmp_path / "other.db"))
    again: list[str] = []
    @other.task
    def handle_other(task: str, ctx: TaskContext) -> None:
        again.extend(ctx.step("charge", current_step_key) for _ in range(2))

    other.add(["order-7"])
    other.run()
    assert again == [idempotency_key("order-7", "charge", 1), keys[0]]
    other.close()


# --- retries ----------------------------------------------------------------------------------------------
def test_step_retries_with_exponential_backoff_only_on_the_listed_errors(db: str) -> None:
    tries: list[float] = []
    job = new_job(db, max_attempts=1)

    @step(max_attempts=3, retry_on=(TimeoutError,), backoff=0.2)
    def flaky() -> str:
        tries.append(time.monotonic())
        if len(tries) < 3:
            raise TimeoutError("slow upstream")
        return "ok"

    @step(max_attempts=3, retry_on=(TimeoutError,), backoff=0.2)
    def broken() -> str:
        tries.append(-1.0)
        raise ValueError("not retryable")

    @job.task
    def handle(task: str, ctx: TaskContext) -> str:
        value = flaky()
        with pytest.raises(ValueError):
            broken()
        return value

    job.add(["t"])
    job.run()
    assert job.result("t") == "ok"
    assert len(tries) == 4 and tries[3] == -1.0  # broken: one try, no retry
    assert tries[1] - tries[0] >= 0.2 and tries[2] - tries[1] >= 0.4  # backoff, then twice that
    assert tries[2] - tries[0] < 2.0
    job.close()


def test_async_step_retries_without_blocking_the_other_tasks(db: str) -> None:
    tries: list[float] = []
    job = new_job(db, concurrency=2)

    @step(max_attempts=2, retry_on=(TimeoutError,), backoff=0.3)
    async def flaky() -> str:
        tries.append(time.monotonic())
        if len(tries) == 1:
            raise TimeoutError
        return "ok"

    beats: list[float] = []

    @job.task
    async def handle(task: str, ctx: AsyncTaskContext) -> str:
        if task == "flaky":
            return await flaky()
        for _ in range(5):  # runs while the other task waits out its backoff
            beats.append(time.monotonic())
            await asyncio.sleep(0.02)
        return "ticker"

    job.add(["flaky", "ticker"])
    job.run()
    assert job.result("flaky") == "ok" and tries[1] - tries[0] >= 0.3
    assert beats[-1] < tries[1]  # the ticker finished during the backoff
    job.close()


# --- async ------------------------------------------------------------------------------------------------
def test_async_tasks_run_concurrently_and_their_steps_replay(db: str) -> None:
    ran: list[str] = []
    spans: list[tuple[float, float]] = []
    job = new_job(db, concurrency=3)

    @step(name="think")
    async def think(task: str, n: int) -> str:
        ran.append(f"{task}:{n}")
        start = time.monotonic()
        await asyncio.sleep(0.1)
        spans.append((start, time.monotonic()))
        return f"{task}-{n}"

    @job.task
    async def handle(task: str, ctx: AsyncTaskContext) -> list[str]:
        out = [await think(task, n) for n in range(3)]
        if ctx.attempt == 1:
            raise RuntimeError("again")
        return out

    job.add(["a", "b", "c"])
    summary = job.run()
    assert summary.done == 3
    assert job.result("b") == ["b-0", "b-1", "b-2"]
    assert sorted(ran) == sorted(f"{t}:{n}" for t in "abc" for n in range(3))  # each once: attempt 2 replayed
    overlapping = max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)
    assert overlapping >= 2  # steps of different tasks ran at the same time on the one event loop
    job.close()


@step(name="sync-add")
def sync_add(a: int, b: int) -> int:
    SHARED_RAN.append("sync")
    return a + b


@step(name="async-mul")
async def async_mul(a: int, b: int) -> int:
    SHARED_RAN.append("async")
    await asyncio.sleep(0)
    return a * b


SHARED_RAN: list[str] = []


@pytest.mark.parametrize("kind", ["sync task", "async task"])
def test_the_same_steps_serve_sync_and_async_tasks(db: str, kind: str) -> None:
    SHARED_RAN.clear()
    job = new_job(db)
    if kind == "sync task":
        @job.task
        def handle(task: str, ctx: TaskContext) -> int:
            total = sync_add(2, 3) + asyncio.run(async_mul(2, 3))  # a sync task may drive its own loop
            if ctx.attempt == 1:
                raise RuntimeError("again")
            return total
    else:
        @job.task
        async def handle_async(task: str, ctx: AsyncTaskContext) -> int:
            total = sync_add(2, 3) + await async_mul(2, 3) + await ctx.step("double", async_mul, 2, 2)
            if ctx.attempt == 1:
                raise RuntimeError("again")
            return total

    job.add(["t"])
    job.run()
    assert job.result("t") == (11 if kind == "sync task" else 15)
    assert SHARED_RAN.count("sync") == 1 and SHARED_RAN.count("async") == (1 if kind == "sync task" else 2)
    job.close()


def test_an_async_task_keeps_its_lease_and_its_steps_count_as_progress(sqlite_url: str) -> None:
    job = new_job(sqlite_url, max_attempts=1, heartbeat=0.1, stall_timeout=0.5)

    @step(name="think")
    async def think(n: int) -> int:
        await asyncio.sleep(0.1)
        return n

    @job.task
    async def handle(task: str, ctx: AsyncTaskContext) -> int:
        return sum([await think(n) for n in range(12)])  # 1.2 s: 12 leases of 0.3 s, 2.4 stall timeouts

    job.add(["t"])
    summary = job.run()
    assert (summary.done, summary.failed) == (1, 0)
    assert job.result("t") == 66
    assert not [kind for kind, _ in events(sqlite_url, "t") if kind in ("reclaimed", "fenced", "retrying")]
    job.close()


def test_an_async_task_past_its_timeout_is_really_cancelled(tmp_path: Path) -> None:
    unwound: list[str] = []
    job = new_job(str(tmp_path / "s.db"), max_attempts=1, timeout=0.3)

    @job.task
    async def handle(task: str, ctx: AsyncTaskContext) -> None:
        try:
            await asyncio.sleep(30)
        finally:
            unwound.append(task)

    job.add(["t"])
    started = time.monotonic()
    job.run()
    assert time.monotonic() - started < 5
    row = job.store.task("t")
    assert row is not None and row.state == "failed" and "timed out after 0.3s" in (row.error or "")
    assert unwound == ["t"]  # CancelledError reached the coroutine
    job.close()


def test_async_durable_sleep_and_checkpoint(db: str) -> None:
    job = new_job(db)

    @job.task
    async def handle(task: str, ctx: AsyncTaskContext) -> dict[str, Any]:
        state = await ctx.restore({"n": 0})
        if state["n"] == 0:
            await ctx.checkpoint({"n": 1})
        started = time.monotonic()
        await ctx.sleep(0.3)
        if ctx.attempt == 1:
            raise RuntimeError("again")
        return {"state": state, "slept": time.monotonic() - started}

    job.add(["t"])
    job.run()
    result = job.result("t")
    assert result["state"] == {"n": 1}
    assert result["slept"] < 0.25  # the deadline had passed: attempt 2 did not sleep again
    job.close()


# --- fencing ----------------------------------------------------------------------------------------------
def test_a_step_finishing_after_its_task_was_taken_over_is_not_recorded(sqlite_url: str) -> None:
    started, release = threading.Event(), threading.Event()
    ran: list[tuple[int, str]] = []
    job = new_job(sqlite_url, heartbeat=5.0)

    @step(name="slow")
    def slow(attempt: int) -> str:
        ran.append((attempt, "slow"))
        if attempt == 1:
            started.set()
            release.wait(10)
        return "s"

    @step(name="next")
    def next_step(attempt: int) -> str:
        ran.append((attempt, "next"))
        return "n"

    @job.task
    def handle(task: str, ctx: TaskContext) -> str:
        return slow(ctx.attempt) + next_step(ctx.attempt)

    job.add(["t"])
    worker = threading.Thread(target=job.run)
    worker.start()
    assert started.wait(10)
    other = open_store(sqlite_url)  # another worker takes the task over (as if our lease had expired)
    [running] = other.running_tasks()
    reclaimed = other.reclaim(running.task_id, running.fence, because("lease expired"))
    assert reclaimed is not None and reclaimed.state == "pending" and reclaimed.counted  # nothing new recorded
    other.close()
    release.set()
    worker.join(30)
    assert not worker.is_alive()
    assert job.result("t") == "sn"
    assert (1, "next") not in ran  # attempt 1 stopped at the refused record
    assert ran == [(1, "slow"), (2, "slow"), (2, "next")]
    assert any(kind == "fenced" for kind, _ in events(sqlite_url, "t"))
    job.close()


# --- worker processes: signals, crashes, visibility -------------------------------------------------------
WORKER = r'''
import asyncio, json, os, sys, time
from onward import Job, step
db, mode, state = sys.argv[1], sys.argv[2], sys.argv[3]
job = Job(db, max_attempts=20, retry_delay=0.01, heartbeat=0.5, grace=5)

def note(event):
    with open(os.path.join(state, "events"), "a") as f:
        f.write(json.dumps(event) + "\n")

@step(name="count")
def count(n):
    note({"step": n, "pid": os.getpid()})
    return n

if mode == "sleep":
    @job.task
    def handle(task, ctx):
        count(0)
        started = time.time()
        ctx.sleep(3.0)
        note({"woke": time.time(), "started": started, "pid": os.getpid()})
        return "rested"

elif mode == "loop":  # steps until stopped: SIGTERM stops it at its next step (Cancelled)
    @job.task
    def handle(task, ctx):
        n = 0
        try:
            while True:
                count(n)
                n += 1
                time.sleep(0.01)
        finally:
            note({"stopping": ctx.stopping})

elif mode == "aloop":
    @step(name="acount")
    async def acount(n):
        note({"step": n, "pid": os.getpid()})
        return n

    @job.task
    async def handle(task, ctx):
        n = 0
        try:
            while True:
                await acount(n)
                n += 1
                await asyncio.sleep(0.01)
        finally:
            note({"stopping": ctx.stopping})

elif mode == "visible":  # five steps, a failed attempt, then a replay that waits in step 6
    @step(name="slow")
    def slow(n):
        time.sleep(0.05)
        return n

    @job.task
    def handle(task, ctx):
        out = [slow(n) for n in range(5)]
        if ctx.attempt == 1:
            raise RuntimeError("first attempt fails")
        def gate():
            note({"waiting": os.getpid()})
            while not os.path.exists(os.path.join(state, "go")):
                time.sleep(0.01)
            return 5
        out.append(ctx.step("gate", gate))
        return out

job.add(["agent"])
summary = job.run()
sys.exit(summary.exit_code)
'''


@pytest.fixture
def worker_env(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    state = tmp_path / "state"
    state.mkdir()
    yield script, state


def start_worker(script: Path, db: str, mode: str, state: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=SRC)
    return subprocess.Popen([sys.executable, str(script), db, mode, str(state)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def read_events(state: Path) -> list[dict[str, Any]]:
    path = state / "events"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_durable_sleep_sleeps_only_the_remainder_after_kill_9(worker_env: tuple[Path, Path], sqlite_url: str) -> None:
    script, state = worker_env
    proc = start_worker(script, sqlite_url, "sleep", state)

    def sleep_record() -> float | None:
        try:  # the worker may be creating the store: the file is there a moment before its schema
            store = open_store(sqlite_url, create=False)
        except StoreMissing:
            return None
        try:
            task_id = store.task_id("agent")
            for r in store.steps(task_id) if task_id else []:
                if r.kind == "sleep":
                    return float(json.loads(unframe(r.data).payload))
        finally:
            store.close()
        return None

    deadline = wait_for(sleep_record, 30, "the sleep's deadline to be recorded")
    assert isinstance(deadline, float)
    wait_for(lambda: time.time() >= deadline - 1.5, 5, "1.5 s into the 3 s sleep")
    proc.kill()
    proc.wait(10)
    restarted = time.time()
    proc = start_worker(script, sqlite_url, "sleep", state)
    assert proc.wait(30) == 0, proc.stderr.read() if proc.stderr else ""
    [woke] = [e for e in read_events(state) if "woke" in e]
    assert woke["woke"] >= deadline - 0.05  # slept until the recorded deadline...
    assert woke["woke"] - restarted < 2.5  # ...which was the remainder (about 1.5 s), not another 3 s
    assert [e["step"] for e in read_events(state) if "step" in e] == [0]  # the step before it replayed


@pytest.mark.parametrize("mode", ["loop", "aloop"])
def test_sigterm_stops_sync_and_async_tasks_at_a_step_and_the_next_run_replays(
        worker_env: tuple[Path, Path], sqlite_url: str, mode: str) -> None:
    script, state = worker_env
    proc = start_worker(script, sqlite_url, mode, state)
    wait_for(lambda: len([e for e in read_events(state) if "step" in e]) >= 5, 30, "five steps")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0  # a graceful stop
    assert proc.stderr is not None and "released" in proc.stderr.read().decode()
    assert [e["stopping"] for e in read_events(state) if "stopping" in e] == [True]
    store = open_store(sqlite_url, create=False)
    row = store.task("agent")
    assert row is not None and row.state == "pending" and row.attempts == 0  # the attempt was not counted
    task_id = store.task_id("agent")
    assert task_id is not None
    recorded = len(store.steps(task_id))
    store.close()
    ran_before = len([e for e in read_events(state) if "step" in e])
    assert recorded in (ran_before, ran_before - 1)  # at most the step cut short by the stop is missing

    # The next run replays every recorded step: none of them runs again.
    proc = start_worker(script, sqlite_url, mode, state)
    wait_for(lambda: len([e for e in read_events(state) if "step" in e]) >= ran_before + 3, 30, "new steps")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    second = [e["step"] for e in read_events(state) if "step" in e][ran_before:]
    assert second[0] == recorded  # the first step the second run executed is the first unrecorded one


def test_status_logs_and_steps_command_show_recorded_and_replayed_steps(
        worker_env: tuple[Path, Path], sqlite_url: str) -> None:
    script, state = worker_env
    proc = start_worker(script, sqlite_url, "visible", state)
    try:
        wait_for(lambda: any("waiting" in e for e in read_events(state)), 30, "attempt 2 to reach its gate")
        status = json.loads(run_onward("status", "--db", sqlite_url, "--json").stdout)
        [running] = status["tasks_running"]
        assert running["attempt"] == 2
        assert running["steps"]["recorded"] == 5 and running["steps"]["replayed"] == 5
        assert 0.2 < running["steps"]["saved_seconds"] < 5  # five steps of ~0.05 s each, at first
        text = run_onward("status", "--db", sqlite_url).stdout.decode()
        assert "5 recorded, 5 replayed (saved" in text
        logs = run_onward("logs", "--db", sqlite_url, "--task", "agent").stdout.decode()
        assert "replayed 5 steps (saved" not in logs  # told once the first new step is recorded
        (state / "go").touch()
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    logs = run_onward("logs", "--db", sqlite_url, "--task", "agent").stdout.decode()
    assert "replayed replayed 5 steps (saved" in logs or "replayed 5 steps (saved" in logs
    assert "steps: 1 recorded by this attempt, 5 replayed" in logs
    listing = run_onward("steps", "--db", sqlite_url, "agent")
    assert listing.returncode == 0
    lines = listing.stdout.decode().splitlines()
    assert lines[0].split("\t") == ["index", "step", "kind", "bytes", "seconds", "attempt", "committed"]
    assert [line.split("\t")[1] for line in lines[1:]] == [f"slow#{n}" for n in range(1, 6)] + ["gate#1"]
    assert [line.split("\t")[5] for line in lines[1:]] == ["1"] * 5 + ["2"]
    assert "6 steps" in listing.stderr.decode()
    as_json = [json.loads(line) for line in run_onward("steps", "--db", sqlite_url, "--json", "agent").stdout
               .decode().splitlines()]
    assert as_json[5] == {**as_json[5], "index": 6, "step": "gate#1", "kind": "value", "size": 1, "attempt": 2}
    # When each was committed, as every JSON output of the CLI says a time: ISO 8601 UTC, as the listing shows it.
    assert [row["at"] for row in as_json] == [line.split("\t")[6] for line in lines[1:]]
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", row["at"]) for row in as_json), as_json
    missing = run_onward("steps", "--db", sqlite_url, "nope")
    assert missing.returncode == 1 and b"no task 'nope'" in missing.stderr


@pytest.mark.parametrize("settings", [
    {"backoff": float("nan")}, {"backoff": float("inf")}, {"backoff": -1}, {"backoff": "1"}, {"backoff": None},
    {"max_backoff": float("nan")}, {"max_backoff": -0.5}, {"max_attempts": 0}, {"max_attempts": 2.5},
    {"max_attempts": True}, {"max_attempts": "3"}, {"retry_on": "TimeoutError"}, {"retry_on": (TimeoutError, 5)},
])
def test_a_step_declared_with_a_bad_setting_is_refused_where_it_is_declared(settings: dict[str, Any]) -> None:
    """At the decorator, naming the step and the setting: a NaN backoff was taken, and every retry's wait
    was then NaN."""
    with pytest.raises(UsageError) as refused:
        step(name="fetch", **settings)(lambda: None)
    message = str(refused.value)
    assert "'fetch'" in message and next(iter(settings)) in message and "\n" not in message


def test_a_step_may_retry_on_nothing_and_back_off_not_at_all() -> None:
    step(name="once", retry_on=(), backoff=0, max_backoff=0)(lambda: None)


def test_a_planted_error_record_cannot_run_code_in_the_worker_that_resumes(tmp_path: Path) -> None:
    """An error record is loaded by a restricted unpickler: exception classes and the HTTP clients' request
    and response types from modules already imported, nothing else. Someone who can write to the store (a
    PostgreSQL database's other users) but not run code on the workers' hosts planted a record that named
    os.system, and every worker that resumed the task ran it."""
    import pickle
    import sqlite3

    db = str(tmp_path / "s.db")
    planted = tmp_path / "planted-ran"
    seen: list[str] = []
    job = Job(db, retry_delay=0, max_attempts=2, log_level=QUIET)

    @step(name="risky")
    def risky() -> None:
        raise ValueError("the first time")

    @job.task
    def task(name: str, ctx: TaskContext) -> str:
        try:
            risky()
        except Exception as e:  # noqa: BLE001  (what was raised, or replayed, is what is checked)
            seen.append(f"{type(e).__name__}: {e}")
        ctx.step("after", lambda: 1)  # the error is not the last record: it is replayed, not run again
        if len(seen) == 1:
            raise RuntimeError("end the first attempt")
        return "done"

    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return os.system, (f"touch {planted}",)

    job.add(["t"])
    assert job.run(max_attempts=1).exit_code == 3  # the first attempt: both steps recorded, then failed
    with sqlite3.connect(db) as c:
        (data,) = c.execute("SELECT data FROM steps WHERE kind = 'error'").fetchone()
        head = bytes(data).partition(b"\n")[0]
        assert head.startswith(b"error-pickle ")
        c.execute("UPDATE steps SET data = ? WHERE kind = 'error'", (head + b"\n" + pickle.dumps(Payload()),))
    c.close()
    assert run_onward("retry", "--db", db, "t").returncode == 0
    assert job.run().exit_code == 0
    job.close()
    assert not planted.exists()
    assert seen[0] == "ValueError: the first time"
    assert seen[1].startswith("StepError: a recorded step error could not be rebuilt: an error record may not name")


GATHER_TASK = """
import asyncio, os, random, signal, sys
from onward import Job, step
from onward.log import QUIET

job = Job(sys.argv[1], max_attempts=1, log_level=QUIET)
pace = random.Random(int(sys.argv[2]))


@step(name="search")
async def search(i):
    await asyncio.sleep(pace.random() * 0.05)
    return f"s{i}"


@step(name="fetch")
async def fetch(i):
    await asyncio.sleep(pace.random() * 0.05)
    return f"f{i}"


@job.task
async def t(task, ctx):
    # The first steps of the attempt, started together: none has its position yet when they start.
    got = await asyncio.gather(*(search(i) if i % 2 else fetch(i) for i in range(8)))
    if os.environ.get("KILL"):
        os.kill(os.getpid(), signal.SIGKILL)
    return got


job.add(["t"])
job.run()
print(" ".join(job.result("t")))
"""


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_steps_started_together_before_the_journal_is_read_keep_their_call_order(db: str, tmp_path: Path,
                                                                                 seed: int) -> None:
    """Async steps started together with ``asyncio.gather`` as an attempt's first calls: each waited for the
    task's journal to be read before it took its position, and took it in the order those reads came back, so a
    resumed task got another call's recorded value (or drifted where the names differed). A position is now
    taken when the call is made."""
    print(f"seed {seed}")
    (tmp_path / "task.py").write_text(GATHER_TASK)
    env = {**os.environ, "PYTHONPATH": SRC}
    first = subprocess.run([sys.executable, str(tmp_path / "task.py"), db, str(seed)], env={**env, "KILL": "1"},
                           timeout=60, capture_output=True, text=True)
    assert first.returncode == -signal.SIGKILL, first.stderr
    expected = [f"s{i}" if i % 2 else f"f{i}" for i in range(8)]
    assert [name for _, name, _ in records(db, "t")] == ["search" if i % 2 else "fetch" for i in range(8)]
    second = subprocess.run([sys.executable, str(tmp_path / "task.py"), db, str(seed + 100)], env=env, timeout=60,
                            capture_output=True, text=True)
    assert second.returncode == 0, second.stderr
    assert second.stdout.split() == expected, second.stderr


class _NamedSerializer:
    def __init__(self, name: Any) -> None:
        self.name = name  # any object, for the tests of what is refused

    def dumps(self, value: Any) -> bytes:
        return json.dumps(value).encode()

    def loads(self, data: bytes) -> Any:
        return json.loads(data)


@pytest.mark.parametrize("name", ["my json", "json\n", "", "\x1b[2J", "half\udcff", 7, None])
def test_a_serializer_whose_name_no_record_could_hold_is_refused_where_the_step_is_decorated(name: object) -> None:
    """A serializer named "my json" recorded its values, and every replay then failed "a step record is not in
    onward's format" (the name heads each record, before a space), the task failed for good. Refused at once,
    as every other setting of a step is."""
    with pytest.raises(UsageError, match="a serializer's name must be a non-empty str of printable characters"):
        @step(serializer=_NamedSerializer(name))  # wrong on purpose
        def f() -> int:
            return 1


def test_a_serializer_with_an_unusual_but_fitting_name_records_and_replays(db: str) -> None:
    job = Job(db, log_level=QUIET)
    calls: list[int] = []

    @step(serializer=_NamedSerializer("données/v2"))
    def f() -> int:
        calls.append(1)
        return 41

    @job.task
    def t(task: str, ctx: TaskContext) -> int:
        return int(f()) + 1

    job.add(["t"])
    assert job.run(install_signal_handlers=False).exit_code == 0
    assert job.result("t") == 42 and calls == [1]
    job.close()


def test_an_object_without_dumps_and_loads_is_refused_as_a_serializer() -> None:
    with pytest.raises(UsageError, match="a serializer needs dumps"):
        @step(serializer=type("S", (), {"name": "s"})())  # wrong on purpose
        def f() -> int:
            return 1


CAUSE_TASK = """
import os, signal, sys
from onward import Job, step
from onward.log import QUIET

job = Job(sys.argv[1], max_attempts=1, log_level=QUIET)


@step(name="call")
def call():
    try:
        {}["model"]
    except KeyError as e:
        raise ValueError("the call failed") from e


@job.task
def t(task, ctx):
    try:
        call()
    except ValueError as e:
        out = f"{e!r} from {e.__cause__!r}, context shown: {not e.__suppress_context__}"
    ctx.step("after", lambda: 1)
    if os.environ.get("KILL"):
        os.kill(os.getpid(), signal.SIGKILL)
    return out


job.add(["t"])
job.run()
print(job.result("t"))
"""


def test_a_step_error_raised_from_another_replays_with_its_cause(tmp_path: Path) -> None:
    """`raise ValueError(...) from KeyError(...)` in a step (an SDK's error raised from its HTTP client's): the
    task that caught it saw KeyError as __cause__ on the first run and None on replay, and could take
    another path. The cause is recorded with the error."""
    (tmp_path / "task.py").write_text(CAUSE_TASK)
    db = str(tmp_path / "s.db")
    env = {**os.environ, "PYTHONPATH": SRC}
    first = subprocess.run([sys.executable, str(tmp_path / "task.py"), db], env={**env, "KILL": "1"}, timeout=60,
                           capture_output=True, text=True)
    assert first.returncode == -signal.SIGKILL, first.stderr
    second = subprocess.run([sys.executable, str(tmp_path / "task.py"), db], env=env, timeout=60,
                            capture_output=True, text=True)
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == "ValueError('the call failed') from KeyError('model'), context shown: False"
