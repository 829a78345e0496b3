"""The Python API: a ``Job`` is a store plus the function that handles each task.

    from onward import Job
    job = Job(".onward/onward.db")

    @job.task(max_attempts=5, timeout=600)
    def handle(task: str, ctx) -> str: ...

    job.add(["a", "b"])      # idempotent
    summary = job.run()      # resumes where it left off
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any, TypeVar, overload

from . import results
from .attempts import PythonHandler
from .context import TaskContext
from .errors import TaskNotDone, UsageError
from .keepawake import KeepAwake, check_marker_path, marker_path
from .log import NORMAL, Log
from .notify import Notifier
from .outdir import OutDir
from .runner import RunConfig, Runner, RunSummary
from .secrets import url_secrets
from .steps import REPLAY_POLICIES, STRICT
from .store import open_store, store_url
from .store.base import Stats, Store

F = TypeVar("F", bound=Callable[..., Any])


class Job:
    def __init__(self, db: str | None = None, *, concurrency: int = 1, max_attempts: int = 3,
                 retry_delay: float = 1.0, timeout: float | None = None, heartbeat: float = 5.0,
                 grace: float = 10.0, stall_timeout: float | None = None, out: str | None = None,
                 keep_awake: str | None = None, log_level: int = NORMAL) -> None:
        self.url = store_url(db)
        self.store: Store = open_store(self.url)
        self.config = RunConfig(concurrency=concurrency, max_attempts=max_attempts, retry_delay=retry_delay,
                                timeout=timeout, heartbeat=heartbeat, grace=grace, stall_timeout=stall_timeout)
        validate_config(self.config)
        self.out = out
        self.keep_awake = keep_awake
        self.log = Log(log_level)
        self._fn: Callable[[str, TaskContext], Any] | None = None
        self._replay = STRICT

    @overload
    def task(self, fn: F) -> F: ...
    @overload
    def task(self, *, max_attempts: int | None = None, timeout: float | None = None,
             stall_timeout: float | None = None, replay: str = STRICT) -> Callable[[F], F]: ...

    def task(self, fn: Any = None, *, max_attempts: int | None = None, timeout: float | None = None,
             stall_timeout: float | None = None, replay: str = STRICT) -> Any:
        """Register the function that handles each task: ``fn(task: str, ctx) -> result``, or an
        ``async def`` (run on the worker's event loop, ``ctx`` an ``AsyncTaskContext``).

        ``replay``: what a resumed task does when it calls a different step than the one recorded at that
        position: ``"strict"`` (default) fails the attempt with ``StepDrift``; ``"prefix"`` keeps the steps
        that matched, drops the recorded ones from there on and runs on."""
        if replay not in REPLAY_POLICIES:
            raise UsageError(f"replay must be one of {', '.join(REPLAY_POLICIES)} (got {replay!r})")

        def register(f: F) -> F:
            if self._fn is not None:
                raise UsageError("this job already has a task function")
            self._fn = f
            self._replay = replay
            changes: dict[str, Any] = {}
            if max_attempts is not None:
                changes["max_attempts"] = max_attempts
            if timeout is not None:
                changes["timeout"] = timeout
            if stall_timeout is not None:
                changes["stall_timeout"] = stall_timeout
            self.config = replace(self.config, **changes)
            validate_config(self.config)
            return f
        return register(fn) if fn is not None else register

    def add(self, tasks: Iterable[str]) -> int:
        """Add tasks (idempotent). Returns how many were new. Streams: a million names need not be held in
        memory; the add is one transaction, so a bad name anywhere adds nothing. Raises ``TypeError`` for
        a bare ``str`` or ``bytes`` (an iterable of characters, not of names) and for an item that is not
        a ``str``, rather than adding its characters or its ``repr``."""
        if isinstance(tasks, (str, bytes, bytearray)):
            kind = "a single str" if isinstance(tasks, str) else "bytes"
            raise TypeError(f"add() takes an iterable of task names, not {kind}: write add([{tasks!r}])")

        def checked() -> Iterator[str]:
            for task in tasks:
                if not isinstance(task, str):
                    raise TypeError(f"a task name must be a str, not {type(task).__name__}: {task!r}")
                name = task.strip()
                check_task_name(name)
                yield name
        return self.store.add(checked())

    def run(self, **overrides: Any) -> RunSummary:
        """Run until no task is pending or running (or a stop signal). Resumes where it left off."""
        if self._fn is None:
            raise UsageError("no task function: decorate one with @job.task")
        config = replace(self.config, **overrides)
        validate_config(config)
        marker = marker_path(self.keep_awake)
        if marker:
            check_marker_path(marker)
        out = OutDir(self.out) if self.out else None
        handler = PythonHandler(self._fn, replay=self._replay)
        try:
            runner = Runner(self.store, handler, config, self.log, notifier=Notifier.from_env(),
                            keep_awake=KeepAwake(marker, self.log) if marker else None, out=out,
                            secrets=url_secrets(self.url))
            return runner.run()
        finally:
            handler.close()
            if out is not None:
                out.close()

    def result(self, task: str) -> Any:
        """The result of a done task, as the function returned it (str, bytes or a JSON value)."""
        stored = self.store.result(task)
        if stored is None:
            row = self.store.task(task)
            state = row.state if row else "unknown"
            raise TaskNotDone(f"task {task!r} is not done ({state})")
        return results.decode(stored.data, stored.kind)

    def status(self) -> Stats:
        return self.store.stats()

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_task_name(name: str) -> None:
    from .tasksfile import MAX_LINE_BYTES

    if not name:
        raise UsageError("a task name cannot be empty")
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: what non-UTF-8 bytes in argv or a file name decode to
        raise UsageError(f"a task name must be valid UTF-8: {name[:40]!r}") from None
    if len(encoded) > MAX_LINE_BYTES:
        raise UsageError(f"task name longer than {MAX_LINE_BYTES} bytes: {name[:40]!r}…")
    if "\n" in name or "\0" in name:
        raise UsageError(f"a task name cannot hold a newline or NUL: {name[:40]!r}")


def validate_config(config: RunConfig) -> None:
    """Nonsense values are refused with one line (exit status 2 from the CLI)."""
    for name in ("retry_delay", "timeout", "heartbeat", "lease", "grace", "stall_timeout"):
        value = getattr(config, name)
        # NaN passes every comparison below, and infinity overflows timers: only finite numbers are durations.
        if value is not None and not math.isfinite(value):
            raise UsageError(f"{name.replace('_', ' ')} must be a finite number of seconds (got {value})")
    def positive(name: str, value: float | None, allow_none: bool = True) -> None:
        if value is None and allow_none:
            return
        if value is None or value <= 0:
            raise UsageError(f"{name} must be greater than 0 (got {value})")

    if config.concurrency < 1:
        raise UsageError(f"concurrency must be at least 1 (got {config.concurrency})")
    if config.max_attempts < 1:
        raise UsageError(f"max attempts must be at least 1 (got {config.max_attempts})")
    if config.retry_delay < 0:
        raise UsageError(f"retry delay cannot be negative (got {config.retry_delay})")
    if config.grace < 0:
        raise UsageError(f"grace cannot be negative (got {config.grace})")
    positive("heartbeat", config.heartbeat, allow_none=False)
    positive("timeout", config.timeout)
    positive("stall timeout", config.stall_timeout)
    positive("lease", config.lease)
    if config.lease is not None and config.lease <= config.heartbeat:
        raise UsageError(f"lease ({config.lease}) must be longer than the heartbeat ({config.heartbeat})")
