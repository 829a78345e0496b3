"""Durable waits against what happens at the same moment: a value sent while its task is being parked, or
while its timed-out wait is being recorded. The moment is held open for real: the test takes the task's row
lock in PostgreSQL (as a slow ``send``, a cancel or another worker's statement would), so the worker's park or
record stops there, then sends, then lets go. A value accepted (exit 0) must be delivered, or still be kept for
the task's next wait on that key: never lost, and the task never left waiting for it for ever."""

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
from tests import pgutil
from tests.conftest import onward_argv, run_onward, wait_for

SRC = str(Path(__file__).resolve().parents[2] / "src")

# Each run of task "t" notes itself, then (on the run named by the file "hold-at", 1 by default) writes "ready"
# and stays until the file "go" exists; then it waits for "k" (timeout in seconds from the file "timeout", if
# there) and returns what it got.
WORKER = textwrap.dedent('''
    import os, sys, time
    from onward import Job
    from onward.errors import WaitTimeout
    url, side = sys.argv[1], sys.argv[2]
    job = Job(url, heartbeat=10)  # no lease renewal (a write to the held row) in the window

    def read(name, default=None):
        path = os.path.join(side, name)
        return open(path).read().strip() if os.path.exists(path) else default

    @job.task
    def handle(task, ctx):
        with open(os.path.join(side, "runs"), "a") as f:
            f.write("x")
        if len(read("runs")) == int(read("hold-at", "1")):
            open(os.path.join(side, "ready"), "w").close()
            while not os.path.exists(os.path.join(side, "go")):
                time.sleep(0.02)
        timeout = read("timeout")
        try:
            return {"got": ctx.wait("k", timeout=float(timeout) if timeout else None)}
        except WaitTimeout:
            return "timed out"

    sys.exit(job.run().exit_code)
''')


@pytest.fixture
def pg_url() -> Iterator[str]:
    with pgutil.fresh_database() as url:
        yield url


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[Callable[[str, Path], subprocess.Popen[bytes]]]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    started: list[subprocess.Popen[bytes]] = []

    def start(url: str, side: Path) -> subprocess.Popen[bytes]:
        with open(tmp_path / "worker.log", "ab") as log:
            started.append(subprocess.Popen([sys.executable, str(script), url, str(side)], stderr=log,
                                            stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": SRC}))
        return started[-1]

    yield start
    for proc in started:
        proc.kill()
        proc.wait(timeout=30)


def result(url: str, task: str) -> Any:
    r = run_onward("result", "--db", url, task)
    if r.returncode != 0:
        return None
    try:
        return json.loads(r.stdout)
    except ValueError:
        return r.stdout.decode()  # a str result is printed as it is


def lock_waiters(admin: Any, db: str) -> int:
    """How many sessions of database ``db`` wait for a lock now."""
    row = admin.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND wait_event_type = 'Lock'",
                        (db,)).fetchone()
    return int(row[0])


def send_while_held(url: str, side: Path, value: str) -> subprocess.CompletedProcess[bytes]:
    """Hold task t's row lock; let t go on to its wait, which stops at that lock (parking, or recording its
    timeout); send ``value`` meanwhile; let go. The send's outcome."""
    return run_while_held(url, side, "send", "--db", url, "t", "k", value)


def run_while_held(url: str, side: Path, *command: str) -> subprocess.CompletedProcess[bytes]:
    """Hold task t's row lock; let t go on to its wait, which stops at that lock; run the onward ``command``
    meanwhile; let go. The command's outcome."""
    import psycopg

    db = url.rsplit("/", 1)[1]
    admin = pgutil.admin_connection()
    holder = psycopg.connect(url)
    try:
        holder.execute("SELECT 1 FROM onward.tasks WHERE name = 't' FOR UPDATE")
        (side / "go").touch()
        wait_for(lambda: lock_waiters(admin, db) >= 1, 30, "the worker to reach the held lock")
        send = subprocess.Popen(onward_argv(*command), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": SRC})
        # The send either completes meanwhile, or queues behind the lock too.
        wait_for(lambda: send.poll() is not None or lock_waiters(admin, db) >= 2, 30, "the send to be made")
        holder.rollback()
        out, err = send.communicate(timeout=60)
        return subprocess.CompletedProcess(send.args, send.returncode, out, err)
    finally:
        holder.close()
        admin.close()


def test_a_value_sent_while_its_task_is_being_parked_wakes_it(pg_url: str, tmp_path: Path, worker: Any) -> None:
    """The park's statement read the mailbox before the send committed, and updated the task after: the
    task was parked 'waiting' for a value already in its mailbox, for ever."""
    side = tmp_path / "side"
    side.mkdir()
    assert run_onward("add", "--db", pg_url, "t").returncode == 0
    worker(pg_url, side)
    wait_for(lambda: (side / "ready").exists(), 60, "t to run")
    sent = send_while_held(pg_url, side, '"yes"')
    assert sent.returncode == 0, sent.stderr
    wait_for(lambda: result(pg_url, "t") is not None, 30,
             f"t to receive the value it was sent ({run_onward('status', '--db', pg_url).stdout.decode()})")
    assert result(pg_url, "t") == {"got": "yes"}


def test_a_value_sent_while_a_timeout_is_recorded_is_not_dropped(pg_url: str, tmp_path: Path, worker: Any) -> None:
    """The timed-out wait looked in the mailbox (empty), then a send committed, then the wait's record took
    the mailbox's row away with it: the sender was told exit 0 and the value was gone. Now either the wait
    gets the value, or it timed out first and the value is kept for the task's next wait on that key."""
    side = tmp_path / "side"
    side.mkdir()
    (side / "timeout").write_text("0.3")
    (side / "hold-at").write_text("2")  # the run after the deadline passed, which records the timeout
    assert run_onward("add", "--db", pg_url, "t").returncode == 0
    worker(pg_url, side)
    wait_for(lambda: (side / "ready").exists(), 60, "t to run again once its wait's deadline passed")
    sent = send_while_held(pg_url, side, '"late"')
    assert sent.returncode == 0, sent.stderr
    wait_for(lambda: result(pg_url, "t") is not None, 30, "t to finish")
    got = result(pg_url, "t")
    if got == "timed out":
        store = open_store(pg_url, create=False)
        try:
            task_id = store.task_id("t")
            assert task_id is not None
            assert store.mail(task_id, "k")[0] == '"late"', "a value accepted with exit 0 was dropped"
        finally:
            store.close()
    else:
        assert got == {"got": "late"}


def test_a_cancel_while_its_task_is_being_parked_cancels_it(pg_url: str, tmp_path: Path, worker: Any) -> None:
    """cancel tried 'pending', then 'waiting', then 'running', each in a statement of its own: a task parked
    between the last two was missed by both, and cancel said it was already waiting, and left it waiting."""
    side = tmp_path / "side"
    side.mkdir()
    assert run_onward("add", "--db", pg_url, "t").returncode == 0
    worker(pg_url, side)
    wait_for(lambda: (side / "ready").exists(), 60, "t to run")
    cancelled = run_while_held(pg_url, side, "cancel", "--db", pg_url, "t")
    assert cancelled.returncode == 0, cancelled.stderr
    store = open_store(pg_url, create=False)
    try:
        wait_for(lambda: (row := store.task("t")) is not None and row.state == "cancelled", 30,
                 "t to be cancelled")
    finally:
        store.close()
