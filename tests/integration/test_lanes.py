"""Turns taken on a task's own thread (``Runner.settle_here``): at concurrency 1 the thread of a Python task
that finished settles it and runs the next task itself, while the worker loop sleeps. What the loop does for
every attempt must still be done for those: their timeouts, and the heartbeats that renew their leases."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

from onward import Job, TaskContext
from onward.log import QUIET


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


def test_the_worker_heartbeats_while_tasks_settle_on_their_own_threads(tmp_path: Path) -> None:
    # Thousands of short tasks, each settled by its own thread: the loop must still get the turn every
    # heartbeat (0.1 s) to renew leases. Read from outside, the worker's heartbeat keeps moving.
    db = str(tmp_path / "s.db")
    job = Job(db, log_level=QUIET, heartbeat=0.1)

    @job.task
    def handle(task: str, ctx: TaskContext) -> str:
        time.sleep(0.0005)
        return task

    job.add(f"t{i:05d}" for i in range(3000))
    heartbeats: set[float] = set()
    done = threading.Event()

    def watch() -> None:
        reader = sqlite3.connect(db)
        while not done.is_set():
            try:
                heartbeats.update(r[0] for r in reader.execute("SELECT heartbeat_at FROM workers"))
            except sqlite3.OperationalError:
                pass  # busy for a moment: look again
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
