"""Importing a tasks file: one task per line, checked whole before anything is added.

A restart must not pay O(N) to re-import a file of a million lines that did not change. The store keeps a
mark per file (inode, size, mtime, digests of its first bytes and of the bytes before the mark): an
unchanged file costs one stat and two 64 KiB reads; a file that only grew is read from the mark on; any
other change (rewritten, edited, replaced) is read whole again, which is always correct because adding an
existing task is a no-op.
"""

from __future__ import annotations

import hashlib
import os
import stat
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from .errors import UsageError
from .store.base import SourceMark, Store

MAX_LINE_BYTES = 4096
UTF8_BOM = b"\xef\xbb\xbf"
DIGEST_BYTES = 65536
CHUNK = 1 << 20


@dataclass
class ImportResult:
    added: int
    read_from: int  # byte offset the import started at (0: the whole file was read)
    skipped: bool  # the file had not changed since the last import


def parse_line(raw: bytes, lineno: int, source: str) -> str | None:
    """One line's task text, or None for a blank or comment line. Raises UsageError for a bad line."""
    if lineno == 1 and raw.startswith(UTF8_BOM):
        raw = raw[len(UTF8_BOM):]  # editors on Windows start files with one: it marks the encoding, not a task
    if len(raw) > MAX_LINE_BYTES:
        raise UsageError(f"{source}: line {lineno} is longer than {MAX_LINE_BYTES} bytes")
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise UsageError(f"{source}: line {lineno} is not valid UTF-8") from None
    if not text or text.startswith("#"):
        return None
    if "\0" in text:
        raise UsageError(f"{source}: line {lineno} contains a NUL character")
    return text


class LineReader:
    """(line number, raw line without its newline) from a binary file, in constant memory. After the
    loop, ``complete_end`` and ``complete_lines`` tell where the last newline-terminated line ended."""

    def __init__(self, f, start: int, start_line: int) -> None:
        self.f = f
        self.complete_end = start
        self.complete_lines = start_line

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        lineno = self.complete_lines
        offset = self.complete_end
        rest = b""
        while True:
            chunk = self.f.read(CHUNK)
            if not chunk:
                break
            lines = (rest + chunk).split(b"\n")
            rest = lines.pop()
            for raw in lines:
                lineno += 1
                offset += len(raw) + 1
                self.complete_end, self.complete_lines = offset, lineno
                yield lineno, raw
            if len(rest) > MAX_LINE_BYTES + 2:  # no need to buffer a line we will refuse anyway
                yield lineno + 1, rest
                return
        if rest:
            yield lineno + 1, rest


def iter_tasks(f, start_line: int, source: str) -> Iterator[str]:
    for lineno, raw in LineReader(f, 0, start_line):
        task = parse_line(raw, lineno, source)
        if task is not None:
            yield task


@dataclass
class TasksImport:
    """A tasks file checked whole, ready to be added with ``apply``. Checking writes nothing, so a caller
    can check every input (tasks file, output folder, flags) before changing anything."""

    path: str
    key: str  # the file's absolute path, under which its mark is kept
    start: int  # where reading starts (the old mark, or 0)
    start_line: int
    end: int  # where the checked bytes end: what was appended since the check waits for the next import
    mark: SourceMark | None  # the mark to record; None for stdin or an unchanged file
    streamed_tasks: list[str] | None = None  # the tasks of stdin or a pipe, read once (no mark: no file)

    def apply(self, store: Store) -> ImportResult:
        if self.streamed_tasks is not None:
            return ImportResult(added=store.add(self.streamed_tasks), read_from=0, skipped=False)
        if self.mark is None:
            return ImportResult(added=0, read_from=self.start, skipped=True)
        try:
            f = open(self.path, "rb")
        except OSError as e:
            raise UsageError(f"cannot read tasks file {self.path}: {e.strerror}") from None
        with f:
            f.seek(self.start)
            with store.batch():
                added = store.add(iter_tasks(_Limited(f, self.end - self.start), self.start_line, self.path))
                store.set_source(self.key, self.mark)
        return ImportResult(added=added, read_from=self.start, skipped=False)


class _Limited:
    """A binary file cut off after ``remaining`` bytes."""

    def __init__(self, f, remaining: int) -> None:
        self.f = f
        self.remaining = remaining

    def read(self, n: int) -> bytes:
        data = self.f.read(min(n, self.remaining))
        self.remaining -= len(data)
        return bytes(data)


def check_tasks_file(store: Store | None, path: str) -> TasksImport:
    """Read the file from its mark on and check every line; write nothing. Raises UsageError."""
    if path == "-":
        return TasksImport(path, "-", 0, 0, 0, None,
                           streamed_tasks=_tasks_from_bytes(sys.stdin.buffer.read(), "stdin"))
    try:
        f = open(path, "rb")
    except OSError as e:
        raise UsageError(f"cannot read tasks file {path}: {e.strerror}") from None
    with f:
        st = os.fstat(f.fileno())
        if stat.S_ISDIR(st.st_mode):
            raise UsageError(f"tasks file {path} is a directory")
        if not stat.S_ISREG(st.st_mode):
            # A pipe (`--tasks <(generate)`) or a device: read once, whole; there is no file to mark.
            return TasksImport(path, path, 0, 0, 0, None, streamed_tasks=_tasks_from_bytes(f.read(), path))
        key = os.path.abspath(path)
        identity = f"{st.st_dev}:{st.st_ino}"
        mark = store.get_source(key) if store is not None else None
        start, start_line = 0, 0
        if mark is not None and mark.identity == identity and st.st_size >= mark.size:
            same_head = _digest(f, 0, min(DIGEST_BYTES, mark.size)) == mark.head_digest
            tail_start = max(0, mark.size - DIGEST_BYTES)
            same_tail = _digest(f, tail_start, mark.size - tail_start) == mark.tail_digest
            if same_head and same_tail:
                if st.st_size == mark.size:
                    return TasksImport(path, key, mark.size, mark.lines, mark.size, None)
                start, start_line = mark.size, mark.lines
        f.seek(start)
        reader = LineReader(f, start, start_line)
        end = start
        for lineno, raw in reader:
            parse_line(raw, lineno, path)
        end = f.tell()
        # The mark stops after the last complete line: an unterminated last line is imported (it is a
        # task) but read again next time, in case it was still being written.
        complete = reader.complete_end
        tail_start = max(0, complete - DIGEST_BYTES)
        new_mark = SourceMark(identity=identity, size=complete, lines=reader.complete_lines,
                              mtime_ns=st.st_mtime_ns, head_digest=_digest(f, 0, min(DIGEST_BYTES, complete)),
                              tail_digest=_digest(f, tail_start, complete - tail_start))
        return TasksImport(path, key, start, start_line, end, new_mark)


class StoreSource(Protocol):
    existing: Store | None  # the store, if it exists already

    def get(self) -> Store:
        """The store, created if need be."""


def import_tasks_file(stores: StoreSource, path: str) -> ImportResult:
    """Check the whole file, then add its tasks; the store is created (if it does not exist yet) only once
    the file is known to be good."""
    return check_tasks_file(stores.existing, path).apply(stores.get())


def _digest(f, start: int, length: int) -> str:
    f.seek(start)
    return hashlib.sha256(f.read(length)).hexdigest()


def _tasks_from_bytes(data: bytes, source: str) -> list[str]:
    tasks = []
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        task = parse_line(raw, lineno, source)
        if task is not None:
            tasks.append(task)
    return tasks
