"""What only the SQLite backend does: the file, its modes, and refusing files that are not a store."""

from __future__ import annotations

import os
import sqlite3
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from onward.errors import CorruptStore, NotAStore, SchemaTooNew, SchemaTooOld, StoreError, StoreMissing
from onward.store import open_store
from onward.store.sqlite import SqliteStore


def test_new_store_is_private(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "er" / "onward.db"
    store = open_store(str(path))
    store.add(["a"])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    for suffix in ("-wal", "-shm"):
        side = Path(str(path) + suffix)
        assert stat.S_IMODE(side.stat().st_mode) == 0o600
    store.close()


def test_wal_and_full_sync(tmp_path: Path) -> None:
    store = SqliteStore(str(tmp_path / "s.db"))
    db = store._db
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    assert db.execute("PRAGMA busy_timeout").fetchone()[0] > 0
    store.close()


def test_sqlite_url(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path}/u.db")
    store.add(["a"])
    store.close()
    assert (tmp_path / "u.db").exists()


def test_missing_store_is_not_created_for_reading(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no onward store"):
        open_store(str(tmp_path / "nope.db"), create=False)
    assert not (tmp_path / "nope.db").exists()


def _unchanged(path: Path) -> Callable[[], bool]:
    before = path.read_bytes()
    return lambda: path.read_bytes() == before


def test_text_file_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("my precious notes\n")
    same = _unchanged(path)
    with pytest.raises(NotAStore, match="not an SQLite database"):
        open_store(str(path))
    assert same()
    assert not Path(str(path) + "-wal").exists()


def test_other_sqlite_database_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE people (name TEXT)")
    db.execute("INSERT INTO people VALUES ('ada')")
    db.commit()
    db.close()
    same = _unchanged(path)
    with pytest.raises(NotAStore, match="another SQLite database"):
        open_store(str(path))
    assert same()


@pytest.mark.parametrize("version, error, message", [
    ("99", SchemaTooNew, "schema version 99, newer than this onward"),
    ("1", SchemaTooOld, "onward db upgrade"),  # (0 is no version at all: see test_schema_version.py)
])
def test_other_schema_versions_are_refused(tmp_path: Path, version: str, error: type, message: str) -> None:
    path = tmp_path / "s.db"
    open_store(str(path)).close()
    db = sqlite3.connect(path)
    db.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (version,))
    db.commit()
    db.close()
    with pytest.raises(error, match=message):
        open_store(str(path))


def test_corrupt_file_is_reported_not_recreated(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    store = open_store(str(path))
    store.add([f"task-{i}" for i in range(2000)])
    store.close()
    # checkpointed and closed: everything lives in the main file now. Scribble over its pages.
    data = bytearray(path.read_bytes())
    assert len(data) > 8192
    for offset in range(100, len(data), 997):
        data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    same = _unchanged(path)
    with pytest.raises((CorruptStore, NotAStore)):
        s = open_store(str(path))
        list(s.iter_tasks())
        s.counts()
        s.close()
    assert same()


def test_directory_is_not_a_store(tmp_path: Path) -> None:
    with pytest.raises(NotAStore):
        open_store(str(tmp_path))


def test_empty_file_is_initialised(tmp_path: Path) -> None:
    # A zero-byte file holds nothing to lose (a creation interrupted before its first write).
    path = tmp_path / "empty.db"
    path.touch()
    store = open_store(str(path))
    assert store.add(["a"]) == 1
    store.close()


def test_integrity_after_use(tmp_path: Path) -> None:
    store = SqliteStore(str(tmp_path / "s.db"))
    store.add(["a"])
    assert store.integrity_check() == "ok"
    store.close()
    assert os.path.getsize(tmp_path / "s.db") > 0


def test_list_on_a_store_that_fails_mid_read_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    from tests.conftest import run_onward

    path = tmp_path / "s.db"
    store = open_store(str(path))
    store.add([f"task-{i:06d}" for i in range(20_000)])
    store.close()
    # A real fault half-way through the listing: the pages holding task 15000 (its table row and its
    # index entry) are wiped, as a bad sector or a stray write would leave them.
    data = bytearray(path.read_bytes())
    page_size = int.from_bytes(data[16:18], "big")
    hits = [i for i in range(0, len(data), page_size) if b"task-015000" in data[i:i + page_size]]
    assert hits
    for start in hits:
        data[start:start + page_size] = bytes(page_size)
    path.write_bytes(bytes(data))
    r = run_onward("list", "--db", str(path))
    lines = r.stderr.decode().strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and lines[0].startswith("onward: error: store") and "corrupt" in lines[0], r.stderr
    assert r.stdout.startswith(b"task-000000\ntask-000001\n")  # it failed mid-read, after printing some


@pytest.mark.parametrize("call", ["claim", "renew"])
def test_a_call_blocked_by_another_writer_fails_within_a_quarter_of_the_lease(tmp_path: Path, call: str) -> None:
    """The runner stops its tasks a third of a lease before the lease runs out, counting on no store call
    taking longer than a quarter of it. A second connection holding SQLite's write lock must make the
    call fail with StoreError within about that quarter, instead of waiting out the lease (and more)."""
    import time

    from onward.proc import current_owner
    from onward.store.base import Lease

    path = str(tmp_path / "s.db")
    store = open_store(path)
    store.add(["a"])
    worker_id = store.register_worker(current_owner(), "test")
    lease = 8.0  # a quarter: 2 s
    (claim,) = store.claim(worker_id, 1, lease, 3)
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        started = time.monotonic()
        with pytest.raises(StoreError, match="locked"):
            if call == "claim":
                store.claim(worker_id, 1, lease, 3)
            else:
                store.renew(worker_id, [Lease(claim.task_id, claim.fence)], lease, 0)
        waited = time.monotonic() - started
    finally:
        other.execute("ROLLBACK")
        other.close()
    print(f"{call} failed after {waited:.2f} s")
    assert waited < lease / 2, waited
    store.close()


def test_a_job_faster_than_the_rate_sample_is_measured_over_its_latest_completions(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import onward.store.sqlite as sqlite_backend

    monkeypatch.setattr(sqlite_backend, "RATE_SAMPLE", 100)
    store = open_store(str(tmp_path / "s.db"))
    store.add([f"t{i:03d}" for i in range(300)])
    now = store.now()
    # 300 completions 0.1 s apart, the latest now: 10 a second over the last 30 s.
    with store._db:  # type: ignore[attr-defined]
        for i in range(300):
            store._db.execute("UPDATE tasks SET state = 'done', finished_at = ? WHERE name = ?",  # type: ignore[attr-defined]
                              (now - (299 - i) * 0.1, f"t{i:03d}"))
    stats = store.stats()
    later = store.now()
    store.close()
    assert stats.done_last_minute == 100  # counted up to the sample, not all 300
    # The 100 latest span 9.9 s, and the moment since (up to `later`, which a loaded machine stretches):
    # about 10 a second, whatever the first event says.
    assert 9.9 <= stats.rate_window <= 9.9 + (later - now) + 0.001
    assert stats.done_last_minute / stats.rate_window <= 10.11


SRC = str(Path(__file__).resolve().parents[2] / "src")
CREATOR = "import sys; from onward.store.sqlite import SqliteStore; SqliteStore(sys.argv[1]).add(['a'])"


def test_a_store_opened_while_another_process_creates_it_waits_instead_of_failing(tmp_path: Path) -> None:
    """Switching a new file to WAL takes an exclusive lock that SQLite tries once, without the busy handler:
    a second connection opening the same new store at that moment (a reader, a second worker) made one of
    the two fail at once with "database is locked". Here a process creates a store while this one opens it
    over and over; neither may fail, in 60 rounds. (Before the fix, 17 of 150 such rounds failed here.)"""
    for trial in range(60):
        path = tmp_path / f"s{trial}.db"
        creator = subprocess.Popen([sys.executable, "-c", CREATOR, str(path)], env=dict(os.environ, PYTHONPATH=SRC),
                                   stderr=subprocess.PIPE)
        try:
            while creator.poll() is None:
                try:
                    SqliteStore(str(path), create=False).close()
                except StoreMissing:
                    pass  # not there yet, or its job not yet committed
        finally:
            _, err = creator.communicate(timeout=60)
        assert creator.returncode == 0, err.decode()[-1500:]


# --- the log synced beside the next task (SqliteStore.sync_ahead, onward.store._syncthread) -------------
def _readable(fd: int) -> bool:
    import select
    return bool(select.select([fd], [], [], 0)[0])


def test_sync_ahead_makes_the_commit_durable_on_a_thread_and_wakes_its_owner_only_when_left_unclaimed(
        tmp_path: Path) -> None:
    from tests.conftest import wait_for
    store = SqliteStore(str(tmp_path / "s.db"))
    fd = store.sync_ahead_fd()
    if fd is None:
        pytest.skip("onward.store._syncthread was not built (no C compiler): sync_ahead syncs in place")
    assert store.sync_ahead() is None  # nothing committed crash-safe yet: nothing owed
    store.add(["a", "b"])
    with store.batch(durable=False):
        store.claim(1, 1, 30.0, 3)
    wait = store.sync_ahead()
    assert wait is not None and store.sync_ahead() is None  # owed once: the request covers it
    # Left unclaimed, the finished sync makes the descriptor readable (after SYNC_AHEAD_LINGER, 20 ms)...
    wait_for(lambda: _readable(fd), 5, "the sync-ahead descriptor to wake an owner that did not wait")
    wait()
    assert not _readable(fd)  # ...and waiting for it takes that back
    with store.batch(durable=False):
        store.claim(1, 1, 30.0, 3)
    wait = store.sync_ahead()
    assert wait is not None
    wait()  # claimed at once: no wake-up
    assert not _readable(fd)
    store.close()
    store.close()


def _sync_thread_class() -> Any:
    import onward.store.sqlite as sqlite_backend
    if sqlite_backend.SyncThread is None:
        pytest.skip("onward.store._syncthread was not built (no C compiler): every sync is made in place")
    return sqlite_backend.SyncThread


def test_a_gathering_sync_waits_for_its_window_covers_the_requests_made_meanwhile_and_a_wait_starts_it(
        tmp_path: Path) -> None:
    from tests.conftest import wait_for
    sync_thread = _sync_thread_class()(60.0)  # (a linger longer than the test: no wake-up in the way)
    fd = os.open(tmp_path / "log", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.write(fd, b"a commit")
        first = sync_thread.request(fd, -1, 60.0)
        os.write(fd, b"another")
        second = sync_thread.request(fd, -1, 60.0)
        # Its window (60 s) holds it: not started in the next 0.3 s, where an fdatasync takes milliseconds.
        held_until = time.monotonic() + 0.3
        while time.monotonic() < held_until:
            assert not sync_thread.finished(first) and not sync_thread.finished(second)
            time.sleep(0.01)
        waited_at = time.monotonic()
        sync_thread.wait(first)  # starts it now, not when the window ends...
        assert time.monotonic() - waited_at < 30
        assert sync_thread.finished(second)  # ...and the one sync covered both requests
        # A request with no gather starts a gathering sync at once, as a wait does.
        third = sync_thread.request(fd, -1, 60.0)
        fourth = sync_thread.request(fd)
        wait_for(lambda: sync_thread.finished(third) and sync_thread.finished(fourth), 30,
                 "a request with no gather to start the sync of the window at once")
        sync_thread.request(fd, -1, 60.0)
        closed_at = time.monotonic()
        sync_thread.close()  # does not wait out the window either
        assert time.monotonic() - closed_at < 30
    finally:
        os.close(fd)


@pytest.mark.parametrize("gather", [-0.001, float("nan"), float("inf"), 3600.5])
def test_a_gather_that_is_not_a_number_of_seconds_up_to_an_hour_is_refused(tmp_path: Path, gather: float) -> None:
    sync_thread = _sync_thread_class()()
    fd = os.open(tmp_path / "log", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with pytest.raises(ValueError, match="gather must be between 0 and 3600 seconds"):
            sync_thread.request(fd, -1, gather)
    finally:
        os.close(fd)
        sync_thread.close()


def test_without_the_sync_thread_sync_ahead_syncs_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # An install built without a C compiler: no descriptor, the worker syncs before the next task instead.
    import onward.store.sqlite as sqlite_backend
    from onward import Job
    from onward.log import QUIET
    monkeypatch.setattr(sqlite_backend, "SyncThread", None)
    synced: list[int] = []
    real_fdatasync = os.fdatasync

    def fdatasync(fd: int) -> None:
        synced.append(fd)
        real_fdatasync(fd)
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    job = Job(str(tmp_path / "s.db"), log_level=QUIET)
    assert job.store.sync_ahead_fd() is None

    @job.task
    def handle(task: str, ctx: object) -> str:
        return task
    job.add(f"t{i}" for i in range(50))
    assert job.run().done == 50
    assert len(synced) >= 49  # one sync per completion, each in place (os.fdatasync, on the task's thread)
    job.close()


# --- the journal probe after a sync (SqliteStore._vouch) ----------------------------------------------
def _journal_probes() -> list[Callable[[int], bool]]:
    import onward.store.sqlite as sqlite_backend
    probes: list[Callable[[int], bool]] = [sqlite_backend.posix_journal_probe]
    if sqlite_backend.SyncThread is not None:
        probes.append(sqlite_backend.journal_probe)  # the C one (without a compiler, the same function)
    return probes


@pytest.mark.parametrize("probe", _journal_probes(), ids=lambda p: p.__module__)
def test_the_journal_probe_is_taken_by_a_file_and_changes_nothing_in_it(tmp_path: Path,
                                                                     probe: Callable[[int], bool]) -> None:
    # Not even the file's ctime: a change there would sit in the journal's running transaction, which the
    # next fdatasync of any file would then have to commit (the probe of before 2026-12-07, a fallocate,
    # cost each sync that commit). A descriptor open for reading only asks as well.
    path = tmp_path / "s.db"
    path.write_bytes(b"SQLite format 3\x00" + bytes(4080))
    for flags in (os.O_RDWR, os.O_RDONLY):
        fd = os.open(path, flags)
        try:
            before = os.fstat(fd)
            assert probe(fd) is True
            after = os.fstat(fd)
            assert (after.st_size, after.st_blocks, after.st_ctime_ns, after.st_mtime_ns) == \
                (before.st_size, before.st_blocks, before.st_ctime_ns, before.st_mtime_ns)
            assert os.listxattr(fd) == []
            assert path.read_bytes() == b"SQLite format 3\x00" + bytes(4080)
        finally:
            os.close(fd)


@pytest.mark.parametrize("probe", _journal_probes(), ids=lambda p: p.__module__)
def test_the_journal_probe_of_a_fifo_or_a_device_says_it_cannot_ask(
        tmp_path: Path, probe: Callable[[int], bool]) -> None:
    # Hostile twins of the store's file: a FIFO in its place, a device (neither takes user attributes).
    fifo = tmp_path / "s.db"
    os.mkfifo(fifo)
    for path, flags in ((fifo, os.O_RDWR | os.O_NONBLOCK), (Path(os.devnull), os.O_RDWR)):
        fd = os.open(path, flags)
        try:
            assert probe(fd) is False
        finally:
            os.close(fd)


def test_a_store_whose_filesystem_takes_no_probe_stops_asking_and_still_commits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import onward.store.sqlite as sqlite_backend
    asked: list[int] = []

    def unsupported(fd: int) -> bool:
        asked.append(fd)
        return False  # as on a filesystem without user extended attributes
    monkeypatch.setattr(sqlite_backend, "journal_probe", unsupported)
    store = SqliteStore(str(tmp_path / "s.db"))
    store.add(["a", "b", "c"])
    with store.batch(durable=False):
        store.claim(1, 1, 30.0, 3)
    store.sync()
    store.add(["d"])
    store.close()
    assert len(asked) == 1  # asked once, then never again
    c = sqlite3.connect(tmp_path / "s.db")
    assert c.execute("SELECT count(*) FROM tasks").fetchone()[0] == 4
    c.close()


# --- after a failed sync of the log (SqliteStore._rewrite_log) ------------------------------------------
def _failing_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next os.fdatasync fails with EIO, as a disk that could not write; the later ones work. (The real
    fault, a write the disk refused: tests/crash/test_power_cut.py.)"""
    import errno
    real_fdatasync = os.fdatasync
    failures = [OSError(errno.EIO, os.strerror(errno.EIO))]

    def fdatasync(fd: int) -> None:
        if failures:
            raise failures.pop()
        real_fdatasync(fd)
    monkeypatch.setattr(os, "fdatasync", fdatasync)


def _store_after_a_failed_sync(db: Path, monkeypatch: pytest.MonkeyPatch, claims: int) -> SqliteStore:
    """A store on ``db`` with three tasks, ``claims`` of them claimed crash-safe, whose sync of that failed."""
    from onward.errors import StoreUnavailable
    store = SqliteStore(str(db))
    store.add(["a", "b", "c"])
    with store.batch(durable=False):
        store.claim(1, claims, 30.0, 3)
    _failing_once(monkeypatch)
    with pytest.raises(StoreUnavailable, match="cannot make the last commit durable"):
        store.sync()
    return store


def _running(db: Path) -> int:
    c = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return int(c.execute("SELECT count(*) FROM tasks WHERE state = 'running'").fetchone()[0])
    finally:
        c.close()


def test_after_a_failed_sync_the_next_one_first_writes_the_log_into_the_database(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "s.db"
    store = _store_after_a_failed_sync(db, monkeypatch, claims=2)
    assert os.path.getsize(f"{db}-wal") > 0
    store.sync()  # the disk works again: the log is written into the database first, then emptied
    assert os.path.getsize(f"{db}-wal") == 0
    assert _running(db) == 2  # what a reader of the database file alone finds
    with store.batch(durable=False):  # and from then on, syncs are plain ones again
        store.claim(1, 1, 30.0, 3)
    store.sync()
    assert os.path.getsize(f"{db}-wal") > 0
    store.close()


def test_a_rewrite_that_a_reader_holds_up_vouches_for_nothing_and_commits_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A reader in the middle of a read (onward status, another worker) keeps the log from being emptied: the
    # rewrite is incomplete, so the sync is not vouched for; and before a durable commit nothing is committed.
    from onward.errors import StoreUnavailable
    db = tmp_path / "s.db"
    store = _store_after_a_failed_sync(db, monkeypatch, claims=1)
    reader = sqlite3.connect(db, timeout=0.1)
    reader.execute("BEGIN")
    assert reader.execute("SELECT count(*) FROM tasks WHERE state = 'running'").fetchone()[0] == 1
    store._db.execute("PRAGMA busy_timeout = 100")  # not the worker's 30 s: the test waits on no one
    with pytest.raises(StoreUnavailable, match="could not be written into the database"):
        store.sync()
    with pytest.raises(StoreUnavailable, match="could not be written into the database"):
        with store.batch(durable=True):
            store.claim(1, 1, 30.0, 3)
    reader.execute("COMMIT")
    assert reader.execute("SELECT count(*) FROM tasks WHERE state = 'running'").fetchone()[0] == 1
    reader.close()
    store.sync()
    with store.batch(durable=True):
        assert len(store.claim(1, 1, 30.0, 3)) == 1
    assert os.path.getsize(f"{db}-wal") > 0
    store.close()


def test_a_failed_sync_is_left_marked_for_the_next_process_until_a_rewrite(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A worker killed between its failed sync and its rewrite: the next one (here a second handle, as a new
    # process would open it) finds the mark and rewrites the log before its first durable commit.
    db = tmp_path / "s.db"
    first = _store_after_a_failed_sync(db, monkeypatch, claims=1)
    mark = Path(f"{db}-unsynced")
    assert mark.exists() and stat.S_IMODE(mark.stat().st_mode) == 0o600
    monkeypatch.undo()
    second = SqliteStore(str(db))
    with second.batch(durable=True):
        assert len(second.claim(2, 1, 30.0, 3)) == 1
    assert not mark.exists()
    assert _running(db) == 2
    first.close()
    second.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("planted", ["fifo", "symlink"])
def test_a_fifo_or_a_link_in_place_of_the_mark_neither_blocks_nor_writes_elsewhere(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, planted: str) -> None:
    # Hostile twins of STORE-unsynced: opened for writing, a FIFO without a reader would block the worker for
    # ever, and a symbolic link would have the mark created where it points (outside the store's folder).
    from onward.errors import StoreUnavailable
    db = tmp_path / "s.db"
    store = SqliteStore(str(db))
    store.add(["a", "b"])
    with store.batch(durable=False):
        store.claim(1, 1, 30.0, 3)
    store.sync()  # a sync that works first: the worker's descriptor of the log is open before the planting
    mark = Path(f"{db}-unsynced")
    target = tmp_path / "elsewhere" / "planted"
    target.parent.mkdir()
    if planted == "fifo":
        os.mkfifo(mark)
    else:
        mark.symlink_to(target)
    with store.batch(durable=False):
        store.claim(1, 1, 30.0, 3)
    _failing_once(monkeypatch)
    with pytest.raises(StoreUnavailable):
        store.sync()
    assert not target.exists()
    store.sync()  # rewritten all the same; what was planted is removed with the mark
    assert os.path.getsize(f"{db}-wal") == 0
    assert not os.path.lexists(mark) and not target.exists()
    store.close()


def _zero_frame(db: Path, frame: int) -> None:
    """Overwrite a frame of the log with zeros: what a page the failed sync did not write reads back as
    once the kernel dropped it from memory (the real fault: tests/crash/test_power_cut.py, pages-dropped)."""
    with open(f"{db}-wal", "r+b") as f:
        page_size = int.from_bytes(f.read(12)[8:12], "big")
        f.seek(32 + (frame - 1) * (24 + page_size))
        f.write(bytes(24 + page_size))


def test_a_log_that_reads_back_with_a_hole_is_never_checkpointed_and_recovers_at_the_next_open(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from onward.errors import StoreLogLost
    from onward.store.sqlite_wal import log_damage
    db = tmp_path / "s.db"
    store = _store_after_a_failed_sync(db, monkeypatch, claims=1)
    frames = (os.path.getsize(f"{db}-wal") - 32) // (24 + 4096)
    assert log_damage(str(db)) is None
    with store.batch(durable=False):  # a commit after the failure, to be lost with the hole
        store.claim(1, 1, 30.0, 3)
    total = (os.path.getsize(f"{db}-wal") - 32) // (24 + 4096)
    _zero_frame(db, frames)  # the last frame of the failed sync's commit
    database = db.read_bytes()
    with pytest.raises(StoreLogLost, match=f"dropped from memory \\(frame {frames} of {total} "):
        with store.batch(durable=True):
            store.claim(1, 1, 30.0, 3)
    with pytest.raises(StoreLogLost):
        store.sync()
    with pytest.raises(StoreLogLost):  # what stops the worker's loop: its heartbeat asks this
        store.check_still_there()
    store.close()  # the last connection: SQLite's checkpoint at its close is kept from running
    assert db.read_bytes() == database and os.path.getsize(f"{db}-wal") > 0
    assert Path(f"{db}-unsynced").exists()
    monkeypatch.undo()
    again = SqliteStore(str(db))  # SQLite's recovery reads the log up to the hole
    assert again.integrity_check() == "ok"
    assert again.counts()["running"] == 0  # the claims after the last whole commit are gone with the hole
    with again.batch(durable=True):
        assert len(again.claim(2, 1, 30.0, 3)) == 1
    assert not Path(f"{db}-unsynced").exists()
    again.close()
    assert not os.path.exists(f"{db}-wal")  # whole again: its close checkpoints as usual


def test_while_a_log_is_suspect_no_close_checkpoints_it_and_status_leaves_it_to_a_worker(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The close of the last connection checkpoints the log with the index that connection holds: after the
    # worker stopped on a hole, `onward status` opened before it stopped would copy the zeros. Every
    # connection onward opens while the mark is there keeps that checkpoint from running.
    from onward.store.sqlite_peek import NotPlain, QuickRead
    db = tmp_path / "s.db"
    first = _store_after_a_failed_sync(db, monkeypatch, claims=1)
    monkeypatch.undo()
    with pytest.raises(NotPlain):  # onward status's quick read: it opens the store the guarded way instead
        QuickRead(str(db), "default")
    second = SqliteStore(str(db))  # finds the mark
    first.close()
    database = db.read_bytes()
    second.close()  # now the last one
    assert db.read_bytes() == database and os.path.getsize(f"{db}-wal") > 0
    status = subprocess.run([sys.executable, "-m", "onward", "status", "--db", str(db)], capture_output=True,
                            text=True, env=dict(os.environ, PYTHONPATH=SRC))
    assert status.returncode == 0, status.stderr
    assert db.read_bytes() == database and os.path.getsize(f"{db}-wal") > 0


def test_a_rewritten_log_is_checkpointed_again_as_usual(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "s.db"
    store = _store_after_a_failed_sync(db, monkeypatch, claims=1)
    assert store._db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
    store.sync()  # rewritten
    assert store._db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 1000
    store.close()
    assert not os.path.exists(f"{db}-wal")


@pytest.mark.parametrize("last", ["store", "status"])
def test_a_connection_opened_before_the_failed_sync_does_not_checkpoint_the_log_at_its_close_either(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, last: str) -> None:
    # A dashboard's store, or onward status's quick read, opened while all was well, and closed last after a
    # worker's sync failed: its close would checkpoint the log with the index it holds, unread.
    from onward.store.sqlite_peek import QuickRead
    db = tmp_path / "s.db"
    early = SqliteStore(str(db))
    early.add(["x"])
    quick = QuickRead(str(db), "default")
    worker = _store_after_a_failed_sync(db, monkeypatch, claims=1)
    monkeypatch.undo()
    worker.close()
    if last == "store":
        quick.close()
    else:
        early.close()
    database = db.read_bytes()
    (early if last == "store" else quick).close()
    assert db.read_bytes() == database and os.path.getsize(f"{db}-wal") > 0


def _lose_the_last_frame_of_a_failed_sync(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's sync of the log fails, a commit follows, the failed frames read back as zeros (dropped by the
    kernel), and the worker stops on that (StoreLogLost) and closes: what a restarted worker then finds."""
    from onward.errors import StoreLogLost
    worker = _store_after_a_failed_sync(db, monkeypatch, claims=1)
    frames = (os.path.getsize(f"{db}-wal") - 32) // (24 + 4096)
    with worker.batch(durable=False):
        worker.claim(1, 1, 30.0, 3)
    _zero_frame(db, frames)
    with pytest.raises(StoreLogLost):
        with worker.batch(durable=True):
            worker.claim(1, 1, 30.0, 3)
    worker.close()
    monkeypatch.undo()


def _next_worker_commits(db: Path) -> bool:
    """Whether a worker opening the store now gets a durable commit through: False when it stops on the log."""
    from onward.errors import StoreLogLost
    store = SqliteStore(str(db))
    try:
        with store.batch(durable=True):
            store.claim(2, 1, 30.0, 3)
        return True
    except StoreLogLost:
        return False
    finally:
        store.close()


def _reader_beside_a_lost_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, SqliteStore]:
    """A store opened while all was well (as a dashboard's), then a worker that lost its log's pages and
    stopped (``_lose_the_last_frame_of_a_failed_sync``): the store's path and that reader."""
    db = tmp_path / "s.db"
    reader = SqliteStore(str(db))
    reader.add(["x"])
    _lose_the_last_frame_of_a_failed_sync(db, monkeypatch)
    return db, reader


def test_a_reader_opened_before_the_failure_lets_go_of_the_log_index_when_idle(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # While any connection keeps SQLite's index of the log (the dashboard's, opened when all was well), the
    # index counts the frames the kernel dropped, and every restarted worker stops on them again.
    db, reader = _reader_beside_a_lost_log(tmp_path, monkeypatch)
    assert not _next_worker_commits(db)  # the reader's connection keeps the old index alive
    reader.idle()  # the mark is there: closed and opened again, the only connection: SQLite rebuilds the index
    assert reader.counts()["pending"] == 4
    assert _next_worker_commits(db)
    assert not Path(f"{db}-unsynced").exists()
    connection = reader._db
    reader.idle()  # no mark: the same connection goes on
    assert reader._db is connection
    assert reader.integrity_check() == "ok"
    reader.close()
    assert not os.path.exists(f"{db}-wal")


def test_idle_never_opens_another_file_in_the_store_s_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from onward.errors import StoreGone
    db, reader = _reader_beside_a_lost_log(tmp_path, monkeypatch)
    os.rename(db, tmp_path / "elsewhere.db")
    with pytest.raises(StoreGone, match="was deleted"):
        reader.idle()
    assert not db.exists()
    db.write_bytes(b"")  # something else in its place: never taken for the store, never initialised
    with pytest.raises(StoreGone, match="replaced by another file"):
        reader.idle()
    assert db.read_bytes() == b""
    reader.close()


def _descriptors_of(pid: int, path: Path) -> int:
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}") == str(path)
        except FileNotFoundError:
            pass
    return count


@pytest.mark.parametrize("reader", ["dashboard", "status --watch", "logs -f"])
def test_a_long_lived_reader_does_not_keep_a_restarted_worker_stopping_on_a_lost_log(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reader: str) -> None:
    # The readers a user leaves running beside a job: each must let go of the log's index while the mark is
    # there, or the next worker stops on the lost pages again (status 75), for as long as the reader runs.
    from tests.conftest import onward_argv, wait_for
    db = tmp_path / "s.db"
    SqliteStore(str(db)).close()
    argv = {"dashboard": ["dashboard", "--db", str(db), "--port", "0"],
            "status --watch": ["status", "--db", str(db), "--watch", "--interval", "0.2"],
            "logs -f": ["logs", "--db", str(db), "-f"]}[reader]
    process = subprocess.Popen(onward_argv(*argv), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               env=dict(os.environ, PYTHONPATH=SRC))
    try:
        # Open: SQLite's descriptor of the database file, and the store's own (the guard's, see _guard_log).
        wait_for(lambda: _descriptors_of(process.pid, db) == 2, 20, f"{reader} to open the store")
        _lose_the_last_frame_of_a_failed_sync(db, monkeypatch)
        # A restarted worker stops on the lost frames while the reader holds the old index (it may have
        # opened again before the worker closed, too early to help); once the reader let go while no other
        # connection was open, the index is rebuilt, and the next restart gets through. Restarts are tried
        # as a supervisor would, until then: without the reader letting go, never.
        wait_for(lambda: _next_worker_commits(db), 30, f"a restarted worker to get through beside {reader}",
                 interval=0.3)
        assert not Path(f"{db}-unsynced").exists()
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
    finally:
        process.terminate()
        _, err = process.communicate(timeout=20)
    assert b"Traceback" not in err, err
    check = SqliteStore(str(db))
    assert check.integrity_check() == "ok"
    check.close()


@contextmanager
def _no_descriptor_left(spare: int = 0) -> Iterator[None]:
    """While the block runs, this process may open no more descriptors than ``spare`` (a real ``ulimit -n``
    reached: RLIMIT_NOFILE lowered to what is open, every gap below it taken)."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    hogs: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 1 + spare, hard))
    try:
        while True:
            try:
                hogs.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                break
        for _ in range(spare):
            os.close(hogs.pop())
        yield
    finally:
        for fd in hogs:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_idle_with_no_descriptor_left_still_lets_go_and_opens_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The guard's descriptor was opened with the store, and the new connection takes the ones the old let go.
    db, reader = _reader_beside_a_lost_log(tmp_path, monkeypatch)
    with _no_descriptor_left():
        assert reader.counts()["running"] == 2  # the old index (2 claims)
        reader.idle()
        assert reader.counts()["running"] == 0  # opened again: the index rebuilt, up to the hole
    assert _next_worker_commits(db)
    reader.close()


def test_a_reopen_that_fails_leaves_a_handle_that_fails_as_a_store_until_the_next_idle(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from onward.errors import StoreUnavailable
    db, reader = _reader_beside_a_lost_log(tmp_path, monkeypatch)
    real_connect = SqliteStore._connect

    def refused(self: SqliteStore, location: str, create: bool, upgrade: bool) -> None:
        raise StoreUnavailable(f"store {self.path}: disk I/O error")
    monkeypatch.setattr(SqliteStore, "_connect", refused)  # the open's own failure (an I/O error, say)
    with pytest.raises(StoreUnavailable, match="disk I/O error"):
        reader.idle()
    with pytest.raises(StoreError, match="not open again yet"):
        reader.counts()
    monkeypatch.setattr(SqliteStore, "_connect", real_connect)
    reader.idle()
    assert reader.counts()["pending"] == 4
    assert _next_worker_commits(db)
    reader.close()


# --- descriptors onward opens beside SQLite's (onward.store.sqlite_locks) -------------------------------------
OPEN_AND_CLOSE = ("import sqlite3, sys; c = sqlite3.connect(sys.argv[1]);"
                  " c.execute('SELECT count(*) FROM tasks').fetchone(); c.close()")


def _another_process_opens_and_closes(db: Path, how: str) -> None:
    if how == "sqlite3":
        subprocess.run([sys.executable, "-c", OPEN_AND_CLOSE, str(db)], check=True, timeout=60)
    else:
        status = subprocess.run([sys.executable, "-m", "onward", "status", "--db", str(db)], capture_output=True,
                                text=True, env=dict(os.environ, PYTHONPATH=SRC), timeout=60)
        assert status.returncode == 0, status.stderr


@pytest.mark.parametrize("how", ["sqlite3", "onward status"])
def test_after_a_rewrite_the_log_is_not_deleted_under_the_worker_by_another_process_s_close(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    # The rewrite opened and closed descriptors of the database file and of its -shm while the worker's
    # connection stayed open: the process's POSIX locks went with them, SQLite's SHARED lock among them, so
    # another process's close took itself for the last connection and deleted the log. The worker's next
    # durable commit then went into the deleted file.
    db = tmp_path / "s.db"
    store = _store_after_a_failed_sync(db, monkeypatch, claims=1)
    store.sync()  # the rewrite
    _another_process_opens_and_closes(db, how)
    assert os.path.exists(f"{db}-wal")
    with store.batch(durable=True):
        store.claim(1, 1, 30.0, 3)
    assert _running(db) == 2  # a new connection sees the commit
    store.close()
    assert _running(db) == 2


@pytest.mark.parametrize("second", ["opened", "refused"])
def test_opening_a_second_handle_in_the_same_process_keeps_the_first_one_s_locks(tmp_path: Path,
                                                                                  second: str) -> None:
    # Two Job objects on one store (two jobs of it, say), no fault at all: the second open's header check
    # closed its descriptor, and the process's SHARED lock went with it (SQLite, which counts its own
    # connections, does not take it again for the second one).
    db = tmp_path / "s.db"
    first = SqliteStore(str(db))
    first.add(["a", "b"])
    if second == "opened":
        other = SqliteStore(str(db), job="another")
    else:
        with pytest.raises(StoreMissing):  # its header read, then refused: nothing of it stays open
            SqliteStore(str(db), create=False, job="no such job")
    _another_process_opens_and_closes(db, "sqlite3")
    assert os.path.exists(f"{db}-wal")
    with first.batch(durable=True):
        first.claim(1, 1, 30.0, 3)
    assert _running(db) == 1
    first.close()
    if second == "opened":
        other.close()
    assert _running(db) == 1


def test_a_sync_that_fails_with_no_descriptor_left_still_keeps_the_log_from_being_checkpointed_unread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The guard's lock is taken on a descriptor opened with the store: at the failure, when the process may
    # have none left to open (nor can it make the mark), the close of the last connection still cannot copy
    # the log into the database unread.
    db = tmp_path / "s.db"
    store = SqliteStore(str(db))
    store.add(["a", "b", "c"])
    with store.batch(durable=False):
        store.claim(1, 1, 30.0, 3)
    store.sync()  # its descriptors of the log and for the journal probe are open from then on
    with store.batch(durable=False):
        store.claim(1, 1, 30.0, 3)
    database = db.read_bytes()
    with _no_descriptor_left():
        _failing_once(monkeypatch)
        with pytest.raises(StoreError, match="cannot make the last commit durable: Input/output error"):
            store.sync()
        monkeypatch.undo()
        assert not Path(f"{db}-unsynced").exists()  # no descriptor for it either
        store.close()  # the last connection
    assert db.read_bytes() == database and os.path.getsize(f"{db}-wal") > 0


def test_a_store_that_cannot_get_its_descriptor_at_open_says_so_in_one_error(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    SqliteStore(str(db)).close()
    with _no_descriptor_left(spare=3):  # SQLite's three (database, log, index), none for the store's own
        with pytest.raises(StoreError, match="Too many open files"):
            SqliteStore(str(db))
    SqliteStore(str(db)).close()
