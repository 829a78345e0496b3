"""Durable waits (ctx.wait / onward send) with real worker processes on each backend: a waiting task is
parked (no slot, no lease), survives SIGKILL and a supervisor restart, receives a value sent before it
waited, replays a recorded timeout, lets the keep-awake marker go while every task waits; `onward send`'s
refusals store nothing."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from onward.store import open_store
from tests.conftest import onward_argv, run_onward, task_result, wait_for

SRC = str(Path(__file__).resolve().parents[2] / "src")

# A Python worker. Each task counts its attempts and its one step in files beside; "plain*" tasks just
# finish; the others wait for "approval" (with a 1 s timeout for "timeout*"), and "*-hang" ones then stay
# until the file "go" exists (so that a test can look, or kill, after the wait).
WORKER = textwrap.dedent('''
    import asyncio, os, sys, time
    from onward import Job
    from onward.errors import WaitTimeout
    url, side, concurrency, flavour = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    marker = sys.argv[5] if len(sys.argv) > 5 else None
    job = Job(url, heartbeat=0.3, concurrency=concurrency, keep_awake=marker)

    def note(task, what):
        with open(os.path.join(side, task + "." + what), "a") as f:
            f.write("x")

    def hang(task):
        while task.endswith("-hang") and not os.path.exists(os.path.join(side, "go")):
            time.sleep(0.02)

    if flavour == "sync":
        @job.task
        def handle(task, ctx):
            note(task, "runs")
            if task.startswith("plain"):
                return "plain"
            ctx.step("before", lambda: note(task, "before"))
            try:
                value = ctx.wait("approval", timeout=1.0 if task.startswith("timeout") else None)
            except WaitTimeout:
                value = "timed out"
            note(task, "after")
            hang(task)
            return {"got": value}
    else:
        @job.task
        async def handle(task, ctx):
            note(task, "runs")
            await ctx.step("before", lambda: note(task, "before"))
            value = await ctx.wait("approval")
            note(task, "after")
            return {"got": value}

    sys.exit(job.run().exit_code)
''')


class Worker:
    def __init__(self, argv: list[str], log: Path) -> None:
        self.log_path = log
        with open(log, "ab") as err:
            self.proc = subprocess.Popen(argv, stderr=err, stdout=subprocess.DEVNULL,
                                         env={**os.environ, "PYTHONPATH": SRC}, start_new_session=True)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Any]:
    started: list[Worker] = []
    script = tmp_path / "worker.py"
    script.write_text(WORKER)

    def go(url: str, side: Path, *, concurrency: int = 1, flavour: str = "sync", marker: Path | None = None,
           supervised: bool = False) -> Worker:
        argv = [sys.executable, str(script), url, str(side), str(concurrency), flavour,
                *([str(marker)] if marker else [])]
        if supervised:
            argv = onward_argv("supervise", "--db", url, "--restart-delay", "0.2", "--", *argv)
        started.append(Worker(argv, tmp_path / f"worker{len(started)}.log"))
        return started[-1]

    yield go
    for w in started:
        w.kill()


def status(url: str) -> dict[str, Any]:
    r = run_onward("status", "--db", url, "--json")
    assert r.returncode == 0, r.stderr
    report: dict[str, Any] = json.loads(r.stdout)
    return report


def count(side: Path, task: str, what: str) -> int:
    path = side / f"{task}.{what}"
    return len(path.read_text()) if path.exists() else 0


def send(url: str, *args: str) -> subprocess.CompletedProcess[bytes]:
    return run_onward("send", "--db", url, *args)


@pytest.fixture
def side(tmp_path: Path) -> Path:
    path = tmp_path / "side"
    path.mkdir()
    return path


def test_a_waiting_task_frees_its_slot_survives_sigkill_and_lets_the_sandbox_sleep(
        store_url: str, side: Path, tmp_path: Path, start: Any) -> None:
    assert run_onward("add", "--db", store_url, "w1-hang", "plain1").returncode == 0
    marker = tmp_path / "keep-awake"
    first = start(store_url, side, concurrency=1, marker=marker)
    # With one slot, the waiting task does not hold it: the plain task runs meanwhile.
    wait_for(lambda: task_result(store_url, "plain1") == "plain", 60, f"plain1 to run; log:\n{first.log}")
    report = wait_for(lambda: (s := status(store_url))["waiting"] == 1 and s, 30, "w1 to wait")
    assert isinstance(report, dict) and report["running"] == 0
    assert report["tasks_waiting"] == [{"task": "w1-hang", "key": "approval", "until": None}]
    assert run_onward("list", "--db", store_url, "--state", "waiting").stdout == b"w1-hang\n"
    wait_for(lambda: not marker.exists(), 30, "the keep-awake marker to go while every task waits")
    assert first.proc.poll() is None  # the worker stays up, waiting with its tasks
    first.kill()
    second = start(store_url, side, concurrency=1, marker=marker)
    wait_for(lambda: "worker started" in second.log, 30, "the second worker")
    r = send(store_url, "w1-hang", "approval", '{"ok": true, "by": "ana"}')
    assert r.returncode == 0 and b"runs again" in r.stderr, r.stderr
    wait_for(lambda: count(side, "w1-hang", "after") == 1, 60, f"w1 to resume; log:\n{second.log}")
    wait_for(marker.exists, 30, "the keep-awake marker back once a task runs")
    (side / "go").touch()
    wait_for(lambda: task_result(store_url, "w1-hang") is not None, 60, "w1 to finish")
    assert task_result(store_url, "w1-hang") == {"got": {"ok": True, "by": "ana"}}
    assert count(side, "w1-hang", "before") == 1  # the step before the wait ran once, then was replayed
    store = open_store(store_url, create=False)
    try:
        row = store.task("w1-hang")
        assert row is not None and row.attempts == 1  # parking is not a failed attempt
    finally:
        store.close()
    r = send(store_url, "w1-hang", "approval", "1")
    assert r.returncode == 1 and r.stderr.count(b"\n") == 1 and b"done" in r.stderr, r.stderr


def test_a_wait_survives_a_supervisor_restart(store_url: str, side: Path, start: Any) -> None:
    assert run_onward("add", "--db", store_url, "w2").returncode == 0
    sup = start(store_url, side, supervised=True)
    wait_for(lambda: status(store_url)["waiting"] == 1, 60, f"w2 to wait; log:\n{sup.log}")
    pids = re.findall(r"worker (\d+) started: ", sup.log)
    assert pids, sup.log
    os.kill(int(pids[-1]), signal.SIGKILL)
    wait_for(lambda: len(re.findall(r"worker (\d+) started: ", sup.log)) >= 2, 60,
             f"the supervisor to restart its worker; log:\n{sup.log}")
    assert send(store_url, "w2", "approval", '"yes"').returncode == 0
    wait_for(lambda: task_result(store_url, "w2") is not None, 60, f"w2 to finish; log:\n{sup.log}")
    assert task_result(store_url, "w2") == {"got": "yes"} and count(side, "w2", "before") == 1


def test_a_value_sent_before_the_wait_is_received_and_refusals_store_nothing(
        store_url: str, side: Path, start: Any) -> None:
    assert run_onward("add", "--db", store_url, "early", "other").returncode == 0
    for bad in ("nan", "NaN", "{", "", "[1, Infinity]", "x" * 10, json.dumps("x" * 70_000)):
        r = send(store_url, "early", "approval", bad)
        assert r.returncode == 2 and r.stderr.count(b"\n") == 1 and b"Traceback" not in r.stderr, (bad[:20], r.stderr)
    r = subprocess.run([*onward_argv("send", "--db", store_url, "early", "approval"), b'"\xff\xfe"'],
                       capture_output=True, env={**os.environ, "PYTHONPATH": SRC})
    assert r.returncode == 2 and r.stderr.count(b"\n") == 1, r.stderr
    for key in ("", "a\nb", "k" * 201):
        r = send(store_url, "early", key, "1")
        assert r.returncode == 2 and r.stderr.count(b"\n") == 1, (key, r.stderr)
    r = send(store_url, "nobody", "approval", "1")
    assert r.returncode == 1 and b"nothing was sent" in r.stderr, r.stderr
    r = send(store_url, "early", "approval", '{"n": 1}')
    assert r.returncode == 0 and b"kept until it waits" in r.stderr, r.stderr
    r = send(store_url, "early", "approval", '{"n": 2}')  # a second value before the first was received
    assert r.returncode == 1 and b"never replaced" in r.stderr, r.stderr
    worker = start(store_url, side, flavour="async")
    wait_for(lambda: task_result(store_url, "early") is not None, 60, f"early to finish; log:\n{worker.log}")
    assert task_result(store_url, "early") == {"got": {"n": 1}}
    assert status(store_url)["waiting"] == 1  # "other" waits; nothing was sent to it
    assert send(store_url, "other", "approval", "[]").returncode == 0
    wait_for(lambda: task_result(store_url, "other") == {"got": []}, 60, f"other to finish; log:\n{worker.log}")


def test_a_timeout_is_recorded_and_replayed_after_a_kill(store_url: str, side: Path, start: Any) -> None:
    assert run_onward("add", "--db", store_url, "timeout-hang").returncode == 0
    first = start(store_url, side)
    wait_for(lambda: count(side, "timeout-hang", "after") == 1, 60, f"the wait to time out; log:\n{first.log}")
    first.kill()
    second = start(store_url, side)
    wait_for(lambda: count(side, "timeout-hang", "after") == 2, 60, f"the task to resume; log:\n{second.log}")
    (side / "go").touch()
    wait_for(lambda: task_result(store_url, "timeout-hang") is not None, 60, "the task to finish")
    assert task_result(store_url, "timeout-hang") == {"got": "timed out"}
    store = open_store(store_url, create=False)
    try:
        # It parked once (until its deadline); the resumed attempt replayed the recorded timeout.
        kinds = [e.kind for e in store.events(task="timeout-hang")]
        assert kinds.count("waiting") == 1, kinds
        task_id = store.task_id("timeout-hang")
        assert task_id is not None
        assert [s.kind for s in store.steps(task_id)] == ["value", "wait"]
    finally:
        store.close()


BAD_WAITS = textwrap.dedent('''
    import sys
    from onward import Job
    job = Job(sys.argv[1], heartbeat=0.3, max_attempts=1)

    @job.task
    def handle(task, ctx):
        if task == "bad-key":
            return ctx.wait("a\\nb")
        if task == "empty-key":
            return ctx.wait("")
        if task == "nan-timeout":
            return ctx.wait("k", timeout=float("nan"))
        if task == "zero-timeout":
            return ctx.wait("k", timeout=0)
        if task == "in-step":
            return ctx.step("outer", lambda: ctx.wait("k"))
        return ctx.wait("k" * 201)

    sys.exit(job.run().exit_code)
''')


def test_bad_waits_fail_the_attempt_with_one_line(store_url: str, tmp_path: Path) -> None:
    script = tmp_path / "bad.py"
    script.write_text(BAD_WAITS)
    names = {"bad-key": "printable", "empty-key": "non-empty", "nan-timeout": "finite", "zero-timeout": "above 0",
             "in-step": "inside a step's body", "long-key": "at most 200"}
    assert run_onward("add", "--db", store_url, *names).returncode == 0
    r = subprocess.run([sys.executable, str(script), store_url], capture_output=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": SRC})
    assert r.returncode == 3, r.stderr
    store = open_store(store_url, create=False)
    try:
        for name, says in names.items():
            row = store.task(name)
            assert row is not None and row.state == "failed" and row.error is not None, name
            assert says in row.error.strip().splitlines()[-1], (name, row.error)
        assert store.counts()["waiting"] == 0
    finally:
        store.close()


# Bad numbers of seconds given to ctx.sleep and ctx.wait, by task name: the call (method, positional
# arguments, keyword arguments, and whether it is made inside a step's body) and the UsageError's message
# on the last line of its task's error. "sleep-zero" is fine: a sleep of 0 s is no mistake.
BAD_SECONDS: dict[str, tuple[str, tuple[Any, ...], dict[str, Any], bool, str]] = {
    "sleep-nan": ("sleep", (float("nan"),), {}, False,
                  "a sleep's duration must be a finite number of seconds (got nan)"),
    "sleep-inf": ("sleep", (float("inf"),), {}, False,
                  "a sleep's duration must be a finite number of seconds (got inf)"),
    "sleep-negative": ("sleep", (-1,), {}, False, "a sleep's duration cannot be negative (got -1)"),
    "sleep-str": ("sleep", ("5",), {}, False, "a sleep's duration must be a number of seconds, not str: '5'"),
    "sleep-none": ("sleep", (None,), {}, False,
                   "a sleep's duration must be a number of seconds, not NoneType: None"),
    "sleep-bool": ("sleep", (True,), {}, False,
                   "a sleep's duration must be a number of seconds, not bool: True"),
    "sleep-too-long": ("sleep", (1e300,), {}, False,
                       "a sleep's duration must be at most 31,622,400 seconds (366 days) (got 1e+300)"),
    "sleep-nan-in-step": ("sleep", (float("nan"),), {}, True,
                          "a sleep's duration must be a finite number of seconds (got nan)"),
    "wait-inf": ("wait", ("k",), {"timeout": float("inf")}, False,
                 "a wait's timeout must be a finite number of seconds (got inf)"),
    "wait-negative": ("wait", ("k",), {"timeout": -1}, False,
                      "a wait's timeout must be a finite number of seconds above 0, or None (got -1)"),
    "wait-str": ("wait", ("k",), {"timeout": "5"}, False,
                 "a wait's timeout must be a number of seconds or None, not str: '5'"),
    "wait-bool": ("wait", ("k",), {"timeout": True}, False,
                  "a wait's timeout must be a number of seconds or None, not bool: True"),
    "wait-too-long": ("wait", ("k",), {"timeout": 1e300}, False,
                      "a wait's timeout must be at most 31,622,400 seconds (366 days) (got 1e+300)"),
    "sleep-zero": ("sleep", (0,), {}, False, ""),
}


@pytest.mark.timeout(120)  # on the old code a NaN sleep inside a step's body could wait for ever
@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_bad_number_of_seconds_for_sleep_or_wait_fails_the_task_saying_what_is_wrong(
        tmp_path: Path, flavour: str) -> None:
    """ctx.sleep(nan) failed its task saying "a step returned a value that is not JSON" (the deadline,
    now + NaN, could not be recorded); a wait's timeout of 1e300 s crashed the worker (OverflowError) when it
    logged the parked task's deadline. Each now fails its attempt as a bad ctx.wait key does, with a
    UsageError saying what is wrong, and records no sleep or wait."""
    from onward import Job
    from onward.log import QUIET

    job = Job(str(tmp_path / "s.db"), max_attempts=1, log_level=QUIET)

    if flavour == "sync":
        @job.task
        def handle(task: str, ctx: Any) -> str:
            method, args, kwargs, in_step, _ = BAD_SECONDS[task]
            call = getattr(ctx, method)
            if in_step:
                ctx.step("outer", lambda: call(*args, **kwargs))
            else:
                call(*args, **kwargs)
            return "ok"
    else:
        @job.task
        async def handle_async(task: str, ctx: Any) -> str:
            method, args, kwargs, in_step, _ = BAD_SECONDS[task]
            call = getattr(ctx, method)
            if in_step:
                await ctx.step("outer", lambda: call(*args, **kwargs))
            else:
                await call(*args, **kwargs)
            return "ok"

    job.add(BAD_SECONDS)
    assert job.run(install_signal_handlers=False).exit_code == 3
    wrong = []
    for name, (method, _, _, _, says) in BAD_SECONDS.items():
        row = job.store.task(name)
        task_id = job.store.task_id(name)
        assert row is not None and task_id is not None
        recorded = [s.kind for s in job.store.steps(task_id)]
        if not says:
            outcome: tuple[object, ...] = (row.state, recorded)
            if outcome != ("done", ["sleep"]):
                wrong.append((name, outcome))
            continue
        last_line = (row.error or "").strip().splitlines()[-1:]
        if row.state != "failed" or last_line != [f"onward.errors.UsageError: {says}"] or method in recorded:
            wrong.append((name, (row.state, last_line, recorded)))
    job.close()
    assert wrong == []


# A Python worker whose tasks sleep durably: "nap-S" sleeps S seconds between a step and the end, writing
# the wall-clock time it woke; "*-hang" ones then stay until the file "go" exists. argv: the store, the side
# folder, sync or async, the run's park_sleeps_over, and the keep-awake marker.
SLEEPER = textwrap.dedent('''
    import asyncio, os, sys, time
    from onward import Job
    url, side, flavour, over, marker = sys.argv[1:6]
    job = Job(url, heartbeat=0.3, keep_awake=marker, park_sleeps_over=float(over))

    def note(task, what, text="x"):
        with open(os.path.join(side, task + "." + what), "a") as f:
            f.write(text)

    def woke(task):
        note(task, "woke", f"{time.time()}\\n")
        while task.endswith("-hang") and not os.path.exists(os.path.join(side, "go")):
            time.sleep(0.02)

    if flavour == "sync":
        @job.task
        def handle(task, ctx):
            note(task, "runs")
            ctx.step("before", lambda: note(task, "before"))
            ctx.sleep(float(task.split("-")[1]))
            woke(task)
            return "rested"
    else:
        @job.task
        async def handle(task, ctx):
            note(task, "runs")
            await ctx.step("before", lambda: note(task, "before"))
            await ctx.sleep(float(task.split("-")[1]))
            await asyncio.to_thread(woke, task)
            return "rested"

    sys.exit(job.run().exit_code)
''')


@pytest.fixture
def start_sleeper(tmp_path: Path) -> Iterator[Any]:
    started: list[Worker] = []
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)

    def go(url: str, side: Path, marker: Path, *, flavour: str = "sync", park_over: float = 1.0) -> Worker:
        argv = [sys.executable, str(script), url, str(side), flavour, str(park_over), str(marker)]
        started.append(Worker(argv, tmp_path / f"sleeper{len(started)}.log"))
        return started[-1]

    yield go
    for w in started:
        w.kill()


def sleep_record(url: str, task: str) -> tuple[float, list[str], list[str]]:
    """The deadline the task's durable sleep recorded (store clock), its step kinds and its journal kinds."""
    store = open_store(url, create=False)
    try:
        task_id = store.task_id(task)
        assert task_id is not None
        steps = store.steps(task_id)
        deadline = float(json.loads(steps[-1].data.partition(b"\n")[2]))
        return deadline, [s.kind for s in steps], [e.kind for e in store.events(task=task)]
    finally:
        store.close()


def parked_sleep(url: str) -> tuple[str, str, float | None] | None:
    """While the one task is parked (as `onward status` shows it): its name, key and deadline (store clock)."""
    report = status(url)
    if report["waiting"] != 1 or report["running"] != 0:
        return None
    store = open_store(url, create=False)
    try:
        [row] = store.waits()
    finally:
        store.close()
    assert report["tasks_waiting"][0]["key"] == row.key
    return row.name, row.key, row.until


def test_a_long_sleep_parks_the_task_and_lets_the_sandbox_sleep(
        store_url: str, side: Path, tmp_path: Path, start_sleeper: Any) -> None:
    assert run_onward("add", "--db", store_url, "nap-3-hang").returncode == 0
    marker = tmp_path / "keep-awake"
    worker = start_sleeper(store_url, side, marker, park_over=1.0)
    parked = wait_for(lambda: parked_sleep(store_url), 60, f"the sleep to park; log:\n{worker.log}")
    deadline, kinds, _ = sleep_record(store_url, "nap-3-hang")
    assert parked == ("nap-3-hang", "onward:sleep", pytest.approx(deadline))
    assert kinds == ["value", "sleep"]
    wait_for(lambda: not marker.exists(), 30, "the keep-awake marker to go while the only task sleeps")
    assert worker.proc.poll() is None  # the worker stays up for its sleeping task
    wait_for(lambda: count(side, "nap-3-hang", "woke"), 60, f"the task to wake; log:\n{worker.log}")
    wait_for(marker.exists, 30, "the keep-awake marker back once the task runs again")
    (side / "go").touch()
    wait_for(lambda: task_result(store_url, "nap-3-hang") == "rested", 60, "the task to finish")
    assert float((side / "nap-3-hang.woke").read_text()) >= deadline - 0.05  # it slept the whole time
    _, kinds, events = sleep_record(store_url, "nap-3-hang")
    assert kinds == ["value", "sleep"] and events.count("waiting") == 1
    assert count(side, "nap-3-hang", "before") == 1 and count(side, "nap-3-hang", "runs") == 2
    # onward's reserved keys cannot be sent to: nothing sent from outside ends a sleep early.
    r = send(store_url, "nap-3-hang", "onward:sleep", "1")
    assert r.returncode == 2 and r.stderr.count(b"\n") == 1 and b"onward's own" in r.stderr, r.stderr


def test_a_parked_sleep_survives_sigkill_and_sleeps_only_the_rest(
        store_url: str, side: Path, tmp_path: Path, start_sleeper: Any) -> None:
    assert run_onward("add", "--db", store_url, "nap-4").returncode == 0
    marker = tmp_path / "keep-awake"
    first = start_sleeper(store_url, side, marker, flavour="async", park_over=1.0)
    parked = wait_for(lambda: parked_sleep(store_url), 60, f"the sleep to park; log:\n{first.log}")
    first.kill()
    second = start_sleeper(store_url, side, marker, flavour="async", park_over=1.0)
    wait_for(lambda: task_result(store_url, "nap-4") == "rested", 60, f"the task to finish; log:\n{second.log}")
    deadline, kinds, events = sleep_record(store_url, "nap-4")
    assert parked == ("nap-4", "onward:sleep", pytest.approx(deadline))
    # The deadline recorded before the kill held: one sleep record, woken after it, not a new 4 s sleep.
    assert kinds == ["value", "sleep"] and count(side, "nap-4", "before") == 1
    assert float((side / "nap-4.woke").read_text()) >= deadline - 0.05
    store = open_store(store_url, create=False)
    try:
        details = [e.detail for e in store.events(task="nap-4") if e.kind == "waiting"]
    finally:
        store.close()
    # Parked by the first worker; the second one, if it claimed it before the deadline, parked it again
    # until the same moment (the journal names it to the second).
    assert 1 <= len(details) <= 2 and len(set(details)) == 1, details
    assert events.count("claimed") == len(details) + 1


def test_a_short_sleep_stays_in_the_worker(store_url: str, side: Path, tmp_path: Path, start_sleeper: Any) -> None:
    assert run_onward("add", "--db", store_url, "nap-1.5").returncode == 0
    marker = tmp_path / "keep-awake"
    worker = start_sleeper(store_url, side, marker, park_over=3.0)
    wait_for(lambda: count(side, "nap-1.5", "before"), 60, f"the task to start; log:\n{worker.log}")
    # The marker first, then the status: a task still running after the look at the marker was running
    # during it (the other order fails when the task ends between the two, on a loaded machine).
    marked = marker.exists()
    report = status(store_url)
    assert report["running"] == 1 and report["waiting"] == 0 and marked
    wait_for(lambda: task_result(store_url, "nap-1.5") == "rested", 60, f"the task to finish; log:\n{worker.log}")
    deadline, kinds, events = sleep_record(store_url, "nap-1.5")
    assert kinds == ["value", "sleep"] and "waiting" not in events
    assert count(side, "nap-1.5", "runs") == 1 and float((side / "nap-1.5.woke").read_text()) >= deadline - 0.05


TIMING_OUT = textwrap.dedent('''
    import sys
    from onward import Job
    job = Job(sys.argv[1], heartbeat=0.3, max_attempts=2, retry_delay=0.05)

    @job.task
    def handle(task, ctx):
        ctx.step("draft", lambda: "a draft")
        return {"approved": ctx.wait("approval", timeout=0.5)}

    sys.exit(job.run().exit_code)
''')


def test_a_timeout_that_failed_the_attempt_is_waited_again_and_a_retry_takes_a_value(store_url: str,
                                                                                      tmp_path: Path) -> None:
    """A wait's timeout the task did not catch: the record of it stayed, so every later attempt failed at once
    on the replayed timeout (three attempts in 20 ms), and after `onward retry` a value sent was kept for good
    and never taken. Like a step's error, it is dropped with the attempt it ended: each attempt waits again."""
    script = tmp_path / "worker.py"
    script.write_text(TIMING_OUT)
    assert run_onward("add", "--db", store_url, "t").returncode == 0
    first = subprocess.run([sys.executable, str(script), store_url], env={**os.environ, "PYTHONPATH": SRC},
                           capture_output=True, timeout=120)
    assert first.returncode == 3, first.stderr.decode()
    store = open_store(store_url, create=False)
    try:
        kinds = [e.kind for e in store.events(task="t")]
        assert kinds.count("waiting") == 2, kinds  # each attempt parked on its own deadline
        task_id = store.task_id("t")
        assert task_id is not None
        assert [s.kind for s in store.steps(task_id)] == ["value"]  # the draft stays; no timeout is kept
    finally:
        store.close()
    assert run_onward("retry", "--db", store_url, "t").returncode == 0
    assert send(store_url, "t", "approval", "true").returncode == 0
    second = subprocess.run([sys.executable, str(script), store_url], env={**os.environ, "PYTHONPATH": SRC},
                            capture_output=True, timeout=120)
    assert second.returncode == 0, second.stderr.decode()
    assert task_result(store_url, "t") == {"approved": True}
