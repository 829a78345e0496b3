"""Importing a tasks file: one task per line, checked whole before anything is added.

A restart must not pay O(N) to re-import a file of a million lines that did not change. The store keeps a
mark per file: how far it was imported (the end of its last complete line), a digest of every byte before
the mark, and the file's stat signature (device, inode, ctime) and mtime.

- Unchanged: same signature and mtime, recorded when the file had been still for ``SETTLE_SECONDS`` (a
  write that lands in the same clock tick as the read leaves the timestamps unchanged, so a fresher stat
  cannot vouch for the content): one stat, nothing read.
- Any other change to the file (content, mtime or ctime): its bytes before the mark are hashed and
  compared; the same bytes mean it only grew, and it is read from the mark on; anything else is read whole
  (always correct, because adding an existing task is a no-op).
- An unterminated last line may still be being written: it is imported only once the file has been still
  for ``SETTLE_SECONDS`` (the import waits that long once); a file still changing after that has it left
  out, with a warning, for the next import.

A big import is committed in chunks of bounded length, each with the mark of what it committed, so that
workers sharing the store can renew their leases between chunks, and an import killed half-way resumes
from its last chunk.
"""

from __future__ import annotations

import hashlib
import os
import stat
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from .errors import UNAVAILABLE_ERRNOS, OnwardError, Unavailable, UsageError
from .store.base import SourceMark, Store

MAX_LINE_BYTES = 4096
# The most of one line that is read: a task of MAX_LINE_BYTES with whitespace or a carriage return around it
# is read whole (and taken, as ``onward add`` takes it); a longer line is cut here, and refused.
LINE_READ_LIMIT = 2 * MAX_LINE_BYTES
UTF8_BOM = b"\xef\xbb\xbf"
DIGEST_BYTES = 65536
CHUNK = 1 << 20
SETTLE_SECONDS = 2.0  # a file unchanged this long is taken as written: its stat vouches for its content
CHUNK_SECONDS = 0.1  # the write lock one import chunk should hold
FIRST_CHUNK_TASKS, MIN_CHUNK_TASKS, MAX_CHUNK_TASKS = 2_000, 100, 200_000


@dataclass
class ImportResult:
    added: int
    read_from: int  # byte offset the import started at (0: the whole file was read)
    skipped: bool  # the file had not changed since the last import
    held_back: str | None = None  # an unterminated last line left out: the file was still being written


NOT_UTF8 = "is not valid UTF-8"


def task_name_problem(name: str) -> str | None:
    """What keeps ``name`` from being a task name, as the end of a sentence ("is not valid UTF-8"), or
    None. The one rule for every way a task comes in: ``Job.add``, ``onward add``, a tasks file."""
    if not name:
        return "cannot be empty"
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: what non-UTF-8 bytes in argv or a file name decode to
        return NOT_UTF8
    if len(encoded) > MAX_LINE_BYTES:
        return f"is longer than {MAX_LINE_BYTES} bytes"
    if "\0" in name:
        return "contains a NUL character"
    if "\n" in name:
        return "contains a newline"
    return None


def task_name(text: str) -> str:
    """The name a task is stored and looked up under, from its text as given (an argument of any command,
    an item of ``Job.add``, a line of a tasks file): without surrounding whitespace (``str.strip``: spaces,
    tabs, carriage returns and the other Unicode whitespace; not a byte order mark, which only a tasks
    file's first line loses, as bytes). Every way in and every lookup goes through here, so that
    ``onward result ' a '`` finds the task ``onward add ' a '`` stored as ``a``. Not checked: see
    ``check_task_name``."""
    return text.strip()


def check_task_name(name: str) -> None:
    """Raise ``UsageError`` for a name that no task may have (see ``task_name_problem``)."""
    problem = task_name_problem(name)
    if problem:
        raise UsageError(f"a task name {problem}: {name[:40]!r}")


def parse_line(raw: bytes, lineno: int, source: str) -> str | None:
    """One line's task text, or None for a blank or comment line. Raises UsageError for a bad line."""
    if lineno == 1 and raw.startswith(UTF8_BOM):
        raw = raw[len(UTF8_BOM):]  # editors on Windows start files with one: it marks the encoding, not a task
    # LineReader cuts a line far too long short, and what is left of it must not pass for a task. Below that,
    # the rule is the task name's (task_name_problem): its length without the whitespace around it, which a
    # CRLF file's "\r" is (a task of 4096 bytes was refused from such a file, and taken by onward add).
    if len(raw) > LINE_READ_LIMIT:
        raise UsageError(f"{source}: line {lineno} is longer than {MAX_LINE_BYTES} bytes")
    # Bad bytes decode to lone surrogates, which task_name_problem refuses as not UTF-8.
    text = task_name(raw.decode("utf-8", "surrogateescape"))
    if not text:
        return None
    problem = task_name_problem(text)
    if problem:
        raise UsageError(f"{source}: line {lineno} {problem}")
    return None if text.startswith("#") else text


class LineReader:
    """(line number, raw line without its newline) from a binary file, in constant memory. During and
    after the loop, ``complete_end`` and ``complete_lines`` tell where the last newline-terminated line
    read so far ended; an unterminated last line comes last, without moving them."""

    def __init__(self, f: Any, start: int, start_line: int) -> None:
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
            if len(rest) > LINE_READ_LIMIT:  # no need to buffer a line we will refuse anyway
                yield lineno + 1, rest
                return
        if rest:
            yield lineno + 1, rest


@dataclass
class TasksImport:
    """A tasks file checked whole, ready to be added with ``apply``. Checking writes nothing, so a caller
    can check every input (tasks file, output folder, flags) before changing anything."""

    path: str
    key: str  # the file's absolute path, under which its mark is kept
    start: int  # where reading starts (the old mark, or 0)
    start_line: int
    end: int  # where the checked bytes end: what was appended since the check waits for the next import
    identity: str  # the stat signature for the mark, or "" when the stat cannot vouch for the content
    mtime_ns: int
    prefix: Any = None  # sha256 of the bytes before ``start``; None: the file is unchanged, nothing to do
    streamed_tasks: list[str] | None = None  # the tasks of stdin or a pipe, read once (no mark: no file)
    held_back: str | None = None  # an unterminated last line left out, shown in a warning

    def apply(self, store: Store) -> ImportResult:
        """Add the checked tasks in chunks, each committed with the mark of what it holds."""
        adder = _ChunkedAdder(store)
        if self.streamed_tasks is not None:
            at = 0
            while at < len(self.streamed_tasks):
                size = adder.chunk_tasks
                adder.commit(self.streamed_tasks[at:at + size], None)
                at += size
            return ImportResult(added=adder.added, read_from=0, skipped=False)
        if self.prefix is None:
            return ImportResult(added=0, read_from=self.start, skipped=True)
        try:
            f = open(self.path, "rb")
        except OSError as e:
            raise _unreadable(self.path, e) from None
        with f:
            f.seek(self.start)
            reader = LineReader(_Limited(f, self.end - self.start), self.start, self.start_line)
            prefix, hashed_to = self.prefix.copy(), self.start
            names: list[str] = []

            def commit(final: bool) -> None:
                nonlocal hashed_to
                offset = reader.complete_end
                _hash_range(prefix, f.fileno(), hashed_to, offset)
                hashed_to = offset
                # Only the last chunk's mark may carry the stat signature: an earlier one covers part of
                # the file, which must be compared (not skipped) next time.
                mark = SourceMark(identity=self.identity if final else "", size=offset,
                                  lines=reader.complete_lines, mtime_ns=self.mtime_ns,
                                  head_digest=prefix.hexdigest(), tail_digest=_tail_digest(f.fileno(), offset))
                adder.commit(names, (self.key, mark))
                names.clear()

            for lineno, raw in reader:
                task = parse_line(raw, lineno, self.path)
                if task is not None:
                    names.append(task)
                    if len(names) >= adder.chunk_tasks:
                        commit(final=False)
            commit(final=True)
        return ImportResult(added=adder.added, read_from=self.start, skipped=False, held_back=self.held_back)


class _ChunkedAdder:
    """Adds tasks in transactions of about ``CHUNK_SECONDS`` each. One transaction for three million lines
    held SQLite's write lock for many seconds, long enough for the leases of running workers (and a
    watchdog) to run out; between chunks their renewals and completions get their turn. The chunk size
    follows how long the last commit took, since insert speed depends on the machine and the store."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.chunk_tasks = FIRST_CHUNK_TASKS
        self.added = 0

    def commit(self, names: list[str], mark: tuple[str, SourceMark] | None) -> None:
        """Add ``names`` (and record ``mark``) in one transaction."""
        started = time.monotonic()
        with self.store.batch():
            self.added += self.store.add(names)
            if mark is not None:
                self.store.set_source(*mark)
        took = time.monotonic() - started
        if took < CHUNK_SECONDS / 2:
            self.chunk_tasks = min(self.chunk_tasks * 2, MAX_CHUNK_TASKS)
        elif took > CHUNK_SECONDS:
            self.chunk_tasks = max(self.chunk_tasks // 2, MIN_CHUNK_TASKS)


class _Limited:
    """A binary file cut off after ``remaining`` bytes."""

    def __init__(self, f: Any, remaining: int) -> None:
        self.f = f
        self.remaining = remaining

    def read(self, n: int) -> bytes:
        data = self.f.read(min(n, self.remaining))
        self.remaining -= len(data)
        return bytes(data)


def check_tasks_file(store: Store | None, path: str) -> TasksImport:
    """Read the file from its mark on and check every line; write nothing. Raises UsageError."""
    if path == "-":
        if sys.stdin is None:  # started with stdin closed (`<&-`)
            raise UsageError("--tasks -: stdin is closed, there is nothing to read tasks from")
        return TasksImport(path, "-", 0, 0, 0, "", 0, streamed_tasks=_tasks_from_stream(sys.stdin.buffer, "stdin"))
    try:
        f = open(path, "rb")
    except OSError as e:
        raise _unreadable(path, e) from None
    with f:
        st = os.fstat(f.fileno())
        if stat.S_ISDIR(st.st_mode):
            raise UsageError(f"tasks file {path} is a directory")
        if not stat.S_ISREG(st.st_mode):
            # A pipe (`--tasks <(generate)`) or a device: read once, line by line; there is no file to mark.
            return TasksImport(path, path, 0, 0, 0, "", 0, streamed_tasks=_tasks_from_stream(f, path))
        key = os.path.abspath(path)
        mark = store.get_source(key) if store is not None else None
        checked = _check_regular_file(f, path, key, mark)
        if checked.held_back is not None and _still_for(os.fstat(f.fileno())) < SETTLE_SECONDS:
            # The last line may be cut mid-write: give the writer one settling period, then look again.
            time.sleep(SETTLE_SECONDS - _still_for(os.fstat(f.fileno())))
            checked = _check_regular_file(f, path, key, mark)
        return checked


def _check_regular_file(f: Any, path: str, key: str, mark: SourceMark | None) -> TasksImport:
    st = os.fstat(f.fileno())
    signature = f"{st.st_dev}:{st.st_ino}:{st.st_ctime_ns}"
    settled = _still_for(st) >= SETTLE_SECONDS
    if mark is not None and mark.identity == signature and mark.mtime_ns == st.st_mtime_ns:
        return TasksImport(path, key, mark.size, mark.lines, mark.size, signature, st.st_mtime_ns)
    start, start_line, prefix = 0, 0, hashlib.sha256()
    if mark is not None and st.st_size >= mark.size and _tail_digest(f.fileno(), mark.size) == mark.tail_digest:
        before = hashlib.sha256()
        _hash_range(before, f.fileno(), 0, mark.size)
        if before.hexdigest() == mark.head_digest:  # the same bytes up to the mark: the file only grew
            start, start_line, prefix = mark.size, mark.lines, before
    f.seek(start)
    reader = LineReader(f, start, start_line)
    tail: tuple[int, bytes] | None = None
    for lineno, raw in reader:
        if lineno > reader.complete_lines:
            tail = (lineno, raw)  # unterminated: checked below, once it is known to be complete
        else:
            parse_line(raw, lineno, path)
    end, held_back = f.tell(), None
    if tail is not None:
        if settled:
            parse_line(tail[1], tail[0], path)
        else:
            end = reader.complete_end
            held_back = tail[1][:60].decode("utf-8", "replace")
    return TasksImport(path, key, start, start_line, end, signature if settled else "", st.st_mtime_ns,
                       prefix=prefix, held_back=held_back)


class StoreSource(Protocol):
    existing: Store | None  # the store, if it exists already

    def get(self) -> Store:
        """The store, created if need be."""


def import_tasks_file(stores: StoreSource, path: str) -> ImportResult:
    """Check the whole file, then add its tasks; the store is created (if it does not exist yet) only once
    the file is known to be good."""
    return check_tasks_file(stores.existing, path).apply(stores.get())


def _unreadable(path: str, e: OSError) -> OnwardError:
    """A tasks file that cannot be opened: bad input (exit 2), unless the machine is out of descriptors or
    memory or its disk fails (exit 75: it is worth trying again later)."""
    kind = Unavailable if e.errno in UNAVAILABLE_ERRNOS else UsageError
    return kind(f"cannot read tasks file {path}: {e.strerror}")


def _still_for(st: os.stat_result) -> float:
    """Seconds since the file last changed (content or metadata)."""
    return time.time() - max(st.st_mtime_ns, st.st_ctime_ns) / 1e9


def _hash_range(hasher: Any, fd: int, start: int, end: int) -> None:
    while start < end:
        data = os.pread(fd, min(CHUNK, end - start), start)
        if not data:
            raise UsageError(f"tasks file shrank while it was read (at byte {start})")
        hasher.update(data)
        start += len(data)


def _tail_digest(fd: int, end: int) -> str:
    """Digest of the bytes just before ``end``: a cheap first look before hashing all of them."""
    start = max(0, end - DIGEST_BYTES)
    return hashlib.sha256(os.pread(fd, end - start, start)).hexdigest()


def _tasks_from_stream(f: Any, source: str) -> list[str]:
    """The tasks of stdin, a pipe or a device, read line by line: a line too long is refused as soon as it
    is (``/dev/zero`` is one endless line), not after the whole stream was held in memory."""
    tasks = []
    for lineno, raw in LineReader(f, 0, 0):
        task = parse_line(raw, lineno, source)
        if task is not None:
            tasks.append(task)
    return tasks
