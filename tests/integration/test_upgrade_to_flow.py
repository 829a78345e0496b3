"""Schema version 5 replaced SQLite's three hot partial indexes (pending by ready_at, running by worker,
done by finish time) with one, tasks_flow (see migrate_to_5 in sqlite.sql). A store written by onward 3
(tests/data/store_v3.db, written by that version's own code) goes through 4 to 5 with `onward db upgrade`;
then every query that used the old indexes is answered from the new one, with the same answers."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

from onward.proc import current_owner
from onward.store import open_store
from onward.store.base import DONE, PENDING, RUNNING
from onward.store.sqlbase import SCHEMA_VERSION
from onward.store.sqlite import Q
from tests.conftest import run_onward

DATA = Path(__file__).resolve().parents[1] / "data"


def indexes(db: str) -> set[str]:
    with sqlite3.connect(db) as c:
        return {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'tasks'"
                                        " AND sql IS NOT NULL")}


def test_an_old_store_upgrades_to_the_one_flow_index_and_answers_alike(tmp_path: Path) -> None:
    db = str(tmp_path / "v3.db")
    shutil.copyfile(DATA / "store_v3.db", db)
    assert {"tasks_ready", "tasks_running", "tasks_done_at"} <= indexes(db)
    r = run_onward("db", "upgrade", "--db", db)
    assert r.returncode == 0 and f"upgraded from schema version 3 to {SCHEMA_VERSION}" in r.stderr.decode(), r.stderr
    found = indexes(db)
    assert "tasks_flow" in found and not {"tasks_ready", "tasks_running", "tasks_done_at"} & found, found
    with sqlite3.connect(db) as c:
        assert c.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    store = open_store(db, create=False)
    try:
        # The running task and its worker, found through the new index as through the old one.
        (running,) = store.running_tasks()
        assert running.name == "running-1"
        (claim,) = store.claim(store.register_worker(current_owner(), "test"), 5, 30, 3)
        assert claim.name == "pending-1"  # the one pending task: nothing else is handed out
        assert sorted(t.name for t in store.task_page(RUNNING, None, 0, 10)) == ["pending-1", "running-1"]
        assert store.task_page(PENDING, None, 0, 10) == []
        done_before = store.totals().completions
        assert store.complete(claim.task_id, claim.fence, b"1", "json")
        # A completion counts in the last minute's rate and the activity chart (both read done tasks by
        # finish time from the index), and leaves the running ones.
        assert store.stats().done_last_minute == 1
        assert sum(done for _, done, _ in store.activity(60)) == done_before + 1
        assert [t.name for t in store.task_page(RUNNING, None, 0, 10)] == ["running-1"]
        assert store.counts()[DONE] == done_before + 1
    finally:
        store.close()
    r = run_onward("status", "--db", db)
    assert r.returncode == 0, r.stderr


def test_the_flow_index_serves_the_hot_queries_without_a_sort_or_scan(tmp_path: Path) -> None:
    """The claim walks the index in order (no sort of every pending task), and the other queries of these
    states search it: SQLite uses an index on expressions only when the query names them exactly."""
    db = str(tmp_path / "s.db")
    store = open_store(db)
    try:
        store.add(f"t{i}" for i in range(50))
    finally:
        store.close()
    params = {"job": 1, "now": 1.0, "lease": 1, "limit": 1, "max_attempts": 1, "worker_id": 1, "since": 0,
              "bucket": 60, "after": 0, "pattern": None, "cap": 10, "rank": 5, "child_pid": None,
              "child_start": None, "alone": False}
    with sqlite3.connect(db) as c:
        for name in ("claim", "cancelling", "running", "count_done_since", "done_at_rank", "activity_done",
                     "iter_running_tasks", "iter_pending_tasks", "live_workers"):
            plan = [r[3] for r in c.execute("EXPLAIN QUERY PLAN " + Q[name], params)]
            assert any("USING INDEX tasks_flow (job_id=? AND <expr>=?" in step for step in plan), (name, plan)
            if name in ("claim", "done_at_rank"):
                assert not any("TEMP B-TREE" in step for step in plan), plan
