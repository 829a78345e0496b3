"""Reading a SQLite write-ahead log as SQLite's own recovery does: every frame up to the last one the
wal-index (the ``-shm`` file) counts must carry the log's salts and a checksum that chains on from the frame
before it. Formats: https://www.sqlite.org/fileformat2.html#walformat and
https://www.sqlite.org/walformat.html#the_wal_index_file_format.

Why onward reads it at all: after a sync of the log failed, the pages the disk did not take are clean in
memory and nowhere else. If the kernel drops them (memory pressure) before the log is written into the
database (``SqliteStore._rewrite_log``), they read back as what the disk holds there (zeros, or older
bytes), and a checkpoint would copy that into the database file, where no recovery undoes it. So the log
is read first, through the same page cache the checkpoint reads, and a frame that does not check out stops
the rewrite (see there)."""

from __future__ import annotations

import functools
import mmap
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .sqlite_locks import close_beside, store_key

WAL_HEADER = 32
FRAME_HEADER = 24
# The wal-index header (native byte order, two copies that agree unless a writer is half-way through):
# iVersion, unused, iChange, isInit, bigEndCksum, szPage, mxFrame, nPage, aFrameCksum[2], aSalt[2], aCksum[2].
INDEX_HEADER = struct.Struct("=IIIBBHII2I2I2I")
MASK = 0xFFFFFFFF


def _checksum(data: bytes, s0: int, s1: int, big_endian: bool) -> tuple[int, int]:
    """SQLite's log checksum (a Fibonacci-weighted sum of 32-bit words, two at a time), continued from
    ``(s0, s1)``."""
    words = struct.unpack(f"{'>' if big_endian else '<'}{len(data) // 4}I", data)
    for i in range(0, len(words), 2):
        s0 = (s0 + words[i] + s1) & MASK
        s1 = (s1 + words[i + 1] + s0) & MASK
    return s0, s1


def indexed_frames(head: bytes) -> tuple[int, int, tuple[int, int], tuple[int, int]] | None:
    """From ``head``, the first bytes of the wal-index (``-shm``): (frames counted, page size, salts,
    checksum of the last frame counted); None when its header's two copies disagree (a writer is updating
    it: ask again)."""
    if len(head) < 2 * INDEX_HEADER.size:
        return 0, 0, (0, 0), (0, 0)
    if head[:INDEX_HEADER.size] != head[INDEX_HEADER.size:]:
        return None
    fields = INDEX_HEADER.unpack(head[:INDEX_HEADER.size])
    is_init, page_size, mx_frame = fields[3], fields[5], fields[6]
    if not is_init:
        return 0, 0, (0, 0), (0, 0)
    page_size = 65536 if page_size == 1 else page_size
    # The salts are the log header's bytes copied as they are (big-endian there); read them the same way.
    salts = struct.unpack(">2I", head[32:40])
    return mx_frame, page_size, (salts[0], salts[1]), (fields[8], fields[9])


def first_bad_frame(wal_path: str, frames: int, page_size: int, salts: tuple[int, int],
                    last_checksum: tuple[int, int]) -> str | None:
    """Read frames 1..``frames`` of the log; None when each carries ``salts`` and its chained checksum, and
    the last one's is ``last_checksum``; otherwise what is wrong with the first that does not (one line)."""
    if frames == 0:
        return None
    frame_size = FRAME_HEADER + page_size
    with open(wal_path, "rb", buffering=0) as f:
        header = f.read(WAL_HEADER)
        if len(header) < WAL_HEADER:
            return f"the log's header is cut short ({len(header)} bytes), with {frames} frames indexed"
        magic, _, header_page_size, _, salt1, salt2, c1, c2 = struct.unpack(">8I", header)
        big_endian = bool(magic & 1)
        if magic & ~1 != 0x377F0682 or header_page_size != page_size or (salt1, salt2) != salts:
            return "the log's header does not match its index (magic, page size or salts)"
        s = _checksum(header[:24], 0, 0, big_endian)
        if s != (c1, c2):
            return "the log's header fails its checksum"
        for frame in range(1, frames + 1):
            data = f.read(frame_size)
            if len(data) < frame_size:
                return f"frame {frame} of {frames} is cut short ({len(data)} of {frame_size} bytes)"
            _, _, frame_salt1, frame_salt2, f1, f2 = struct.unpack(">6I", data[:FRAME_HEADER])
            if (frame_salt1, frame_salt2) != salts:
                return f"frame {frame} of {frames} does not carry the log's salts, read back as {_looks(data)}"
            s = _checksum(data[:8], *s, big_endian)
            s = _checksum(data[FRAME_HEADER:], *s, big_endian)
            if s != (f1, f2):
                return f"frame {frame} of {frames} fails its checksum, read back as {_looks(data)}"
    if s != last_checksum:
        return f"frame {frames}'s checksum is not the one the index holds"
    return None


def _looks(data: bytes) -> str:
    return "zeros" if not data.strip(b"\0") else "other bytes"


def _index(db_path: str, index_fd: int | None) -> tuple[int, int, tuple[int, int], tuple[int, int]] | str:
    # The -shm file holds SQLite's locks of this process's connections: a descriptor of it opened here is
    # closed the way sqlite_locks says, or those locks would go with it.
    fd = index_fd
    if fd is None:
        try:
            fd = os.open(db_path + "-shm", os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return 0, 0, (0, 0), (0, 0)  # no index: SQLite rebuilds it from the log at the next open
    try:
        for _ in range(100):
            indexed = indexed_frames(os.pread(fd, 2 * INDEX_HEADER.size, 0))
            if indexed is not None:
                return indexed
    finally:
        if index_fd is None:
            close_beside(fd, store_key(db_path))
    return "the log's index kept changing under the check"


@contextmanager
def read_back(db_path: str, index_fd: int | None = None) -> Iterator[str | None]:
    """Read the log of the database at ``db_path`` back, up to what its index counts, and yield None when
    it is whole, otherwise one line on the first frame that is not. Until the block ends, those frames'
    pages are pinned in memory (``_pinned``): a checkpoint made in the block reads the bytes just read,
    not what the disk holds should the kernel want the memory back in between. ``index_fd``: a descriptor of
    its ``-shm`` the caller keeps open (None: opened here)."""
    indexed = _index(db_path, index_fd)
    if isinstance(indexed, str):
        yield indexed
        return
    frames, page_size, salts, last_checksum = indexed
    with _pinned(db_path + "-wal", WAL_HEADER + frames * (FRAME_HEADER + page_size) if frames else 0):
        try:
            damage = first_bad_frame(db_path + "-wal", frames, page_size, salts, last_checksum)
        except FileNotFoundError:
            damage = f"the log is gone, with {frames} frames indexed" if frames else None
        yield damage


def log_damage(db_path: str) -> str | None:
    """``read_back`` without keeping anything pinned."""
    with read_back(db_path) as damage:
        return damage


@contextmanager
def _pinned(path: str, length: int) -> Iterator[bool]:
    """Keep the first ``length`` bytes of the file at ``path`` in memory while the block runs: a shared
    mapping of them, locked (mlock). A page the kernel dropped already is read in from the disk (and then
    found wrong by the check); one still in memory stays there. Nothing is ever read or written through the
    mapping (a file cut shorter meanwhile cannot fault). Yields whether they are pinned: not when the
    process may lock that much no more (RLIMIT_MEMLOCK, 8 MiB by default for a user; a log is about 4 MiB
    at most in normal use), nor without a C library."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        yield False
        return
    try:
        length = min(length, os.fstat(fd).st_size)
        libc = _libc()
        address = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0) if length and libc else None
        if address is None or address == MAP_FAILED:
            yield False
            return
        try:
            yield libc.mlock(address, length) == 0
        finally:
            libc.munmap(address, length)  # unlocks them too
    finally:
        os.close(fd)


MAP_FAILED = (1 << (8 * struct.calcsize("P"))) - 1  # (void *) -1, as ctypes gives it back


@functools.lru_cache(maxsize=1)
def _libc() -> Any:
    """The C library's mmap, mlock and munmap (Python's mmap module locks nothing), loaded on first use:
    only a worker whose sync failed gets here."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


__all__ = ["read_back", "log_damage", "first_bad_frame", "indexed_frames"]
