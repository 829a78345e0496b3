"""Resources over long runs: what a worker leaves behind it grows with the work, not with the time it ran."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import onward.store.sqlite
from onward import Job
from onward.log import QUIET
from onward.store.sqlite import JOURNAL_SIZE_LIMIT

# A user's own reader (a sqlite3 shell, a script) that opens a read transaction and keeps it until told.
HOLDING_READER = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN")
db.execute("SELECT count(*) FROM tasks").fetchone()
print("holding", flush=True)
sys.stdin.read()  # until the test closes our stdin
db.execute("COMMIT")
db.close()
"""


def test_a_log_a_reader_made_grow_shrinks_back_once_the_reader_lets_go(tmp_path: Path) -> None:
    """SQLite cannot checkpoint past a reader's snapshot: while one is held the log grows with every commit
    (about 18 KB a task). Once the reader lets go, the log is checkpointed and written again from its start;
    without a size limit it kept its largest size on disk for as long as any connection to the store stayed
    open (the worker's, a dashboard's), hundreds of MB after a minute's read transaction."""
    db = tmp_path / "s.db"
    wal = Path(f"{db}-wal")
    n, release_at = 3000, 1500
    job = Job(str(db), log_level=QUIET)
    job.add(str(i) for i in range(n))
    reader = subprocess.Popen([sys.executable, "-c", HOLDING_READER, str(db)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout is not None and reader.stdin is not None
        assert reader.stdout.readline().strip() == "holding"
        sizes: dict[int, int] = {}

        @job.task
        def noop(task: str, ctx: Any) -> str:
            i = int(task)
            sizes[i] = wal.stat().st_size
            if i == release_at:
                reader.stdin.close()  # type: ignore[union-attr]
                reader.wait(timeout=10)
            return task

        summary = job.run()
        assert summary.done == n
        grown = sizes[release_at]
        assert grown > 3 * JOURNAL_SIZE_LIMIT, f"the held snapshot should have grown the log: {grown} bytes"
        last = sizes[n - 1]
        assert last <= JOURNAL_SIZE_LIMIT, (
            f"the log stayed at {last:,} bytes after the reader let go (it grew to {grown:,}); "
            f"at most {JOURNAL_SIZE_LIMIT:,} expected")
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()


def test_a_worker_says_so_when_a_reader_holds_its_log_back(tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """While a reader holds one snapshot, the log grows by every commit and nothing else shows it until the
    disk is full: the worker warns (once a minute while it lasts), naming the cause. (The threshold is
    lowered from 64 MiB to 16 MiB, still twice what checkpoints leave, so that a few seconds of work reach it.)"""
    monkeypatch.setattr(onward.store.sqlite, "LOG_WARN_BYTES", 16 << 20)
    db = tmp_path / "s.db"
    job = Job(str(db), log_level=QUIET, concurrency=4, heartbeat=0.1)
    n = 8_000
    job.add(str(i) for i in range(n))
    reader = subprocess.Popen([sys.executable, "-c", HOLDING_READER, str(db)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout is not None and reader.stdin is not None
        assert reader.stdout.readline().strip() == "holding"

        @job.task
        def noop(task: str, ctx: Any) -> str:
            return task

        assert job.run().done == n
        grown = os.path.getsize(f"{db}-wal")
    finally:
        reader.kill()
        reader.wait()
    assert grown > 2 * onward.store.sqlite.LOG_WARN_BYTES, f"the log should have grown further: {grown:,} bytes"
    warnings = [line for line in capfd.readouterr().err.splitlines() if "the store's log is" in line]
    assert len(warnings) == 1, warnings  # once a minute at most
    assert "another connection holds a read transaction open" in warnings[0]
