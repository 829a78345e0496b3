"""How a worker runs: ``RunConfig``, the one place its settings, their defaults and their limits live.

The CLI's ``onward run`` options and the Python API's ``Job`` both take their defaults from here, and a
``RunConfig`` refuses nonsense values when it is made (one ``UsageError`` line; exit status 2 from the CLI).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import UsageError

# The largest stdout a command's attempt may produce as its result (the CLI's --max-result-bytes).
DEFAULT_MAX_RESULT_BYTES = 16 * 1024 * 1024


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
        """Refuse nonsense values with one line naming the setting."""
        for name in ("retry_delay", "timeout", "heartbeat", "lease", "grace", "stall_timeout", "park_sleeps_over"):
            value = getattr(self, name)
            # NaN passes every comparison below, and infinity overflows timers: only finite numbers are
            # durations.
            if value is not None and not math.isfinite(value):
                raise UsageError(f"{name.replace('_', ' ')} must be a finite number of seconds (got {value})")
            if value is not None and value > MAX_SECONDS:
                raise UsageError(f"{name.replace('_', ' ')} must be at most {MAX_SECONDS:,} seconds (got {value})")
        for name in ("concurrency", "max_attempts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):  # 2.5 was taken, then failed every claim
                raise UsageError(f"{name.replace('_', ' ')} must be a whole number (got {value!r})")
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


def _positive(name: str, value: float | None) -> None:
    if value is None or value <= 0:
        raise UsageError(f"{name} must be greater than 0 (got {value})")
