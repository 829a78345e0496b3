"""Durable waits against what happens at the same moment: a value sent while its task is being parked, or
while its timed-out wait is being recorded. The moment is held open for real: the test takes the task's row
lock in PostgreSQL (as a slow ``send``, a cancel or another worker's statement would), so the worker's park or
record stops there, then sends, then lets go. A value accepted (exit 0) must be delivered, or still be kept for
the task's next wait on that key: never lost, and the task never left waiting for it for ever."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from onward.store import open_store
from tests import pgutil
from tests.conftest import onward_argv, run_onward, task_result, wait_for

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
            # The task ends only once the test's send has returned (the file "sent"). A send queued on the
            # task's row lock behind the wait's record is woken when that commits, but the task's completion
            # a moment later joins no queue (PostgreSQL queues only those that found the row locked): it
            # passed a send whose process was slow to run (CI, twice; SIGSTOP of the send's server process
            # for 0.1 s shows it), which then found the task done.
            deadline = time.monotonic() + 60
            while not os.path.exists(os.path.join(side, "sent")) and time.monotonic() < deadline:
                time.sleep(0.02)
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


COMMAND_APP = "onward-test-command"  # application_name of the command run while the lock is held


def lock_waiters(admin: Any, db: str, app: str | None = None) -> int:
    """How many sessions of database ``db`` wait for a lock now (those of application_name ``app``, if
    given)."""
    row = admin.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND wait_event_type = 'Lock'"
                        " AND (%s::text IS NULL OR application_name = %s::text)", (db, app, app)).fetchone()
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
        # The command's sessions are told from the worker's by their application_name. Counting the waiting
        # sessions that connected after the command began was not enough: once, under load, such a count was
        # met before the command's session came (the worker's statements give up on the lock after 3 s and
        # it tries again, releases, reclaims), the lock was let go, and the command found the task done.
        tagged = f"{url}?application_name={COMMAND_APP}"
        send = subprocess.Popen(onward_argv(*(tagged if part == url else part for part in command)),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env={**os.environ, "PYTHONPATH": SRC})
        # The command either completes meanwhile, or queues behind the lock too.
        wait_for(lambda: send.poll() is not None or lock_waiters(admin, db, app=COMMAND_APP) >= 1,
                 30, "the command to be made")
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
    wait_for(lambda: task_result(pg_url, "t") is not None, 30,
             f"t to receive the value it was sent ({run_onward('status', '--db', pg_url).stdout.decode()})")
    assert task_result(pg_url, "t") == {"got": "yes"}


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
    (side / "sent").touch()
    assert sent.returncode == 0, sent.stderr
    wait_for(lambda: task_result(pg_url, "t") is not None, 30, "t to finish")
    got = task_result(pg_url, "t")
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


# --- many rounds at random ------------------------------------------------------------------------------
# Each task "r<round>-<i>-<timeout ms>" notes its run and waits once for "k" (0 ms: no timeout); values come
# from several sender processes at random moments, and a canceller cancels some tasks meanwhile.
RACE_WORKER = textwrap.dedent('''
    import os, sys
    from onward import Job
    from onward.errors import WaitTimeout
    url, side = sys.argv[1], sys.argv[2]
    job = Job(url, heartbeat=0.3, concurrency=2)

    @job.task
    def handle(task, ctx):
        ctx.step("before", lambda: open(os.path.join(side, task), "a").write("x"))
        timeout = int(task.rsplit("-", 1)[1]) / 1000 or None
        try:
            return {"got": ctx.wait("k", timeout=timeout)}
        except WaitTimeout:
            return "timed out"

    sys.exit(job.run().exit_code)
''')
# argv: url, seed, what ("send <id>" or "cancel"), then task names. Prints one line per call: task, value, outcome.
RACE_SENDER = textwrap.dedent('''
    import json, random, sys, time
    from onward import Job
    from onward.errors import OnwardError
    url, seed, what, names = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
    rng = random.Random(seed)
    rng.shuffle(names)
    with Job(url) as job:
        for name in names:
            time.sleep(rng.random() * 0.03)
            if what == "cancel":
                if rng.random() < 0.2:
                    print(name, "-", json.dumps(job.cancel([name])[name]), flush=True)
                continue
            value = f"{what}/{name}"
            try:
                outcome = job.send(name, "k", value)
            except OnwardError as e:
                outcome = "refused: " + str(e)
            print(name, value, json.dumps(outcome), flush=True)
''')


def race_round(url: str, tmp_path: Path, rng: random.Random, n: int, senders: int) -> list[str]:
    """One round: n tasks, two workers, ``senders`` sender processes and a canceller at once, then a last
    value to every task left. The breaches of the rules found (empty: none)."""
    from onward.store.states import FINAL_STATES

    side = tmp_path / "side"
    side.mkdir(exist_ok=True)
    round_id = rng.randrange(1 << 30)
    names = [f"r{round_id}-{i}-{rng.choice([0, 50, 200, 400, 800])}" for i in range(n)]
    assert run_onward("add", "--db", url, *names).returncode == 0
    env = {**os.environ, "PYTHONPATH": SRC}
    workers = [subprocess.Popen([sys.executable, str(tmp_path / "worker.py"), url, str(side)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(2)]
    try:
        time.sleep(rng.random() * 0.5)
        callers = [subprocess.Popen([sys.executable, str(tmp_path / "sender.py"), url, str(rng.randrange(1 << 30)),
                                     what, *names], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                   for what in [*(f"s{k}" for k in range(senders)), "cancel"]]
        lines = []
        for caller in callers:
            out, err = caller.communicate(timeout=120)
            assert caller.returncode == 0, err.decode()
            lines += out.decode().splitlines()
        store = open_store(url, create=False)
        try:
            def settled() -> bool:
                rows = [store.task(name) for name in names]
                return all(r is not None and r.state in FINAL_STATES for r in rows)

            # Waits without a timeout end with the last value (or were cancelled); the others by 0.8 s.
            r = subprocess.run([sys.executable, str(tmp_path / "sender.py"), url, "0", "last", *names],
                               env=env, capture_output=True, timeout=60)
            lines += r.stdout.decode().splitlines()
            wait_for(settled, 60, "every task to end")
            return check_round(store, names, lines, side)
        finally:
            store.close()
    finally:
        for w in workers:
            w.kill()
            w.wait(timeout=30)


def check_round(store: Any, names: list[str], lines: list[str], side: Path) -> list[str]:
    breaches = []
    accepted: dict[str, list[str]] = {name: [] for name in names}
    for line in lines:
        name, value, outcome = line.split(" ", 2)
        if json.loads(outcome) in ("delivered", "stored"):
            accepted[name].append(value)
    for name in names:
        row = store.task(name)
        task_id = store.task_id(name)
        kept = store.mail(task_id, "k")[0]
        kept = None if kept is None else json.loads(kept)
        got = None
        if row.state == "done":
            stored = store.result(name)
            if stored.data != b"timed out":  # a str result is kept as it is
                got = json.loads(stored.data)["got"]
            if got is not None and got not in accepted[name]:
                breaches.append(f"{name}: received {got!r}, which no send was told was accepted")
        for value in accepted[name]:
            if value != got and value != kept:
                breaches.append(f"{name} ({row.state}, got {got!r}, kept {kept!r}): {value!r} was accepted, then lost")
        if row.attempts > 1:
            breaches.append(f"{name}: {row.attempts} attempts counted (waiting used some up)")
        runs = (side / name).read_text() if (side / name).exists() else ""
        if len(runs) > 1:
            breaches.append(f"{name}: its step ran {len(runs)} times")
    return breaches


@pytest.mark.torture
@pytest.mark.timeout(1800)
def test_sends_cancels_and_timeouts_at_once_lose_nothing(store_url: str, tmp_path: Path, seed: int) -> None:
    """Rounds of tasks that wait once each, with values from several processes at once, cancels and
    timeouts falling at the same moments: every value accepted (exit 0) is received or still kept for the
    task's next wait; no task stays waiting; waiting uses up no attempt; no step runs twice."""
    import random

    rng = random.Random(seed)
    (tmp_path / "worker.py").write_text(RACE_WORKER)
    (tmp_path / "sender.py").write_text(RACE_SENDER)
    rounds = int(os.environ.get("ONWARD_WAIT_RACE_ROUNDS", "20"))
    breaches: list[str] = []
    for _ in range(rounds):
        breaches += race_round(store_url, tmp_path, rng, n=24, senders=3)
    assert not breaches, f"seed {seed}: " + "\n".join(breaches[:30])
