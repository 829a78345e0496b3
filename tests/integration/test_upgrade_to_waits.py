"""A store written by onward 3 (schema version 3: named jobs, before durable waits) upgrades in place to
version 4 (and on, to the current one). tests/data/store_v3.db was written by that version's own code: job "default" with a done task, a
running one with a recorded step, a pending one, and a job "other" with one pending task. (PostgreSQL's
migration to 4 is run by test_upgrade_to_jobs.py, whose version 2 store goes through 3 to 4.)"""

from __future__ import annotations

import shutil
from pathlib import Path

from onward.proc import current_owner
from onward.store import open_store
from onward.store.base import CANCELLED, DONE, FAILED, PENDING, RUNNING, WAITING
from onward.store.sqlbase import SCHEMA_VERSION
from tests.conftest import run_onward

DATA = Path(__file__).resolve().parents[1] / "data"


def test_a_version_3_store_upgrades_to_4_and_keeps_every_fact(tmp_path: Path) -> None:
    db = str(tmp_path / "v3.db")
    shutil.copyfile(DATA / "store_v3.db", db)
    r = run_onward("status", "--db", db)
    assert r.returncode == 2 and f"schema version 3, older than this onward's {SCHEMA_VERSION}" in r.stderr.decode(), r.stderr
    r = run_onward("send", "--db", db, "pending-1", "k", "1")
    assert r.returncode == 2 and "onward db upgrade" in r.stderr.decode(), r.stderr  # nothing stored
    r = run_onward("db", "upgrade", "--db", db)
    assert r.returncode == 0 and f"upgraded from schema version 3 to {SCHEMA_VERSION}" in r.stderr.decode(), r.stderr
    store = open_store(db, create=False)
    try:
        assert sorted(j.name for j in store.jobs()) == ["default", "other"]
        assert store.counts() == {PENDING: 1, RUNNING: 1, WAITING: 0, DONE: 1, FAILED: 0, CANCELLED: 0}
        result = store.result("done-1")
        assert result is not None and result.data == b'{"ok": 1}'
        (running,) = store.running_tasks()
        assert running.name == "running-1"
        assert [(s.index, s.name, s.data) for s in store.steps(running.task_id)] == [(1, "llm", b"step-one")]
        # Waits work on the upgraded store, in each job.
        (claim,) = store.claim(store.register_worker(current_owner(), "test"), 1, 30, 3)
        assert claim.name == "pending-1" and store.park(claim.task_id, claim.fence, "approval", None) == WAITING
        assert store.send("pending-1", "approval", '"yes"') == "delivered"
    finally:
        store.close()
    other = open_store(db, create=False, job="other")
    try:
        assert other.counts()[PENDING] == 1 and other.counts()[WAITING] == 0
        assert other.send("x", "k", "1") == "stored"
    finally:
        other.close()
    assert run_onward("send", "--db", db, "--job", "other", "x", "k", "2").returncode == 1  # not replaced
