"""What the two SQL backends share: one class, ``SqlStore``, holding every part of the ``Store`` contract
that does not depend on the database (decoding rows, paging, the order claims are handed out in, nested
batches, the journal's wording, schema-version checks, error translation). A backend derives from it and
supplies its SQL (its ``.sql`` file, with named parameters of the same names in both) and what truly
differs: how a statement is run and committed, whose clock the SQL reads, how a task name is keyed, and
how its driver's errors read.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, TypeVar

from ..errors import SchemaTooNew, SchemaTooOld, StoreError
from ..proc import hostname
from .base import (
    PENDING,
    Claim,
    Owner,
    Reclaimed,
    RunningTask,
    SourceMark,
    StepRecord,
    StoredResult,
    TaskRow,
    WorkerRow,
)
from .rows import running_task_of, step_of, worker_of

# The schema both backends write; each one's .sql file holds its migrations to it (see sql.migration).
SCHEMA_VERSION = 2
# Tasks per page when listing: each page is its own statement, so a long listing pins no old snapshot.
PAGE_SIZE = 1000
# How long one store call may be kept waiting (for a lock, or by the network), in ms: a quarter of the lease
# the runner works with, at least the first figure. The runner stops its tasks a third of a lease before the
# lease runs out, so a call stuck for longer than a quarter could leave it no time to do so.
STALL_FLOOR_MS = 250
M = TypeVar("M", bound=Callable[..., Any])
_IN_THE_BATCH = nullcontext()  # a write inside a batch: the batch's commit covers it


def stall_ms(lease_seconds: float, ceiling_ms: int | None = None) -> int:
    """The bound on one call's wait for a lease of ``lease_seconds`` (see STALL_FLOOR_MS)."""
    ms = max(STALL_FLOOR_MS, int(lease_seconds * 1000 / 4))
    return ms if ceiling_ms is None else min(ceiling_ms, ms)


def check_schema_version(found: int, wanted: int, where: str) -> None:
    """Refuse a store whose schema version is not ``wanted`` (the backend's ``SCHEMA_VERSION``, passed in
    so that it is read when the check runs), with the one message that says what to do."""
    if found > wanted:
        raise SchemaTooNew(f"store {where} has schema version {found}, newer than this onward's {wanted};"
                           " upgrade onward")
    if found < wanted:
        raise SchemaTooOld(f"store {where} has schema version {found}, older than this onward's {wanted};"
                           " run `onward db upgrade`")


def added_message(added: int) -> str:
    """The journal's detail for one ``add`` call."""
    return f"{added} new task{'s' if added != 1 else ''}"


def translating(method: M) -> M:
    """The method, raising ``StoreError`` (via the backend's ``_translate_error``) instead of a bare driver
    error; a generator (``iter_tasks``) is translated for as long as it is iterated, since its reads happen
    then, not when it is called."""
    if inspect.isgeneratorfunction(method):
        @functools.wraps(method)
        def generator(self: SqlStore, *args: Any, **kwargs: Any) -> Iterator[Any]:
            with self._translated():
                yield from method(self, *args, **kwargs)
        return generator  # type: ignore[return-value]

    @functools.wraps(method)
    def wrapper(self: SqlStore, *args: Any, **kwargs: Any) -> Any:
        # A plain try rather than _translated(): this runs on every call, and costs nothing until a raise.
        try:
            return method(self, *args, **kwargs)
        except self._driver_error() as e:
            raise self._translate_error(e) from None
    return wrapper  # type: ignore[return-value]


def _translate_public_methods(cls: type) -> None:
    """Apply ``translating`` to every public method the class defines: done to each class as a whole (the
    base and every backend), so a method added later cannot be left out."""
    for name, member in list(vars(cls).items()):
        if not name.startswith("_") and inspect.isfunction(member):
            setattr(cls, name, translating(member))


class SqlStore:
    """The shared part of a SQL ``Store``. Subclasses implement the hooks below (``_exec`` and the rest)."""

    url: str
    _batch_depth = 0
    _stall_ms: int | None = None  # the bound on one call's wait, once the runner named a lease
    _stall_ceiling_ms: int | None = None  # the longest that bound may be, whatever the lease

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _translate_public_methods(cls)

    # --- what a backend supplies ---------------------------------------------------------------------
    def _driver_error(self) -> type[BaseException] | tuple[type[BaseException], ...]:
        """The base class (or classes) of the errors the driver raises."""
        raise NotImplementedError

    def _translate_error(self, e: BaseException) -> StoreError:
        """The ``StoreError`` (one line, no secret) for a driver error."""
        raise NotImplementedError

    def _exec(self, name: str, params: dict[str, Any] | None = None) -> Any:
        """Run the named query with named parameters, on the transaction open now if any; its cursor."""
        raise NotImplementedError

    def _clock(self) -> dict[str, Any]:
        """Parameters giving the SQL the time (SQLite: ``now`` from here; PostgreSQL: none, the server's)."""
        raise NotImplementedError

    def _key(self, name: str) -> Any:
        """How the SQL finds a task by name (the ``key`` parameter)."""
        raise NotImplementedError

    def _transaction(self, durable: bool) -> AbstractContextManager[None]:
        """One write transaction; a crash-safe one (not ``durable``) may skip waiting for stable storage."""
        raise NotImplementedError

    def _on_its_own(self, name: str, params: dict[str, Any]) -> list[Any]:
        """Run one write statement as a transaction of its own (or in the open batch); its rows."""
        raise NotImplementedError

    def _apply_stall_bound(self) -> None:
        """Make the connection keep to ``_stall_ms`` (at once, or before its next call)."""
        raise NotImplementedError

    def _work_ready(self) -> None:
        """Tell idle workers that a task became ready, in the open transaction (a no-op where they poll)."""

    def _journal(self, kind: str, *, task_id: int | None = None, worker_id: int | None = None,
                 attempt: int | None = None, detail: str | None = None, pid: int | None = None,
                 host: str | None = None) -> None:
        """Append one event to the journal in the open transaction."""
        self._exec("log_event", {**self._clock(), "kind": kind, "pid": pid or os.getpid(), "host": host or hostname(),
                                 "worker_id": worker_id, "task_id": task_id, "attempt": attempt, "detail": detail})

    # --- errors and transactions ---------------------------------------------------------------------
    @contextmanager
    def _translated(self) -> Iterator[None]:
        try:
            yield
        except self._driver_error() as e:
            raise self._translate_error(e) from None

    def _write(self, durable: bool = True) -> AbstractContextManager[None]:
        """One write transaction, unless a batch is open (then its commit covers this write). Its driver
        errors are translated by the public method it serves."""
        return _IN_THE_BATCH if self._batch_depth else self._transaction(durable)

    @contextmanager
    def batch(self) -> Iterator[None]:
        if self._batch_depth:
            self._batch_depth += 1
            try:
                yield
            finally:
                self._batch_depth -= 1
            return
        with self._translated(), self._batch_transaction():
            self._batch_depth = 1
            try:
                yield
            finally:
                self._batch_depth = 0

    def _batch_transaction(self) -> AbstractContextManager[None]:
        return self._transaction(True)

    def _set_lease(self, lease_seconds: float) -> None:
        """Tie how long one call may wait to the lease the runner works with (see STALL_FLOOR_MS)."""
        bound = stall_ms(lease_seconds, self._stall_ceiling_ms)
        if bound != self._stall_ms:
            self._stall_ms = bound
            self._apply_stall_bound()

    # --- the work queue ------------------------------------------------------------------------------
    def claim(self, worker_id: int, limit: int, lease_seconds: float, max_attempts: int) -> list[Claim]:
        self._set_lease(lease_seconds)
        rows = self._on_its_own("claim", {**self._clock(), "worker_id": worker_id, "lease": lease_seconds,
                                           "limit": limit, "max_attempts": max_attempts})
        rows.sort()  # RETURNING gives no order guarantee; hand tasks out in the order they were added
        return [Claim(task_id=r[0], name=r[1], attempt=r[2], fence=r[3], max_attempts=r[4]) for r in rows]

    def note_child(self, task_id: int, fence: int, child_pid: int, child_start: int) -> None:
        with self._write(durable=False):
            self._exec("note_child", {"pid": child_pid, "start": child_start, "task_id": task_id, "fence": fence})

    def fail(self, task_id: int, fence: int, error: str, retry_delay: float) -> str | None:
        with self._write():
            row = self._exec("fail", {**self._clock(), "delay": retry_delay, "error": error, "task_id": task_id,
                                      "fence": fence}).fetchone()
            if row is not None and row[0] == PENDING:
                self._work_ready()
        return row[0] if row else None

    def release(self, task_id: int, fence: int, reason: str) -> bool:
        with self._write():
            row = self._exec("release", {"task_id": task_id, "fence": fence}).fetchone()
            if row is not None:
                self._work_ready()
        return row is not None

    def reclaim(self, task_id: int, fence: int, reason: str) -> Reclaimed | None:
        with self._write():
            row = self._exec("reclaim", {**self._clock(), "reason": reason, "task_id": task_id,
                                         "fence": fence}).fetchone()
            if row is not None and row[0] == PENDING:
                self._work_ready()
        return Reclaimed(state=row[0], counted=bool(row[1])) if row else None

    def running_tasks(self) -> list[RunningTask]:
        rows = self._exec("running", self._clock()).fetchall()
        return sorted((running_task_of(r) for r in rows), key=lambda t: t.task_id)

    # --- reading -------------------------------------------------------------------------------------
    def task(self, name: str) -> TaskRow | None:
        row = self._exec("task", {"key": self._key(name)}).fetchone()
        return TaskRow(*row) if row else None

    def task_id(self, name: str) -> int | None:
        row = self._exec("task_id", {"key": self._key(name)}).fetchone()
        return row[0] if row else None

    def result(self, name: str) -> StoredResult | None:
        row = self._exec("result", {"key": self._key(name)}).fetchone()
        return StoredResult(kind=row[0], data=bytes(row[1])) if row else None

    def iter_tasks(self, state: str | None = None) -> Iterator[TaskRow]:
        # Pages by id, each page its own statement: a long listing never pins an old snapshot.
        after = 0
        while True:
            if state is None:
                rows = self._exec("iter_tasks", {"after": after, "limit": PAGE_SIZE}).fetchall()
            else:
                rows = self._exec("iter_tasks_in_state", {"after": after, "state": state, "limit": PAGE_SIZE}
                                  ).fetchall()
            if not rows:
                return
            for r in rows:
                yield TaskRow(*r[1:])
            after = rows[-1][0]

    def workers(self) -> list[WorkerRow]:
        return [worker_of(r) for r in self._exec("live_workers", self._clock())]

    # --- workers and the journal ---------------------------------------------------------------------
    def register_worker(self, owner: Owner, detail: str) -> int:
        with self._write():
            worker_id = int(self._exec("register_worker", {
                **self._clock(), "host": owner.host, "host_key": owner.host_key, "pid": owner.pid,
                "pid_start": owner.pid_start, "detail": detail}).fetchone()[0])
            self._journal("worker started", worker_id=worker_id, detail=detail, pid=owner.pid, host=owner.host)
        return worker_id

    def worker_stopped(self, worker_id: int, reason: str) -> None:
        with self._write():
            self._exec("worker_stopped", {**self._clock(), "reason": reason, "worker_id": worker_id})
            self._journal("worker stopped", worker_id=worker_id, detail=reason)

    def log_event(self, kind: str, *, task_id: int | None = None, worker_id: int | None = None,
                  attempt: int | None = None, detail: str | None = None, durable: bool = False) -> None:
        with self._write(durable=durable):
            self._journal(kind, task_id=task_id, worker_id=worker_id, attempt=attempt, detail=detail)

    # --- import marks and durable steps --------------------------------------------------------------
    def get_source(self, path_key: str) -> SourceMark | None:
        row = self._exec("get_source", {"path": path_key}).fetchone()
        return SourceMark(*row) if row else None

    def set_source(self, path_key: str, mark: SourceMark) -> None:
        with self._write():
            self._exec("set_source", {"path": path_key, "identity": mark.identity, "size": mark.size,
                                      "lines": mark.lines, "mtime_ns": mark.mtime_ns,
                                      "head_digest": mark.head_digest, "tail_digest": mark.tail_digest})

    def steps(self, task_id: int) -> list[StepRecord]:
        return [step_of(r) for r in self._exec("steps", {"task_id": task_id})]


_translate_public_methods(SqlStore)
