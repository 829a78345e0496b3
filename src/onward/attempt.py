"""What one attempt of a task is, whatever runs it: its ``Outcome``, the ``Attempt`` record the worker loop
keeps while it runs, the ``Handler`` that starts attempts, and ``Loop``, the little an attempt needs of the
loop (report its outcome, watch a descriptor, have a store call run in the next group commit).

This is the layer between the runner (which drives attempts through these types) and the code that runs
them (``onward.attempts``); neither imports the other.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from .errors import OnwardError
from .log import one_line
from .redact import scrub
from .store.base import Claim, Store

T = TypeVar("T")
ERROR_TAIL_BYTES = 4096


@dataclass(frozen=True)
class Outcome:
    kind: str  # "done", "failed", "released" (given back uncounted on a graceful stop) or "parked"
    result: bytes = b""
    result_kind: str = "bytes"
    error: str = ""
    wait_key: str = ""  # parked: the key of the wait, and its deadline (store clock; None: none)
    wait_until: float | None = None
    # released: because the store failed one of the task's step calls (its work since the last recorded step
    # is done again by the next attempt, which the worker puts off: see Runner._put_off_claims)
    store_fault: bool = False

    def __post_init__(self) -> None:
        if self.error:
            object.__setattr__(self, "error", storable_text(self.error))

    @classmethod
    def done(cls, data: bytes, kind: str) -> Outcome:
        return cls("done", data, kind)

    @classmethod
    def failure(cls, error: str) -> Outcome:
        return cls("failed", error=error)

    @classmethod
    def released(cls, reason: str, *, store_fault: bool = False) -> Outcome:
        return cls("released", error=reason, store_fault=store_fault)

    @classmethod
    def parked(cls, key: str, until: float | None) -> Outcome:
        return cls("parked", wait_key=key, wait_until=until)

    @property
    def error_line(self) -> str:
        """The error squeezed onto one line for a log."""
        return one_line(self.error) or "(no message)"


def storable_text(text: str) -> str:
    """``text`` as both stores can hold it, escaped where it could not be: a NUL (PostgreSQL's text cannot hold
    one: the commit of the whole batch failed over and over, the other tasks' outcomes with it) and a lone
    surrogate (half an emoji in a model's cut answer, bytes decoded with surrogateescape: not UTF-8, so
    neither store can take it, and the worker died at the commit of the task's failure, its attempt then
    counted against it as "owner died" over and over, the real error never recorded)."""
    if "\0" in text:
        text = text.replace("\0", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def error_tail(text: str, cut: bool, secrets: Sequence[str]) -> str:
    """The end of a task's error output (its stderr, a traceback), as kept in the store and shown: the last
    ERROR_TAIL_BYTES of ``text`` (``cut``: ``text`` is such an end already), without the store's password.
    A cut can fall inside the password and leave its second half at the start, which no longer matches it:
    that part goes too."""
    if len(text) > ERROR_TAIL_BYTES:
        text, cut = text[-ERROR_TAIL_BYTES:], True
    if cut:
        text = text.lstrip("\ufffd")  # a character cut in two by a byte cut
        for secret in secrets:  # longest first
            part = next((k for k in range(len(secret) - 1, 0, -1) if text.startswith(secret[-k:])), 0)
            if part:
                text = text[part:]
                break
    return scrub(text, secrets)


def cannot_run(program: str, error: OSError) -> str:
    """Why a command's program could not be run, as its failed attempt says it: ``cannot run PROGRAM:
    REASON``. A script whose ``#!`` line names an interpreter that is not there gets ENOENT from ``execve``,
    which reads as if the script itself were missing: its interpreter is named then."""
    text = f"cannot run {program}: {error.strerror or error}"
    if error.errno == errno.ENOENT:
        interpreter = _missing_interpreter(program)
        if interpreter is not None:
            text += f" (its interpreter {interpreter} was not found)"
    return text


def _missing_interpreter(program: str) -> str | None:
    """The interpreter named on the ``#!`` line of ``program`` (a path, or a name found on the PATH the
    command gets: the worker's own), if the program is there and its interpreter is not; else None."""
    found = program if "/" in program else shutil.which(program, path=os.pathsep.join(os.get_exec_path()))
    if found is None:
        return None
    try:
        with open(found, "rb") as f:
            head = f.read(256)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    words = head[2:].split(b"\n", 1)[0].split()
    if not words or os.path.exists(words[0]):
        return None
    return os.fsdecode(words[0])


class Cancelled(OnwardError):
    """Raised by ``ctx.check()`` in a task that was asked to stop (timeout, stall, lease lost, SIGTERM)."""


class Parked(BaseException):
    """Raised by ``ctx.wait`` when no value is there yet: the attempt ends and the task parks until the value
    comes or the wait's deadline passes, then runs again and replays up to the wait. A BaseException, like
    asyncio's CancelledError, so that a task's ``except Exception`` does not swallow it."""

    def __init__(self, key: str, until: float | None) -> None:
        super().__init__(key)
        self.key = key
        self.until = until


class Attempt:
    """One attempt of one task. Subclasses run it; the base is also the record of an attempt that could
    not start."""

    child_pid: int | None = None
    child_start: int | None = None

    def __init__(self, claim: Claim) -> None:
        self.claim = claim
        self.started = time.monotonic()
        self._progress = self.started
        self.note: str | None = None
        self.cancel_reason: str | None = None
        self.cancelled_at: float | None = None
        self.fenced = False  # the lease was lost: whatever happens, commit nothing
        # It has ended, and the commit of its outcome failed (Runner._settle_and_claim): it is tried again.
        # Nothing of it runs, so no lease running out or reported lost fences it: that commit may have been
        # carried out all the same (its answer lost), and the try again asks the store (Store.settled_under).
        self.awaiting_commit = False
        # Monotonic time by which the attempt must have ended, whatever the grace: set when its lease runs out
        # unrenewed, since another worker may take the task over once it has, and when it was taken over
        # (Leases).
        self.must_end_by: float | None = None

    @property
    def cancelled(self) -> bool:
        return self.cancel_reason is not None

    @property
    def fenceable(self) -> bool:
        """Whether a lease lost or run out must fence it: not fenced yet, and not ended awaiting its commit."""
        return not self.fenced and not self.awaiting_commit

    def last_progress(self) -> float:
        return self._progress

    def beat(self, note: str | None = None) -> None:
        self._progress = time.monotonic()
        if note is not None:
            # Text that is not valid Unicode (a lone surrogate, from bytes decoded with surrogateescape)
            # cannot be stored: the renewal that carries the note would fail, and the worker with it.
            self.note = storable_text(note[:200])

    def request_stop(self) -> None:
        """The worker is stopping gracefully: finish soon if you can."""

    def cancel(self, reason: str) -> None:
        """Stop this attempt now; it counts as failed with ``reason``."""
        if self.cancel_reason is None:
            self.cancel_reason = reason
            self.cancelled_at = time.monotonic()

    def fence(self, reason: str, end_by: float) -> None:
        """The lease is lost (taken over, or run out unrenewed): commit nothing of this attempt, stop it now,
        and have it ended by ``end_by`` (monotonic), whatever the grace (see ``must_end_by``)."""
        self.fenced = True
        self.cancel(reason)
        self.must_end_by = end_by

    def abandon(self, reason: str) -> None:
        """The worker is leaving: end the attempt at once and report it released."""

    def unresponsive(self, now: float, grace: float) -> bool:
        """True when the attempt was cancelled more than ``grace`` seconds ago and still runs."""
        return False


class Loop(Protocol):
    """What an attempt needs of the worker loop that runs it (``Runner`` is the one there is)."""

    @property
    def worker_id(self) -> int:
        """The worker's id in the store, written into the journal lines an attempt adds."""

    @property
    def secrets(self) -> Sequence[str]:
        """The store's password in every form it may take: kept out of every error an attempt reports."""

    def post(self, attempt: Attempt, outcome: Outcome) -> None:
        """Report the attempt's outcome (exactly once; from any thread)."""

    def settle_here(self, attempt: Attempt, outcome: Outcome) -> bool:
        """Report the attempt's outcome (exactly once) from the attempt's own thread, which may settle it
        there and then (True) and be handed the next attempt to run (see ``Runner.settle_here``)."""

    def abort(self, error: BaseException) -> None:
        """From an attempt's thread that cannot report its outcome (``post`` or ``settle_here`` failed, no
        memory left): stop the worker with ``error`` rather than leave the attempt running for good."""

    def note_child(self, claim: Claim, pid: int, start: int) -> None:
        """Record in the store (crash-safe) the process an attempt is about to run its command in, before
        the command runs: a worker taking the task over kills it first. Raises ``Fenced`` if the claim is
        gone (taken over while this worker was frozen), StoreError if the store cannot say."""

    def check_claim(self, claim: Claim) -> None:
        """Before a command whose pid was noted with its claim runs: raises ``Fenced`` if the claim is gone
        (taken over while this worker was frozen), StoreError if the store cannot say. A read, no commit."""

    def out_of_resources(self, claim: Claim, error: OSError) -> None:
        """On the loop's thread: an attempt of ``claim`` found, once started, that the worker was short of
        resources (its command's ``execve`` failed with ENOMEM, EAGAIN, EMFILE or ENFILE), as a start that
        could not make its process does: warn, lower the concurrency, and claim nothing for a while."""

    def register(self, fd: int, callback: Callable[[], None]) -> None:
        """Call ``callback`` on the loop's thread whenever ``fd`` is readable (a child's pipe or pidfd)."""

    def unregister(self, fd: int) -> None:
        """Stop watching ``fd`` (before it is closed)."""

    def store_call(self, fn: Callable[[Store], T]) -> T:
        """From a task's thread: run ``fn(store)`` inside the loop's next group commit; its value once durable."""


class Handler(Protocol):
    def start(self, claim: Claim, loop: Loop) -> Attempt:
        """Start one attempt; it must report its outcome with ``loop.post`` exactly once."""

    def spare_children(self, limit: int) -> list[tuple[int, int]]:
        """Processes (pid, start time) made ready to run the next attempts' commands, up to ``limit``: the
        worker notes the first with its next claim (``Store.claim``'s ``child``) and the others on the claims
        after it, in the same commit, and ``start`` of a claim that names one (``Claim.child_pid``) runs that
        attempt in it. Empty for a handler without such processes."""

    def discard_spares(self) -> None:
        """End the processes ``spare_children`` gave, unstarted: a commit that noted them failed, and may yet have
        been committed (a connection lost during COMMIT), so the store may name them under claims this
        worker does not know it holds, which whoever reclaims those claims will kill."""


