"""A store written by onward before named jobs (schema version 2) upgrades in place: its job becomes
"default" and every fact it held survives. The stores under tests/data were written by that version's own
code (tests in every state, recorded steps, journal events, an import mark, a worker): a SQLite file, and a
pg_dump of the PostgreSQL schema."""

from __future__ import annotations

from onward.proc import current_owner
from onward.store import open_store
from onward.store.base import CANCELLED, DONE, FAILED, PENDING, RUNNING, WAITING, Owner, SourceMark, Store
from onward.store.sqlbase import SCHEMA_VERSION
from tests.conftest import because, run_onward


def test_a_version_2_store_is_refused_until_upgraded_then_keeps_every_fact(v2_store: str) -> None:
    r = run_onward("status", "--db", v2_store)
    assert r.returncode == 2 and f"schema version 2, older than this onward's {SCHEMA_VERSION}; run `onward db upgrade`" in \
        r.stderr.decode(), r.stderr
    r = run_onward("db", "upgrade", "--db", v2_store)
    assert r.returncode == 0 and f"upgraded from schema version 2 to {SCHEMA_VERSION}" in r.stderr.decode(), r.stderr
    store = open_store(v2_store, create=False)
    try:
        assert store.job == "default"
        assert [j.name for j in store.jobs()] == ["default"]
        check_facts(store)
    finally:
        store.close()
    r = run_onward("db", "upgrade", "--db", v2_store)
    assert r.returncode == 0 and f"up to date (schema version {SCHEMA_VERSION})" in r.stderr.decode(), r.stderr
    assert run_onward("result", "--db", v2_store, "done-1").stdout == b'{"ok": 1}'
    # The upgraded store takes new jobs, whose task names may repeat the old job's.
    assert run_onward("add", "--db", v2_store, "--job", "next", "done-1").returncode == 0
    store = open_store(v2_store, create=False, job="next")
    try:
        assert store.counts()[PENDING] == 1 and store.task("running-1") is None
        (claim,) = store.claim(store.register_worker(_owner(), "test"), 5, 30, 3)
        assert claim.name == "done-1" and store.complete(claim.task_id, claim.fence, b"again", "bytes")
    finally:
        store.close()
    store = open_store(v2_store, create=False)
    try:
        check_facts(store)  # the old job saw none of that
        # The running task's recorded steps still credit the claim that made them (furthest step 2, fence 1),
        # and the failed task can be retried.
        (running,) = store.running_tasks()
        reclaimed = store.reclaim(running.task_id, running.fence, because("owner died"))
        assert reclaimed is not None and (reclaimed.state, reclaimed.counted) == (PENDING, False)
        assert store.retry(["failed-1"]) == 1
        assert store.counts() == {PENDING: 5, RUNNING: 0, DONE: 1, FAILED: 0, CANCELLED: 0, WAITING: 0}
        # Version 4 (durable waits) on the upgraded store: a task parks on a wait and a sent value wakes it.
        (claim,) = store.claim(store.register_worker(_owner(), "test"), 1, 30, 3)
        assert store.park(claim.task_id, claim.fence, "approval", None) == WAITING
        assert store.counts()[WAITING] == 1
        assert store.send(claim.name, "approval", "true") == "delivered"
        assert store.counts()[WAITING] == 0 and store.counts()[PENDING] == 5
    finally:
        store.close()


def check_facts(store: Store) -> None:
    tasks = {t.name: t for t in store.iter_tasks()}
    assert list(tasks) == ["done-1", "failed-1", "running-1", "retrying-1", "pending-1", "naïve ✓ name"]
    assert {n: (t.state, t.attempts) for n, t in tasks.items()} == {
        "done-1": (DONE, 1), "failed-1": (FAILED, 2), "running-1": (RUNNING, 1), "retrying-1": (PENDING, 1),
        "pending-1": (PENDING, 0), "naïve ✓ name": (PENDING, 0)}
    assert tasks["failed-1"].error == "boom for good" and tasks["retrying-1"].error == "try again"
    assert tasks["done-1"].result_kind == "json" and tasks["done-1"].finished_at is not None
    result = store.result("done-1")
    assert result is not None and (result.kind, result.data) == ("json", b'{"ok": 1}')
    assert store.counts() == {PENDING: 3, RUNNING: 1, DONE: 1, FAILED: 1, CANCELLED: 0, WAITING: 0}
    (running,) = store.running_tasks()
    assert (running.name, running.fence, running.note, running.child_pid, running.child_start) == (
        "running-1", 1, "halfway", 4242, 99)
    steps = store.steps(running.task_id)
    assert [(s.index, s.name, s.kind, s.data, s.at) for s in steps] == [
        (1, "llm", "value", b"\x00step-one", 1700000000.5), (2, "tool", "value", b"step-two", 1700000001.25)]
    assert store.get_source("/data/tasks.txt") == SourceMark("2049:1234", 120, 6, 1700000000123456789, "headd",
                                                             "taild")
    events = store.events()
    assert [e.kind for e in events] == ["added", "worker started", "done", "retrying", "failed", "retrying",
                                        "restart"]
    assert [e.task for e in events if e.task] == ["done-1", "failed-1", "failed-1", "retrying-1"]
    assert store.events(last=1)[0].detail == "worker exited with status 1"
    stats = store.stats()
    assert stats.restarts == 1 and not stats.paused
    assert [e.kind for e in stats.errors] == ["retrying", "failed", "retrying"]
    (worker,) = store.workers()
    assert worker.running_count == 1 and worker.done == 1
    totals = store.totals()
    assert (totals.completions, totals.failed_attempts, totals.final_failures, totals.restarts) == (1, 3, 1, 1)


def _owner() -> Owner:
    return current_owner()
