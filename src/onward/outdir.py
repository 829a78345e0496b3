"""The output folder (``onward run --out DIR``): each task's result written to its own file, atomically.

File names. A task's result goes to ``DIR/<name>.txt``, where ``<name>`` is:

- the task text itself, when it is a *safe* file name: only ``A-Z a-z 0-9 . _ -``, not starting with
  ``.``, at most 200 bytes. ``build-1.2_x`` goes to ``build-1.2_x.txt``.
- otherwise an *escaped* name: ``~`` followed by the task text's UTF-8 bytes, each byte outside
  ``A-Z a-z 0-9 _ -`` written as ``%XX`` (uppercase hex; ``.``, ``%`` and ``~`` are escaped too).
  ``/etc/passwd`` goes to ``~%2Fetc%2Fpasswd.txt``, ``..`` to ``~%2E%2E.txt``, ``é`` to ``~%C3%A9.txt``.
- when the escaped name would be longer than 200 bytes: ``~``, the escaped form of as many whole
  characters from the start of the task text as fit in 128 bytes, ``~``, and the 64-digit sha256 (hex) of
  the task text's UTF-8 bytes: ``~aaaa…aaaa~9f86d081…0a08.txt``.

So every file name is one path component of at most 204 bytes, never ``.`` or ``..``, never contains ``/``,
and two different task texts never share a file name (the argument is at ``file_name``). On a
case-insensitive file system (macOS and Windows defaults) safe names that differ only in case do share a
file; onward's own targets (Linux) are case-sensitive.

Writes. A result is written to a fresh temporary file in DIR, fsynced, and renamed onto its final name,
then DIR itself is fsynced: a reader (or a crash) sees the old file or the new one, never a partial one,
and a result that ``write`` returned for survives a power cut. Temporary files are named
``.onward-tmp-<pid>-<random hex>``; no task's file starts with ``.``, so they cannot clash. Nothing in DIR
is ever written through a symlink: files are created with ``O_EXCL`` and moved into place with
``rename``, which replaces a symlink at the destination instead of following it.

One job per folder. Two jobs writing to one folder would replace each other's files wherever their task
names meet, silently. So ``onward run`` marks the folder as its job's (the extended attribute
``user.onward.owner`` of the folder: the store, by its file's real path or, for PostgreSQL, by its
database name and port, and the job's name), and refuses, in one line with exit status 2, a folder marked
for another store or job. The mark is set with ``XATTR_CREATE``, so of two jobs starting on one new folder
at once exactly one gets it. A file system without user extended attributes (some network and FUSE file
systems) cannot carry the mark: there the rule is not enforced. To hand a folder over to another job:
``setfattr -x user.onward.owner DIR``.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
import stat
from collections.abc import Iterator
from types import TracebackType
from urllib.parse import unquote, urlsplit

from onward.errors import UNAVAILABLE_ERRNOS, OutputUnavailable, UsageError
from onward.folders import create_private_folders
from onward.proc import pid_exists, pid_start_time, process_alive

# The longest stem (file name without '.txt') of any form; with the suffix, 204 bytes, within the 255
# that Linux and macOS file systems allow for one path component.
MAX_STEM_BYTES = 200
# How much of the escaped text a hashed name keeps, for people listing the folder: 1 + 128 + 1 + 64 = 194.
HASHED_PREFIX_BYTES = 128
SUFFIX = ".txt"

_SAFE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*", re.ASCII)
# Bytes that stay as they are inside an escaped name. Not '.', so an escaped stem has no dot at all; not
# '~', so only the hashed form has a second '~'; not '%', so every '%' starts an escape.
_KEPT_BYTES = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")

OWNER_ATTRIBUTE = "user.onward.owner"
# The folder cannot carry the mark (a file system without user xattrs; a sticky folder of another user's,
# where only its owner may set them): the rule is off there.
_NO_XATTRS = frozenset({errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EPERM})

TEMP_PREFIX = ".onward-tmp-"
# Digits only (no sign, no spaces, no other scripts' digits): os.kill(-n, 0) and os.kill(0, 0) ask about a
# whole process group, not one process, so a negative pid must not parse and pid 0 is skipped.
# The writer's pid, then its start time (names made before it was added have none), then random hex.
_TEMP_NAME = re.compile(re.escape(TEMP_PREFIX) + r"([0-9]{1,10})-(?:([0-9]{1,20})-)?[0-9a-f]+", re.ASCII)


def _task_bytes(task: str) -> bytes:
    # 'surrogatepass' so that any Python str works, including lone surrogates that os.fsdecode produces
    # for undecodable bytes; it still encodes each code point on its own, so it stays one-to-one.
    return task.encode("utf-8", "surrogatepass")


def _escape(text: str) -> str:
    return "".join(chr(byte) if byte in _KEPT_BYTES else f"%{byte:02X}" for byte in _task_bytes(text))


def file_name(task: str) -> str:
    """The file name (with '.txt') that a task's result goes to; the rule is in the module docstring.

    Why two different texts never get the same name (all three forms end in the same '.txt', so it is
    enough that the stems differ):

    - safe vs escaped: every escaped stem starts with '~', which no safe name contains.
    - safe vs safe: the stem is the text itself.
    - escaped vs escaped: UTF-8 is one-to-one, and so is the percent-encoding, because '%' is always
      escaped: decoding the stem gives back the exact bytes.
    - short escaped vs hashed: '~' is always escaped, so a short escaped stem has exactly one '~' and a
      hashed stem has two.
    - hashed vs hashed: the prefix has no '~', so the last 64 characters are the sha256 of the whole
      text; equal names would be a sha256 collision.
    """
    encoded = _task_bytes(task)
    if len(encoded) <= MAX_STEM_BYTES and _SAFE_NAME.fullmatch(task):
        return task + SUFFIX
    escaped = _escape(task)
    if 1 + len(escaped) <= MAX_STEM_BYTES:
        return "~" + escaped + SUFFIX
    # Whole characters only, so the prefix reads as the task's beginning: no half '%XX', no half 'é'.
    prefix = ""
    for character in task:
        escaped_character = _escape(character)
        if len(prefix) + len(escaped_character) > HASHED_PREFIX_BYTES:
            break
        prefix += escaped_character
    return "~" + prefix + "~" + hashlib.sha256(encoded).hexdigest() + SUFFIX


def _create_new_file(dir_fd: int, name: str) -> int:
    """Create ``name`` in the folder, failing if anything (a symlink included) already has that name.

    O_EXCL makes the kernel refuse an existing name, dangling symlinks too, instead of opening its target;
    O_NOFOLLOW says the same thing again for readers of this line.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(name, flags, 0o600, dir_fd=dir_fd)


_writer: tuple[int, int | None] | None = None  # this process's pid and start time, read once per process


def _new_temp_name() -> str:
    # The writer's start time beside its pid: a pid is reused (32,768 of them, by default), so a dead
    # writer's file would otherwise look live whenever another process got its pid, and stay. 64 random
    # bits: two writers (or a name someone planted in advance) clash only by luck.
    global _writer
    pid = os.getpid()
    if _writer is None or _writer[0] != pid:  # (a forked child is another writer)
        _writer = (pid, pid_start_time(pid))
    start = _writer[1]
    return f"{TEMP_PREFIX}{pid}-{'' if start is None else f'{start}-'}{secrets.token_hex(8)}"




def owner_of(store_location: str, job: str, *, postgres: bool) -> str:
    """The mark of a job's output folder: its store, as ``store_url`` gives it (``postgres``: whether it is
    a PostgreSQL URL), and the job. A SQLite store by the real path of its file (the same file however it
    is spelt); a PostgreSQL one by its database and port, not its host, which hosts of one job may reach by
    different addresses (and never by its user or password)."""
    if postgres:
        parts = urlsplit(store_location)
        try:
            port = parts.port or 5432
        except ValueError:
            port = 5432
        where = f"postgresql database {unquote(parts.path.lstrip('/')) or '?'!r} on port {port}"
    else:
        where = f"sqlite store {os.path.realpath(store_location.removeprefix('sqlite:///'))!r}"
    return f"{where}, job {job!r}"


class OutDir:
    """An open output folder. Every name given to it is a task text; every path inside is its own.

    The folder is held open as a directory fd and every operation is relative to it, so renaming or
    replacing the folder's path while onward runs cannot redirect a write somewhere else.
    """

    def __init__(self, path: str, owner: str | None = None) -> None:
        """Create the folder if missing, check it can be written, and mark it as ``owner``'s (see
        ``owner_of``; None: no mark, no check). Crashed writers' temp files are removed by
        ``remove_stale_temp_files``, which a worker goes through beside its tasks (a folder of a million
        files took a second to list at every start).

        Raises UsageError with a one-line message when the folder cannot be created, opened or written, or
        is marked as another owner's.
        """
        self.path = path
        self._dir_fd = -1
        try:
            create_private_folders(path)
            # The folder's own path may go through symlinks (an --out on another disk is common); only
            # what is inside the folder is never followed. O_DIRECTORY refuses a file at that path.
            self._dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            # Permission bits do not say whether a write works (root, read-only mounts, ACLs, quotas):
            # trying does.
            probe_name = _new_temp_name()
            os.close(_create_new_file(self._dir_fd, probe_name))
            os.unlink(probe_name, dir_fd=self._dir_fd)
            if owner is not None:
                self._claim(owner)
        except OSError as exc:
            self.close()
            reason = exc.strerror or str(exc)
            # A failing, full or read-only disk, or a process out of descriptors or memory, is no mistake of
            # the user's: exit 75, restarted later.
            kind = OutputUnavailable if exc.errno in UNAVAILABLE_ERRNOS else UsageError
            raise kind(f"cannot write to output folder {path!r}: {reason}") from exc
        except BaseException:
            self.close()
            raise

    def _claim(self, owner: str) -> None:
        """Mark the folder as ``owner``'s, or check that it is already; UsageError if another's."""
        wanted = owner.encode("utf-8", "surrogateescape")
        try:
            os.setxattr(self._dir_fd, OWNER_ATTRIBUTE, wanted, os.XATTR_CREATE)
            return
        except OSError as exc:
            if exc.errno in _NO_XATTRS:
                return
            if exc.errno != errno.EEXIST:
                raise
        found = os.getxattr(self._dir_fd, OWNER_ATTRIBUTE)
        if found != wanted:
            shown = found[:300].decode("utf-8", "replace").encode("unicode_escape").decode("ascii")
            raise UsageError(f"output folder {self.path!r} holds the results of another job ({shown});"
                             f" give this job its own --out (or hand the folder over:"
                             f" setfattr -x {OWNER_ATTRIBUTE} DIR)")

    def remove_stale_temp_files(self) -> Iterator[None]:
        """Remove temp files whose writer's process is gone: they are what a crash mid-write leaves. Yields
        after each name of the folder it looks at, read as it goes (a folder of a million files is never
        held in memory whole): the caller may stop and go on later. Raises OSError if the folder cannot be
        read.

        A live process's files are kept: it may be about to rename them. Caveat: a writer in another pid
        namespace (another container sharing the folder) looks gone from here, and its write in progress
        would fail; a shared output folder needs onward processes that see each other's pids.
        """
        with os.scandir(self._open_fd()) as entries:
            for entry in entries:
                self._remove_if_stale(entry.name)
                yield

    def _remove_if_stale(self, name: str) -> None:
        match = _TEMP_NAME.fullmatch(name) if name.startswith(TEMP_PREFIX) else None
        if match is None:
            return
        pid, start = int(match.group(1)), match.group(2)
        if pid == 0 or (pid_exists(pid) if start is None else process_alive(pid, int(start))):
            return
        try:
            os.unlink(name, dir_fd=self._dir_fd)
        except OSError:
            # Best effort: another opener removed it first, or it is not ours to remove (a folder, another
            # user's file in a sticky folder). A leftover temp file harms no result.
            pass

    def _open_fd(self) -> int:
        if self._dir_fd < 0:
            raise ValueError(f"output folder {self.path!r} is closed")
        return self._dir_fd

    def write(self, task: str, data: bytes) -> None:
        """Make ``data`` the task's result file, atomically and durably, replacing any earlier one.

        When this returns, the file holds ``data`` and survives a power cut; if it raises (a full disk,
        a folder sitting at the file's name), the old file, if any, is untouched and no temp file is left.
        """
        dir_fd = self._open_fd()
        temp_name = _new_temp_name()
        file_fd = _create_new_file(dir_fd, temp_name)
        try:
            try:
                remaining = memoryview(data)
                while remaining:  # os.write may write less than asked (signals, some file systems)
                    remaining = remaining[os.write(file_fd, remaining) :]
                # The data must be on disk before the rename makes it visible: otherwise a power cut
                # after the rename can leave the final name pointing at an empty or partial file.
                os.fsync(file_fd)
            finally:
                os.close(file_fd)
            # rename replaces whatever has the final name, a symlink included, without following it.
            os.rename(temp_name, file_name(task), src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            try:
                os.unlink(temp_name, dir_fd=dir_fd)
            except OSError:
                pass
            raise
        # The rename lives in the folder's entries: fsync the folder so that it survives a power cut.
        os.fsync(dir_fd)

    def has(self, task: str) -> bool:
        """Whether the task's result file exists. Only a regular file counts, never a symlink or a folder."""
        try:
            status = os.stat(file_name(task), dir_fd=self._open_fd(), follow_symlinks=False)
        except FileNotFoundError:
            return False
        return stat.S_ISREG(status.st_mode)

    def close(self) -> None:
        """Release the folder's fd. Closing twice is fine; any other use after closing raises ValueError."""
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1

    def __enter__(self) -> OutDir:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
