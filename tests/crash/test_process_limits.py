"""A worker out of processes for real: a cgroup v1 pids limit (which counts threads too) on the worker's own
process. Whatever the worker cannot start for want of processes (a command, a task's thread, a thread of its
own store) is a shortfall of the machine: no task loses an attempt for it, no traceback, and the job goes on
once the limit is lifted."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import pgutil
from tests.conftest import in_cgroup, onward_argv, own_cgroup_v1, run_onward, wait_for

SRC = str(Path(__file__).resolve().parents[2] / "src")


@pytest.fixture
def pids_cgroup() -> Iterator[Path]:
    """A cgroup v1 pids cgroup of the test's own (no limit until the test writes ``pids.max``)."""
    with own_cgroup_v1("pids") as cgroup:
        try:
            yield cgroup
        finally:
            (cgroup / "pids.max").write_text("max")  # room for the cleanup's kills to be seen through


def run_with_two_processes(worker: str, tasks: int, tmp_path: Path, pids_cgroup: Path) -> Path:
    """Run the Python ``worker`` script on a new SQLite store under `pids.max` 2 (its main thread and one
    more): it must exit 0 without a traceback, each of its ``tasks`` tasks done at attempt 1. The store."""
    db = tmp_path / "s.db"
    script = tmp_path / "worker.py"
    script.write_text(worker)
    (pids_cgroup / "pids.max").write_text("2")
    r = subprocess.run(in_cgroup(pids_cgroup, [sys.executable, str(script), str(db)]),
                       env=dict(os.environ, PYTHONPATH=SRC), capture_output=True, timeout=60)
    err = r.stderr.decode()
    assert r.returncode == 0 and "Traceback" not in err, err[-3000:]
    c = sqlite3.connect(db)
    assert dict(c.execute("SELECT name, state || ' ' || attempts FROM tasks")) == {
        f"t{i}": "done 1" for i in range(tasks)}
    c.close()
    return db


PYTHON_WORKER = """
import sys, time
from onward import Job

job = Job(sys.argv[1])

@job.task(max_attempts=1)
def work(task, ctx):
    time.sleep(0.02)
    return "ok"

job.add([f"t{i}" for i in range(6)])
sys.exit(job.run(concurrency=1).exit_code)
"""


def test_a_python_worker_with_no_thread_left_for_its_syncs_syncs_in_place(tmp_path: Path,
                                                                          pids_cgroup: Path) -> None:
    """`pids.max` 2: the worker's main thread and one task thread, none left for the thread that syncs
    SQLite's log while the next task runs. Its start failed with EAGAIN, which escaped as a
    BlockingIOError traceback out of ``job.run()``, with the task that had just run left claimed (its
    attempt spent by the reclaim). The sync is now made in place, and every task is done at attempt 1."""
    run_with_two_processes(PYTHON_WORKER, 6, tmp_path, pids_cgroup)


def test_a_postgres_worker_that_cannot_start_its_threads_is_unavailable_not_crashed(tmp_path: Path,
                                                                                    pids_cgroup: Path) -> None:
    """The threads of a PostgreSQL store (its LISTEN connection, its stall watch) could not be started:
    `RuntimeError: can't start new thread`, a traceback and exit 1, which `onward supervise` takes for a
    crash. With no thread at all (`pids.max` 1) the worker now says so in one line and exits 75, nothing
    claimed; with one (`pids.max` 2, no stall watch) it rides it out as a store fault and finishes the job,
    each task once, as soon as the limit is lifted."""
    tasks = tmp_path / "tasks.txt"
    names = [f"t{i}" for i in range(8)]
    tasks.write_text("".join(n + "\n" for n in names))
    env = dict(os.environ, PYTHONPATH=SRC)
    with pgutil.fresh_database() as url:
        run = onward_argv("run", "--db", url, "--tasks", str(tasks), "--concurrency", "4", "--", "echo", "{task}")
        (pids_cgroup / "pids.max").write_text("1")
        r = subprocess.run(in_cgroup(pids_cgroup, run), env=env, capture_output=True, timeout=60)
        err = r.stderr.decode()
        assert r.returncode == 75, err[-3000:]
        lines = [line for line in err.splitlines() if " added " not in line]
        assert len(lines) == 1 and "cannot start a thread" in lines[0], err[-3000:]
        listed = run_onward("list", "--db", url, "--long")
        assert {row.split("\t")[0] for row in listed.stdout.decode().splitlines()} == {"pending"}

        (pids_cgroup / "pids.max").write_text("2")
        log = tmp_path / "worker.log"
        with log.open("wb") as out:
            worker = subprocess.Popen(in_cgroup(pids_cgroup, run), env=env, stdout=subprocess.DEVNULL, stderr=out)
        try:
            wait_for(lambda: "cannot start a thread" in log.read_text(), 30, "the worker to meet the limit")
            (pids_cgroup / "pids.max").write_text("max")
            assert worker.wait(timeout=60) == 0, log.read_text()[-3000:]
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
        listed = run_onward("list", "--db", url, "--long")
        rows = [line.split("\t") for line in listed.stdout.decode().splitlines()]
        assert {row[-1]: (row[0], row[1]) for row in rows} == {n: ("done", "1") for n in names}


def test_supervise_waits_for_processes_to_start_its_worker(tmp_path: Path, pids_cgroup: Path) -> None:
    """`onward supervise` in a pids cgroup with no process left for its worker: the fork's EAGAIN was taken
    for a usage error (`cannot start …`, exit 2, which nothing restarts), and at a restart it ended the
    supervisor with 1. It now says so once and tries every second: the worker starts and finishes the job
    once the limit is lifted, and a stop meanwhile ends the supervisor with 75 (unavailable), in one line."""
    db = str(tmp_path / "s.db")
    tasks = tmp_path / "tasks.txt"
    names = [f"t{i}" for i in range(5)]
    tasks.write_text("".join(n + "\n" for n in names))
    supervise = in_cgroup(pids_cgroup, onward_argv("supervise", "--db", db, "--", *onward_argv(
        "run", "--db", db, "--tasks", str(tasks), "--", "echo", "{task}")))
    env = dict(os.environ, PYTHONPATH=SRC)
    for lifted in (True, False):
        (pids_cgroup / "pids.max").write_text("1")
        log = tmp_path / f"supervise-{lifted}.log"
        with log.open("wb") as out:
            supervisor = subprocess.Popen(supervise, env=env, stdout=subprocess.DEVNULL, stderr=out)
        try:
            wait_for(lambda: "cannot start the worker" in log.read_text() or supervisor.poll() is not None, 30,
                     "the supervisor to meet the limit")
            assert supervisor.poll() is None, log.read_text()[-3000:]
            if lifted:
                (pids_cgroup / "pids.max").write_text("max")
                assert supervisor.wait(timeout=60) == 0, log.read_text()[-3000:]
            else:
                supervisor.send_signal(signal.SIGTERM)
                assert supervisor.wait(timeout=30) == 75, log.read_text()[-3000:]
        finally:
            if supervisor.poll() is None:
                supervisor.kill()
                supervisor.wait()
        text = log.read_text()
        assert "Traceback" not in text and text.count("cannot start the worker") == 1, text[-3000:]
        if not lifted:
            assert "not starting it" in text, text
    listed = run_onward("list", "--db", db, "--long")
    rows = [line.split("\t") for line in listed.stdout.decode().splitlines()]
    assert {row[-1]: (row[0], row[1]) for row in rows} == {n: ("done", "1") for n in names}


def spawner_children(pid: int) -> list[int]:
    """The spawner processes among ``pid``'s children (``python -I -S … onward/spawner.py``)."""
    found = []
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        try:
            if b"spawner.py" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(int(child))
        except FileNotFoundError:
            pass
    return found


def test_a_spawner_that_cannot_start_for_want_of_processes_is_tried_again(tmp_path: Path,
                                                                          pids_cgroup: Path) -> None:
    """Where commands go through the spawner (ONWARD_SPAWN=spawner here; the default where the clone path is
    not built), a spawner that could not be forked for want of processes was taken for a system that cannot
    run one: the worker forked its commands for the rest of its life (the path on which a worker frozen as
    it starts a command can leave it running unrecorded). The attempt is now given back and the spawner
    started at the next try, once the limit is lifted."""
    tasks = tmp_path / "tasks.txt"
    names = [f"t{i}" for i in range(20)]
    tasks.write_text("".join(n + "\n" for n in names))
    db = tmp_path / "s.db"
    log = tmp_path / "worker.log"
    (pids_cgroup / "pids.max").write_text("1")
    with log.open("wb") as out:
        worker = subprocess.Popen(in_cgroup(pids_cgroup, onward_argv("run", "--db", str(db), "--tasks", str(tasks),
                                                                      "--", "sleep", "0.1")),
                                  env=dict(os.environ, PYTHONPATH=SRC, ONWARD_SPAWN="spawner"),
                                  stdout=subprocess.DEVNULL, stderr=out)
    try:
        wait_for(lambda: "out of resources starting" in log.read_text(), 30, "the worker to meet the limit")
        (pids_cgroup / "pids.max").write_text("max")
        wait_for(lambda: spawner_children(worker.pid) or worker.poll() is not None, 10, "a spawner to start")
        assert worker.poll() is None, "the job ended before any spawner started: its commands were forked"
        assert worker.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    c = sqlite3.connect(db)
    assert dict(c.execute("SELECT name, state || ' ' || attempts FROM tasks")) == {n: "done 1" for n in names}
    c.close()


def test_onward_run_on_a_terminal_with_no_thread_left_for_its_bar_goes_on_without_it(tmp_path: Path,
                                                                                     pids_cgroup: Path) -> None:
    """On a terminal `onward run` draws its progress bar from a thread. With no process left for one (a pids
    limit of 1) it crashed before doing anything: `RuntimeError: can't start new thread`, then `cannot join
    thread before it is started`, exit 1. It now goes on without the bar, meets the shortfall when it
    starts a command (a warning, the attempt given back) and finishes once the limit is lifted."""
    import fcntl
    import pty

    tasks = tmp_path / "tasks.txt"
    tasks.write_text("a\nb\n")
    leader, follower = pty.openpty()
    fcntl.fcntl(leader, fcntl.F_SETFL, fcntl.fcntl(leader, fcntl.F_GETFL) | os.O_NONBLOCK)
    seen = bytearray()

    def read_terminal() -> str:
        try:
            while chunk := os.read(leader, 65536):
                seen.extend(chunk)
        except OSError:  # EAGAIN: nothing more now; EIO: the other side closed
            pass
        return seen.decode(errors="replace")

    (pids_cgroup / "pids.max").write_text("1")
    env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}
    worker = subprocess.Popen(in_cgroup(pids_cgroup, onward_argv("run", "--db", str(tmp_path / "s.db"), "--tasks",
                                                                  str(tasks), "--", "true")),
                              env=dict(env, PYTHONPATH=SRC, TERM="xterm"), stdout=follower, stderr=follower)
    os.close(follower)
    try:
        wait_for(lambda: "out of resources starting" in read_terminal() or worker.poll() is not None, 30,
                 "the worker to meet the limit")
        (pids_cgroup / "pids.max").write_text("max")
        code = worker.wait(timeout=60)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        text = read_terminal()
        os.close(leader)
    assert code == 0 and "Traceback" not in text, text[-3000:]
    assert "done=2" in text, text[-3000:]


ASYNC_WORKER = """
import asyncio, sys
from onward import Job, step

job = Job(sys.argv[1])

@step
async def fetch(n):
    await asyncio.sleep(0.01)
    return n * 2

@job.task(max_attempts=1)
async def work(task, ctx):
    return await fetch(len(task))

job.add([f"t{i}" for i in range(4)])
sys.exit(job.run(concurrency=1).exit_code)
"""


def test_a_durable_step_of_an_async_task_with_no_thread_left_runs_on_the_event_loop(tmp_path: Path,
                                                                                      pids_cgroup: Path) -> None:
    """`pids.max` 2: the worker's main thread and its event loop's, none left for the thread a durable step
    of an ``async def`` task records itself from (``asyncio.to_thread``). Its `RuntimeError: can't start new
    thread` failed the step, then again the recording of that failure, which stopped the worker with a
    traceback and exit 1, the task left claimed. The step is now recorded from the event loop's thread, and
    every task is done at attempt 1 with its step."""
    db = run_with_two_processes(ASYNC_WORKER, 4, tmp_path, pids_cgroup)
    steps = run_onward("steps", "--db", str(db), "t1")
    assert steps.returncode == 0 and "fetch#1" in steps.stdout.decode(), steps
