"""Resources over long runs: what a worker leaves behind it grows with the work, not with the time it ran."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import onward.store.sqlite
from onward import Job, step
from onward.log import QUIET
from onward.store.sqlite import JOURNAL_SIZE_LIMIT
from onward.supervise import MAX_BACKOFF, backoff_delay
from tests import pgutil
from tests.conftest import onward_argv, run_onward, wait_for

# A user's own reader (a sqlite3 shell, a script) that opens a read transaction and keeps it until told.
HOLDING_READER = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN")
db.execute("SELECT count(*) FROM tasks").fetchone()
print("holding", flush=True)
sys.stdin.read()  # until the test closes our stdin
db.execute("COMMIT")
db.close()
"""


@contextlib.contextmanager
def holding_reader(db: Path) -> Iterator[subprocess.Popen[str]]:
    """HOLDING_READER on ``db``, once it holds its snapshot; closing its stdin lets it go. Killed at the end."""
    reader = subprocess.Popen([sys.executable, "-c", HOLDING_READER, str(db)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout is not None and reader.stdin is not None
        assert reader.stdout.readline().strip() == "holding"
        yield reader
    finally:
        if reader.poll() is None:
            reader.kill()
        reader.wait()


def test_a_log_a_reader_made_grow_shrinks_back_once_the_reader_lets_go(tmp_path: Path) -> None:
    """SQLite cannot checkpoint past a reader's snapshot: while one is held the log grows with every commit
    (about 18 KB a task). Once the reader lets go, the log is checkpointed and written again from its start;
    without a size limit it kept its largest size on disk for as long as any connection to the store stayed
    open (the worker's, a dashboard's), hundreds of MB after a minute's read transaction."""
    db = tmp_path / "s.db"
    wal = Path(f"{db}-wal")
    n, release_at = 3000, 1500
    job = Job(str(db), log_level=QUIET)
    job.add(str(i) for i in range(n))
    with holding_reader(db) as reader:
        sizes: dict[int, int] = {}

        @job.task
        def noop(task: str, ctx: Any) -> str:
            i = int(task)
            sizes[i] = wal.stat().st_size
            if i == release_at:
                reader.stdin.close()  # type: ignore[union-attr]
                reader.wait(timeout=10)
            return task

        summary = job.run()
        assert summary.done == n
        grown = sizes[release_at]
        assert grown > 3 * JOURNAL_SIZE_LIMIT, f"the held snapshot should have grown the log: {grown} bytes"
        last = sizes[n - 1]
        assert last <= JOURNAL_SIZE_LIMIT, (
            f"the log stayed at {last:,} bytes after the reader let go (it grew to {grown:,}); "
            f"at most {JOURNAL_SIZE_LIMIT:,} expected")


def test_a_worker_says_so_when_a_reader_holds_its_log_back(tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """While a reader holds one snapshot, the log grows by every commit and nothing else shows it until the
    disk is full: the worker warns (once a minute while it lasts), naming the cause. (The threshold is
    lowered from 64 MiB to 16 MiB, still twice what checkpoints leave, so that a few seconds of work reach it.)"""
    monkeypatch.setattr(onward.store.sqlite, "LOG_WARN_BYTES", 16 << 20)
    db = tmp_path / "s.db"
    job = Job(str(db), log_level=QUIET, concurrency=4, heartbeat=0.1)
    n = 8_000
    job.add(str(i) for i in range(n))
    with holding_reader(db):
        @job.task
        def noop(task: str, ctx: Any) -> str:
            return task

        assert job.run().done == n
        grown = os.path.getsize(f"{db}-wal")
    assert grown > 2 * onward.store.sqlite.LOG_WARN_BYTES, f"the log should have grown further: {grown:,} bytes"
    warnings = [line for line in capfd.readouterr().err.splitlines() if "the store's log is" in line]
    assert len(warnings) == 1, warnings  # once a minute at most
    assert "another connection holds a read transaction open" in warnings[0]


# --- many retries: the doubling backoff past 1,024 doublings ------------------------------------------------
# `retry_delay * 2 ** (attempt - 1)` converted an int of 2 ** 1024 to a float at a task's 1,025th attempt (a
# step's 1,025th try, a supervisor's 1,025th fast restart in a row), which raised OverflowError.

def test_a_task_retried_past_1024_attempts_goes_on_to_its_last_attempt(store_url: str) -> None:
    """--max-attempts takes up to 1,000,000. The worker died with a traceback (exit 1) as the 1,025th attempt
    failed, leaving the task claimed; every worker after it failed that attempt the same way."""
    r = run_onward("add", "--db", store_url, "poison")
    assert r.returncode == 0, r.stderr
    r = run_onward("run", "--db", store_url, "--max-attempts", "1030", "--retry-delay", "0", "-q", "--",
                   "false", "{task}", timeout=60)
    assert b"Traceback" not in r.stderr, r.stderr.decode()[-2000:]
    assert r.returncode == 3, r.stderr.decode()[-2000:]
    listed = run_onward("list", "--db", store_url, "--json")
    row = json.loads(listed.stdout)
    assert (row["state"], row["attempts"]) == ("failed", 1030)


def test_a_step_retried_past_1024_tries_fails_with_its_own_error(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    job = Job(db, log_level=QUIET, max_attempts=1)
    tries: list[int] = []

    @job.task
    def flaky(task: str, ctx: Any) -> str:
        @step(max_attempts=1030, backoff=0.0)
        def call() -> str:
            tries.append(1)
            raise ValueError("still down")
        return call()

    job.add(["t"])
    assert job.run().failed == 1
    assert len(tries) == 1030
    row = json.loads(run_onward("list", "--db", db, "--json").stdout)
    assert row["state"] == "failed" and "still down" in row["error"], row


def test_the_restart_backoff_after_1024_fast_restarts_stays_at_its_cap() -> None:
    assert backoff_delay(0.0, 1025) == 0.0
    assert backoff_delay(0.1, 1025) == MAX_BACKOFF
    assert backoff_delay(0.1, 10**6) == MAX_BACKOFF


def test_supervise_keeps_restarting_a_worker_that_keeps_dying_fast() -> None:
    """A worker that exits 75 (the store unavailable) is restarted "for as long as it takes". Each such
    restart is fast, so the streak grew by one each time, and at the 1,025th the supervisor died of the
    OverflowError (after about 8.5 hours of an outage at the default delay), leaving no worker to resume the
    job once the store was back. Reached here in seconds by a worker that crashes (exit 1) with
    --restart-delay 0 and no crash-loop limit in reach: the same streak and the same doubling (an exit 75
    waits at least 0.1 s, doubling, see the test below)."""
    env = dict(os.environ)
    env.setdefault("PYTHONPATH", str(Path(__file__).resolve().parents[2] / "src"))
    with subprocess.Popen(onward_argv("supervise", "--restart-delay", "0", "--max-restarts", "1000000", "--",
                                      "sh", "-c", "exit 1"),
                          stderr=subprocess.PIPE, text=True, env=env) as sup:
        assert sup.stderr is not None
        restarts, tail = 0, list[str]()
        try:
            for line in sup.stderr:
                tail = [*tail[-20:], line]
                restarts += "restarting worker" in line
                if restarts >= 1030 or sup.poll() is not None:
                    break
        finally:
            sup.send_signal(signal.SIGTERM)
            rest = sup.communicate(timeout=30)[1]
        assert restarts >= 1030, "".join(tail) + rest
        assert "Traceback" not in rest


def test_supervise_backs_off_from_a_tenth_of_a_second_on_exit_75_even_with_no_restart_delay(
        tmp_path: Path) -> None:
    """--restart-delay 0 restarts a crashed worker at once; a worker that exits 75 (its store unavailable) was
    restarted at once too, some ten a second for as long as the outage lasted, a core kept busy for nothing.
    Its restarts now wait 0.1 s, then 0.2, 0.4, 0.8 s (the backoff of fast runs): five starts take 1.5 s at
    the least, however fast the machine."""
    starts = tmp_path / "starts"
    env = dict(os.environ)
    env.setdefault("PYTHONPATH", str(Path(__file__).resolve().parents[2] / "src"))
    with subprocess.Popen(onward_argv("supervise", "--restart-delay", "0", "--", "sh", "-c",
                                      'date +%s.%N >> "$0"; exit 75', str(starts)),
                          stderr=subprocess.PIPE, text=True, env=env) as sup:
        try:
            wait_for(lambda: starts.exists() and len(starts.read_text().split()) >= 5, 60, "five starts")
        finally:
            sup.send_signal(signal.SIGTERM)
            rest = sup.communicate(timeout=30)[1]
    at = [float(t) for t in starts.read_text().split()]
    assert at[4] - at[0] >= 1.5 - 0.05, (at, rest)  # (date's clock and the monotonic one may differ a hair)
    assert "backing off 0.8 s" in rest, rest


# --- the journal's time index on PostgreSQL -------------------------------------------------------------------
LAST_MINUTE = ("SELECT count(*) FILTER (WHERE kind = 'done') FROM onward.events"
               " WHERE at >= onward.epoch() - 60 AND job_id = 1")


def _blocks_read(conn: Any, query: str) -> int:
    """Heap blocks the query reads through the journal's time index (a bitmap scan forced, as the planner
    picks once the table is analyzed)."""
    with conn.transaction():
        conn.execute("SET LOCAL enable_seqscan = off")
        row = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + query).fetchone()
        assert row is not None
        plan = row[0][0]["Plan"]

    def walk(node: dict[str, Any]) -> int:
        own = node.get("Exact Heap Blocks", 0) + node.get("Lossy Heap Blocks", 0)
        return own + sum(walk(child) for child in node.get("Plans", []))
    return walk(plan)


def test_the_rate_of_the_last_minute_reads_only_the_last_minute_of_the_journal_on_postgres() -> None:
    """The rate (`onward status`, every refresh of `status --watch` and of the dashboard, each metrics
    scrape) counts the journal's last minute through a BRIN index on the events' time. PostgreSQL summarizes a
    BRIN range only at a VACUUM, and an unsummarized range matches any time: between two VACUUMs (up to a fifth
    of the table with autovacuum's defaults; for ever with autovacuum off) each refresh read every event
    written since. Measured: 200,000 events of a 100,000-task job, 110-180 ms a refresh, 1.2 ms once vacuumed.
    A worker now summarizes the new ranges itself, once a minute and at its first heartbeat."""
    import psycopg

    with pgutil.fresh_database() as url:
        job = Job(url, log_level=QUIET, heartbeat=0.1)
        job.add(["a"])
        with psycopg.connect(url, autocommit=True) as conn:
            # A long job's journal, two hours old: 200,000 events (as 100,000 tasks leave), no VACUUM since.
            conn.execute("INSERT INTO onward.events (at, kind, job_id, attempt)"
                         " SELECT onward.epoch() - 7200 + g / 100.0, CASE WHEN g % 2 = 0 THEN 'claimed'"
                         " ELSE 'done' END, 1, 1 FROM generate_series(1, 200000) AS g")
            conn.execute("ANALYZE onward.events")
            row = conn.execute("SELECT pg_relation_size('onward.events') / 8192").fetchone()
            assert row is not None
            table = row[0]
            assert _blocks_read(conn, LAST_MINUTE) >= table * 0.9  # every block, as before a VACUUM

            @job.task
            def slow(task: str, ctx: Any) -> str:
                time.sleep(0.5)  # a few heartbeats
                return task

            assert job.run().done == 1
            read = _blocks_read(conn, LAST_MINUTE)
        assert read <= 2 * 128, f"the last minute read {read} of the journal's {table} blocks"
