"""SIGKILL around a durable wait's commits, on each backend: a worker killed as its task's wait found no value
(nothing committed), just after the park committed, just after the wait's outcome (a value, or its timeout)
was recorded; and an `onward send` killed inside its commit (SQLite: strace kills it at its fdatasync). After
each, a fresh worker goes on: the value sent is received once, a timeout is replayed, the step before the
wait ran once, and the store never holds a value while its task still waits for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from onward.store import open_store
from tests.conftest import onward_argv, require_tool, run_onward, wait_for

SRC = str(Path(__file__).resolve().parents[2] / "src")

# Task "t" runs a step, then waits for "k" (at most the seconds in the file "timeout", if there).
WORKER = textwrap.dedent('''
    import os, sys
    from onward import Job
    from onward.errors import WaitTimeout
    url, side = sys.argv[1], sys.argv[2]
    job = Job(url, heartbeat=0.3)

    @job.task
    def handle(task, ctx):
        ctx.step("before", lambda: open(os.path.join(side, "before"), "a").write("x"))
        path = os.path.join(side, "timeout")
        timeout = float(open(path).read()) if os.path.exists(path) else None
        try:
            return {"got": ctx.wait("k", timeout=timeout)}
        except WaitTimeout:
            return {"got": "timed out"}

    sys.exit(job.run().exit_code)
''')


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    started: list[subprocess.Popen[bytes]] = []

    def start(url: str, side: Path, crash_at: str | None = None) -> subprocess.Popen[bytes]:
        hooks = {"ONWARD_TEST_HOOKS": "1", "ONWARD_CRASH_AT": crash_at} if crash_at else {}
        with open(tmp_path / "worker.log", "ab") as log:
            started.append(subprocess.Popen([sys.executable, str(script), url, str(side)], stderr=log,
                                            stdout=subprocess.DEVNULL,
                                            env={**os.environ, "PYTHONPATH": SRC, **hooks}))
        return started[-1]

    yield start
    for proc in started:
        proc.kill()
        proc.wait(timeout=30)


def result(url: str) -> Any:
    r = run_onward("result", "--db", url, "t")
    return json.loads(r.stdout)["got"] if r.returncode == 0 else None


def task_state(url: str) -> tuple[str, str | None, int]:
    """Task t's state, the value its mailbox keeps for "k" (or None), and its attempts."""
    store = open_store(url, create=False)
    try:
        row, task_id = store.task("t"), store.task_id("t")
        assert row is not None and task_id is not None
        return row.state, store.mail(task_id, "k")[0], row.attempts
    finally:
        store.close()


def killed(proc: subprocess.Popen[bytes]) -> bool:
    return proc.poll() == -9


@pytest.mark.parametrize("phase", ["wait_parking", "wait_parked"])
def test_a_worker_killed_as_its_task_parks_loses_no_value(
        store_url: str, tmp_path: Path, worker: Any, phase: str) -> None:
    side = tmp_path / "side"
    side.mkdir()
    assert run_onward("add", "--db", store_url, "t").returncode == 0
    first = worker(store_url, side, crash_at=f"{phase}:1")
    wait_for(lambda: killed(first), 60, f"the worker to kill itself at {phase}")
    # Killed before the park committed: the task is still running under a dead worker; after: it waits.
    assert task_state(store_url)[0] == ("running" if phase == "wait_parking" else "waiting")
    sent = run_onward("send", "--db", store_url, "t", "k", '"v"')
    assert sent.returncode == 0, sent.stderr
    worker(store_url, side)
    wait_for(lambda: result(store_url) is not None, 60, "t to finish")
    assert result(store_url) == "v"
    assert (side / "before").read_text() == "x"  # recorded before the kill, replayed after
    state, kept, attempts = task_state(store_url)
    assert kept is None  # received, so taken out of the mailbox
    # A park uses up no attempt; nor did the killed one, which had recorded its step.
    assert attempts == 1


@pytest.mark.parametrize("outcome", ["value", "timeout"])
def test_a_worker_killed_once_the_wait_is_recorded_replays_it(
        store_url: str, tmp_path: Path, worker: Any, outcome: str) -> None:
    side = tmp_path / "side"
    side.mkdir()
    assert run_onward("add", "--db", store_url, "t").returncode == 0
    if outcome == "value":
        assert run_onward("send", "--db", store_url, "t", "k", '"v"').returncode == 0  # kept until it waits
    else:
        (side / "timeout").write_text("0.3")
    first = worker(store_url, side, crash_at="wait_recorded:1")
    wait_for(lambda: killed(first), 60, "the worker to kill itself once the wait is recorded")
    state, kept, _ = task_state(store_url)
    assert state == "running" and kept is None  # a value taken out with the record, in one commit
    worker(store_url, side)
    wait_for(lambda: result(store_url) is not None, 60, "t to finish")
    assert result(store_url) == ("v" if outcome == "value" else "timed out")
    assert (side / "before").read_text() == "x"
    store = open_store(store_url, create=False)
    try:
        task_id = store.task_id("t")
        assert task_id is not None
        assert [s.kind for s in store.steps(task_id)] == ["value", "wait"]  # recorded once, then replayed
    finally:
        store.close()


@pytest.mark.parametrize(("call", "nth"), [("pwrite64", 1), ("pwrite64", 2), ("fdatasync", 1)])
def test_a_send_killed_inside_its_commit_leaves_the_value_whole_or_absent(
        tmp_path: Path, worker: Any, call: str, nth: int) -> None:
    """The send's process SIGKILLed at its nth write or fdatasync (strace): its value and the task's wake-up
    are one commit, so the store holds both or neither; a send again is then refused (the value is there)
    or delivers it, and the task receives one value."""
    strace = require_tool("strace")
    db, side = str(tmp_path / "s.db"), tmp_path / "side"
    side.mkdir()
    assert run_onward("add", "--db", db, "t").returncode == 0
    first = worker(db, side)
    wait_for(lambda: task_state(db)[0] == "waiting", 60, "t to wait")
    first.kill()
    first.wait(timeout=30)
    send = subprocess.run([strace, "-f", "-qq", "-o", "/dev/null", "-P", db + "-wal", "-e", f"trace={call}", "-e",
                           f"inject={call}:signal=KILL:when={nth}",
                           *onward_argv("send", "--db", db, "t", "k", '"v"')],
                          capture_output=True, env={**os.environ, "PYTHONPATH": SRC}, timeout=60)
    state, kept, _ = task_state(db)
    if send.returncode == 0:  # it had fewer syncs than nth: it completed
        assert (state, kept) == ("pending", '"v"')
    else:
        assert (state, kept) in (("waiting", None), ("pending", '"v"')), (send.returncode, state, kept)
        again = run_onward("send", "--db", db, "t", "k", '"v"')
        assert again.returncode == (1 if kept else 0), again.stderr
    worker(db, side)
    wait_for(lambda: result(db) is not None, 60, "t to finish")
    assert result(db) == "v" and (side / "before").read_text() == "x"
