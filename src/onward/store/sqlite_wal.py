"""Reading a SQLite write-ahead log as SQLite's own recovery does: every frame up to the last one the
wal-index (the ``-shm`` file) counts must carry the log's salts and a checksum that chains on from the frame
before it. Formats: https://www.sqlite.org/fileformat2.html#walformat and
https://www.sqlite.org/walformat.html#the_wal_index_file_format.

Why onward reads it at all: after a sync of the log failed, the pages the disk did not take are clean in
memory and nowhere else. If the kernel drops them (memory pressure) before the log is written into the
database (``SqliteStore._rewrite_log``), they read back as what the disk holds there (zeros, or older
bytes), and a checkpoint would copy that into the database file, where no recovery undoes it. So the log is read first, through the same page
cache the checkpoint reads, and a frame that does not check out stops the rewrite (see there)."""

from __future__ import annotations

import struct

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


def indexed_frames(shm_path: str) -> tuple[int, int, tuple[int, int], tuple[int, int]] | None:
    """From the wal-index header: (frames counted, page size, salts, checksum of the last frame counted);
    None when the header is not there or its two copies disagree (a writer is updating it: ask again)."""
    try:
        with open(shm_path, "rb") as f:
            head = f.read(2 * INDEX_HEADER.size)
    except FileNotFoundError:
        return 0, 0, (0, 0), (0, 0)  # no index: SQLite rebuilds it from the log at the next open
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


def log_damage(db_path: str) -> str | None:
    """None when the log of the database at ``db_path`` reads back whole up to what its index counts;
    otherwise one line on the first frame that does not. Asks the index again while a writer updates it."""
    for _ in range(100):
        indexed = indexed_frames(db_path + "-shm")
        if indexed is not None:
            break
    else:
        return "the log's index kept changing under the check"
    frames, page_size, salts, last_checksum = indexed
    try:
        return first_bad_frame(db_path + "-wal", frames, page_size, salts, last_checksum)
    except FileNotFoundError:
        return f"the log is gone, with {frames} frames indexed" if frames else None


__all__ = ["log_damage", "first_bad_frame", "indexed_frames"]
