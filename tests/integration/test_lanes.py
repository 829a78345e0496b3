"""Turns taken on a task's own thread (``Runner.settle_here``): at concurrency 1 the thread of a Python task
that finished settles it and runs the next task itself, while the worker loop sleeps. What the loop does for
every attempt must still be done for those: their timeouts and the heartbeats that renew their leases. And on
SQLite, whichever thread commits, no completion is told before a sync that covers it."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from onward import Job, TaskContext
from onward.log import NORMAL, QUIET, Log
from onward.store.base import PendingSync
from tests.conftest import require_tool

SRC = str(Path(__file__).resolve().parents[2] / "src")


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
    assert summary.counts["done"] == 3000
    # What this run counts as done, exactly, on both stores. On PostgreSQL a COMMIT whose answer was lost (a
    # loaded machine stalled the worker past the 0.5 s it gives the server, and it dropped the connection)
    # may have been carried out all the same: once, the lease of such an outcome ran out before the try
    # again, which dropped it uncounted. An ended attempt is no longer fenced so; the try again finds it.
    assert summary.done == 3000, summary
    # One heartbeat every 0.1 s over the run; at least a third of them seen by a reader polling every 20 ms.
    assert len(heartbeats) >= max(3, int(elapsed / 0.1 / 3)), (len(heartbeats), elapsed)
    job.close()


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


# The worker of the test below: no-op tasks at concurrency 1 through the Python API, printing (as JSON) when
# each completion's commit returned and when its `done` line was written, on the clock strace stamps with.
_SYNC_ORDER_WORKER = """
import io, json, re, sys, time
from onward import Job
from onward.log import NORMAL, Log

class Stamped(io.StringIO):
    reported = {}
    def write(self, text):
        now = time.time()
        match = re.search(r' done task="([^"]+)"', text)
        if match:
            self.reported[match[1]] = now
        return super().write(text)

db, n = sys.argv[1], int(sys.argv[2])
job = Job(db, log_level=NORMAL)
job.log = Log(NORMAL, Stamped())
committed = {}
store = job.store
real_complete_and_claim = store.complete_and_claim
def complete_and_claim(done, *args, **kwargs):
    value = real_complete_and_claim(done, *args, **kwargs)
    committed[done.name] = time.time()
    return value
store.complete_and_claim = complete_and_claim

@job.task
def handle(task, ctx):
    return task

job.add(f"t{i:04d}" for i in range(n))
done = job.run().done
print(json.dumps({"done": done, "committed": committed, "reported": Stamped.reported}))
job.close()
"""


def _log_syncs(trace: str) -> list[tuple[float, float]]:
    """When each successful fsync/fdatasync of a `-wal` file began and ended, from `strace -f -ttt -T -y`:
    "1234 1733270000.123456 fdatasync(5</x/s.db-wal>) = 0 <0.000213>", or, when another thread's traced
    call came in between, split into "... fdatasync(5</x/s.db-wal> <unfinished ...>" and, later,
    "1234 1733270000.123700 <... fdatasync resumed>) = 0 <0.000213>" (the duration counts from the start)."""
    began: dict[str, tuple[float, bool]] = {}  # thread -> its sync under way: start, on the log or not
    syncs = []
    for line in trace.splitlines():
        thread, at, call = line.split(None, 2)  # strace pads short pids: "2941  1733270000.1 ..."
        if call.startswith("<... "):
            start, on_log = began.pop(thread)
        elif re.match(r"f(?:data)?sync\(", call):
            start, on_log = float(at), bool(re.match(r"f(?:data)?sync\(\d+<[^>]*-wal>", call))
            if call.endswith("<unfinished ...>"):
                began[thread] = (start, on_log)
                continue
        else:
            continue
        outcome = re.search(r"= 0 <([\d.]+)>$", call)
        if on_log and outcome:
            syncs.append((start, start + float(outcome[1])))
    return sorted(syncs)


def test_no_completion_is_reported_before_a_sync_begun_after_its_commit(tmp_path: Path) -> None:
    """At concurrency 1 a task's thread commits its outcome crash-safe with the next claim, starts that task,
    and has the log synced beside it (a thread of the store's own, one fdatasync for the turns of a few
    milliseconds; the loop syncs while the next task runs, when a tick is due). Each `done` line is written
    after an fdatasync of the log that began after that task's commit returned, and had returned itself: the
    rule that makes a reported completion survive a power cut (tests/crash/test_power_cut.py checks the same
    from the outside). The syncs are the process's real system calls on the `-wal` file, whichever thread
    made them, as strace saw them."""
    strace = require_tool("strace")
    db = tmp_path / "s.db"
    trace = tmp_path / "trace.txt"
    proc = subprocess.run(
        [strace, "-f", "-qq", "-ttt", "-T", "-y", "-e", "trace=fdatasync,fsync", "-o", str(trace),
         sys.executable, "-c", _SYNC_ORDER_WORKER, str(db), "2000"],
        env=dict(os.environ, PYTHONPATH=SRC), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["done"] == 2000
    committed, reported = found["committed"], found["reported"]
    assert len(reported) == 2000 and set(committed) <= set(reported) and len(committed) >= 1990
    syncs = _log_syncs(trace.read_text())
    # One sync covers the turns of its window (PIPELINED_SYNC_GATHER): how many depends on the machine's pace.
    print(f"{len(syncs)} syncs of the log for 2000 tasks")
    assert syncs
    for name, at in committed.items():
        assert any(at <= began and ended <= reported[name] for began, ended in syncs), \
            f"{name}: committed at {at}, reported at {reported[name]}, with no sync in between"


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


def test_a_completion_is_told_while_the_next_task_still_runs(tmp_path: Path) -> None:
    """a's thread commits a's outcome with the claim of b, leaves the log's sync running and runs b. Nothing
    comes back to that thread while b runs, and the loop sleeps until its next heartbeat (30 s away): the
    store's descriptor wakes it once the sync finished unclaimed, and it tells a's completion meanwhile."""
    told = threading.Event()

    class Watching(io.StringIO):
        def write(self, text: str) -> int:
            if ' done task="a"' in text:
                told.set()
            return super().write(text)

    job = Job(str(tmp_path / "s.db"), log_level=NORMAL, heartbeat=30, max_attempts=1)
    job.log = Log(NORMAL, Watching())
    waited: list[float] = []
    left_running = []  # the syncs left running beside a task (the loop's first turn settles x0 in place)
    real_sync_ahead = job.store.sync_ahead

    def sync_ahead(gather: float = 0.0) -> Any:
        wait = real_sync_ahead(gather)
        left_running.append(wait is not None)
        return wait
    job.store.sync_ahead = sync_ahead  # type: ignore[method-assign]

    @job.task
    def handle(task: str, ctx: TaskContext) -> str:
        if task == "b":
            started = time.monotonic()
            if not told.wait(10):
                raise AssertionError("a's completion was not told while b ran")
            waited.append(time.monotonic() - started)
        return task

    if job.store.sync_ahead_fd() is None:
        pytest.skip("onward.store._syncthread was not built (no C compiler): every sync is made in place")
    job.add(["x0", "x1", "x2", "a", "b"])
    summary = job.run()
    assert (summary.done, summary.failed) == (5, 0)
    assert left_running[-1], left_running  # a's sync ran beside b (b's, the last task's, is made in place)
    print(f"a told {waited[0] * 1000:.1f} ms after b started")
    job.close()


def test_a_tasks_own_turn_does_not_wait_for_an_earlier_turns_sync(tmp_path: Path) -> None:
    """At concurrency 1 each task's thread commits its outcome with the next claim and leaves the log's sync
    running beside the next task (Store.sync_ahead). The first sync left so is held back here until the last
    task runs: the turns in between must not wait for it (they share the syncs of their moment instead of
    standing in one each, PIPELINED_SYNC_GATHER), and nothing that sync was to make durable may be told
    before it returned."""
    told: list[str] = []

    class Watching(io.StringIO):
        def write(self, text: str) -> int:
            match = re.search(r' done task="([^"]+)"', text)
            if match:
                told.append(match[1])
            return super().write(text)

    job = Job(str(tmp_path / "s.db"), log_level=NORMAL, heartbeat=30, max_attempts=1)
    job.log = Log(NORMAL, Watching())
    if job.store.sync_ahead_fd() is None:
        pytest.skip("onward.store._syncthread was not built (no C compiler): every sync is made in place")
    release = threading.Event()
    held: list[str] = []  # what had been told when the held sync was left running
    released_by_the_last_task: list[bool] = []
    real_sync_ahead = job.store.sync_ahead

    def sync_ahead(gather: float = 0.0) -> Any:
        real = real_sync_ahead(gather)
        if real is None or held:
            return real
        held.append(",".join(told))

        def wait() -> None:
            released_by_the_last_task.append(release.wait(10))
            real()
        return PendingSync(wait, lambda: release.is_set() and real.finished())
    job.store.sync_ahead = sync_ahead  # type: ignore[method-assign]

    names = [f"t{i}" for i in range(8)]
    told_while_held: list[str] = []

    @job.task
    def handle(task: str, ctx: TaskContext) -> str:
        if task == names[-1]:
            told_while_held.extend(told)
            release.set()  # every task before this one ran with the held sync still owed
        return task

    job.add(names)
    summary = job.run()
    assert (summary.done, summary.failed) == (8, 0)
    assert held, "no sync was left running beside a task"
    assert released_by_the_last_task == [True], \
        "a turn waited for the held sync (10 s) instead of running the next tasks"
    # Nothing the held sync covered, nor anything committed after it, was told before it returned; then
    # everything, in commit order, every task once.
    assert ",".join(told_while_held) == held[0], (told_while_held, held)
    assert told == names, told
    job.close()


@pytest.mark.parametrize("concurrency", [1, 4])
def test_a_report_that_meets_a_memory_error_is_told_again_later_once_and_the_worker_goes_on(
        tmp_path: Path, concurrency: int) -> None:
    """A Python task may hold all memory in the moment a turn tells what an earlier commit settled: the log
    line of a report then fails with MemoryError (tests/crash/test_memory_faults.py makes it so for real, in
    about half the runs before this was handled, when the worker ended with the traceback). Here the stream
    refuses the first `done` line of t3 once. That report and the ones after it are told at a later turn:
    the run ends normally, every task is told done once and in order, and the tally counts each once."""
    told: list[str] = []
    refused: list[str] = []

    class RefusingOnce(io.StringIO):
        def write(self, text: str) -> int:
            match = re.search(r' done task="([^"]+)"', text)
            if match and match[1] == "t3" and not refused:
                refused.append(match[1])
                raise MemoryError
            if match:
                told.append(match[1])
            return super().write(text)

    job = Job(str(tmp_path / "s.db"), log_level=NORMAL, concurrency=concurrency, max_attempts=1)
    job.log = Log(NORMAL, RefusingOnce())
    names = [f"t{i}" for i in range(12)]

    @job.task
    def handle(task: str, ctx: TaskContext) -> str:
        return task

    job.add(names)
    summary = job.run()  # raised the MemoryError before
    assert refused == ["t3"]
    assert (summary.done, summary.failed, summary.retried) == (12, 0, 0)
    assert sorted(told) == sorted(names) and len(told) == 12, told
    if concurrency == 1:
        assert told == names  # in commit order
    job.close()


def test_reports_that_find_no_memory_for_a_whole_lease_end_the_worker(tmp_path: Path) -> None:
    """Memory that stays gone is the machine's, not a task's moment: the loop looks again every 10 ms while a
    report cannot be told, and once that has lasted a whole lease it ends the worker with a MemoryError (what
    `onward run` says in one line, exit 75), rather than turning for ever. Here every `done` line of t3 is
    refused."""
    class AlwaysRefusing(io.StringIO):
        def write(self, text: str) -> int:
            if ' done task="t3"' in text:
                raise MemoryError
            return super().write(text)

    job = Job(str(tmp_path / "s.db"), log_level=NORMAL, heartbeat=0.2, max_attempts=1)  # a lease of 0.6 s
    job.log = Log(NORMAL, AlwaysRefusing())

    @job.task
    def handle(task: str, ctx: TaskContext) -> str:
        return task

    job.add(f"t{i}" for i in range(6))
    ended: list[BaseException | None] = []

    def run() -> None:
        try:
            job.run()
            ended.append(None)
        except BaseException as e:  # the outcome under test
            ended.append(e)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    assert ended, "the worker was still turning 60 s later"
    assert isinstance(ended[0], MemoryError) and "for a whole lease" in str(ended[0]), ended
