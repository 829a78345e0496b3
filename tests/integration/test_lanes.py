"""Turns taken on a task's own thread (``Runner.settle_here``): at concurrency 1 the thread of a Python task
that finished settles it and runs the next task itself, while the worker loop sleeps. What the loop does for
every attempt must still be done for those: their timeouts and the heartbeats that renew their leases. And on
SQLite, whichever thread commits, no completion is told before a sync that covers it."""

from __future__ import annotations

import io
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from onward import Job, TaskContext
from onward.log import NORMAL, QUIET, Log


def _noting_each_commit(store: Any, note: Callable[[str], None]) -> Callable[..., Any]:
    """A stand-in for ``store.complete_and_claim`` that calls ``note`` with the completed task's name once the
    real call returned (on the thread that made it)."""
    real_complete_and_claim = store.complete_and_claim

    def complete_and_claim(done: Any, *args: Any, **kwargs: Any) -> Any:
        value = real_complete_and_claim(done, *args, **kwargs)
        note(done.name)
        return value
    return complete_and_claim


def test_a_task_started_by_the_thread_of_the_one_before_still_times_out(store_url: str) -> None:
    # "b-spin" is started by a-quick's thread, not by the loop, which sleeps meanwhile (its next heartbeat is
    # 30 s away): its 0.3 s timeout must hold all the same, and not wait for that heartbeat.
    job = Job(store_url, log_level=QUIET, timeout=0.3, heartbeat=30, max_attempts=1)

    @job.task
    def handle(task: str, ctx: TaskContext) -> str:
        while task == "b-spin":
            ctx.check()  # raises Cancelled once the worker cancelled the attempt
            time.sleep(0.01)
        return task

    job.add(["a-quick", "b-spin"])
    started = time.monotonic()
    summary = job.run()
    elapsed = time.monotonic() - started
    assert (summary.done, summary.failed) == (1, 1)
    row = job.store.task("b-spin")
    assert row is not None and "timed out after 0.3s" in (row.error or "")
    # Cancelled at its timeout, give or take the machine's load: not at the heartbeat 30 s later.
    assert elapsed < 15, f"the run took {elapsed:.1f} s: the timeout waited for a heartbeat"
    job.close()


def test_the_worker_heartbeats_while_tasks_settle_on_their_own_threads(store_url: str) -> None:
    # Thousands of short tasks, each settled by its own thread: the loop must still get its turn every
    # heartbeat (0.1 s) to renew leases. Read from outside, through a second handle, the worker's heartbeat
    # keeps moving.
    from onward.store import open_store

    job = Job(store_url, log_level=QUIET, heartbeat=0.1)

    @job.task
    def handle(task: str, ctx: TaskContext) -> str:
        time.sleep(0.0005)
        return task

    job.add(f"t{i:05d}" for i in range(3000))
    heartbeats: set[float] = set()
    done = threading.Event()

    def watch() -> None:
        reader = open_store(store_url)
        while not done.is_set():
            now = reader.now()
            heartbeats.update(round(now - w.heartbeat_age, 2) for w in reader.workers())
            time.sleep(0.02)
        reader.close()

    watcher = threading.Thread(target=watch)
    watcher.start()
    started = time.monotonic()
    try:
        summary = job.run()
    finally:
        done.set()
        watcher.join()
    elapsed = time.monotonic() - started
    assert summary.done == 3000
    # One heartbeat every 0.1 s over the run; at least a third of them seen by a reader polling every 20 ms.
    assert len(heartbeats) >= max(3, int(elapsed / 0.1 / 3)), (len(heartbeats), elapsed)
    job.close()


class _Stamped(io.StringIO):
    """A log stream that notes when each ``done task=NAME`` line was written (time.monotonic)."""

    def __init__(self) -> None:
        super().__init__()
        self.reported: dict[str, float] = {}

    def write(self, text: str) -> int:
        now = time.monotonic()
        match = re.search(r' done task="([^"]+)"', text)
        if match:
            self.reported[match[1]] = now
        return super().write(text)


def test_at_concurrency_1_a_task_commits_its_own_outcome_on_its_own_thread(store_url: str) -> None:
    # The point of the lane: no hand-over to the loop's thread (here the thread calling job.run) and back
    # between two tasks. With the heartbeat far away, each completion is committed (with the next claim) by
    # the thread that ran the task, not by the loop's.
    job = Job(store_url, log_level=QUIET, heartbeat=30)
    task_threads: dict[str, int] = {}
    commit_threads: dict[str, int] = {}
    store = job.store
    complete_and_claim = _noting_each_commit(store, lambda name: commit_threads.update({name: threading.get_ident()}))

    @job.task
    def handle(task: str, ctx: TaskContext) -> str:
        task_threads[task] = threading.get_ident()
        return task

    job.add(f"t{i:04d}" for i in range(300))
    store.complete_and_claim = complete_and_claim  # type: ignore[method-assign]
    assert job.run().done == 300
    loop_thread = threading.get_ident()
    assert len(commit_threads) >= 290  # one call per completion (the last may be settled another way)
    own = sum(1 for name, ident in commit_threads.items() if ident == task_threads[name] != loop_thread)
    assert own >= 290, f"only {own} of 300 completions were committed by the task's own thread"
    job.close()


def test_no_completion_is_reported_before_a_sync_begun_after_its_commit(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """At concurrency 1 a task's thread commits its outcome crash-safe with the next claim, starts that task,
    then syncs (the loop does the same, syncing while the next task runs, when a tick is due). Each `done`
    line is written after an fdatasync of the log that began after that task's commit returned, and had
    returned itself: the rule that makes a reported completion survive a power cut
    (tests/crash/test_power_cut.py checks the same from the outside)."""
    db = str(tmp_path / "s.db")
    syncs: list[tuple[float, float]] = []
    real_fdatasync = os.fdatasync

    def fdatasync(fd: Any) -> None:  # os.fdatasync's own type
        began = time.monotonic()
        real_fdatasync(fd)
        syncs.append((began, time.monotonic()))

    stream = _Stamped()
    job = Job(db, log_level=NORMAL)
    job.log = Log(NORMAL, stream)
    committed: dict[str, float] = {}
    store = job.store
    complete_and_claim = _noting_each_commit(store, lambda name: committed.update({name: time.monotonic()}))

    @job.task
    def handle(task: str, ctx: TaskContext) -> str:
        return task

    job.add(f"t{i:04d}" for i in range(2000))
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    monkeypatch.setattr(store, "complete_and_claim", complete_and_claim)
    summary = job.run()
    assert summary.done == 2000
    assert len(stream.reported) == 2000 and set(committed) <= set(stream.reported)
    for name, at in committed.items():
        reported = stream.reported[name]
        assert any(at <= began and ended <= reported for began, ended in syncs), \
            f"{name}: committed at {at}, reported at {reported}, with no sync in between"
    job.close()


def test_a_task_finishing_beside_another_hands_its_outcome_over_without_waiting_for_the_loops_turn(
        store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # With another task running, a finished task's outcome is the loop's to commit (with the others', in one
    # commit): its thread has nothing to do but hand it over, and must not first wait for the loop's turn to
    # end (at concurrency 4 that wait cost each task two more context switches). The loop is held here in the
    # middle of a turn, the heartbeat's lease renewal, until "quick", told to finish then, has handed over.
    from onward.inbox import LoopInbox

    handed_over = threading.Event()
    real_post = LoopInbox.post

    def post(self: LoopInbox, attempt: Any, outcome: Any) -> None:
        real_post(self, attempt, outcome)
        if attempt.claim.name == "quick":
            handed_over.set()

    monkeypatch.setattr(LoopInbox, "post", post)
    finish_quick, finish_slow = threading.Event(), threading.Event()
    seen_during_turn: list[bool] = []
    job = Job(store_url, log_level=QUIET, concurrency=2, heartbeat=0.2)
    store = job.store
    real_renew = store.renew

    def renew(worker_id: int, leases: Any, *args: Any, **kwargs: Any) -> Any:
        if len(leases) == 2 and not seen_during_turn:  # both tasks run: hold this turn until quick has handed over
            finish_quick.set()
            seen_during_turn.append(handed_over.wait(10))
            finish_slow.set()
        return real_renew(worker_id, leases, *args, **kwargs)

    @job.task
    def handle(task: str, ctx: TaskContext) -> str:
        assert (finish_quick if task == "quick" else finish_slow).wait(60)
        return task

    job.add(["quick", "slow"])
    monkeypatch.setattr(store, "renew", renew)
    assert job.run().done == 2
    assert seen_during_turn == [True], "quick's thread waited for the loop's turn to hand its outcome over"
    job.close()
