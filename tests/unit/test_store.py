"""The Store contract, checked the same way on every backend (the ``store_url`` fixture)."""

from __future__ import annotations

import io
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from onward.attempt import Attempt, Outcome
from onward.errors import StoreUnavailable
from onward.log import Log
from onward.proc import current_owner
from onward.settle import Settler
from onward.store import open_store
from onward.store.base import (
    CANCELLED,
    DONE,
    FAILED,
    PENDING,
    RUNNING,
    WAITING,
    Claim,
    Lease,
    Reclaimed,
    SourceMark,
    StepRecord,
    Store,
)
from onward.store.sqlbase import SCHEMA_VERSION
from tests.conftest import because, worker


def test_add_is_idempotent_and_counted(store: Store) -> None:
    assert store.add(["a", "b", "c"]) == 3
    assert store.add(["b", "c", "d"]) == 1
    assert store.add([]) == 0
    assert store.counts() == {PENDING: 4, RUNNING: 0, DONE: 0, FAILED: 0, CANCELLED: 0, WAITING: 0}
    assert [t.name for t in store.iter_tasks()] == ["a", "b", "c", "d"]



def test_complete_and_claim_is_complete_then_claim_with_their_journal(store: Store) -> None:
    """The worker's one call per task when it has one success to commit: the same rows, counts and journal
    as complete, claim and their events, in one commit (one statement on PostgreSQL); fenced out, the
    completion writes nothing but its "fenced" event, and the claims still happen."""
    store.add(["a", "b", "c", "d"])
    w = worker(store)
    (a,) = store.claim(w, 1, 30, 3)
    completed, claims = store.complete_and_claim(a, b"ra", "str", w, 2, 30, 3)
    assert completed and [(c.name, c.attempt, c.fence) for c in claims] == [("b", 1, 1), ("c", 1, 1)]
    result = store.result("a")
    assert result is not None and result.data == b"ra" and result.kind == "str"
    assert store.counts() == {PENDING: 1, RUNNING: 2, DONE: 1, FAILED: 0, CANCELLED: 0, WAITING: 0}
    assert [(e.kind, e.task, e.attempt) for e in store.events()][-3:] == [
        ("done", "a", 1), ("claimed", "b", 1), ("claimed", "c", 1)]
    b = claims[0]
    completed, claims = store.complete_and_claim(Claim(b.task_id, b.name, b.attempt, b.fence + 1, 3), b"x", "str",
                                                 w, 5, 30, 3)
    assert not completed and [c.name for c in claims] == ["d"]  # fenced out: b stays running, d is claimed
    assert store.task("b").state == RUNNING and store.result("b") is None  # type: ignore[union-attr]
    assert store.counts() == {PENDING: 0, RUNNING: 3, DONE: 1, FAILED: 0, CANCELLED: 0, WAITING: 0}
    fenced, claimed = store.events()[-2:]
    assert (fenced.kind, fenced.task, claimed.kind, claimed.task) == ("fenced", "b", "claimed", "d")
    assert fenced.detail and "taken over" in fenced.detail
    c = store.running_tasks()[1]
    assert c.name == "c"
    completed, claims = store.complete_and_claim(Claim(c.task_id, c.name, c.attempt, c.fence, 3), b"rc", "str",
                                                 w, 0, 30, 3)
    assert completed and claims == []  # nothing asked for: a completion alone
    assert store.counts()[DONE] == 2 and store.claim(w, 5, 30, 3) == []

@pytest.mark.parametrize("way", ["alone", "in a batch", "complete"])
def test_a_completion_tried_again_after_its_commit_landed_is_done_not_fenced(store: Store, way: str) -> None:
    """What a worker does when a commit's answer was lost (a connection cut after the server committed; a
    sync check failing after SQLite's commit): it commits the same completion again. The task is done
    under that attempt's fence, so the second try says done (``settled_under``), changes nothing, and
    journals nothing more: one "done", no "fenced". A claim that moved the fence on still fences it out."""
    store.add(["a", "b", "c"])
    w = worker(store)
    (a,) = store.claim(w, 1, 30, 3)
    assert store.settled_under(a.task_id, a.fence) is None  # running: not settled under any fence yet

    settler = Settler(store, Log(stream=io.StringIO()), None, 1, 1)
    settler.worker_id = w

    def complete_again(claim: Claim, result: bytes) -> bool:
        if way == "complete":  # the worker's way with several outcomes in one commit: the settler's
            with store.batch():
                report = settler.settle(Attempt(claim), Outcome.done(result, "str"))
            done, fenced = settler.summary.done, settler.summary.fenced
            report()
            assert settler.summary.done + settler.summary.fenced == done + fenced + 1
            return settler.summary.done > done
        if way == "in a batch":
            with store.batch():
                completed, claims = store.complete_and_claim(claim, result, "str", w, 0, 30, 3)
        else:
            completed, claims = store.complete_and_claim(claim, result, "str", w, 0, 30, 3)
        assert claims == []
        return completed

    assert complete_again(a, b"first")
    events = len(store.events())
    assert store.settled_under(a.task_id, a.fence) == DONE
    assert complete_again(a, b"second")  # the retry: done already, under this very fence
    result = store.result("a")
    assert result is not None and result.data == b"first"  # nothing written by the retry
    assert store.counts() == {PENDING: 2, RUNNING: 0, DONE: 1, FAILED: 0, CANCELLED: 0, WAITING: 0}
    assert len(store.events()) == events
    assert [e.kind for e in store.events() if e.task == "a"] == ["done"]
    # Another fence: refused, as ever.
    assert store.settled_under(a.task_id, a.fence + 1) is None
    (b,) = store.claim(w, 1, 30, 3)
    store.reclaim(b.task_id, b.fence, because("lease expired"))  # the fence moves on; b pending again
    (b2,) = store.claim(w, 1, 30, 3)
    assert b2.name == "b" and b2.fence == b.fence + 2
    assert complete_again(b2, b"by the new owner")
    assert not complete_again(b, b"late")
    assert store.settled_under(b.task_id, b.fence) is None
    result = store.result("b")
    assert result is not None and result.data == b"by the new owner"
    assert [e.kind for e in store.events() if e.task == "b"][-2:] == ["done", "fenced"]


@pytest.mark.parametrize("outcome", [Outcome.failure("exit status 1"), Outcome.released("worker stopping"),
                                     Outcome.parked("approval", None)], ids=["failed", "released", "parked"])
def test_any_outcome_written_again_after_its_commit_landed_is_told_not_fenced(store: Store,
                                                                              outcome: Outcome) -> None:
    """The same for a failed attempt, one given back, and one that began to wait: the second write of
    the outcome is refused (the task no longer runs), ``settled_under`` gives the state the first left,
    and the settler tells that outcome as usual, with no journal row more and nothing "fenced"."""
    store.add(["a"])
    w = worker(store)
    (a,) = store.claim(w, 1, 30, 3)
    settler = Settler(store, Log(stream=io.StringIO()), None, 1, 1)
    settler.worker_id = w
    journaled = []
    for _ in range(2):  # the try whose answer was lost, then the try again
        with store.batch():
            report = settler.settle(Attempt(a), outcome)
        report()
        journaled.append([e.kind for e in store.events() if e.task == "a"])
    assert journaled[0] == journaled[1] and "fenced" not in journaled[1]
    assert settler.summary.fenced == 0
    state = {"failed": PENDING, "released": PENDING, "parked": WAITING}[outcome.kind]
    assert store.task("a").state == state and store.settled_under(a.task_id, a.fence) == state  # type: ignore[union-attr]
    if outcome.kind == "failed":
        assert store.task("a").attempts == 1  # type: ignore[union-attr]  # counted once


def test_a_crash_safe_settle_is_seen_at_once_and_made_durable_by_sync(store_url: str) -> None:
    """``complete_and_claim(durable=False)`` and ``batch(durable=False)``: every reader sees the commit at
    once (no other worker may claim what it claimed), and ``sync`` then brings it to stable storage. Where
    commits are not durable by themselves (SQLite), ``sync`` is one fdatasync of the write-ahead log,
    owed once per crash-safe commit; after a durable commit nothing is owed."""
    writer, reader = open_store(store_url), open_store(store_url)
    synced: list[str] = []
    real_fdatasync = os.fdatasync

    def fdatasync(fd: Any) -> None:  # os.fdatasync's own type: a descriptor or what has a fileno()
        synced.append(os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}"))
        real_fdatasync(fd)
    try:
        writer.add(["a", "b", "c"])
        w = worker(writer)
        (a,) = writer.claim(w, 1, 30, 3)
        os.fdatasync = fdatasync  # observe the calls (each still goes to the kernel)
        completed, (b,) = writer.complete_and_claim(a, b"ra", "str", w, 1, 30, 3, durable=False)
        assert completed and b.name == "b"
        assert reader.task("a").state == DONE and reader.task("b").state == RUNNING  # type: ignore[union-attr]
        assert reader.claim(worker(reader), 5, 30, 3)[0].name == "c"  # b is taken: visible to every claimer
        assert synced == []  # nothing waited for the disk yet
        writer.sync()
        sqlite = not store_url.startswith("postgresql")
        assert synced == ([str(Path(store_url).resolve()) + "-wal"] if sqlite else [])
        writer.sync()  # nothing owed any more
        with writer.batch(durable=False):
            writer.complete(b.task_id, b.fence, b"rb", "str")
        with writer.batch():
            writer.log_event("durable")  # a durable commit covers the crash-safe one before it
        count = len(synced)
        writer.sync()
        assert len(synced) == count
        # A durable commit that wrote nothing synced nothing: the crash-safe one before it is still owed.
        with writer.batch(durable=False):
            writer.log_event("crash-safe")
        with writer.batch():
            writer.add(["a"])  # there already: no row changes
        writer.sync()
        assert len(synced) == count + sqlite
    finally:
        os.fdatasync = real_fdatasync
        writer.close()
        reader.close()


def test_a_failed_sync_is_store_unavailable_in_one_line(tmp_path: Path) -> None:
    """A sync the disk refuses (here: the log's descriptor swapped for a pipe's, which fdatasync refuses
    with EINVAL) is ``StoreUnavailable`` naming the store, never a driver's or an OSError."""
    s = open_store(str(tmp_path / "s.db"))
    try:
        s.add(["a"])
        with s.batch(durable=False):
            s.log_event("crash-safe")
        read_end, write_end = os.pipe()
        s._wal_fd = read_end  # type: ignore[attr-defined]
        with pytest.raises(StoreUnavailable) as raised:
            s.sync()
        assert "cannot make the last commit durable" in str(raised.value) and "\n" not in str(raised.value)
        os.close(write_end)
    finally:
        s.close()  # closes the pipe's read end too


def test_reopen_keeps_everything(store_url: str) -> None:
    s = open_store(store_url)
    s.add(["x"])
    s.close()
    s = open_store(store_url, create=False)
    assert s.task("x") is not None and s.task("x").state == PENDING  # type: ignore[union-attr]
    s.close()


def test_claim_counts_attempt_and_moves_fence(store: Store) -> None:
    store.add(["a", "b", "c"])
    w = worker(store)
    claims = store.claim(w, 2, 30, 3)
    assert [c.name for c in claims] == ["a", "b"]
    assert all(c.attempt == 1 and c.fence == 1 for c in claims)
    assert store.counts()[RUNNING] == 2
    assert store.task("a").attempts == 1  # type: ignore[union-attr]
    # the attempt is committed at claim time: another connection sees it
    assert [c.name for c in store.claim(w, 5, 30, 3)] == ["c"]
    assert store.claim(w, 5, 30, 3) == []


def test_complete_under_the_right_fence_only(store: Store) -> None:
    store.add(["a"])
    w = worker(store)
    (c,) = store.claim(w, 1, 30, 3)
    assert not store.complete(c.task_id, c.fence + 1, b"x", "bytes")
    assert store.complete(c.task_id, c.fence, b"result", "str")
    assert not store.complete(c.task_id, c.fence, b"again", "str")  # done is final
    r = store.result("a")
    assert r is not None and r.data == b"result" and r.kind == "str"
    assert store.counts()[DONE] == 1
    assert store.claim(w, 1, 30, 3) == []  # a done task is never claimed again


def test_fail_retries_after_delay_then_fails_for_good(store: Store) -> None:
    store.add(["a"])
    w = worker(store)
    (c,) = store.claim(w, 1, 30, 2)
    assert store.fail(c.task_id, c.fence, "boom", 0.5) == PENDING
    assert store.claim(w, 1, 30, 2) == []  # not before its retry time
    deadline = time.monotonic() + 5
    claims: list[Claim] = []
    while not claims and time.monotonic() < deadline:
        time.sleep(0.05)
        claims = store.claim(w, 1, 30, 2)
    (c2,) = claims
    assert c2.attempt == 2 and c2.fence == c.fence + 1
    assert store.fail(c2.task_id, c2.fence, "boom again", 0) == FAILED
    row = store.task("a")
    assert row is not None and row.state == FAILED and row.error == "boom again" and row.attempts == 2
    assert store.fail(c2.task_id, c2.fence, "late", 0) is None  # not running any more


def test_next_ready_in_is_the_earliest_pending_tasks_wait(store: Store) -> None:
    """What an idle worker sleeps until: None with nothing pending, the backoff left of the earliest retry
    (tasks running or done do not count), and zero or less once one is ready."""
    assert store.next_ready_in() is None
    store.add(["a", "b", "c"])
    w = worker(store)
    ready = store.next_ready_in()
    assert ready is not None and ready <= 0
    a, b, c = store.claim(w, 3, 30, 3)
    assert store.next_ready_in() is None  # running tasks are not pending
    assert store.fail(b.task_id, b.fence, "later", 50.0) == PENDING
    assert store.fail(a.task_id, a.fence, "sooner", 20.0) == PENDING
    assert store.complete(c.task_id, c.fence, b"", "str")
    ready = store.next_ready_in()
    assert ready is not None and 19.0 < ready <= 20.0, ready
    store.add(["d"])
    ready = store.next_ready_in()
    assert ready is not None and ready <= 0


def test_release_does_not_count_the_attempt(store: Store) -> None:
    store.add(["a"])
    w = worker(store)
    (c,) = store.claim(w, 1, 30, 3)
    assert store.release(c.task_id, c.fence, "stopping")
    assert store.task("a").attempts == 0  # type: ignore[union-attr]
    (c2,) = store.claim(w, 1, 30, 3)
    assert c2.attempt == 1 and c2.fence == c.fence + 1


def test_reclaim_fences_out_the_old_owner(store: Store) -> None:
    store.add(["a"])
    w = worker(store)
    (c,) = store.claim(w, 1, 30, 3)
    assert store.reclaim(c.task_id, c.fence, because("owner died")) == Reclaimed(PENDING, counted=True)
    assert store.reclaim(c.task_id, c.fence, because("again")) is None
    assert not store.complete(c.task_id, c.fence, b"late", "bytes")
    assert store.renew(w, [Lease(c.task_id, c.fence)], 30, 0) == [c.task_id]
    (c2,) = store.claim(w, 1, 30, 3)
    assert c2.attempt == 2
    # A worker thawed after the takeover learns it when it notes its command's pid, before the command runs.
    assert not store.note_child(c.task_id, c.fence, 4321, 1)
    assert store.note_child(c2.task_id, c2.fence, 1234, 1)
    (running,) = store.running_tasks()
    assert running.child_pid == 1234
    # A process noted with its claim instead: the thawed worker asks whether the claim holds before its go.
    assert not store.holds(c.task_id, c.fence)
    assert store.holds(c2.task_id, c2.fence)
    assert store.complete(c2.task_id, c2.fence, b"ok", "bytes")
    assert not store.holds(c2.task_id, c2.fence)  # done: nothing runs under it any more


@pytest.mark.parametrize("limit", [1, 3])
def test_a_process_made_ahead_is_noted_with_the_claim_of_the_first_task(store: Store, limit: int) -> None:
    """``claim`` and ``complete_and_claim`` with ``child``: its pid and start time are noted on the first task
    they claim, in the same transaction, and that claim says so; the others have no pid."""
    store.add(["a", "b", "c", "d", "e"])
    w = worker(store)
    claims = store.claim(w, limit, 30, 3, child=(4242, 77))
    assert [c.name for c in claims] == ["a", "b", "c"][:limit]
    assert [c.child_pid for c in claims] == [4242] + [None] * (limit - 1)
    noted = {t.name: (t.child_pid, t.child_start) for t in store.running_tasks()}
    assert noted == {"a": (4242, 77), **{n: (None, None) for n in ["b", "c"][:limit - 1]}}
    for c in claims[1:]:
        assert store.release(c.task_id, c.fence, "test")
    completed, more = store.complete_and_claim(claims[0], b"ok", "bytes", w, limit, 30, 3, child=(4343, 88))
    assert completed
    assert [c.child_pid for c in more] == [4343] + [None] * (len(more) - 1)
    noted = {t.name: (t.child_pid, t.child_start) for t in store.running_tasks()}
    assert noted[more[0].name] == (4343, 88)
    assert all(noted[c.name] == (None, None) for c in more[1:])
    # None noted when there is nothing to claim.
    for c in more:
        assert store.complete(c.task_id, c.fence, b"ok", "bytes")
    left = [c for c in store.claim(w, 5, 30, 3)]
    for c in left:
        assert store.complete(c.task_id, c.fence, b"ok", "bytes")
    assert store.claim(w, 1, 30, 3, child=(4444, 99)) == []


def test_reclaim_with_no_attempts_left_fails_the_task(store: Store) -> None:
    store.add(["poison"])
    w = worker(store)
    (c,) = store.claim(w, 1, 30, 1)
    assert store.reclaim(c.task_id, c.fence, because("owner died")) == Reclaimed(FAILED, counted=True)
    assert store.task("poison").state == FAILED  # type: ignore[union-attr]


def step_record(index: int) -> StepRecord:
    return StepRecord(index, f"s{index}", "value", b"1", time.time())


def test_a_progressing_agent_is_not_quarantined_as_poison(store: Store) -> None:
    """An attempt whose owner died after it recorded a step further than any before is given back
    uncounted, however often that happens; one that got no further counts, as for any poison task."""
    store.add(["agent"])
    w = worker(store)
    for run in range(1, 6):  # five owners die in a row, each after two new steps: never failed
        (c,) = store.claim(w, 1, 30, 3)
        assert c.attempt == 1  # the number is reused, as after a release
        for index in (2 * run - 1, 2 * run):
            assert store.record_step(c.task_id, c.fence, step_record(index))
        assert store.reclaim(c.task_id, c.fence, because("owner died")) == Reclaimed(PENDING, counted=False)
        assert store.task("agent").attempts == 0  # type: ignore[union-attr]
    # Owners that die with no new step count, up to max attempts, as before.
    for attempt in (1, 2, 3):
        (c,) = store.claim(w, 1, 30, 3)
        assert c.attempt == attempt
        state = FAILED if attempt == 3 else PENDING
        assert store.reclaim(c.task_id, c.fence, because("owner died")) == Reclaimed(state, counted=True)
    row = store.task("agent")
    assert row is not None and row.state == FAILED and row.attempts == 3 and row.error == "owner died"


def test_a_shared_crash_counts_no_attempt_and_its_tasks_run_alone_after(store: Store) -> None:
    """A task taken back from an owner that ran others beside it is not counted, even with its attempts
    used up: it gets one more instead (its attempt number still grows), and runs alone from then on: claims
    pass it by unless the worker claims alone (then it is handed out by itself, its Claim saying so); a
    crash while it runs alone counts as before."""
    store.add(["a", "b", "c"])
    w = worker(store)
    a, b = store.claim(w, 2, 30, 1)
    assert not a.alone and not b.alone
    assert not store.alone_ready()
    assert store.reclaim(a.task_id, a.fence, because("owner died"), shared=True) == Reclaimed(PENDING, counted=False)
    assert store.alone_ready()
    row = store.task("a")
    assert row is not None and row.state == PENDING and row.attempts == 1
    # Not claimed by a worker that runs, or may run, anything beside it.
    assert [c.name for c in store.claim(w, 3, 30, 1)] == ["c"]
    assert store.claim(w, 1, 30, 1) == []
    assert store.claim(w, 2, 30, 1, alone=True) == []  # alone claims one task, never more
    (again,) = store.claim(w, 1, 30, 1, alone=True)
    assert again.name == "a" and again.alone and (again.attempt, again.max_attempts) == (2, 2)
    assert not store.alone_ready()  # running, not pending
    assert store.reclaim(again.task_id, again.fence, because("owner died")) == Reclaimed(FAILED, counted=True)
    # The same through complete_and_claim, the commit of a worker whose one task is done.
    assert store.reclaim(b.task_id, b.fence, because("owner died"), shared=True) == Reclaimed(PENDING, counted=False)
    (c,) = [t for t in store.running_tasks() if t.name == "c"]
    done, claims = store.complete_and_claim(Claim(c.task_id, "c", 1, c.fence, 1), b"", "json", w, 1, 30, 1)
    assert done and claims == []
    (b2,) = store.claim(w, 1, 30, 1, alone=True)
    assert b2.name == "b" and b2.alone


def test_re_recording_steps_already_reached_is_not_progress(store: Store) -> None:
    """Progress is a step beyond the furthest one ever recorded for the task: re-running the last step
    (an error record run again), or steps dropped by replay="prefix" and recorded anew, gets no further,
    so an agent that crashes its worker there still ends failed after max attempts."""
    store.add(["agent"])
    w = worker(store)
    (c,) = store.claim(w, 1, 30, 2)
    for index in (1, 2, 3):
        assert store.record_step(c.task_id, c.fence, step_record(index))
    assert store.reclaim(c.task_id, c.fence, because("owner died")) == Reclaimed(PENDING, counted=False)
    (c,) = store.claim(w, 1, 30, 2)
    assert store.drop_steps(c.task_id, c.fence, 3)  # the last record was an error: run that step again
    assert store.record_step(c.task_id, c.fence, step_record(3))
    assert store.reclaim(c.task_id, c.fence, because("owner died")) == Reclaimed(PENDING, counted=True)
    (c,) = store.claim(w, 1, 30, 2)
    assert store.drop_steps(c.task_id, c.fence, 2)  # replay="prefix": steps 2 and 3 dropped, then again
    assert store.record_step(c.task_id, c.fence, step_record(2))
    assert store.record_step(c.task_id, c.fence, step_record(3))
    assert store.reclaim(c.task_id, c.fence, because("lease expired")) == Reclaimed(FAILED, counted=True)
    # A step under a fence that moved on is refused, and moves nothing either.
    store.retry(["agent"])
    (c,) = store.claim(w, 1, 30, 2)
    assert not store.record_step(c.task_id, c.fence - 1, step_record(4))
    assert store.reclaim(c.task_id, c.fence, because("owner died")) == Reclaimed(PENDING, counted=True)
    (c,) = store.claim(w, 1, 30, 2)
    assert store.record_step(c.task_id, c.fence, step_record(4))
    assert store.reclaim(c.task_id, c.fence, because("owner died")) == Reclaimed(PENDING, counted=False)


def test_lease_expiry_is_seen_on_the_store_clock(store: Store) -> None:
    store.add(["a"])
    w = worker(store)
    (c,) = store.claim(w, 1, 0.3, 3)
    (running,) = store.running_tasks()
    assert running.task_id == c.task_id and not running.lease_expired
    assert running.owner is not None and running.owner.pid == current_owner().pid
    time.sleep(0.5)
    (running,) = store.running_tasks()
    assert running.lease_expired
    assert store.renew(w, [Lease(c.task_id, c.fence, progress_age=0.0, note="half way")], 30, 0) == []
    (running,) = store.running_tasks()
    assert not running.lease_expired and running.note == "half way"


def test_two_connections_never_claim_the_same_task(store_url: str) -> None:
    setup = open_store(store_url)
    setup.add([f"t{i}" for i in range(300)])
    w = worker(setup)
    setup.close()
    claimed: list[list[str]] = [[], [], []]

    def claim_all(slot: int) -> None:
        s = open_store(store_url)
        try:
            while True:
                got = s.claim(w, 3, 30, 3)
                if not got:
                    return
                claimed[slot].extend(c.name for c in got)
        finally:
            s.close()

    threads = [threading.Thread(target=claim_all, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    everything = [n for part in claimed for n in part]
    assert len(everything) == 300 and len(set(everything)) == 300


def test_batch_is_one_transaction(store: Store) -> None:
    store.add(["a", "b"])
    w = worker(store)
    with pytest.raises(RuntimeError):
        with store.batch():
            store.claim(w, 2, 30, 3)
            raise RuntimeError("abort")
    assert store.counts()[RUNNING] == 0  # rolled back
    with store.batch():
        (a, b) = store.claim(w, 2, 30, 3)
        store.complete(a.task_id, a.fence, b"1", "bytes")
        store.fail(b.task_id, b.fence, "x", 0)
    assert store.counts() == {PENDING: 1, RUNNING: 0, DONE: 1, FAILED: 0, CANCELLED: 0, WAITING: 0}


def test_retry_failed_tasks(store: Store) -> None:
    store.add(["a", "b", "c"])
    w = worker(store)
    for c in store.claim(w, 3, 30, 1):
        store.fail(c.task_id, c.fence, "x", 0)
    assert store.counts()[FAILED] == 3
    assert store.retry(["b"]) == 1
    assert store.retry(["b"]) == 0  # not failed any more
    assert store.retry(None) == 2
    assert store.counts() == {PENDING: 3, RUNNING: 0, DONE: 0, FAILED: 0, CANCELLED: 0, WAITING: 0}
    assert all(t.attempts == 0 for t in store.iter_tasks())


def test_iter_tasks_by_state_streams_in_added_order(store: Store) -> None:
    names = [f"n{i:05d}" for i in range(2500)]
    store.add(names)
    w = worker(store)
    for c in store.claim(w, 10, 30, 3):
        store.complete(c.task_id, c.fence, b"", "bytes")
    assert [t.name for t in store.iter_tasks()] == names
    assert [t.name for t in store.iter_tasks(DONE)] == names[:10]
    assert len(list(store.iter_tasks(PENDING))) == 2490


def test_journal_and_stats(store: Store) -> None:
    store.add(["a", "b"])
    w = worker(store)
    (a,) = store.claim(w, 1, 30, 1)
    store.log_event("claimed", task_id=a.task_id, worker_id=w, attempt=1)
    store.complete(a.task_id, a.fence, b"", "bytes")
    store.log_event("done", task_id=a.task_id, worker_id=w, attempt=1, durable=True)
    (b,) = store.claim(w, 1, 30, 1)
    store.fail(b.task_id, b.fence, "it broke\nsecond line", 0)
    store.log_event("failed", task_id=b.task_id, worker_id=w, attempt=1, detail="it broke")
    store.log_event("restart", detail="exit status 1", durable=True)
    kinds = [e.kind for e in store.events()]
    assert kinds == ["added", "worker started", "claimed", "done", "failed", "restart"]
    assert store.events()[0].detail == "2 new tasks"
    assert [e.kind for e in store.events(task="a")] == ["claimed", "done"]
    assert [e.kind for e in store.events(last=2)] == ["failed", "restart"]
    stats = store.stats()
    assert stats.counts[DONE] == 1 and stats.counts[FAILED] == 1 and stats.total == 2
    assert stats.done_last_minute == 1 and stats.restarts == 1
    assert [e.task for e in stats.errors] == ["b"]
    assert [wr.worker_id for wr in stats.workers] == [w]
    store.worker_stopped(w, "finished")
    assert store.stats().workers == []


def test_a_batch_journals_every_event_in_order_however_many(store: Store) -> None:
    """A batch keeps its events in memory and writes them just before its commit, in chunks of at most
    ``EVENTS_PER_INSERT`` rows: more than two chunks' worth, with their times, come back in order; a batch
    that fails writes none of its events."""
    store.add(["a"])
    w = worker(store)
    before = store.now()
    with store.batch():
        for i in range(2_345):
            store.log_event("note", worker_id=w, detail=str(i))
    notes = [e for e in store.events(limit=5_000) if e.kind == "note"]
    assert [e.detail for e in notes] == [str(i) for i in range(2_345)]
    assert all(before - 1 <= e.at <= store.now() + 1 for e in notes)
    with pytest.raises(RuntimeError), store.batch():
        store.log_event("lost", worker_id=w)
        raise RuntimeError("the batch fails")
    assert not [e for e in store.events(limit=5_000) if e.kind == "lost"]


def test_source_marks(store: Store) -> None:
    assert store.get_source("/x") is None
    mark = SourceMark("1:2", 10, 3, 123, "h", "t")
    store.set_source("/x", mark)
    assert store.get_source("/x") == mark
    store.set_source("/x", SourceMark("1:2", 20, 5, 124, "h", "t2"))
    assert store.get_source("/x").size == 20  # type: ignore[union-attr]


def test_steps_are_recorded_under_the_fence(store: Store) -> None:
    store.add(["agent"])
    w = worker(store)
    (c,) = store.claim(w, 1, 30, 3)
    assert store.record_step(c.task_id, c.fence, StepRecord(1, "llm", "value", b'"hi"', time.time()))
    assert store.record_step(c.task_id, c.fence, StepRecord(2, "tool", "value", b"1", time.time()))
    assert [s.name for s in store.steps(c.task_id)] == ["llm", "tool"]
    assert not store.record_step(c.task_id, c.fence + 1, StepRecord(3, "x", "value", b"1", time.time()))
    assert store.drop_steps(c.task_id, c.fence, 2)
    assert [s.index for s in store.steps(c.task_id)] == [1]
    assert store.reclaim(c.task_id, c.fence, because("lost")) == Reclaimed(PENDING, counted=False)
    assert not store.record_step(c.task_id, c.fence, StepRecord(2, "late", "value", b"1", time.time()))
    assert not store.drop_steps(c.task_id, c.fence, 1)
    assert [s.index for s in store.steps(c.task_id)] == [1]


def test_unicode_and_odd_task_names_round_trip(store: Store) -> None:
    names = ["héllo wörld", "a/b/../c", "'; DROP TABLE tasks; --", "x" * 4096, "🙂"]
    store.add(names)
    assert [t.name for t in store.iter_tasks()] == names


def test_db_upgrade_brings_a_version_1_store_up_and_keeps_how_far_its_agents_got(
        store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store written by schema version 1 (no furthest step on tasks) is refused with a pointer to `onward db
    upgrade`, which adds the mark from the steps already recorded: re-recording them is not progress, going
    beyond them is; the claim that was running across the upgrade is credited with nothing."""
    import sqlite3

    from onward.errors import SchemaTooOld
    from onward.store import is_postgres_url, postgres, sqlite
    from tests.conftest import run_onward

    backend = postgres if is_postgres_url(store_url) else sqlite
    # The store as version 1 wrote it: its schema, and one task running its first attempt.
    c = Claim(task_id=1, name="agent", attempt=1, fence=1, max_attempts=3)
    write_store_at_version(store_url, 1, running_task="agent")
    rows = [(c.task_id, index, f"s{index}", "value", b"1", time.time()) for index in (1, 2, 3)]
    if backend is sqlite:  # the steps as version 1 recorded them: the row, nothing else
        db = sqlite3.connect(store_url)
        db.executemany("INSERT INTO steps (task_id, idx, name, kind, data, at) VALUES (?, ?, ?, ?, ?, ?)", rows)
        db.commit()
        db.close()
    else:
        import psycopg

        with psycopg.connect(store_url, autocommit=True) as pg:
            pg.cursor().executemany("INSERT INTO onward.steps (task_id, idx, name, kind, data, at)"
                                    " VALUES (%s, %s, %s, %s, %s, %s)", rows)
    with pytest.raises(SchemaTooOld, match="onward db upgrade"):
        open_store(store_url)
    r = run_onward("db", "upgrade", "--db", store_url)
    assert r.returncode == 0 and f"upgraded from schema version 1 to {SCHEMA_VERSION}" in r.stderr.decode(), r.stderr
    r = run_onward("db", "upgrade", "--db", store_url)
    assert r.returncode == 0 and f"up to date (schema version {SCHEMA_VERSION})" in r.stderr.decode(), r.stderr

    store = open_store(store_url)
    try:
        assert [s.index for s in store.steps(c.task_id)] == [1, 2, 3]
        assert store.reclaim(c.task_id, c.fence, because("owner died")) == Reclaimed(PENDING, counted=True)
        (c,) = store.claim(worker(store), 1, 30, 3)
        assert store.record_step(c.task_id, c.fence, step_record(3))  # no further than before the upgrade
        assert store.reclaim(c.task_id, c.fence, because("owner died")) == Reclaimed(PENDING, counted=True)
        (c,) = store.claim(worker(store), 1, 30, 3)
        assert c.attempt == 3
        assert store.record_step(c.task_id, c.fence, step_record(4))
        assert store.reclaim(c.task_id, c.fence, because("owner died")) == Reclaimed(PENDING, counted=False)
    finally:
        store.close()


def write_store_at_version(url: str, version: int, running_task: str) -> None:
    """A store with the schema of ``version`` (its migrations applied as they stand, nothing later) holding one
    task, running its first attempt under fence 1, as that version wrote it: raw SQL, not today's queries."""
    import sqlite3
    from pathlib import Path

    from onward.store import is_postgres_url, postgres, sqlite
    from onward.store.sql import migration

    now = time.time()
    if is_postgres_url(url):
        import psycopg

        with psycopg.connect(url, autocommit=True) as pg:
            for v in range(1, version + 1):
                pg.execute(migration(postgres.Q, v))
            pg.execute(postgres.Q["set_meta"], {"version": str(version)})
            pg.execute("INSERT INTO onward.tasks (key, name, state, attempts, fence, added_at, started_at,"
                       " lease_until) VALUES (%s, %s, 'running', 1, 1, %s, %s, %s)",
                       (postgres.task_key(running_task), running_task, now, now, now + 30))
            pg.execute("INSERT INTO onward.counts (state, n) VALUES ('running', 1)")
        return
    Path(url).parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(url)
    for v in range(1, version + 1):
        db.executescript(migration(sqlite.Q, v))
    db.execute(sqlite.Q["set_meta"], {"version": str(version)})
    db.execute("INSERT INTO tasks (name, state, attempts, fence, added_at, started_at, lease_until)"
               " VALUES (?, 'running', 1, 1, ?, ?, ?)", (running_task, now, now, now + 30))
    db.execute("UPDATE counts SET n = 1 WHERE state = 'running'")
    db.commit()
    db.close()


def test_a_store_deleted_or_replaced_under_an_open_connection_is_noticed(store_url: str) -> None:
    import os

    from onward.errors import StoreGone
    from onward.store import is_postgres_url
    from tests import pgutil

    store = open_store(store_url)
    try:
        store.check_still_there()
        if is_postgres_url(store_url):
            admin = pgutil.admin_connection(dbname=store_url.rsplit("/", 1)[1])
            admin.execute("DROP SCHEMA onward CASCADE")
            admin.close()
            with pytest.raises(StoreGone, match='schema "onward" was dropped'):
                store.check_still_there()
            open_store(store_url).close()  # created again: another store in its place
        else:
            os.unlink(store_url)
            with pytest.raises(StoreGone, match="was deleted"):
                store.check_still_there()
            open_store(store_url).close()
        with pytest.raises(StoreGone, match="was replaced"):
            store.check_still_there()
    finally:
        store.close()
