"""The PostgreSQL store under faults: a server restart mid-job, a worker cut off from the database past its
lease, a late completion, lost connections, a database that is not what it should be, and passwords.

Real servers (a throwaway cluster of the test's own where the server itself is restarted), real `onward run`
processes; every wait is a condition with a deadline. Each task appends to a side-effect log, which is
how executions are counted.
"""

from __future__ import annotations

import json
import os
import random
import select
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from onward.errors import NotAStore, SchemaTooOld, StoreError
from onward.proc import current_owner, pid_start_time
from onward.store import open_store
from onward.store.base import (
    CANCELLED,
    DONE,
    FAILED,
    PENDING,
    RUNNING,
    WAITING,
    Lease,
    Reclaimed,
    StepRecord,
    Store,
)
from onward.store.postgres import SCHEMA_VERSION, PostgresStore
from tests import pgutil
from tests.conftest import because, onward_argv, result_bytes, run_onward, wait_for
from tests.reliability import record

if TYPE_CHECKING:
    import psycopg

pytestmark = pytest.mark.postgres
SRC = str(Path(__file__).resolve().parents[2] / "src")


@pytest.fixture
def pg_url() -> Iterator[str]:
    with pgutil.fresh_database() as url:
        yield url


def admin(url: str):
    import psycopg

    return psycopg.connect(url, autocommit=True)


def spawn(*args: str, log: Path, **env: str) -> subprocess.Popen[bytes]:
    """An `onward` process writing its stderr to ``log``."""
    full = dict(os.environ, PYTHONPATH=SRC, **env)
    with open(log, "wb") as err:
        return subprocess.Popen(onward_argv(*args), env=full, stdout=subprocess.DEVNULL, stderr=err)


def wait_exit(p: subprocess.Popen[bytes], timeout: float, log: Path) -> int:
    try:
        return p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        raise AssertionError(f"worker {p.pid} still running after {timeout}s; its log:\n{log.read_text()[-3000:]}") from None


def side_effects(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def done_events_by_task(url: str) -> Counter[str]:
    store = open_store(url, create=False)
    try:
        return Counter(e.task for e in store.events(limit=100_000) if e.kind == "done" and e.task)
    finally:
        store.close()


# --- a server restart in the middle of a job ----------------------------------------------------------
def test_a_run_survives_a_server_restart(tmp_path: Path, seed: int) -> None:
    """Two workers, 400 tasks; `pg_ctlcluster … restart` while tasks are running and being committed. The
    workers reconnect; every task is done, executed exactly once (the restart is far shorter than the
    lease), committed exactly once."""
    rng = random.Random(seed)
    names = [f"t{i:03d}" for i in range(400)]
    side = tmp_path / "side.log"
    restart_after = rng.randint(60, 160)
    with pgutil.private_cluster() as cluster:
        url = cluster.url(cluster.create_database("onward"))
        store = open_store(url)
        store.add(names)
        store.close()
        command = ["sh", "-c", f'echo "$ONWARD_TASK $ONWARD_ATTEMPT" >> {side}; sleep 0.1; printf %s "$ONWARD_TASK"']
        logs = [tmp_path / f"worker{i}.log" for i in range(2)]
        workers = [spawn("run", "--db", url, "--concurrency", "4", "--", *command, log=log) for log in logs]
        try:
            wait_for(lambda: len(side_effects(side)) >= restart_after, 60, f"{restart_after} executions")
            before = cluster.started_at()
            cluster.restart()
            restarted_at = time.time()
            assert cluster.started_at() > before
            codes = [wait_exit(w, 120, log) for w, log in zip(workers, logs, strict=True)]
        finally:
            for w in workers:
                if w.poll() is None:
                    w.kill()
                    w.wait()
        assert codes == [0, 0], [log.read_text()[-2000:] for log in logs]
        warnings = "".join(log.read_text() for log in logs)
        # Both workers did lose their connections (and said so), and carried on.
        assert all(any(word in log.read_text() for word in ("terminating connection", "not connected", "closed"))
                   for log in logs), warnings

        executions = Counter(name for name, _ in side_effects(side))
        committed = done_events_by_task(url)
        record("fault matrix", backend="postgres", case="server restarted (pg_ctlcluster restart) mid-job, 2 workers",
               seed=seed, tasks=len(names), exit_statuses=codes, lost=len(set(names) - set(committed)),
               doubled=sum(1 for k in committed.values() if k > 1),
               executed_twice=sum(1 for k in executions.values() if k > 1), recovered=codes == [0, 0])
        assert set(executions) == set(names)
        assert [n for n, k in executions.items() if k != 1] == [], "a task ran twice across the restart"
        assert committed == Counter(names)
        store = open_store(url, create=False)
        # The restart landed mid-job: tasks were completed after the server came back.
        assert any(e.kind == "done" and e.at > restarted_at for e in store.events(limit=100_000))
        assert store.counts() == {PENDING: 0, RUNNING: 0, DONE: 400, FAILED: 0, CANCELLED: 0, WAITING: 0}
        assert all(result_bytes(store, n) == n.encode() for n in rng.sample(names, 40))
        store.close()


# --- the server paused past a lease --------------------------------------------------------------------
PAUSE_HEARTBEAT = 0.5
PAUSE_LEASE = 3 * PAUSE_HEARTBEAT  # the runner's default: three heartbeats


def test_a_server_paused_past_the_lease_keeps_no_task_running_past_it_and_loses_or_doubles_nothing(
        tmp_path: Path, seed: int) -> None:
    """Two workers, 12 tasks of 2.5 s each; the whole server (postmaster and backends) is stopped with SIGSTOP
    for two to three leases while tasks run, then resumed. Nothing answers meanwhile (the kernel still
    acknowledges what the workers send, so only their own clocks can tell). Each worker stops the tasks
    whose lease ran out and commits nothing about them; once the server is back, the tasks are reclaimed
    and done. The workers ride it out (exit 0) or leave with one error line and exit 75; a clean run then
    finishes. Every task is committed once, by an execution that ran to its end; no two executions of a
    task overlap; none outlives the lease it held when the server stopped."""
    from tests.integration.test_multihost import executions

    rng = random.Random(seed)
    names = [f"t{i:03d}" for i in range(12)]
    side = tmp_path / "side.log"
    # start, a tick every 0.1 s for 2.5 s (longer than the lease), end: each line with the task, attempt, pid and time.
    script = (f'log() {{ echo "$1 $ONWARD_TASK $ONWARD_ATTEMPT paused-test $$ $(date +%s.%N)" >> {side}; }};'
              ' log start; i=0; while [ $i -lt 25 ]; do sleep 0.1; log tick; i=$((i+1)); done; log end;'
              ' printf "%s %s %s" "$ONWARD_TASK" "$$" "$ONWARD_ATTEMPT"')
    pause_for = rng.uniform(2 * PAUSE_LEASE, 3 * PAUSE_LEASE)
    with pgutil.private_cluster() as cluster:
        url = cluster.url(cluster.create_database("onward"))
        store = open_store(url)
        store.add(names)
        store.close()
        argv = ("run", "--db", url, "--heartbeat", str(PAUSE_HEARTBEAT), "--concurrency", "2", "--",
                "sh", "-c", script)
        logs = [tmp_path / f"worker{i}.log" for i in range(2)]
        workers = [spawn(*argv, log=log) for log in logs]
        sql = cluster.admin("onward")
        try:
            wait_for(lambda: sql.execute("SELECT count(*) FROM onward.tasks WHERE state = 'done'").fetchone()[0]
                     >= rng.randint(1, 3), 60, "the job to get going")
            wait_for(lambda: sql.execute("SELECT count(*) FROM onward.tasks WHERE state = 'running'"
                                         ).fetchone()[0] >= 2, 30, "tasks running")
            sql.close()
            print(f"pausing the server for {pause_for:.2f}s (lease {PAUSE_LEASE}s)")
            with cluster.paused() as stopped:
                paused_at = time.time()
                assert len(stopped) >= 3, stopped  # the postmaster and at least the workers' backends
                time.sleep(pause_for)  # the fault itself lasts this long: not a wait for a condition
                resumed_at = time.time()
            codes = [wait_exit(w, 120, log) for w, log in zip(workers, logs, strict=True)]
        finally:
            for w in workers:
                if w.poll() is None:
                    w.kill()
                    w.wait()
        texts = [log.read_text() for log in logs]
        print(f"exit statuses {codes}")
        for text in texts:
            print(text[-1500:])
        assert all(code in (0, 75) for code in codes), f"exit {codes}: not a status that gets the job restarted"
        for code, text in zip(codes, texts, strict=True):
            assert "Traceback" not in text
            assert "out of resources" not in text, text  # commands started after the fence all ran
            if code == 75:
                last = text.strip().splitlines()[-1]
                assert last.startswith("onward: error: "), last
        finish = run_onward(*argv, timeout=120)
        assert finish.returncode == 0, finish.stderr.decode(errors="replace")[-2000:]
        store = open_store(url, create=False)
        try:
            journal = store.events(limit=100_000)
            counts = store.counts()
            results = {n: result_bytes(store, n).decode() for n in names}
        finally:
            store.close()

    runs = executions(side)
    done = Counter(str(e.task) for e in journal if e.kind == "done")
    lost = [n for n in names if done[n] == 0]
    doubled = [n for n in names if done[n] > 1]
    # The committed result names the execution (its pid and attempt) that produced it: it ran to its end.
    not_from_an_ended_execution = [
        n for n in names if not any(r.task == n and r.ended and f"{n} {r.pid} {r.attempt}" == results[n]
                                    for r in runs)]
    # No two executions of a task overlap: the one given up leaves no line after the next one starts.
    overlaps = []
    for name in names:
        ordered = sorted((r for r in runs if r.task == name), key=lambda r: r.start)
        overlaps += [name for before, after in zip(ordered, ordered[1:]) if before.last >= after.start]  # noqa: B905
    # Fences: an execution under way when the server stopped held a lease renewed at the latest then, so it
    # had to be stopped by PAUSE_LEASE after the pause began (0.1 s: the tick granularity).
    outlived = [(r.task, round(r.last - paused_at, 2)) for r in runs
                if r.start < paused_at and not r.ended and r.last > paused_at + PAUSE_LEASE + 0.1]
    # And none reached its end while the server was away for longer than its lease: its outcome could not
    # have been committed under that lease.
    ended_unleased = [r.task for r in runs if r.ended and r.start < paused_at
                      and r.last > paused_at + PAUSE_LEASE + 0.1 and r.last < resumed_at]
    reclaims = [e for e in journal if e.kind == "reclaimed"]
    record("fault matrix", backend="postgres",
                  case=f"server paused (SIGSTOP of postmaster and backends) {pause_for:.1f}s, lease {PAUSE_LEASE}s,"
                       " 2 workers", seed=seed, tasks=len(names), exit_statuses=codes, lost=len(lost),
                  doubled=len(doubled), overlaps=len(overlaps), fence_violations=len(outlived) + len(ended_unleased),
                  reclaimed=len(reclaims), recovered=finish.returncode == 0 and not lost)
    assert not lost and not doubled, (lost, doubled)
    assert not not_from_an_ended_execution, not_from_an_ended_execution
    assert not overlaps, overlaps
    assert not outlived, f"executions ran past their lease: {outlived}"
    assert not ended_unleased, ended_unleased
    assert counts == {PENDING: 0, RUNNING: 0, DONE: len(names), FAILED: 0, CANCELLED: 0, WAITING: 0}
    # The pause did land on running tasks: some were given up and reclaimed.
    assert reclaims and all("lease expired" in (e.detail or "") for e in reclaims), reclaims


# --- a worker that cannot renew its lease --------------------------------------------------------------
def test_a_worker_that_cannot_renew_its_lease_stops_its_tasks_and_commits_nothing(pg_url: str,
                                                                               tmp_path: Path) -> None:
    """Worker A loses the database (its sessions are ended and its role may no longer connect) while it
    runs two tasks. Before its lease runs out it kills them and commits nothing; once it can connect
    again, worker B takes the tasks over, and A moves on and finishes."""
    role = f"onward_cut_{uuid.uuid4().hex[:8]}"
    dbname = pg_url.rsplit("/", 1)[1]
    side = tmp_path / "side.log"
    sql = admin(pg_url)
    store = open_store(pg_url)
    store.add(["slow-a", "slow-b"])
    # Attempt 1 would take 30 s (it must be stopped long before); the takeover's attempt is quick.
    command = ["sh", "-c", f'echo "start $ONWARD_TASK $ONWARD_ATTEMPT $$" >> {side};'
               ' if [ "$ONWARD_ATTEMPT" = 1 ]; then sleep 30; fi;'
               f' echo "end $ONWARD_TASK $ONWARD_ATTEMPT $$" >> {side}; printf "attempt %s" "$ONWARD_ATTEMPT"']
    a_log, b_log = tmp_path / "a.log", tmp_path / "b.log"
    a = b = None
    try:
        sql.execute(f'CREATE ROLE "{role}" LOGIN')
        sql.execute(f'GRANT USAGE ON SCHEMA onward TO "{role}"')
        sql.execute(f'GRANT ALL ON ALL TABLES IN SCHEMA onward TO "{role}"')
        sql.execute(f'GRANT ALL ON ALL SEQUENCES IN SCHEMA onward TO "{role}"')
        a_url = pg_url.replace(f"{pgutil.PG_USER}@", f"{role}@", 1)
        a = spawn("run", "--db", a_url, "--concurrency", "2", "--heartbeat", "0.5", "--", *command, log=a_log)
        wait_for(lambda: len(side_effects(side)) == 2, 30, "worker A to start both tasks")
        children = [int(line[3]) for line in side_effects(side)]

        # Cut A off: no new session for its role, its sessions ended. Once they are gone, the leases in
        # the store are the last A will ever have written.
        sql.execute(f'REVOKE CONNECT ON DATABASE "{dbname}" FROM PUBLIC')
        sql.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,))
        wait_for(lambda: sql.execute("SELECT count(*) FROM pg_stat_activity WHERE usename = %s",
                                     (role,)).fetchone()[0] == 0, 10, "A's sessions to end")
        lease_until = min(r[0] for r in sql.execute("SELECT lease_until FROM onward.tasks"))

        # A stops both tasks before its lease runs out (the store's clock: this machine's, here).
        def stopped_at() -> float | None:
            # pid_start_time: None once the process is a zombie or gone, read in one go (a look for
            # /proc/PID followed by a read of its stat raced with the reaping of a killed task).
            alive = [pid for pid in children if pid_start_time(pid) is not None]
            return None if alive else time.time()
        killed_at = float(wait_for(stopped_at, 10, "A to stop its tasks", interval=0.01))  # type: ignore[arg-type]
        assert killed_at < lease_until, f"tasks still ran {killed_at - lease_until:.3f}s after the lease expired"
        wait_for(lambda: "lease ran out" in a_log.read_text(), 10, "A to say why it stopped them")
        assert not [line for line in side_effects(side) if line[0] == "end"]
        # ... and committed nothing about them: they are still running, attempt 1, as far as the store knows.
        rows = sql.execute("SELECT state, attempts FROM onward.tasks ORDER BY name").fetchall()
        assert rows == [(RUNNING, 1), (RUNNING, 1)]

        # A can connect again; B (another worker) takes the expired tasks over.
        sql.execute(f'GRANT CONNECT ON DATABASE "{dbname}" TO PUBLIC')
        b = spawn("run", "--db", pg_url, "--heartbeat", "0.5", "--", *command, log=b_log)
        assert wait_exit(b, 60, b_log) == 0, b_log.read_text()
        assert wait_exit(a, 60, a_log) == 0, a_log.read_text()
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        sql.execute(f'GRANT CONNECT ON DATABASE "{dbname}" TO PUBLIC')
        sql.execute(f'DROP OWNED BY "{role}"')
        sql.execute(f'DROP ROLE IF EXISTS "{role}"')
        sql.close()
        store.close()

    store = open_store(pg_url, create=False)
    try:
        assert store.counts() == {PENDING: 0, RUNNING: 0, DONE: 2, FAILED: 0, CANCELLED: 0, WAITING: 0}
        for name in ("slow-a", "slow-b"):
            assert result_bytes(store, name) == b"attempt 2"
        # Committed once each, by the takeover's attempt (B's, or A's own once it could connect again).
        done = [e for e in store.events() if e.kind == "done"]
        assert sorted((e.task, e.attempt) for e in done) == [("slow-a", 2), ("slow-b", 2)]
        reclaims = [e for e in store.events() if e.kind == "reclaimed"]
        assert len(reclaims) == 2 and all("lease expired" in (e.detail or "") for e in reclaims)
    finally:
        store.close()
    ends = [line for line in side_effects(side) if line[0] == "end"]
    assert sorted((line[1], line[2]) for line in ends) == [("slow-a", "2"), ("slow-b", "2")]


# --- a commit whose answer is lost ---------------------------------------------------------------------
class AnswerCutter:
    """A TCP relay between the worker and the server (127.0.0.1) that, once, lets a message through and
    loses its answer: when the client's bytes contain ``marker``, they reach the server, and the next bytes
    the server sends on that connection are dropped and both ends closed. So the statement carrying the
    marker is carried out, committed (autocommit: the server answers only after the commit), and the
    client sees a lost connection: what a network cut or a server's host dying in that moment does."""

    def __init__(self, marker: bytes) -> None:
        self.marker = marker
        self.cuts = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._stopping = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stopping:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection((pgutil.PG_HOST, pgutil.PG_PORT))
            threading.Thread(target=self._relay, args=(client, server), daemon=True).start()

    def _relay(self, client: socket.socket, server: socket.socket) -> None:
        seen, cutting = b"", False
        try:
            while True:
                readable, _, _ = select.select([client, server], [], [])
                for end in readable:
                    data = end.recv(65536)
                    if not data:
                        return
                    if end is client:
                        seen = (seen + data)[-(len(self.marker) + len(data)):]
                        if self.cuts == 0 and self.marker in seen:
                            cutting = True
                        server.sendall(data)
                    elif cutting:
                        self.cuts += 1  # the answer is dropped: the commit happened, the client never hears
                        return
                    else:
                        client.sendall(data)
        except OSError:
            return
        finally:
            client.close()
            server.close()

    def close(self) -> None:
        self._stopping = True
        self._listener.close()


def test_a_completion_whose_commit_answer_was_lost_is_reported_done_once_not_fenced(
        pg_url: str, tmp_path: Path) -> None:
    """The connection is cut after the server committed a task's completion (and the next claim) but before
    the worker heard. The worker takes it for not committed and tries the completion again on a new
    connection: the task is done already, under the very fence of its attempt, so it is reported done
    (log line, --out file, tally), journaled once, and nothing says it was taken over. The task claimed in
    the lost commit runs once its lease has run out; the job finishes."""
    names = [f"t{i:02d}" for i in range(12)]
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("".join(n + "\n" for n in names))
    cutter = AnswerCutter(b"result of t05")
    url = pg_url.replace(f":{pgutil.PG_PORT}/", f":{cutter.port}/", 1) + "?sslmode=disable"
    log, out = tmp_path / "worker.log", tmp_path / "out"
    try:
        worker = spawn("run", "--db", url, "--tasks", str(tasks), "--out", str(out), "--heartbeat", "0.5",
                       "--", "echo", "result of", "{task}", log=log)
        assert wait_exit(worker, 60, log) == 0, log.read_text()[-3000:]
    finally:
        cutter.close()
    text = log.read_text()
    assert cutter.cuts == 1, text[-3000:]
    assert "store error, will retry" in text  # the worker did see the cut
    assert "fenced" not in text and "taken over" not in text, text[-3000:]
    assert text.count('done task="t05"') == 1
    assert done_events_by_task(pg_url) == Counter(names)  # journaled once each
    store = open_store(pg_url, create=False)
    try:
        assert not [e for e in store.events(limit=10_000) if e.kind == "fenced"]
        assert store.counts()[DONE] == len(names)
        assert result_bytes(store, "t05") == b"result of t05\n"
    finally:
        store.close()
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{n}.txt" for n in names)


# --- a late completion ---------------------------------------------------------------------------------
def test_a_late_completion_is_rejected(pg_url: str) -> None:
    """The first owner comes back after its task was reclaimed and claimed again elsewhere: every write it
    tries about that task is refused, before and after the new owner completes it."""
    a, b = open_store(pg_url), open_store(pg_url)
    try:
        a.add(["job"])
        wa = a.register_worker(current_owner(), "a")
        wb = b.register_worker(current_owner(), "b")
        (ca,) = a.claim(wa, 1, 0.3, 3)
        assert a.record_step(ca.task_id, ca.fence, StepRecord(1, "early", "value", b"1", time.time()))
        wait_for(lambda: b.running_tasks()[0].lease_expired, 5, "the lease to expire on the server's clock")
        # Given back uncounted (attempt 1 again): it had recorded a new step.
        assert b.reclaim(ca.task_id, ca.fence, because("lease expired")) == Reclaimed(PENDING, counted=False)
        (cb,) = b.claim(wb, 1, 30, 3)
        assert (cb.task_id, cb.attempt, cb.fence) == (ca.task_id, 1, ca.fence + 2)

        assert a.renew(wa, [Lease(ca.task_id, ca.fence)], 30, 0) == [ca.task_id]
        assert not a.complete(ca.task_id, ca.fence, b"late", "str")
        assert a.fail(ca.task_id, ca.fence, "late failure", 0) is None
        assert not a.release(ca.task_id, ca.fence, "late release")
        assert not a.record_step(ca.task_id, ca.fence, StepRecord(2, "late", "value", b"2", time.time()))
        assert not a.drop_steps(ca.task_id, ca.fence, 1)
        a.note_child(ca.task_id, ca.fence, 12345, 1)
        assert b.running_tasks()[0].child_pid is None

        assert b.complete(cb.task_id, cb.fence, b"on time", "str")
        assert not a.complete(ca.task_id, ca.fence, b"later still", "str")
        assert result_bytes(a, "job") == b"on time"
        assert a.counts() == {PENDING: 0, RUNNING: 0, DONE: 1, FAILED: 0, CANCELLED: 0, WAITING: 0}
    finally:
        a.close()
        b.close()


def connection_of(store: Store) -> psycopg.Connection[Any]:
    """The PostgreSQL store's current connection: the tests below reach into it."""
    assert isinstance(store, PostgresStore) and store._conn is not None
    return store._conn


# --- lost connections ----------------------------------------------------------------------------------
def test_a_lost_connection_fails_one_call_and_is_replaced_in_the_background(pg_url: str) -> None:
    store = open_store(pg_url)
    sql = admin(pg_url)
    try:
        store.add(["a"])
        backend = connection_of(store).info.backend_pid
        sql.execute("SELECT pg_terminate_backend(%s)", (backend,))
        wait_for(lambda: sql.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s",
                                     (backend,)).fetchone()[0] == 0, 5, "the session to end")
        with pytest.raises(StoreError) as lost:
            store.counts()
        assert "\n" not in str(lost.value) and str(lost.value).startswith(f"store {store.url}")
        started = time.monotonic()
        wait_for(lambda: _try(store.counts), 5, "a new connection")
        assert time.monotonic() - started < 2
        assert store.counts()[PENDING] == 1
    finally:
        sql.close()
        store.close()


def _try(fn: Any) -> Any:
    try:
        return fn() or True
    except StoreError:
        return False


def test_new_work_wakes_a_listening_store_even_after_its_listen_session_is_lost(pg_url: str) -> None:
    listening, adding = open_store(pg_url), open_store(pg_url)
    sql = admin(pg_url)
    try:
        fd = listening.wakeup_fd()
        assert fd is not None
        assert select.select([fd], [], [], 5)[0]  # the first connection announces itself
        listening.drain_wakeups()
        assert not select.select([fd], [], [], 0.2)[0]
        started = time.monotonic()
        adding.add(["x"])
        assert select.select([fd], [], [], 2)[0]
        assert time.monotonic() - started < 0.5
        listening.drain_wakeups()
        assert not select.select([fd], [], [], 0)[0]

        # The server ends the LISTEN session: the store makes another on the same descriptor.
        sql.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND query ILIKE 'LISTEN%%'")
        assert select.select([fd], [], [], 5)[0]  # reconnected (notifications may have been missed)
        listening.drain_wakeups()
        wait_for(lambda: sql.execute("SELECT count(*) FROM pg_stat_activity WHERE query ILIKE 'LISTEN%%'"
                                     " AND datname = current_database()").fetchone()[0] == 1, 5, "a new LISTEN")
        adding.retry(None)  # nothing to retry: no notification
        adding.add(["y"])
        assert select.select([fd], [], [], 2)[0]
    finally:
        sql.close()
        listening.close()
        adding.close()


def test_calls_cannot_hang_on_the_network_longer_than_a_fraction_of_the_lease(pg_url: str) -> None:
    store = open_store(pg_url)
    try:
        conn = connection_of(store)
        settings = dict(conn.execute("SELECT name, setting FROM pg_settings WHERE name IN ('synchronous_commit',"
                                     " 'statement_timeout', 'idle_in_transaction_session_timeout',"
                                     " 'tcp_keepalives_idle', 'tcp_user_timeout')").fetchall())
        assert settings["synchronous_commit"] == "on"
        assert int(settings["statement_timeout"]) > 0 and int(settings["idle_in_transaction_session_timeout"]) > 0

        def user_timeout() -> int:
            with socket.socket(fileno=os.dup(connection_of(store).fileno())) as s:
                return s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)
        assert 0 < user_timeout() <= 3000
        w = store.register_worker(current_owner(), "t")
        store.claim(w, 1, 1.5, 3)  # a worker with a 1.5 s lease: calls give up after 375 ms of silence
        assert user_timeout() == 375
        assert conn.execute("SHOW lock_timeout").fetchone() == ("375ms",)
        assert conn.execute("SHOW idle_in_transaction_session_timeout").fetchone() == ("750ms",)
    finally:
        store.close()


# --- counts and the journal under concurrency ---------------------------------------------------------
def test_counts_stay_exact_under_concurrent_workers_and_compaction(pg_url: str) -> None:
    setup = open_store(pg_url)
    setup.add([f"n{i}" for i in range(600)])
    w = setup.register_worker(current_owner(), "t")
    setup.close()

    def work(seed: int) -> None:
        rng = random.Random(seed)
        s = open_store(pg_url)
        try:
            while True:
                claims = s.claim(w, 5, 30, 2)
                if not claims:
                    counts = s.counts()  # (another thread may still give tasks back)
                    if counts[PENDING] == counts[RUNNING] == 0:
                        return
                    time.sleep(0.01)
                for c in claims:
                    outcome = rng.random()
                    if outcome < 0.6:
                        s.complete(c.task_id, c.fence, b"", "bytes")
                    elif outcome < 0.8:
                        s.fail(c.task_id, c.fence, "x", 0)
                    elif outcome < 0.9:
                        # A reclaim skips a row another transaction holds locked right now (a claimer's
                        # SKIP LOCKED scan may lock it in passing): the runner tries again next tick.
                        while s.reclaim(c.task_id, c.fence, because("lease expired")) is None:
                            time.sleep(0.001)
                    else:
                        s.release(c.task_id, c.fence, "stop")
                s.counts()  # compacts now and then, concurrently with the others' deltas
        finally:
            s.close()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    store = open_store(pg_url, create=False)
    sql = admin(pg_url)

    def exact() -> None:
        real = dict(sql.execute("SELECT state, count(*) FROM onward.tasks GROUP BY state").fetchall())
        assert store.counts() == {s: real.get(s, 0) for s in (PENDING, RUNNING, WAITING, DONE, FAILED, CANCELLED)}
    try:
        exact()
        assert store.counts()[DONE] + store.counts()[FAILED] == 600
        failed = [t.name for t in store.iter_tasks(FAILED)]
        assert store.retry(failed[:3]) == 3
        exact()
        assert store.retry(None) == len(failed) - 3
        exact()
        assert store.add(["n1", "new"]) == 1
        exact()
    finally:
        sql.close()
        store.close()


def test_complete_and_claim_claims_before_its_completion_can_wait_on_a_lock(pg_url: str) -> None:
    """Another worker's claim scan may lock a running task in passing (SKIP LOCKED locks the newest version
    of a row it saw pending, then finds it is not). Completing that task then waits for that worker's
    commit. The claim in the same statement must already be done by then: made after the wait, with the
    statement's older snapshot, it would lock in passing every task claimed meanwhile, and make their
    owners wait in turn (a convoy that cost a third of the throughput at 4 worker processes)."""
    store = open_store(pg_url)
    locker, prober = admin(pg_url), admin(pg_url)
    outcome: list[tuple[bool, list[Any]]] = []
    try:
        store.add(["first", "second"])
        w = store.register_worker(current_owner(), "t")
        (first,) = store.claim(w, 1, 30, 3)
        backend = connection_of(store).info.backend_pid
        locker.execute("BEGIN")
        locker.execute("SELECT 1 FROM onward.tasks WHERE id = %s FOR UPDATE", (first.task_id,))
        settle = threading.Thread(target=lambda: outcome.append(
            store.complete_and_claim(first, b"ok", "str", w, 1, 30, 3)))
        settle.start()
        wait_for(lambda: prober.execute("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s",
                                        (backend,)).fetchone() == (True,), 10, "the completion to wait on the lock")
        second = prober.execute("SELECT id FROM onward.tasks WHERE name = 'second'").fetchone()[0]
        import psycopg

        prober.execute("BEGIN")
        with pytest.raises(psycopg.errors.LockNotAvailable):  # locked already: claimed before the wait
            prober.execute("SELECT 1 FROM onward.tasks WHERE id = %s FOR UPDATE NOWAIT", (second,))
        prober.execute("ROLLBACK")
        locker.execute("ROLLBACK")
        settle.join(10)
        ((completed, claims),) = outcome
        assert completed and [c.name for c in claims] == ["second"]
    finally:
        locker.close()
        prober.close()
        store.close()


def test_following_the_journal_never_skips_an_event_of_a_transaction_still_open(pg_url: str) -> None:
    """Event ids are handed out before commit: a reader must not move past an id still uncommitted."""
    import psycopg

    store = open_store(pg_url)
    slow = psycopg.connect(pg_url, autocommit=True, application_name="onward")
    try:
        store.log_event("first", durable=True)
        after = store.events(last=1)[-1].event_id
        slow.execute("BEGIN")
        slow.execute("INSERT INTO onward.events (kind) VALUES ('slow')")
        store.log_event("fast", durable=True)  # a higher id, committed first
        seen = store.events(after_id=after)
        assert [e.kind for e in seen] == []  # not yet: "slow" may still commit below "fast"
        slow.execute("COMMIT")
        assert [e.kind for e in store.events(after_id=after)] == ["slow", "fast"]
    finally:
        slow.close()
        store.close()


# --- a database that is not what it should be ---------------------------------------------------------
def test_workers_starting_together_on_an_empty_database_create_the_store_once(pg_url: str) -> None:
    env = dict(os.environ, PYTHONPATH=SRC)
    procs = [subprocess.Popen(onward_argv("add", "--db", pg_url, f"t{i}"), env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for i in range(6)]
    results = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0] * 6, results
    store = open_store(pg_url, create=False)
    assert store.counts()[PENDING] == 6
    store.close()
    sql = admin(pg_url)
    version = sql.execute("SELECT value FROM onward.meta WHERE key = 'schema_version'").fetchall()
    assert version == [(str(SCHEMA_VERSION),)]
    sql.close()


def test_reading_commands_do_not_create_a_store(pg_url: str) -> None:
    r = run_onward("status", "--db", pg_url)
    assert r.returncode == 2 and r.stderr.decode().count("\n") == 1 and b"no onward store" in r.stderr
    sql = admin(pg_url)
    assert sql.execute("SELECT count(*) FROM pg_namespace WHERE nspname = 'onward'").fetchone()[0] == 0
    sql.close()


def test_a_foreign_onward_schema_is_refused_untouched(pg_url: str) -> None:
    sql = admin(pg_url)
    sql.execute("CREATE SCHEMA onward")
    sql.execute("CREATE TABLE onward.jobs (id int)")
    try:
        for command, *rest in (("status",), ("add", "x"), ("run", "--", "true")):
            r = run_onward(command, "--db", pg_url, *rest)
            assert r.returncode == 2 and b"not an onward store" in r.stderr, r.stderr
            assert r.stderr.decode().count("\n") == 1
        with pytest.raises(NotAStore):
            open_store(pg_url)
        assert sql.execute("SELECT count(*) FROM pg_class WHERE relnamespace = 'onward'::regnamespace"
                           ).fetchone()[0] == 1
    finally:
        sql.close()


@pytest.mark.parametrize("foreign", [
    "CREATE TYPE onward.state AS ENUM ('x')",
    "CREATE FUNCTION onward.epoch() RETURNS int LANGUAGE sql AS 'SELECT 1'",
    "CREATE TABLE onward.meta (k text, v text)",
])
def test_an_onward_schema_holding_another_programs_type_function_or_meta_is_refused_untouched(
        pg_url: str, foreign: str) -> None:
    """Only relations were counted: a schema "onward" holding another program's type was taken for empty,
    and onward built its tables beside it; one holding a function named like onward's failed with "function
    epoch already exists", and a table onward.meta of other columns with "column key does not exist"."""
    sql = admin(pg_url)
    sql.execute("CREATE SCHEMA onward")
    sql.execute(foreign)
    try:
        r = run_onward("run", "--db", pg_url, "--", "true")
        assert r.returncode == 2 and b"not an onward store" in r.stderr, r.stderr
        assert r.stderr.decode().count("\n") == 1
        assert sql.execute("SELECT count(*) FROM pg_class WHERE relnamespace = 'onward'::regnamespace"
                           ).fetchone()[0] == (1 if "TABLE" in foreign else 0)
    finally:
        sql.close()


def test_a_newer_schema_is_refused_in_one_line(pg_url: str) -> None:
    open_store(pg_url).close()
    sql = admin(pg_url)
    sql.execute("UPDATE onward.meta SET value = '99' WHERE key = 'schema_version'")
    sql.close()
    for args in (("status", "--db", pg_url), ("run", "--db", pg_url, "--", "true"), ("db", "upgrade", "--db", pg_url)):
        r = run_onward(*args)
        assert r.returncode == 2, r.stderr
        line = r.stderr.decode()
        assert line.count("\n") == 1 and f"schema version 99, newer than this onward's {SCHEMA_VERSION}" in line


def test_an_older_schema_asks_for_db_upgrade_which_brings_it_up(pg_url: str, monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    from onward.cli import entry
    from onward.store import postgres

    open_store(pg_url).close()
    # This onward pretends to be one version ahead, with a migration to it.
    ahead = postgres.SCHEMA_VERSION + 1
    monkeypatch.setattr(postgres, "SCHEMA_VERSION", ahead)
    monkeypatch.setitem(postgres.Q, f"migrate_to_{ahead}", "ALTER TABLE onward.meta ADD COLUMN note text")
    with pytest.raises(SchemaTooOld, match="run `onward db upgrade`"):
        open_store(pg_url)
    assert entry(["db", "upgrade", "--db", pg_url]) == 0
    store = open_store(pg_url)
    store.close()
    sql = admin(pg_url)
    assert sql.execute("SELECT value FROM onward.meta WHERE key = 'schema_version'").fetchone() == (str(ahead),)
    assert sql.execute("SELECT count(*) FROM information_schema.columns WHERE table_schema = 'onward'"
                       " AND table_name = 'meta' AND column_name = 'note'").fetchone() == (1,)
    sql.close()
    assert entry(["db", "upgrade", "--db", pg_url]) == 0  # already there: nothing to do


# --- secrets -------------------------------------------------------------------------------------------
def test_the_password_never_shows_in_titles_logs_status_or_errors(pg_url: str, tmp_path: Path) -> None:
    secret = f"S3cr3t-{uuid.uuid4().hex[:10]}"
    url = pg_url.replace(f"{pgutil.PG_USER}@", f"{pgutil.PG_USER}:{secret}@", 1)
    outputs: list[str] = []

    def onward(*args: str, code: int = 0) -> str:
        r = run_onward(*args)
        text = (r.stdout + r.stderr).decode()
        assert r.returncode == code, text
        outputs.append(text)
        return text

    onward("add", "--db", url, "a", "b")
    log = tmp_path / "worker.log"
    # The child gets the full URL in ONWARD_DB (an environment is not a log); it checks it and says so.
    worker = spawn("run", "--db", url, "--heartbeat", "0.5", "-v", "--", "sh", "-c",
                   'sleep 1; if [ "$ONWARD_DB" = "$EXPECTED_DB" ]; then printf env-ok; fi',
                   log=log, EXPECTED_DB=url)
    try:
        wait_for(lambda: "worker started" in log.read_text(), 30, "the worker to open the store")
        title = Path(f"/proc/{worker.pid}/cmdline").read_bytes().decode()
        ps = subprocess.run(["ps", "-o", "args=", "-p", str(worker.pid)], capture_output=True, text=True).stdout
        assert secret not in title and secret not in ps
        assert f"{pgutil.PG_USER}:{'*' * len(secret)}@" in title  # wiped in place, the rest intact
        outputs.append(onward("status", "--db", url))
        assert wait_exit(worker, 60, log) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    outputs.append(log.read_text())
    assert "store=postgresql://postgres:***@" in log.read_text()
    status = json.loads(onward("status", "--db", url, "--json").split("\n", 1)[0])
    assert status["store"].startswith("postgresql://postgres:***@") and status["done"] == 2
    onward("logs", "--db", url)
    onward("list", "--db", url, "--long")
    assert onward("result", "--db", url, "a") == "env-ok"
    onward("result", "--db", url, "nope", code=1)
    # Errors: a missing database, a refused port, a URL libpq cannot parse (its message quotes it).
    base, _, dbname = url.rpartition("/")
    # A refused port is the server being away (75, restarted later), the others configuration (2).
    for bad, code in ((f"{base}/{dbname}_missing", 2), (url.replace(f":{pgutil.PG_PORT}/", ":1/"), 75),
                      (url.replace(secret, secret + "%zz"), 2), (url + "?sslmode=bogus&password=" + secret, 2)):
        text = onward("status", "--db", bad, code=code)
        assert text.count("\n") == 1 and text.startswith("onward: error: ")
    for text in outputs:
        assert secret not in text, text


# --- a step the store could not record ------------------------------------------------------------------
STEP_WORKER = """
import sys, time
from onward import Job

job = Job(sys.argv[1])

@job.task(max_attempts=1)
def handle(task, ctx):
    for i in range(8):
        ctx.step(f"s{i}", lambda: time.sleep(0.25) or i)
    return "ok"

job.add(["a"])
sys.exit(job.run(concurrency=int(sys.argv[2])).exit_code)
"""


@pytest.mark.parametrize("concurrency", [1, 4])  # the step committed on the task's thread, or by the loop
def test_a_step_the_store_cannot_record_for_a_while_does_not_fail_the_task(pg_url: str, tmp_path: Path,
                                                                           concurrency: int) -> None:
    """A lock on onward.steps held past the lock timeout (as a server restarting, or any store fault, would
    do) makes the record of a Python task's step fail. That failure was raised into the task and counted
    as the task's failed attempt: with max_attempts=1 the task ended `failed` (exit 3) for a fault of the
    store. The attempt is now given back uncounted, and the task goes on from its recorded steps."""
    script = tmp_path / "worker.py"
    script.write_text(STEP_WORKER)
    log = tmp_path / "worker.log"
    with open(log, "wb") as err:
        worker = subprocess.Popen([sys.executable, str(script), pg_url, str(concurrency)],
                                  env=dict(os.environ, PYTHONPATH=SRC), stdout=subprocess.DEVNULL, stderr=err)
    try:
        with admin(pg_url) as conn:
            def a_step_recorded() -> bool:
                if conn.execute("SELECT to_regclass('onward.steps')").fetchone() == (None,):
                    return False  # no store yet
                return conn.execute("SELECT 1 FROM onward.steps LIMIT 1").fetchone() is not None

            wait_for(a_step_recorded, 30, "the first step recorded")
            with conn.transaction():
                conn.execute("LOCK TABLE onward.steps IN ACCESS EXCLUSIVE MODE")
                wait_for(lambda: "lock timeout" in log.read_text(), 30, "a step's record to fail on the lock")
        code = wait_exit(worker, 60, log)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    text = log.read_text()
    assert code == 0, text
    assert "released task=\"a\": the store could not record a step" in text, text
    assert "Traceback" not in text and "attempt failed" not in text, text
    store = open_store(pg_url, create=False)
    try:
        assert store.counts()[DONE] == 1
        assert result_bytes(store, "a") == b"ok"
        assert [e.attempt for e in store.events(task="a") if e.kind == "done"] == [1]  # never counted
    finally:
        store.close()


PAYING_STEP_WORKER = """
import sys
from onward import Job

job = Job(sys.argv[1], heartbeat=0.2)  # a lock timeout of 0.15 s: a step's record fails fast on the lock

def model_call(n):
    with open(sys.argv[2], "a") as f:  # what the task paid for
        f.write(f"s{n}\\n")
    return n

@job.task(max_attempts=1)
def handle(task, ctx):
    for i in range(3):
        ctx.step(f"s{i}", lambda: model_call(i))
    return "ok"

job.add(["a"])
sys.exit(job.run().exit_code)
"""


def test_a_step_the_store_keeps_failing_to_record_is_not_paid_again_at_every_lock_timeout(
        pg_url: str, tmp_path: Path) -> None:
    """While the store fails to record a step (a lock held on onward.steps), each attempt of the task runs
    the step again and is given back uncounted. The worker claimed the task again at once: the step's work
    (a model call, paid for) was done again at every lock timeout, 10 times in 4 s here, with no bound. It
    now claims nothing for --retry-delay doubling after each such attempt: 1, 2, 4 s."""
    script = tmp_path / "worker.py"
    script.write_text(PAYING_STEP_WORKER)
    paid = tmp_path / "paid.log"
    paid.touch()
    log = tmp_path / "worker.log"
    worker = None
    try:
        with admin(pg_url) as conn:
            # The store made and the lock taken before the worker starts: its first step cannot be recorded.
            open_store(pg_url).close()
            with conn.transaction():
                # Reads pass (each attempt loads the steps, then runs the first), writes wait: its record fails.
                conn.execute("LOCK TABLE onward.steps IN SHARE MODE")
                with open(log, "wb") as err:
                    worker = subprocess.Popen([sys.executable, str(script), pg_url, str(paid)],
                                              env=dict(os.environ, PYTHONPATH=SRC), stdout=subprocess.DEVNULL,
                                              stderr=err)
                wait_for(lambda: "lock timeout" in log.read_text(), 30, "a step's record to fail on the lock")
                time.sleep(4)  # the fault lasting: what the worker does meanwhile is what is measured
                paid_under_the_lock = paid.read_text().split().count("s0")
        code = wait_exit(worker, 60, log)
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
            worker.wait()
    text = log.read_text()
    assert code == 0 and "Traceback" not in text, text
    # 1 + the tries after 1 s and 3 s (and one more, by a slow start); before, one every lock timeout.
    assert paid_under_the_lock <= 4, f"s0 paid {paid_under_the_lock} times in 4 s of the fault\n{text}"
    assert paid.read_text().split()[-3:] == ["s0", "s1", "s2"]  # and the task went on once it could
    assert "claiming nothing for 1 s: the store failed a step call" in text, text


def test_a_server_idle_session_timeout_does_not_end_onwards_connections(pg_url: str, tmp_path: Path) -> None:
    """A server (or database) with idle_session_timeout ends every session left idle that long: onward's
    connection between two heartbeats, while a task runs. Each commit after such a pause then failed
    ('terminating connection due to idle-session timeout'), a store error backed off and retried, once per
    task. onward's sessions now turn that timeout off (keepalives already end a session whose client is
    gone)."""
    with pgutil.admin_connection() as conn:
        conn.execute(f'ALTER DATABASE "{pg_url.rsplit("/", 1)[1]}" SET idle_session_timeout = \'300ms\'')
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("a\nb\n")
    done = run_onward("run", "--db", pg_url, "--tasks", str(tasks), "--", "sleep", "1")
    err = done.stderr.decode()
    assert done.returncode == 0, err
    assert "idle-session timeout" not in err and "store error" not in err, err
    store = open_store(pg_url, create=False)
    assert store.counts()[DONE] == 2
    store.close()
