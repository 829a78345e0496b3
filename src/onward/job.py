"""The Python API: a ``Job`` is a store plus the function that handles each task.

    from onward import Job
    job = Job(".onward/onward.db")

    @job.task(max_attempts=5, timeout=600)
    def handle(task: str, ctx) -> str: ...

    job.add(["a", "b"])      # idempotent
    summary = job.run()      # resumes where it left off

Several jobs may share one store: ``Job(db, name="nightly")`` (default: $ONWARD_JOB, else "default") sees
only its own tasks, results, journal, workers and pause flag.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import fields, replace
from typing import Any, TypeVar, overload

from . import results, waits
from .attempts import PythonHandler
from .config import RunConfig, job_settings
from .context import TaskContext
from .errors import TaskNotDone, Unavailable, UsageError
from .keepawake import marker_path
from .log import NORMAL, Log
from .outdir import OutDir, owner_of
from .settle import RunSummary
from .steps import REPLAY_POLICIES, STRICT
from .store import cancel_all_or_nothing, is_postgres_url, open_store, store_url
from .store.base import Stats, Store
from .tasksfile import check_task_name, task_name
from .worker import run_worker

F = TypeVar("F", bound=Callable[..., Any])


@contextlib.contextmanager
def _spaced_when_unavailable() -> Iterator[None]:
    """A store or output unavailable (``Unavailable``, the CLI's exit 75) raised in the main process of a
    systemd service is raised once the process has lived ``UNAVAILABLE_SPACING`` seconds, as the CLI's exit
    75 is spaced (onward.systemd.space_unavailable_exit): a worker script ends with that error, its status
    restarted like 75, and without the wait an outage at start used up the unit's start limit (6 starts in
    60 s) within seconds, leaving the unit failed when the server came back. The program's signal handlers
    are left as they are: SIGINT's and SIGTERM's defaults end the wait."""
    try:
        yield
    except Unavailable:
        # As in onward.cli.cli_main: nothing imported unless needed (no file descriptor may be left to load it).
        if os.environ.get("SYSTEMD_EXEC_PID") == str(os.getpid()):
            from .systemd import space_unavailable_exit

            space_unavailable_exit(reset_signals=False)
        raise


class Job:
    def __init__(self, db: str | os.PathLike[str] | None = None, *, name: str | None = None,
                 concurrency: int = RunConfig.concurrency, max_attempts: int = RunConfig.max_attempts,
                 retry_delay: float = RunConfig.retry_delay, timeout: float | None = RunConfig.timeout,
                 heartbeat: float = RunConfig.heartbeat, grace: float = RunConfig.grace,
                 stall_timeout: float | None = RunConfig.stall_timeout,
                 park_sleeps_over: float = RunConfig.park_sleeps_over, out: str | os.PathLike[str] | None = None,
                 keep_awake: str | os.PathLike[str] | None = None, log_level: int = NORMAL) -> None:
        # Every setting is checked, for its type and then its value, before the store is opened: a refused
        # one raises UsageError and creates nothing.
        settings = job_settings(db=db, name=name, out=out, keep_awake=keep_awake, log_level=log_level)
        self.config = RunConfig(concurrency=concurrency, max_attempts=max_attempts, retry_delay=retry_delay,
                                timeout=timeout, heartbeat=heartbeat, grace=grace, stall_timeout=stall_timeout,
                                park_sleeps_over=park_sleeps_over)
        self.url = store_url(settings.db)
        with _spaced_when_unavailable():
            self.store: Store = open_store(self.url, job=settings.name)
        self.name = self.store.job
        self.out = settings.out
        self.keep_awake = settings.keep_awake
        self.log = Log(settings.log_level)
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
            if not callable(f):  # else taken, and every attempt then failed with "not callable"
                raise UsageError(f"@job.task takes a function, not {type(f).__name__}: {f!r:.60}")
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
            return f
        return register(fn) if fn is not None else register

    def add(self, tasks: Iterable[str]) -> int:
        """Add tasks (idempotent). Returns how many were new. Streams: a million names need not be held in
        memory; the add is one transaction, so a bad name anywhere adds nothing. Raises ``TypeError`` for
        a bare ``str`` or ``bytes`` (an iterable of characters, not of names) and for an item that is not
        a ``str``, rather than adding its characters or its ``repr``."""
        _not_one_name("add", tasks)

        def checked() -> Iterator[str]:
            for task in tasks:
                name = _task_name(task)
                check_task_name(name)
                yield name
        with _spaced_when_unavailable():
            return self.store.add(checked())

    def run(self, **overrides: Any) -> RunSummary:
        """Run until no task is pending or running (or a stop signal). Resumes where it left off."""
        if self._fn is None:
            raise UsageError("no task function: decorate one with @job.task")
        # A misspelt setting is refused like a wrong value, in one line that names what run() takes, not with
        # dataclasses' "RunConfig.__init__() got an unexpected keyword argument".
        known = [f.name for f in fields(RunConfig)]
        unknown = sorted(set(overrides) - set(known))
        if unknown:
            raise UsageError(f"run() has no setting {unknown[0]!r}; it takes {', '.join(known)}")
        config = replace(self.config, **overrides)
        marker = marker_path(self.keep_awake)
        # Marked as this job's, as the CLI's --out is: two jobs writing one folder would overwrite each other's
        # results (README, "--out DIR").
        out = OutDir(self.out, owner=owner_of(self.url, self.name, postgres=is_postgres_url(self.url))) \
            if self.out else None
        try:
            handler = PythonHandler(self._fn, replay=self._replay, park_sleeps_over=config.park_sleeps_over)
            with _spaced_when_unavailable():
                return run_worker(self.store, handler, config, self.log, url=self.url, out=out,
                                  keep_awake=marker)
        finally:
            if out is not None:
                out.close()

    def result(self, task: str) -> Any:
        """The result of a done task, as the function returned it (str, bytes or a JSON value). ``task`` is
        looked up as ``add`` stored it (surrounding whitespace removed)."""
        task = _task_name(task)
        stored = self.store.result(task)
        if stored is None:
            row = self.store.task(task)
            state = row.state if row else "unknown"
            raise TaskNotDone(f"task {task!r} is not done ({state})")
        return results.decode(stored.data, stored.kind)

    def status(self) -> Stats:
        return self.store.stats()

    def pause(self) -> bool:
        """Stop every worker of this job, on every host, from claiming new tasks (running ones go on).
        True when it was not paused already."""
        return self.store.set_paused(True)

    def resume(self) -> bool:
        """Let the job's workers claim again. True when it was paused."""
        return self.store.set_paused(False)

    def cancel(self, tasks: Iterable[str]) -> dict[str, str]:
        """Cancel tasks by name (looked up as ``add`` stored them): what was done for each (see
        ``Store.cancel``). A name not in the job raises ``UnknownTask`` and cancels nothing, not even the
        names that exist, as ``onward cancel`` does. A bare ``str`` is refused with ``TypeError``, as by
        ``add``."""
        _not_one_name("cancel", tasks)
        return cancel_all_or_nothing(self.store, [_task_name(task) for task in tasks])

    def send(self, task: str, key: str, value: Any) -> str:
        """Send ``value`` (JSON-able, at most 64 KiB of JSON) to ``task``'s ``ctx.wait(key)``, durably:
        ``"delivered"`` when the task was waiting for it (it runs again at once), ``"stored"`` when it is
        kept until the task waits for it. Raises ``UnknownTask`` for a task not in the job, ``NotSent`` for a
        finished task or a second value for a key whose first was not received yet; nothing is stored then."""
        return waits.send(self.store, _task_name(task), key, waits.value_text(value))

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _not_one_name(method: str, tasks: object) -> None:
    """Refuse a bare ``str`` or ``bytes`` where an iterable of names is due: iterating it gives characters,
    each of which would be taken for a task."""
    if isinstance(tasks, (str, bytes, bytearray)):
        kind = "a single str" if isinstance(tasks, str) else "bytes"
        raise TypeError(f"{method}() takes an iterable of task names, not {kind}: write {method}([{tasks!r}])")


def _task_name(task: object) -> str:
    """A task name given to the Python API, as it is stored and looked up (``tasksfile.task_name``);
    ``TypeError`` for anything but a ``str`` (``str(7)`` or a ``repr`` would name another task)."""
    if not isinstance(task, str):
        raise TypeError(f"a task name must be a str, not {type(task).__name__}: {task!r}")
    return task_name(task)
