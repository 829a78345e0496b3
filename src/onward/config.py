"""How a worker runs: ``RunConfig``, the one place its settings, their defaults and their limits live.

The CLI's ``onward run`` options and the Python API's ``Job`` both take their defaults from here, and a
``RunConfig`` refuses nonsense values when it is made (one ``UsageError`` line; exit status 2 from the CLI).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TypeGuard

from .errors import UsageError
from .log import NORMAL, QUIET, VERBOSE

# The largest stdout a command's attempt may produce as its result (the CLI's --max-result-bytes).
DEFAULT_MAX_RESULT_BYTES = 16 * 1024 * 1024
# The largest value a store takes: a task's result, a durable step's value (and `onward run`'s
# --max-result-bytes at most). Below what either backend can hold in one row (SQLite: 1,000,000,000 bytes,
# PostgreSQL: 1 GiB), with room for the rest of the row; a bigger one failed its commit with "string or blob
# too big", and the worker retried that commit, with the other tasks' outcomes, for good. A value near it
# already takes seconds to commit and about three times its size in memory.
MAX_STORED_BYTES = 512 * 1024 * 1024


# The longest duration any setting may name (about 11.5 days). The kernel's timers take at most 2**31 - 1
# milliseconds (24.8 days): a heartbeat or timeout beyond that overflows poll() and select().
MAX_SECONDS = 1_000_000
# The shortest heartbeat. A lease is three of them by default: below a tenth of a second, a turn of the
# worker's loop, a garbage collection or a busy disk outlasts a lease, and healthy workers take each other's
# tasks (two attempts overlapping) until every task has used up its attempts.
MIN_HEARTBEAT = 0.1
MAX_CONCURRENCY = 4096  # tasks at once in one worker, each a thread or a child process
MAX_ATTEMPTS = 1_000_000  # stored as an SQL integer; beyond any real retry policy


@dataclass
class RunConfig:
    concurrency: int = 1
    max_attempts: int = 3
    retry_delay: float = 1.0  # first backoff; doubles with every further attempt
    max_retry_delay: float = 300.0
    timeout: float | None = None  # seconds an attempt may run
    heartbeat: float = 5.0  # lease renewal period
    lease: float | None = None  # lease length; default 3 heartbeats
    grace: float = 10.0  # on SIGTERM: how long running tasks may take to finish
    stall_timeout: float | None = None  # cancel a task with no sign of progress for this long
    # A Python task's durable sleep (ctx.sleep) with more than this many seconds left parks the task (state
    # waiting, no slot, no lease, the keep-awake marker free to go) until it is due; shorter ones sleep in
    # the worker.
    park_sleeps_over: float = 60.0
    install_signal_handlers: bool = True

    def __post_init__(self) -> None:
        # dataclasses.replace() builds a new RunConfig, so an override is checked like the original.
        self.validate()

    @property
    def lease_seconds(self) -> float:
        return self.lease if self.lease is not None else 3 * self.heartbeat

    def validate(self) -> None:
        """Refuse nonsense with one line naming the setting: first a value of the wrong type (only the
        Python API can pass one), then a value out of its range."""
        self._check_types()
        for name in SECONDS_SETTINGS:
            value = getattr(self, name)
            # NaN passes every comparison below, and infinity overflows timers: only finite numbers are
            # durations. (An int needs no look: every int is finite, and one too big for a float would make
            # math.isfinite raise OverflowError instead of the "at most" below.)
            if isinstance(value, float) and not math.isfinite(value):
                raise UsageError(f"{name.replace('_', ' ')} must be a finite number of seconds (got {value})")
            if value is not None and value > MAX_SECONDS:
                raise UsageError(f"{name.replace('_', ' ')} must be at most {MAX_SECONDS:,} seconds (got {value})")
        if self.concurrency < 1:
            raise UsageError(f"concurrency must be at least 1 (got {self.concurrency})")
        if self.concurrency > MAX_CONCURRENCY:
            raise UsageError(f"concurrency must be at most {MAX_CONCURRENCY} (got {self.concurrency})")
        if self.max_attempts < 1:
            raise UsageError(f"max attempts must be at least 1 (got {self.max_attempts})")
        if self.max_attempts > MAX_ATTEMPTS:
            raise UsageError(f"max attempts must be at most {MAX_ATTEMPTS:,} (got {self.max_attempts})")
        if self.retry_delay < 0:
            raise UsageError(f"retry delay cannot be negative (got {self.retry_delay})")
        if self.max_retry_delay < 0:
            raise UsageError(f"max retry delay cannot be negative (got {self.max_retry_delay})")
        if self.grace < 0:
            raise UsageError(f"grace cannot be negative (got {self.grace})")
        if self.park_sleeps_over < 0:
            raise UsageError(f"park sleeps over cannot be negative (got {self.park_sleeps_over})")
        if not self.heartbeat >= MIN_HEARTBEAT:
            raise UsageError(f"heartbeat must be at least {MIN_HEARTBEAT:g} seconds (got {self.heartbeat})")
        for name, value in (("timeout", self.timeout), ("stall timeout", self.stall_timeout),
                            ("lease", self.lease)):
            if value is not None:
                _positive(name, value)
        if self.lease is not None and self.lease <= self.heartbeat:
            raise UsageError(f"lease ({self.lease}) must be longer than the heartbeat ({self.heartbeat})")
        if self.lease is None and self.lease_seconds > MAX_SECONDS:
            # The default lease, 3 heartbeats, must keep the rule every duration keeps (it went past it).
            raise UsageError(f"heartbeat must be at most {MAX_SECONDS // 3:,} seconds without a lease, which is 3"
                             f" heartbeats by default and at most {MAX_SECONDS:,} seconds (got {self.heartbeat})")

    def _check_types(self) -> None:
        # Messages name the keyword as the caller wrote it (retry_delay=): the CLI parses its flags into
        # these types, so only Python code can get one wrong.
        for name in SECONDS_SETTINGS:
            value = getattr(self, name)
            if value is None and name in OPTIONAL_SETTINGS:
                continue
            if not is_number(value):
                takes = "a number of seconds (an int or a float)"
                if name in OPTIONAL_SETTINGS:
                    takes += " or None"
                raise UsageError(setting_refused(name, takes, value))
        for name in ("concurrency", "max_attempts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):  # 2.5 was taken, then failed every claim
                raise UsageError(setting_refused(name, "a whole number (an int)", value))
        if not isinstance(self.install_signal_handlers, bool):
            raise UsageError(setting_refused("install_signal_handlers", "True or False", self.install_signal_handlers))


# The settings that are durations in seconds, and those of them that None leaves unset (no timeout, no
# stall timeout, a lease of three heartbeats).
SECONDS_SETTINGS = ("retry_delay", "max_retry_delay", "timeout", "heartbeat", "lease", "grace", "stall_timeout",
                    "park_sleeps_over")
OPTIONAL_SETTINGS = frozenset({"timeout", "lease", "stall_timeout"})
LOG_LEVELS = (QUIET, NORMAL, VERBOSE)


def is_number(value: object) -> TypeGuard[int | float]:
    """An int or a float, and not a bool: True is an int to Python, but ``heartbeat=True`` or
    ``concurrency=True`` is a slip, never a setting (concurrency and max_attempts refused it first)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def setting_refused(name: str, takes: str, value: object) -> str:
    """The one line that refuses a setting of the wrong type: what it takes, what it got."""
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return f"{name} must be {takes}, not {type(value).__name__}: {shown}"


def location_setting(name: str, value: object) -> str | None:
    """A path or store location given to the Python API (``Job``'s ``db``, ``out`` and ``keep_awake``):
    None, a str or an ``os.PathLike`` such as ``pathlib.Path``, as a str. Raises ``UsageError`` for
    anything else, bytes included (a store's location and a result's file name are text)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, os.PathLike):
        path = os.fspath(value)
        if isinstance(path, str):
            return path
    raise UsageError(setting_refused(name, "a str or a pathlib.Path (or None)", value))


@dataclass(frozen=True)
class JobSettings:
    """``Job``'s settings besides its ``RunConfig``, paths as str (see ``job_settings``)."""

    db: str | None
    name: str | None
    out: str | None
    keep_awake: str | None
    log_level: int


def job_settings(*, db: object, name: object, out: object, keep_awake: object, log_level: object) -> JobSettings:
    """``Job``'s settings besides its ``RunConfig``, checked for type before any store is opened (a
    refusal creates nothing). What each value must be (a store location, a job name, a marker path) is
    checked where it is used, by the same code as the CLI's flags."""
    if name is not None and not isinstance(name, str):
        raise UsageError(setting_refused("name", "a job name (a str) or None", name))
    if not isinstance(log_level, int) or isinstance(log_level, bool) or log_level not in LOG_LEVELS:
        raise UsageError(setting_refused("log_level", "onward.log.QUIET, NORMAL or VERBOSE (0, 1 or 2)", log_level))
    return JobSettings(db=location_setting("db", db), name=name, out=location_setting("out", out),
                       keep_awake=location_setting("keep_awake", keep_awake), log_level=log_level)


def _positive(name: str, value: float | None) -> None:
    if value is None or value <= 0:
        raise UsageError(f"{name} must be greater than 0 (got {value})")
