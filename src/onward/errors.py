"""Exception types: every user-facing failure is one of these, with a message fit for one line.

The CLI maps these types to exit codes in one place (``onward.cli.EXIT_CODES``); library users catch them.
"""

from __future__ import annotations

import errno

# Errors of the machine rather than of the input: the disk failed, filled up, turned read-only (ext4's
# errors=remount-ro) or ran out of quota. An operation that met one may succeed once it is fixed.
TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.ENOSPC, errno.EROFS, errno.EDQUOT})
# Those, and a process or machine out of descriptors or memory: a command that meets one anywhere (a
# report written to a full disk, a store opened under an exhausted ``ulimit -n``) says so in one line and
# exits 75, unavailable right now, for a supervisor to try again later.
UNAVAILABLE_ERRNOS = TRANSIENT_ERRNOS | {errno.EMFILE, errno.ENFILE, errno.ENOMEM}
# A process could not be made or set up for want of the worker's own resources (descriptors, processes,
# memory): not the task's fault, nor its cgroup's. The attempt is given back uncounted (runner, attempts).
RESOURCE_ERRNOS = frozenset({errno.EAGAIN, errno.ENOMEM, errno.ENFILE, errno.EMFILE})


# The exit status of "unavailable for now, try again later" (EX_TEMPFAIL of sysexits.h): the store or the output
# folder cannot be used right now; supervisors and systemd restart it without counting a crash loop.
UNAVAILABLE_EXIT = 75

class OnwardError(Exception):
    """Base class of every error onward raises on purpose."""


class UsageError(OnwardError):
    """Bad input from the user: a flag value, a tasks file, an output folder. Exit status 2."""


class StoreError(OnwardError):
    """The store cannot be opened or used as asked. Exit status 2: nothing was changed."""


class Unavailable(OnwardError):
    """A fault of the machine, not of the input: a disk that fails, is full or turned read-only, a database
    server that does not answer. Exit status 75 (EX_TEMPFAIL): unlike status 2, supervisors and systemd
    restart the worker, and the job resumes once the fault is gone."""


class StoreUnavailable(StoreError, Unavailable):
    """The store cannot be read or written right now (an I/O error, a full disk, a database server down).
    Nothing was changed. Exit status 75."""


class StoreLogLost(StoreUnavailable):
    """A SQLite store's write-ahead log lost pages in memory after a failed write (the kernel dropped pages
    the disk had not taken): the worker stops without checkpointing it, and the next start recovers the log
    up to them (``SqliteStore._lose_log``). Exit status 75, so that a supervisor starts it again."""


class OutputUnavailable(Unavailable):
    """The output folder cannot be written right now (an I/O error, a full or read-only disk). Exit
    status 75."""


class StoreMissing(StoreError):
    """There is no store at the location given (no file, or no ``onward`` schema), and it was only to be
    read, not created."""


class JobMissing(StoreMissing):
    """The store is there, but not the job named (and it was only to be read, not created)."""


class NotAStore(StoreError):
    """The file exists but is not an onward store (another SQLite file, or not SQLite at all)."""


class SchemaTooNew(StoreError):
    """The store was written by a newer onward; this version refuses to touch it."""


class SchemaTooOld(StoreError):
    """The store's schema is older than this onward; ``onward db upgrade`` brings it up to date."""


class WorkersRunning(StoreError):
    """``onward db upgrade`` found live workers recorded in a store that needs an upgrade: workers of an
    older onward (this one refuses such a store), whose code would run on the new schema. Nothing was
    changed. Exit status 2."""


class CorruptStore(StoreError):
    """The database file is damaged. onward reports it and never recreates the store silently."""


class StoreGone(StoreError):
    """The store was deleted or replaced under a running worker (its file unlinked or renamed over, its
    PostgreSQL schema dropped). The worker stops: what it committed since went where nobody will read it,
    and a restart would start a new, empty store. Exit status 2, which supervisors do not restart."""


class TaskNotDone(OnwardError):
    """A result was asked for a task that has none (unknown, pending, running or failed). Exit status 1."""


class UnknownTask(OnwardError):
    """A task name given on the command line is not in the store. Exit status 1."""


class Fenced(OnwardError):
    """This worker lost its claim on the task (its lease was taken over): it must not commit anything more.

    Raised inside a task when it tries to record a step under a fence that is no longer current.
    """


class StepDrift(OnwardError):
    """A resumed task called a different step than the one recorded at that position."""


class WedgedTask(OnwardError):
    """A Python task ignored its cancellation past the grace period: a thread cannot be killed, so the
    worker exits (status 4) for its supervisor to start a clean one."""

    def __init__(self, task: str, reason: str) -> None:
        super().__init__(f"task {task!r} ignored cancellation ({reason}); exiting so a supervisor restarts"
                         " the worker")


class WaitTimeout(OnwardError):
    """``ctx.wait(key, timeout=...)``: no value was sent for ``key`` before the deadline. Recorded like a
    step's outcome: a resumed task gets it again at the same call, without waiting."""


class NotSent(OnwardError):
    """``send`` refused a value, storing nothing: the task is finished (done, failed, cancelled), or a value
    for that key was sent before and not received yet (it is never replaced). Exit status 1."""
