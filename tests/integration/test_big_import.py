"""A big import shares the store: it commits in chunks, so running workers keep renewing their leases, and
an import killed half-way resumes from what it committed."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from onward.store import open_store
from tests.conftest import onward_argv, run_onward, wait_for

LINES = 1_500_000  # one transaction for these held the write lock for about 5 s on a 2-core machine


def write_big_file(path: Path, lines: int = LINES) -> Path:
    with path.open("w") as out:
        for start in range(0, lines, 100_000):
            out.write("".join(f"item-{i:09d}\n" for i in range(start, min(lines, start + 100_000))))
    return path


def stored_tasks(url: str) -> int:
    store = open_store(url, create=False)
    try:
        return sum(store.counts().values())
    finally:
        store.close()


def test_a_big_import_leaves_running_workers_their_turn_at_the_write_lock(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    assert run_onward("add", "--db", db, "slow").returncode == 0
    started = tmp_path / "started"
    worker = subprocess.Popen(
        onward_argv("run", "--db", db, "--heartbeat", "0.5", "--grace", "0.5", "--", "sh", "-c",
                    f"touch {started}; exec sleep 300"),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    big = write_big_file(tmp_path / "big.txt")
    reader = open_store(db, create=False)
    try:
        wait_for(started.exists, 30, "the worker's task to start")
        importer = subprocess.Popen(onward_argv("add", "--db", db, "--tasks", str(big)),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        longest, samples = 0.0, 0
        while importer.poll() is None:
            workers = reader.workers()  # a reader: WAL never makes it wait for the writer
            longest = max(longest, workers[0].heartbeat_age)
            samples += 1
            time.sleep(0.05)
        _, err = importer.communicate()
        assert importer.returncode == 0, err
        assert stored_tasks(db) == LINES + 1
        assert samples >= 20, samples  # the worker was watched while the import ran
        # The worker renews every 0.5 s; one transaction for the whole import made it wait ~5 s for the
        # write lock. A generous bound, so that only a lock held for seconds fails it, not a busy machine.
        assert longest < 3.0, f"the worker could not renew its lease for {longest:.1f} s during the import"
        assert worker.poll() is None
    finally:
        reader.close()
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)


KILLED_LINES = 200_000  # about twenty 0.1 s chunks on this machine: room to be killed between two


def test_an_import_killed_half_way_adds_the_rest_exactly_once_when_run_again(tmp_path: Path, store_url: str,
                                                                           seed: int) -> None:
    big = write_big_file(tmp_path / "big.txt", KILLED_LINES)
    assert run_onward("add", "--db", store_url, "before").returncode == 0
    importer = subprocess.Popen(onward_argv("add", "--db", store_url, "--tasks", str(big)),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    threshold = 1 + KILLED_LINES // 10 + seed % (KILLED_LINES // 3)  # kill somewhere in the first half
    wait_for(lambda: stored_tasks(store_url) > threshold or importer.poll() is not None, 120,
             "part of the import", interval=0.01)
    os.kill(importer.pid, signal.SIGKILL)
    importer.wait(10)
    assert importer.returncode == -signal.SIGKILL, "the import finished before it could be killed"
    committed = stored_tasks(store_url) - 1
    assert 0 < committed < KILLED_LINES
    store = open_store(store_url, create=False)
    mark = store.get_source(str(big.resolve()))
    store.close()
    assert mark is not None and mark.lines == committed  # the mark covers exactly what was committed
    r = run_onward("add", "--db", store_url, "--tasks", str(big))
    assert r.returncode == 0, r.stderr
    assert r.stderr.decode().strip() == f"added {KILLED_LINES - committed} new tasks"
    store = open_store(store_url, create=False)
    try:
        if hasattr(store, "integrity_check"):
            assert store.integrity_check() == "ok"
        names = [row.name for row in store.iter_tasks()]
        assert names == ["before", *(f"item-{i:09d}" for i in range(KILLED_LINES))]  # each once, in file order
    finally:
        store.close()
