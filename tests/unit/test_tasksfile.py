"""Tasks files: the line rules, refusing bad input whole, and not re-reading an unchanged file."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from onward.commands import LazyStore
from onward.errors import UsageError
from onward.tasksfile import MAX_LINE_BYTES, import_tasks_file


def names(url: str) -> list[str]:
    store = LazyStore(url)
    try:
        return [t.name for t in store.get().iter_tasks()]
    finally:
        store.close()


def load(url: str, path: Path):  # type: ignore[no-untyped-def]
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


def test_unterminated_last_line_that_grows(sqlite_url: str, tmp_path: Path) -> None:
    f = tmp_path / "tasks.txt"
    f.write_text("a\nb")
    load(sqlite_url, f)
    with f.open("a") as out:
        out.write("c\nd\n")
    load(sqlite_url, f)
    # what a full re-read gives: "bc" is a new task; "b" was a task already
    assert names(sqlite_url) == ["a", "b", "bc", "d"]


def test_large_file_in_one_pass(sqlite_url: str, tmp_path: Path) -> None:
    f = tmp_path / "tasks.txt"
    n = 200_000
    f.write_text("".join(f"item-{i:07d}\n" for i in range(n)))
    assert load(sqlite_url, f).added == n
    assert load(sqlite_url, f).skipped


@pytest.mark.torture
def test_a_million_lines(sqlite_url: str, tmp_path: Path) -> None:
    f = tmp_path / "tasks.txt"
    with f.open("w") as out:
        for i in range(1_000_000):
            out.write(f"https://example.invalid/item/{i:07d}\n")
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
