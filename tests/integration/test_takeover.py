"""Taking a task over from its owner, when the owner is alive but late: real workers, a real store on each
backend, the owner stopped and resumed with real signals at the moment that matters."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, cast

import pytest

from onward import Job
from onward.errors import StoreError
from onward.log import Log
from onward.reclaim import reclaim_abandoned
from onward.store import open_store
from onward.store.base import PENDING, Lease, Reclaimed, RunningTask, Store
from tests.conftest import onward_argv, wait_for, worker
from tests.integration.test_cli_run import frozen_by_cgroup, stopped_with_sigstop

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


class OwnerRenewsAfterTheRead:
    """The store as a taker-over sees it, except that right after it reads the running tasks, the stopped
    owner is resumed and renews its lease (seen through another handle) before the taker goes on."""

    def __init__(self, store: Store, watch: Store, owner_pid: int) -> None:
        self._store, self._watch, self._owner_pid = store, watch, owner_pid

    def running_tasks(self) -> list[RunningTask]:
        tasks = self._store.running_tasks()
        assert [t.lease_expired for t in tasks] == [True]
        os.kill(self._owner_pid, signal.SIGCONT)
        wait_for(lambda: not self._watch.running_tasks()[0].lease_expired, 30, "the owner to renew its lease")
        return tasks

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def test_an_owner_that_renews_as_it_is_taken_over_keeps_its_task_and_its_command(store_url: str,
                                                                                 tmp_path: Path) -> None:
    """A worker stopped (SIGSTOP) past its lease is resumed right after another worker read the running
    tasks and found its lease expired, and renews at once. The takeover must then not happen, nor the
    command be killed: it was killed on that stale read, before a takeover that then counted an attempt
    for nothing and fenced a live owner."""
    store = open_store(store_url)
    store.add(["t"])
    pidfile, gate, marks = tmp_path / "child.pid", tmp_path / "gate", tmp_path / "marks"
    script = (f'echo $$ > {pidfile}; while [ ! -e {gate} ]; do sleep 0.05; done; '
              f'echo "end $ONWARD_ATTEMPT" >> {marks}')
    owner = subprocess.Popen(onward_argv("run", "--db", store_url, "--heartbeat", "0.3", "--lease", "1", "--",
                                         "sh", "-c", script),
                             env=dict(os.environ, PYTHONPATH=SRC), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    watch = open_store(store_url)
    try:
        wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), 30, "the owner's command to start")
        child = int(pidfile.read_text())
        os.kill(owner.pid, signal.SIGSTOP)
        wait_for(lambda: watch.running_tasks()[0].lease_expired, 30, "the stopped owner's lease to expire")
        (before,) = watch.running_tasks()
        taker = worker(store)
        log_text = io.StringIO()
        reclaim_abandoned(cast(Store, OwnerRenewsAfterTheRead(store, watch, owner.pid)), taker, set(),
                          Log(stream=log_text))
        assert _alive(child), "the live owner's command was killed"
        (after,) = watch.running_tasks()
        assert (after.fence, after.worker_id) == (before.fence, before.worker_id), log_text.getvalue()
        gate.touch()
        _, err = owner.communicate(timeout=60)
    finally:
        gate.touch()
        if owner.poll() is None:
            os.kill(owner.pid, signal.SIGCONT)
            owner.kill()
            owner.wait()
        watch.close()
    assert owner.returncode == 0, err
    assert b"fenced" not in err, err
    assert marks.read_text() == "end 1\n"
    row = store.task("t")
    assert row is not None and (row.state, row.attempts) == ("done", 1)
    assert not [e for e in store.events() if e.kind in ("reclaimed", "fenced")]
    store.close()


def test_the_owner_cannot_renew_while_a_takeover_decides(store_url: str) -> None:
    """What the taker-over decides on (the task read again by ``reclaim``) holds until its takeover commits:
    the owner's renewal, tried while it decides, waits for it (and, bounded, gives up), and once the
    takeover committed it finds its task taken over; a renewal after a decision to leave the task holds."""
    owner, taker = open_store(store_url), open_store(store_url)
    try:
        owner.add(["t"])
        w = worker(owner)
        (c,) = owner.claim(w, 1, 0.5, 3)  # a lease of 0.5 s: a store call waits at most 0.25 s for a lock
        wait_for(lambda: taker.running_tasks()[0].lease_expired, 30, "the lease to expire")
        renewals: list[str] = []

        def decide(task: RunningTask) -> str | None:
            assert task.lease_expired and task.task_id == c.task_id
            try:
                renewals.append(f"renewed, lost {owner.renew(w, [Lease(task.task_id, task.fence)], 0.5, 0)}")
            except StoreError as e:
                renewals.append(f"refused: {e}")
            return "lease expired" if len(renewals) == 1 else None

        assert taker.reclaim(c.task_id, c.fence, decide) == Reclaimed(PENDING, counted=True)
        assert renewals[0].startswith("refused"), renewals
        assert owner.renew(w, [Lease(c.task_id, c.fence)], 0.5, 0) == [c.task_id]

        (c2,) = owner.claim(w, 1, 0.5, 3)
        wait_for(lambda: taker.running_tasks()[0].lease_expired, 30, "the lease to expire again")
        assert taker.reclaim(c2.task_id, c2.fence, decide) is None
        assert renewals[1].startswith("refused"), renewals
        assert owner.renew(w, [Lease(c2.task_id, c2.fence)], 30, 0) == []
        (running,) = taker.running_tasks()
        assert running.fence == c2.fence and not running.lease_expired
    finally:
        owner.close()
        taker.close()


class AnotherTakerReadsAfterTheFirstReclaim:
    """The store as one taker-over sees it, except that once its first reclaim has returned, a second
    taker-over (another worker, through its own handle) runs its whole look at the running tasks before the
    first goes on: the moment two workers' heartbeats meet over a dead worker's tasks."""

    def __init__(self, store: Store, other: Store, other_id: int) -> None:
        self._store, self._other, self._other_id = store, other, other_id
        self.other_failed: list[str] = []
        self._reclaims = 0

    def reclaim(self, *args: Any, **kwargs: Any) -> Reclaimed | None:
        done = self._store.reclaim(*args, **kwargs)
        self._reclaims += 1
        if self._reclaims == 1:
            def other_look() -> None:
                try:
                    reclaim_abandoned(self._other, self._other_id, set(), Log(stream=io.StringIO()))
                except StoreError as e:  # waited for our lock past its bound: it looks again at its next beat
                    self.other_failed.append(str(e))
            look = threading.Thread(target=other_look)
            look.start()
            look.join(timeout=60)
            assert not look.is_alive(), "the second taker-over never returned"
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def test_two_workers_taking_over_a_dead_workers_tasks_at_once_count_none_of_them(store_url: str) -> None:
    """A worker dies (its process is gone) with two tasks running beside each other: neither attempt counts,
    each task gets one more and runs alone from then on (see Store.reclaim). Two live workers look at once:
    the second reads the running tasks after the first took back one of the two. It used to see the other
    one running alone, and count its attempt as if its owner had died running only that task."""
    first, second = open_store(store_url), open_store(store_url)
    try:
        first.add(["a", "b"])
        # The owner: a process of this host that claims both tasks and exits without a word.
        subprocess.run([sys.executable, "-c",
                        "import os, sys\n"
                        "from onward.store import open_store\n"
                        "from onward.proc import current_owner\n"
                        "s = open_store(sys.argv[1])\n"
                        "w = s.register_worker(current_owner(), 'test')\n"
                        "assert len(s.claim(w, 2, 30, 3)) == 2\n"
                        "os._exit(0)\n", store_url],
                       env=dict(os.environ, PYTHONPATH=SRC), check=True, timeout=60)
        assert sorted(t.name for t in first.running_tasks()) == ["a", "b"]
        first_id, second_id = worker(first), worker(second)
        second.renew(second_id, [], 0.5, 0)  # the second waits at most 0.25 s for a lock the first holds
        seen = AnotherTakerReadsAfterTheFirstReclaim(first, second, second_id)
        log_text = io.StringIO()
        reclaim_abandoned(cast(Store, seen), first_id, set(), Log(stream=log_text))
        kinds = sorted((e.task or "", e.kind) for e in first.events() if e.kind in ("reclaimed", "interrupted"))
        assert kinds == [("a", "interrupted"), ("b", "interrupted")], (kinds, log_text.getvalue(), seen.other_failed)
        for name in ("a", "b"):
            row = first.task(name)
            assert row is not None and (row.state, row.attempts) == (PENDING, 1), row
        alone = [first.claim(first_id, 1, 30, 3, alone=True) for _ in range(2)]
        assert sorted((c.name, c.alone, c.max_attempts) for (c,) in alone) == [("a", True, 4), ("b", True, 4)]
    finally:
        first.close()
        second.close()


# A Python task run by the Job API: a thread, which cannot be killed. It writes a line (worker, time) every
# 0.05 s and never looks at its cancellation; the worker that took it over ("B") ends once the gate exists.
PY_WORKER = """
import os, sys, time
from onward import Job
db, side, gate, label = sys.argv[1:5]
job = Job(db, max_attempts=5)
@job.task
def handle(task, ctx):
    for _ in range(2400):
        with open(side, "a") as f:
            f.write(f"{label} {time.time():.6f}\\n")
        if label == "B" and os.path.exists(gate):
            return "ok"
        time.sleep(0.05)
    return "ok"
job.run(heartbeat=0.3, grace=600)
"""


def _side_effects(side: Path) -> list[tuple[str, float]]:
    if not side.exists():
        return []
    return [(label, float(at)) for label, at in (line.split() for line in side.read_text().splitlines() if line)]


@pytest.mark.parametrize("pause", [stopped_with_sigstop, frozen_by_cgroup], ids=["sigstop", "freezer"])
def test_a_thawed_worker_whose_python_task_ignores_its_cancellation_leaves_soon(
        store_url: str, tmp_path: Path, pause: Callable[[int, int], AbstractContextManager[None]]) -> None:
    """Worker A is frozen past its lease with a Python task that never checks its cancellation; worker B
    takes the task over. Thawed, A learns its task was taken over, but cannot kill the thread: it must exit
    (WedgedTask, status 4) within a second or so, not after --grace (600 s here) nor when the task ends on
    its own (2 minutes), while B's attempt of the same task runs on beside it."""
    side, gate, script = tmp_path / "side", tmp_path / "gate", tmp_path / "worker.py"
    script.write_text(PY_WORKER)
    workers: dict[str, subprocess.Popen[bytes]] = {}
    job = Job(store_url)
    job.add(["t"])
    job.close()

    def start(label: str) -> None:
        workers[label] = subprocess.Popen([sys.executable, str(script), store_url, str(side), str(gate), label],
                                          env=dict(os.environ, PYTHONPATH=SRC), stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE)
    try:
        start("A")
        wait_for(lambda: any(label == "A" for label, _ in _side_effects(side)), 30, "A's task to start")
        with pause(workers["A"].pid, workers["A"].pid):
            start("B")
            wait_for(lambda: any(label == "B" for label, _ in _side_effects(side)), 60, "B to take the task over")
            thawed_at = time.time()
        wait_for(lambda: workers["A"].poll() is not None, 30, "the thawed worker A to exit")
        _, err_a = workers["A"].communicate()
        gate.touch()
        _, err_b = workers["B"].communicate(timeout=60)
    finally:
        gate.touch()
        for p in workers.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    assert workers["B"].returncode == 0, err_b
    assert b"WedgedTask" in err_a and b"ignored cancellation (lease lost: the task was taken over)" in err_a, err_a
    lines = _side_effects(side)
    after_thaw = [at for label, at in lines if label == "A" and at >= thawed_at]
    b_times = [at for label, at in lines if label == "B"]
    overlap = (max(after_thaw) - thawed_at) if after_thaw else 0.0
    print(f"A's task wrote {len(after_thaw)} lines over {overlap:.2f} s after the thaw, beside B's attempt")
    # A's side effects ended while B's attempt still ran: bounded by the worker, not by the task or the grace.
    assert not after_thaw or max(after_thaw) < max(b_times)
    job = Job(store_url)
    row = job.store.task("t")
    assert row is not None and row.state == "done"
    job.close()
