"""The log reader behind the rewrite after a failed sync (onward.store.sqlite_wal): it must agree with
SQLite on a whole log, and name the first frame that does not check out."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from onward.store.sqlite_wal import INDEX_HEADER, log_damage, read_back


def _log(tmp_path: Path, commits: int) -> tuple[Path, sqlite3.Connection]:
    db = tmp_path / "w.db"
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA wal_autocheckpoint = 0")
    conn.execute("CREATE TABLE t (x)")
    for i in range(commits):
        conn.execute("INSERT INTO t VALUES (?)", (bytes([i % 256]) * 3000,))
    return db, conn


def test_a_whole_log_reads_back_whole(tmp_path: Path) -> None:
    db, conn = _log(tmp_path, 300)
    assert log_damage(str(db)) is None
    conn.close()


def test_a_frame_of_zeros_is_named(tmp_path: Path) -> None:
    db, conn = _log(tmp_path, 300)
    with open(f"{db}-wal", "r+b") as f:
        f.seek(32 + 99 * (24 + 4096))  # frame 100
        f.write(bytes(24 + 4096))
    damage = log_damage(str(db))
    assert damage is not None and damage.startswith("frame 100 of ") and damage.endswith("read back as zeros")
    conn.close()


def test_a_changed_byte_in_a_page_is_named(tmp_path: Path) -> None:
    db, conn = _log(tmp_path, 50)
    with open(f"{db}-wal", "r+b") as f:
        f.seek(32 + 9 * (24 + 4096) + 24 + 2000)  # inside frame 10's page
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    damage = log_damage(str(db))
    assert damage is not None and damage.startswith("frame 10 of ") and "fails its checksum" in damage
    conn.close()


def test_a_log_cut_short_is_named(tmp_path: Path) -> None:
    db, conn = _log(tmp_path, 50)
    wal = Path(f"{db}-wal")
    with open(wal, "r+b") as f:
        f.truncate(wal.stat().st_size - 100)
    damage = log_damage(str(db))
    assert damage is not None and "is cut short" in damage
    conn.close()


def test_no_log_and_no_index_is_no_damage(tmp_path: Path) -> None:
    db, conn = _log(tmp_path, 5)
    conn.close()  # the last connection: checkpointed, the log and its index removed
    assert not Path(f"{db}-wal").exists() and not Path(f"{db}-shm").exists()
    assert log_damage(str(db)) is None


def test_an_index_whose_two_headers_disagree_is_read_again_then_given_up(tmp_path: Path) -> None:
    db, conn = _log(tmp_path, 5)
    with open(f"{db}-shm", "r+b") as f:
        f.seek(INDEX_HEADER.size + 8)  # the second copy's change counter, as a writer half-way through
        f.write(b"\xff\xff\xff\xff")
    assert log_damage(str(db)) == "the log's index kept changing under the check"
    conn.close()


def _locked_kib(path: Path) -> int | None:
    """What /proc/self/smaps says is locked in memory of this process's mapping of ``path``; None: no mapping."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.endswith(" " + str(path)):
            for detail in lines[i + 1:]:
                if detail.startswith("Locked:"):
                    return int(detail.split()[1])
    return None


def test_the_frames_read_back_stay_pinned_in_memory_until_the_block_ends(tmp_path: Path) -> None:
    db, conn = _log(tmp_path, 300)
    wal = Path(f"{db}-wal")
    with read_back(str(db)) as damage:
        assert damage is None
        locked = _locked_kib(wal)
        assert locked is not None and locked >= wal.stat().st_size // 1024 - 4, locked
    assert _locked_kib(wal) is None
    conn.close()
