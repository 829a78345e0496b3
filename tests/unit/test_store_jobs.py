"""Named jobs, pause, cancel and the dashboard's reads (task pages, activity, totals), checked the same way on
every backend (the ``store_url`` fixture)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from onward.errors import StoreMissing, UsageError
from onward.store import open_store
from onward.store.base import (
    CANCELLED,
    DONE,
    FAILED,
    PENDING,
    RUNNING,
    STATES,
    WAITING,
    JobRow,
    Store,
    Totals,
)
from tests.conftest import because, worker


def test_a_new_store_has_the_default_job(store: Store) -> None:
    assert store.job == "default"
    assert store.jobs() == [JobRow(name="default", counts=dict.fromkeys(STATES, 0), paused=False)]


def test_jobs_in_one_store_are_independent(store_url: str) -> None:
    a = open_store(store_url, job="alpha")
    b = open_store(store_url, job="beta")
    try:
        assert a.add(["same", "only-a"]) == 2
        assert b.add(["same"]) == 1  # a task name is unique within its job only
        (ca,) = a.claim(worker(a), 1, 30, 3)
        assert ca.name == "same"
        assert a.complete(ca.task_id, ca.fence, b"from alpha", "bytes")
        (cb,) = b.claim(worker(b), 5, 30, 3)
        assert cb.name == "same" and cb.task_id != ca.task_id
        assert b.complete(cb.task_id, cb.fence, b"from beta", "bytes")
        assert a.result("same").data == b"from alpha"  # type: ignore[union-attr]
        assert b.result("same").data == b"from beta"  # type: ignore[union-attr]
        assert a.counts()[DONE] == 1 and a.counts()[PENDING] == 1
        assert b.counts() == {PENDING: 0, RUNNING: 0, DONE: 1, FAILED: 0, CANCELLED: 0, WAITING: 0}
        assert [t.name for t in b.iter_tasks()] == ["same"]
        assert b.task("only-a") is None
        assert a.set_paused(True)
        assert a.paused() and not b.paused()
        assert [e.kind for e in b.events()].count("paused") == 0
        assert [e.kind for e in a.events()].count("paused") == 1
        jobs = {j.name: j for j in a.jobs()}
        assert set(jobs) == {"alpha", "beta"}  # no job "default": nothing made it
        assert jobs["alpha"].paused and not jobs["beta"].paused
        assert jobs["alpha"].counts[DONE] == 1 and jobs["alpha"].counts[PENDING] == 1
        assert jobs["beta"].counts[DONE] == 1 and jobs["beta"].counts[PENDING] == 0
        assert len(a.workers()) == 1 and len(b.workers()) == 1
        assert a.workers()[0].worker_id != b.workers()[0].worker_id
    finally:
        a.close()
        b.close()


def test_reading_a_job_that_does_not_exist_creates_nothing(store_url: str) -> None:
    open_store(store_url).close()
    with pytest.raises(StoreMissing, match="no job 'nope'"):
        open_store(store_url, create=False, job="nope")
    s = open_store(store_url)
    try:
        assert [j.name for j in s.jobs()] == ["default"]
    finally:
        s.close()


@pytest.mark.parametrize("name", ["", "../x", "a/b", "x" * 200, "bad\udcff", "50%", "<script>", "-x", "a b",
                                  "line\nbreak"])
def test_bad_job_names_are_refused_before_anything_is_touched(tmp_path: Path, name: str) -> None:
    path = tmp_path / "store.db"
    with pytest.raises(UsageError, match="bad job name") as e:
        open_store(str(path), job=name)
    assert "\n" not in str(e.value)
    assert not path.exists()


def test_a_job_name_from_the_environment(store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONWARD_JOB", "from-env")
    s = open_store(store_url)
    try:
        assert s.job == "from-env"
        assert "from-env" in [j.name for j in s.jobs()]
    finally:
        s.close()


def test_a_paused_job_claims_nothing_until_resumed(store: Store) -> None:
    store.add(["a", "b"])
    w = worker(store)
    (held,) = store.claim(w, 1, 30, 3)
    assert store.set_paused(True)
    assert not store.set_paused(True)  # no change
    assert store.paused() and store.stats().paused
    assert store.claim(w, 5, 30, 3) == []
    assert store.complete(held.task_id, held.fence, b"ok", "bytes")  # what is held is still committed
    assert store.set_paused(False)
    assert not store.paused()
    assert [c.name for c in store.claim(w, 5, 30, 3)] == ["b"]
    assert [e.kind for e in store.events() if e.kind in ("paused", "resumed")] == ["paused", "resumed"]


def test_cancel_pending_running_finished_and_unknown(store: Store) -> None:
    store.add(["pending", "running", "done", "failed", "twice"])
    w = worker(store)
    claims = {c.name: c for c in store.claim(w, 4, 30, 1)}
    assert set(claims) == {"pending", "running", "done", "failed"}
    for name in ("pending",):
        store.release(claims[name].task_id, claims[name].fence, "test")
    store.complete(claims["done"].task_id, claims["done"].fence, b"r", "bytes")
    store.fail(claims["failed"].task_id, claims["failed"].fence, "boom", 0)
    assert store.cancel(["twice"]) == {"twice": CANCELLED}
    outcome = store.cancel(["pending", "running", "done", "failed", "twice", "nobody", "pending"])
    assert outcome == {"pending": CANCELLED, "running": "cancelling", "done": "already done",
                       "failed": "already failed", "twice": "already cancelled", "nobody": "unknown"}
    assert store.task("pending").state == CANCELLED  # type: ignore[union-attr]
    assert store.task("running").state == RUNNING  # type: ignore[union-attr]
    assert store.counts() == {PENDING: 0, RUNNING: 1, DONE: 1, FAILED: 1, CANCELLED: 2, WAITING: 0}
    run = claims["running"]
    assert store.cancelling(w) == [run.task_id]
    # The worker stops the attempt; its failure ends the task cancelled, not retried (attempts were left).
    assert store.fail(run.task_id, run.fence, "cancelled by request", 5) == CANCELLED
    assert store.cancelling(w) == []
    assert store.counts() == {PENDING: 0, RUNNING: 0, DONE: 1, FAILED: 1, CANCELLED: 3, WAITING: 0}
    assert store.claim(w, 5, 30, 3) == []  # cancelled is final
    kinds = [e.kind for e in store.events()]
    assert kinds.count("cancelled") == 2 and kinds.count("cancel requested") == 1


def test_a_cancel_requested_task_ends_cancelled_however_its_attempt_ends(store: Store) -> None:
    store.add(["released", "reclaimed", "completed"])
    w = worker(store)
    claims = {c.name: c for c in store.claim(w, 3, 30, 3)}
    store.cancel(list(claims))
    c = claims["released"]
    assert store.release(c.task_id, c.fence, "worker stopping") == CANCELLED
    c = claims["reclaimed"]
    reclaimed = store.reclaim(c.task_id, c.fence, because("owner died"))
    assert reclaimed is not None and reclaimed.state == CANCELLED
    c = claims["completed"]
    assert store.complete(c.task_id, c.fence, b"finished first", "bytes")  # its work is there: done wins
    assert {t.name: t.state for t in store.iter_tasks()} == {
        "released": CANCELLED, "reclaimed": CANCELLED, "completed": DONE}
    assert store.counts() == {PENDING: 0, RUNNING: 0, DONE: 1, FAILED: 0, CANCELLED: 2, WAITING: 0}


def test_retry_brings_cancelled_tasks_back_when_named(store: Store) -> None:
    store.add(["a", "b", "f"])
    w = worker(store)
    store.cancel(["a", "b"])
    (c,) = store.claim(w, 1, 30, 1)
    store.fail(c.task_id, c.fence, "boom", 0)
    assert store.retry(None) == 1  # every failed task; cancelled ones stay
    assert store.task("a").state == CANCELLED  # type: ignore[union-attr]
    assert store.retry(["a"]) == 1
    assert store.task("a").state == PENDING and store.task("a").attempts == 0  # type: ignore[union-attr]
    assert store.counts() == {PENDING: 2, RUNNING: 0, DONE: 0, FAILED: 0, CANCELLED: 1, WAITING: 0}
    assert [x.name for x in store.claim(w, 5, 30, 3)] == ["a", "f"]


def test_task_rows_carry_their_ids(store: Store) -> None:
    store.add(["a", "b"])
    ids = [t.task_id for t in store.iter_tasks()]
    assert ids == sorted(ids) and len(set(ids)) == 2 and 0 not in ids
    assert store.task("b").task_id == ids[1] == store.task_id("b")  # type: ignore[union-attr]


def test_task_page_pages_by_id_filters_and_searches_literally(store: Store) -> None:
    names = [f"task-{i:03d}" for i in range(30)] + ["100%_done", "100x_done", "Mixed CASE", "back\\slash"]
    store.add(names)
    page = store.task_page(None, None, 0, 10)
    assert [t.name for t in page] == names[:10]
    page2 = store.task_page(None, None, page[-1].task_id, 10)
    assert [t.name for t in page2] == names[10:20]
    assert store.task_page(None, None, store.task_id(names[-1]) or 0, 10) == []
    assert [t.name for t in store.task_page(None, "%_", 0, 10)] == ["100%_done"]  # % and _ are literal
    assert [t.name for t in store.task_page(None, "0x_", 0, 10)] == ["100x_done"]
    assert [t.name for t in store.task_page(None, "mixed case", 0, 10)] == ["Mixed CASE"]
    assert [t.name for t in store.task_page(None, "k\\s", 0, 10)] == ["back\\slash"]
    assert [t.name for t in store.task_page(None, "task-01", 0, 100)] == [f"task-01{i}" for i in range(10)]
    w = worker(store)
    claims = store.claim(w, 3, 30, 1)
    store.fail(claims[0].task_id, claims[0].fence, "boom", 0)
    store.cancel(["task-005", "task-006"])
    assert [t.name for t in store.task_page(RUNNING, None, 0, 10)] == ["task-001", "task-002"]
    assert [t.name for t in store.task_page(RUNNING, "002", 0, 10)] == ["task-002"]
    assert [t.name for t in store.task_page(FAILED, None, 0, 10)] == ["task-000"]
    assert [t.name for t in store.task_page(CANCELLED, None, 0, 10)] == ["task-005", "task-006"]
    assert [t.name for t in store.task_page(CANCELLED, "6", 0, 10)] == ["task-006"]
    pending = store.task_page(PENDING, None, 0, 5)
    assert [t.name for t in pending] == ["task-003", "task-004", "task-007", "task-008", "task-009"]
    assert [t.name for t in store.task_page(PENDING, "_done", 0, 5)] == ["100%_done", "100x_done"]
    assert store.task_page(DONE, None, 0, 5) == []


def test_activity_and_totals_count_completions_and_failed_attempts(store: Store) -> None:
    store.add(["a", "b", "c", "d"])
    w = worker(store)
    assert store.activity() == []
    assert store.totals() == Totals(0, 0, 0, 0, 0, 0)
    claims = {c.name: c for c in store.claim(w, 4, 30, 2)}
    for name in ("a", "b"):
        store.complete(claims[name].task_id, claims[name].fence, b"", "bytes")
        store.log_event("done", task_id=claims[name].task_id, worker_id=w, attempt=1)
    c = claims["c"]
    assert store.fail(c.task_id, c.fence, "boom", 0) == PENDING
    store.log_event("retrying", task_id=c.task_id, worker_id=w, attempt=1, detail="boom")
    d = claims["d"]
    store.reclaim(d.task_id, d.fence, because("owner died"))
    store.log_event("reclaimed", task_id=d.task_id, worker_id=w, attempt=1, detail="owner died")
    store.log_event("fenced", task_id=d.task_id, worker_id=w, attempt=1, detail="not an attempt of its own")
    store.log_event("restart", detail="worker exited with status 1")
    store.log_event("replayed", task_id=c.task_id, worker_id=w, attempt=2, detail="replayed 3 steps (saved 1.5 s)")
    store.log_event("replayed", task_id=c.task_id, worker_id=w, attempt=3, detail="replayed 1 step (saved 0.0 s)")
    store.cancel(["c"])
    buckets = store.activity(3600)
    assert sum(b[1] for b in buckets) == 2 and sum(b[2] for b in buckets) == 2
    start = buckets[0][0]
    assert start % 3600 == 0 and start <= time.time() < start + 2 * 3600
    assert store.totals() == Totals(completions=2, failed_attempts=2, final_failures=0, cancelled=1, restarts=1,
                                    step_replays=4)


def test_the_python_api_names_its_job_and_steers_it(store_url: str) -> None:
    from onward import Job
    from onward.log import QUIET

    with Job(store_url, name="py", log_level=QUIET) as job, Job(store_url, log_level=QUIET) as other:
        job.task(lambda task, ctx: f"py {task}")
        other.task(lambda task, ctx: f"default {task}")
        assert job.name == "py" and other.name == "default"
        job.add(["a", "b", "c"])
        other.add(["a"])
        assert job.cancel(["c"]) == {"c": CANCELLED}
        assert job.pause() and not job.pause()
        assert job.status().paused and not other.status().paused
        assert job.resume()
        summary = job.run()
        assert (summary.done, summary.failed, summary.exit_code) == (2, 0, 0)  # cancelled is no failure
        assert job.result("a") == "py a"
        assert other.run().done == 1 and other.result("a") == "default a"


def test_a_search_bounded_by_until_reads_no_task_beyond_it(store: Store) -> None:
    store.add([f"n{i:03d}" for i in range(1, 101)])
    ids = {row.name: row.task_id for row in store.task_page(None, None, 0, 1000)}
    until = ids["n050"]
    found = store.task_page(None, "N0", 0, 1000, until)
    assert [r.name for r in found] == [f"n{i:03d}" for i in range(1, 51)]
    assert store.task_page(None, "n07", 0, 10, until) == []  # n070..n079 lie beyond the bound
    # Also where the state has an index of its own (pending tasks, while few).
    assert [r.name for r in store.task_page(PENDING, "n0", 0, 1000, until)] == [f"n{i:03d}" for i in range(1, 51)]
    assert [r.name for r in store.task_page(PENDING, "n07", until, 10, until + 30)] == [
        f"n{i:03d}" for i in range(70, 80)]
