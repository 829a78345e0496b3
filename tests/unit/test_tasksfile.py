"""Tasks files: the line rules, refusing bad input whole, and not re-reading an unchanged file."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from onward import tasksfile
from onward.commands import LazyStore
from onward.errors import UsageError
from onward.tasksfile import MAX_LINE_BYTES, ImportResult, import_tasks_file
from tests.conftest import wait_for

SETTLE = 0.3


@pytest.fixture(autouse=True)
def short_settling(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same rules with a shorter settling period, so that the tests need not wait seconds."""
    monkeypatch.setattr(tasksfile, "SETTLE_SECONDS", SETTLE)


def settle(path: Path) -> None:
    """Wait until the file has been still long enough for its stat to vouch for its content."""
    def still() -> bool:
        st = path.stat()
        return time.time() - max(st.st_mtime_ns, st.st_ctime_ns) / 1e9 >= SETTLE
    wait_for(still, 10, f"{path} to settle")


def names(url: str) -> list[str]:
    store = LazyStore(url)
    try:
        return [t.name for t in store.get().iter_tasks()]
    finally:
        store.close()


def load(url: str, path: Path) -> ImportResult:
    store = LazyStore(url)
    try:
        return import_tasks_file(store, str(path))
    finally:
        store.close()


def test_line_rules(sqlite_url: str, tmp_path: Path) -> None:
    f = tmp_path / "tasks.txt"
    f.write_bytes(b"  alpha  \n\n# a comment\n\tbeta\r\n   \n#also\ngamma delta\nalpha\nlast-no-newline")
    result = load(sqlite_url, f)
    assert result.added == 4
    assert names(sqlite_url) == ["alpha", "beta", "gamma delta", "last-no-newline"]


@pytest.mark.parametrize(
    "content, message",
    [
        (b"ok\nfine\n\xff\xfe bad\n", "line 3 is not valid UTF-8"),
        (b"ok\n" + b"x" * (MAX_LINE_BYTES + 1) + b"\n", "line 2 is longer than 4096 bytes"),
        (b"ok\n" + b"x" * (MAX_LINE_BYTES + 1) + b"\r\n", "line 2 is longer than 4096 bytes"),
        (b"ok\n" + b"x" * (3 * MAX_LINE_BYTES) + b"\n", "line 2 is longer than 4096 bytes"),
        (b"ok\n" + b" " * (2 * MAX_LINE_BYTES) + b"x\n", "line 2 is longer than 4096 bytes"),
        (b"ok\nnul\x00inside\n", "line 2 contains a NUL"),
    ],
)
def test_bad_line_changes_nothing(sqlite_url: str, tmp_path: Path, content: bytes, message: str) -> None:
    f = tmp_path / "tasks.txt"
    f.write_bytes(content)
    with pytest.raises(UsageError, match=message):
        load(sqlite_url, f)
    assert not Path(sqlite_url).exists()  # the store was not even created
    # and with an existing store, nothing is added
    good = tmp_path / "good.txt"
    good.write_text("one\n")
    load(sqlite_url, good)
    with pytest.raises(UsageError, match=message):
        load(sqlite_url, f)
    assert names(sqlite_url) == ["one"]


def test_line_exactly_at_the_limit_is_fine(sqlite_url: str, tmp_path: Path) -> None:
    f = tmp_path / "tasks.txt"
    f.write_bytes(b"y" * MAX_LINE_BYTES + b"\n")
    assert load(sqlite_url, f).added == 1


def test_a_task_at_the_limit_is_fine_with_a_carriage_return_or_spaces_around_it(sqlite_url: str,
                                                                                tmp_path: Path) -> None:
    """The limit counted the raw line: a task of 4096 bytes was refused from a CRLF file, or with spaces
    around it, though ``onward add`` takes it (the name is what is stripped of whitespace)."""
    f = tmp_path / "tasks.txt"
    f.write_bytes(b"a" * MAX_LINE_BYTES + b"\r\n" + b"  " + b"b" * MAX_LINE_BYTES + b"  \r\n")
    assert load(sqlite_url, f).added == 2
    assert names(sqlite_url) == ["a" * MAX_LINE_BYTES, "b" * MAX_LINE_BYTES]


def test_missing_file_or_a_directory(sqlite_url: str, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="cannot read tasks file"):
        load(sqlite_url, tmp_path / "nope.txt")
    with pytest.raises(UsageError, match="is a directory|cannot read"):
        load(sqlite_url, tmp_path)


def test_a_pipe_is_read_whole(sqlite_url: str, tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text("p1\np2\n# c\np3\n"))
    writer.start()
    result = load(sqlite_url, fifo)
    writer.join(10)
    assert result.added == 3 and names(sqlite_url) == ["p1", "p2", "p3"]
    assert load(sqlite_url, Path("/dev/null")).added == 0


def test_unchanged_file_is_not_read_again(sqlite_url: str, tmp_path: Path) -> None:
    f = tmp_path / "tasks.txt"
    f.write_text("".join(f"task-{i}\n" for i in range(5000)))
    settle(f)
    first = load(sqlite_url, f)
    assert first.added == 5000 and first.read_from == 0
    again = load(sqlite_url, f)
    assert again.skipped and again.added == 0


def test_grown_file_is_read_from_the_mark(sqlite_url: str, tmp_path: Path) -> None:
    f = tmp_path / "tasks.txt"
    f.write_text("".join(f"task-{i}\n" for i in range(1000)))
    size = f.stat().st_size
    load(sqlite_url, f)
    with f.open("a") as out:
        out.write("task-new-1\ntask-new-2\n")
    grown = load(sqlite_url, f)
    assert grown.read_from == size and grown.added == 2
    assert names(sqlite_url)[-2:] == ["task-new-1", "task-new-2"]


def test_errors_after_the_mark_name_the_true_line(sqlite_url: str, tmp_path: Path) -> None:
    f = tmp_path / "tasks.txt"
    f.write_text("a\nb\nc\n")
    load(sqlite_url, f)
    with f.open("ab") as out:
        out.write(b"d\n\xff\n")
    with pytest.raises(UsageError, match="line 5 is not valid UTF-8"):
        load(sqlite_url, f)


def test_edited_file_is_read_whole(sqlite_url: str, tmp_path: Path) -> None:
    f = tmp_path / "tasks.txt"
    f.write_text("a\nb\nc\n")
    load(sqlite_url, f)
    f.write_text("a\nB\nc\nd\n")  # same inode, the prefix changed
    result = load(sqlite_url, f)
    assert result.read_from == 0 and result.added == 2
    assert names(sqlite_url) == ["a", "b", "c", "B", "d"]


def test_unterminated_last_line_is_imported_only_once_the_file_is_still(sqlite_url: str, tmp_path: Path) -> None:
    f = tmp_path / "tasks.txt"
    f.write_text("a\nb")
    done = threading.Event()

    def slow_writer() -> None:  # finishes the line "b…" a character at a time, until told to end it
        with f.open("a") as out:
            while not done.is_set():
                out.write("c")
                out.flush()
                time.sleep(0.02)
            out.write("\nd\n")

    writer = threading.Thread(target=slow_writer)
    writer.start()
    try:
        during = load(sqlite_url, f)
    finally:
        done.set()
        writer.join(10)
    assert during.held_back is not None and during.held_back.startswith("bc")
    assert names(sqlite_url) == ["a"]  # no stray "b…": the line was still being written
    after = load(sqlite_url, f)
    assert after.held_back is None and after.read_from > 0
    line = f.read_text().splitlines()[1]
    assert names(sqlite_url) == ["a", line, "d"]


def test_unterminated_last_line_of_a_still_file_is_a_task(sqlite_url: str, tmp_path: Path) -> None:
    f = tmp_path / "tasks.txt"
    f.write_text("a\nb")  # just written: the import waits for it to be still, then takes "b"
    result = load(sqlite_url, f)
    assert result.added == 2 and result.held_back is None
    assert names(sqlite_url) == ["a", "b"]
    assert load(sqlite_url, f).skipped  # and it is not read again


def test_same_size_edit_in_place_of_a_big_file_is_seen(sqlite_url: str, tmp_path: Path) -> None:
    f = tmp_path / "tasks.txt"
    f.write_text("".join(f"task-{i:06d}\n" for i in range(20_000)))  # 240 KiB
    assert f.stat().st_size > 128 * 1024
    settle(f)
    assert load(sqlite_url, f).added == 20_000
    inode = f.stat().st_ino
    for n, restore_mtime in ((10_000, False), (10_001, True)):
        settle(f)
        old = f.stat()
        with f.open("r+b") as out:  # same inode, same size, a line far from both ends rewritten
            out.seek(n * 12)
            out.write(f"TASK-{n:06d}".encode())
        if restore_mtime:  # as cp -p or rsync -t leave it: only the ctime tells
            os.utime(f, ns=(old.st_atime_ns, old.st_mtime_ns))
        assert f.stat().st_ino == inode and f.stat().st_size == old.st_size
        result = load(sqlite_url, f)
        assert not result.skipped and result.added == 1, (n, restore_mtime)
        assert f"TASK-{n:06d}" in names(sqlite_url)


def test_touched_file_is_read_again_and_unchanged_file_is_not(sqlite_url: str, tmp_path: Path) -> None:
    f = tmp_path / "tasks.txt"
    f.write_text("".join(f"task-{i:06d}\n" for i in range(20_000)))
    settle(f)
    load(sqlite_url, f)
    assert load(sqlite_url, f).skipped
    os.utime(f)  # a new mtime (and ctime), the same bytes
    again = load(sqlite_url, f)
    assert not again.skipped and again.added == 0
    settle(f)
    assert load(sqlite_url, f).added == 0  # compared once more, now that its stat can vouch for it
    assert load(sqlite_url, f).skipped  # and cheap again


def test_large_file_in_one_pass(sqlite_url: str, tmp_path: Path) -> None:
    f = tmp_path / "tasks.txt"
    n = 200_000
    f.write_text("".join(f"item-{i:07d}\n" for i in range(n)))
    settle(f)
    assert load(sqlite_url, f).added == n
    assert load(sqlite_url, f).skipped


@pytest.mark.torture
def test_a_million_lines(sqlite_url: str, tmp_path: Path) -> None:
    f = tmp_path / "tasks.txt"
    with f.open("w") as out:
        for i in range(1_000_000):
            out.write(f"https://example.invalid/item/{i:07d}\n")
    settle(f)
    assert load(sqlite_url, f).added == 1_000_000
    again = load(sqlite_url, f)
    assert again.skipped
    with f.open("a") as out:
        out.write("one more\n")
    grown = load(sqlite_url, f)
    assert grown.added == 1 and grown.read_from > 0


def test_a_leading_byte_order_mark_is_not_part_of_the_first_task(sqlite_url: str, tmp_path: Path) -> None:
    f = tmp_path / "tasks.txt"
    f.write_bytes(b"\xef\xbb\xbf# header\nfirst\n\xef\xbb\xbfsecond-keeps-its-bom\n")
    assert load(sqlite_url, f).added == 2
    assert names(sqlite_url) == ["first", "\ufeffsecond-keeps-its-bom"]  # only the file's own BOM goes
