"""Regression tests for what the hostile-input properties found, one per bug, each named after it."""

from __future__ import annotations

import sqlite3
import subprocess
from pathlib import Path

import pytest

from tests.conftest import run_onward


def _store_with_tasks(tmp_path: Path) -> Path:
    db = tmp_path / "s.db"
    done = run_onward("add", "--db", str(db), "alpha", "beta")
    assert done.returncode == 0, done.stderr
    c = sqlite3.connect(db)
    c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    c.close()
    return db


def _one_line_exit_2(done: subprocess.CompletedProcess[bytes]) -> str:
    assert done.returncode == 2, done
    lines = done.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("onward: error: "), lines
    return str(lines[0])


def test_a_damaged_schema_is_reported_in_one_line_not_the_schema_sql_over_many(tmp_path: Path) -> None:
    db = _store_with_tasks(tmp_path)
    c = sqlite3.connect(db)
    (schema,) = c.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'tasks'").fetchone()
    c.close()
    data = bytearray(db.read_bytes())
    at = data.index(schema.encode())
    data[at + 20: at + 24] = b"(((("  # the tasks table's SQL no longer parses
    db.write_bytes(bytes(data))
    line = _one_line_exit_2(run_onward("status", "--db", str(db)))
    assert "corrupt" in line or "malformed" in line


def test_a_text_value_that_is_not_utf8_in_a_damaged_store_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    db = _store_with_tasks(tmp_path)
    # An invalid UTF-8 sequence inside the stored name, in the table and in its index alike.
    db.write_bytes(db.read_bytes().replace(b"alpha", b"a\xcepha"))
    line = _one_line_exit_2(run_onward("list", "--db", str(db)))
    assert "not valid UTF-8" in line


@pytest.mark.parametrize(("flag", "value", "words"), [
    ("--heartbeat", "2147484", "'--heartbeat': 2147484 is more than 1,000,000 seconds"),  # overflowed epoll's
    ("--timeout", "1e7", "'--timeout': 1e7 is more than 1,000,000 seconds"),
    ("--concurrency", "9" * 40, "concurrency must be at most"),  # overflowed an SQL integer
    ("--max-attempts", "9" * 40, "max attempts must be at most"),
])
def test_a_number_beyond_what_timers_or_sql_integers_hold_is_refused_not_a_traceback(
        tmp_path: Path, flag: str, value: str, words: str) -> None:
    db = tmp_path / "store" / "s.db"
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("a\n")
    line = _one_line_exit_2(run_onward("run", "--db", str(db), "--tasks", str(tasks), flag, value, "--", "true"))
    assert words in line
    assert not db.parent.exists()


def test_a_retry_refused_by_a_damaged_journal_leaves_the_store_as_it_was(tmp_path: Path) -> None:
    # A bit flipped in the events table's SQL renames one of its columns: every write of the journal then
    # fails. The retry and its journal line are one commit, so the refusal changes no byte (before, the tasks
    # went back to pending, and the journal line after it failed).
    db = tmp_path / "s.db"
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("ok\nbad\n")
    done = run_onward("run", "--db", str(db), "--tasks", str(tasks), "-q", "--max-attempts", "1", "--",
                      "sh", "-c", 'test "$1" = ok', "x", "{task}")
    assert done.returncode == 3, done.stderr  # "bad" failed
    c = sqlite3.connect(db)
    c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    (schema,) = c.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'events'").fetchone()
    c.close()
    data = bytearray(db.read_bytes())
    tail = schema[schema.index("worker_id"):]  # the long SQL overflows its page: look for its tail
    at = data.index(tail.encode())
    assert data.count(tail.encode()) == 1
    data[at] ^= 1  # worker_id -> vorker_id
    db.write_bytes(bytes(data))
    before = db.read_bytes()
    for command in (["retry", "--failed"], ["retry", "bad"]):
        line = _one_line_exit_2(run_onward(*command, "--db", str(db)))
        assert "worker_id" in line
        assert db.read_bytes() == before, f"{command}: a refused retry must keep every byte"
