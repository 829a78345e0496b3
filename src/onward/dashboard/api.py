"""The dashboard's JSON API: each public route's answer, built from the store.

Every function here takes an open store and plain, already decoded request values, checks them, and
returns JSON-ready data; it knows nothing of HTTP. A bad value raises ``ApiError`` before the store is
touched, so a refused request changes nothing. The numbers come from the same functions as
``onward status --json`` (``status_dict``), never from a second query path. Texts (task names, errors,
results, journal details) are returned raw: escaping them is the page's job, where they are shown.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .. import waits
from ..errors import NotSent, UnknownTask, UsageError
from ..log import iso_time
from ..status import status_dict
from ..store.base import CANCELLED, FAILED, STATES, Event, Store, TaskRow
from ..tasksfile import task_name_problem

DEFAULT_PAGE = 50
MAX_PAGE = 500
MAX_NAMES = 1000  # task names in one retry or cancel request
MAX_SEARCH = 4096  # characters in a search; a task name is at most 4096 bytes
# Task ids one search request reads at most (see ``tasks``): about 40 ms on SQLite and 100 ms on
# PostgreSQL here, where a rare name over a million tasks took 0.4 s and 1 s in one request.
SEARCH_WINDOW = 100_000
RESULT_PREVIEW_BYTES = 4096
EVENTS_SHOWN = 200  # a task's latest journal events in its detail
ERROR_CHARS = 200  # of a task's error in the task table (the detail has all of it)

# The journal kinds that end an attempt (see onward.settle and onward.reclaim); "claimed" starts one.
_RETRYABLE = frozenset({FAILED, CANCELLED})  # what a retry of named tasks brings back
_ATTEMPT_ENDS = frozenset({"done", "retrying", "failed", "released", "reclaimed", "interrupted", "fenced",
                           "cancelled"})


class ApiError(Exception):
    """A request the API refuses: ``status`` is the HTTP status, the message one line for the JSON error."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# --- reading --------------------------------------------------------------------------------------------
def status(store: Store) -> dict[str, Any]:
    """``GET /api/status``: exactly the object ``onward status --json`` prints."""
    return status_dict(store)


def tasks(store: Store, query: Mapping[str, str], search_window: int = SEARCH_WINDOW) -> dict[str, Any]:
    """``GET /api/tasks?state=&q=&after=&limit=``: one page of tasks in the order they were added, those
    with an id above ``after``; ``next_after`` is the ``after`` of the next page, null on the last one.

    A search (``q``) reads every task it passes, so one request searches at most ``search_window`` ids
    past ``after``: a rare name costs a few windows' worth of requests, each answered quickly, instead of
    one request that reads a million rows. Such a page may hold fewer than ``limit`` tasks, or none, with
    ``next_after`` still set; ``searched_to`` says how far this request looked."""
    unknown = set(query) - {"state", "q", "after", "limit"}
    if unknown:
        raise ApiError(400, f"unknown parameter {sorted(unknown)[0]!r}")
    state = query.get("state") or None
    if state is not None and state not in STATES:
        raise ApiError(400, f"state must be one of {', '.join(STATES)}")
    search = query.get("q") or None
    if search is not None and (len(search) > MAX_SEARCH or "\x00" in search):
        raise ApiError(400, f"q must be at most {MAX_SEARCH} characters, without NUL")
    after = _whole_number(query, "after", 0, 0, 1 << 62)
    limit = _whole_number(query, "limit", DEFAULT_PAGE, 1, MAX_PAGE)
    until = after + search_window if search is not None else None
    rows = store.task_page(state, search, after, limit, until)
    if len(rows) == limit:
        next_after: int | None = rows[-1].task_id
    elif until is not None and store.task_page(None, None, until, 1):
        next_after = until  # the window ended before the page filled, and tasks lie beyond it
    else:
        next_after = None
    answer: dict[str, Any] = {"tasks": [_task_line(row) for row in rows], "next_after": next_after}
    if until is not None:
        answer["searched_to"] = rows[-1].task_id if len(rows) == limit else until
    return answer


def task_detail(store: Store, name: str) -> dict[str, Any]:
    """``GET /api/tasks/<name>``: one task with its attempts, error, a preview of its result, its recorded
    steps and its latest journal events. 404 when there is no such task."""
    if task_name_problem(name) is not None:
        raise ApiError(404, "no such task")
    row = store.task(name)
    if row is None:
        raise ApiError(404, "no such task")
    events = store.events(task=name, last=EVENTS_SHOWN)
    return {
        **_task_line(row, error_chars=None),
        "result": _result_preview(store, name),
        "attempt_history": _attempts(events),
        "steps": [{"index": s.index, "name": s.name, "kind": s.kind, "bytes": len(s.data), "at": iso_time(s.at)}
                  for s in (store.steps(row.task_id) if row.task_id else [])],
        "events": [_event(e) for e in events],
    }


def activity(store: Store, query: Mapping[str, str]) -> dict[str, Any]:
    """``GET /api/activity?bucket=60``: completions and failed attempts per bucket over the job's life, for
    the chart: ``[start time (epoch seconds), completions, failed attempts]``, non-empty buckets only."""
    unknown = set(query) - {"bucket"}
    if unknown:
        raise ApiError(400, f"unknown parameter {sorted(unknown)[0]!r}")
    bucket = _whole_number(query, "bucket", 60, 1, 86400)
    return {"bucket_seconds": bucket,
            "buckets": [[start, done, failed] for start, done, failed in store.activity(bucket)]}


# --- changing -------------------------------------------------------------------------------------------
def retry(store: Store, body: object) -> dict[str, Any]:
    """``POST /api/retry`` with ``{"tasks": [...]}`` (failed or cancelled tasks by name) or
    ``{"failed": true}`` (every failed task): back to pending with their attempts reset. Answers how many
    went back and, for named tasks, what became of each."""
    fields = _object(body, allowed={"tasks", "failed"})
    if ("tasks" in fields) == ("failed" in fields):
        raise ApiError(400, 'give {"tasks": [...]} or {"failed": true}')
    if "failed" in fields:
        if fields["failed"] is not True:
            raise ApiError(400, '"failed" must be true')
        n = store.retry(None, by="dashboard")
        outcome: dict[str, str] = {}
    else:
        names = _names(fields["tasks"])
        rows = {name: store.task(name) for name in names}
        outcome = {name: "unknown" if row is None else "retried" if row.state in _RETRYABLE
                   else f"already {row.state}" for name, row in rows.items()}
        retryable = [name for name, said in outcome.items() if said == "retried"]
        n = store.retry(retryable, by="dashboard") if retryable else 0
    return {"retried": n, "tasks": outcome}


def cancel(store: Store, body: object) -> dict[str, Any]:
    """``POST /api/cancel`` with ``{"tasks": [...]}``: what ``store.cancel`` did with each."""
    fields = _object(body, allowed={"tasks"})
    if "tasks" not in fields:
        raise ApiError(400, 'give {"tasks": [...]}')
    return {"tasks": store.cancel(_names(fields["tasks"]))}


def send(store: Store, body: object) -> dict[str, Any]:
    """``POST /api/send`` with ``{"task": NAME, "key": KEY, "value": JSON}``: the value for the task's
    ``ctx.wait(KEY)`` (what ``onward send`` does). Answers ``{"sent": "delivered"}`` (the task waited: it runs
    again) or ``{"sent": "stored"}`` (kept until it waits); 404 for a task not in the job, 409 for a finished
    task or a second value for a key not received yet; 400 for a bad key or value (over 64 KiB of JSON).
    Nothing is stored when refused."""
    fields = _object(body, allowed={"task", "key", "value"})
    if set(fields) != {"task", "key", "value"}:
        raise ApiError(400, 'give {"task": NAME, "key": KEY, "value": JSON}')
    task, key = fields["task"], fields["key"]
    if not isinstance(task, str) or task_name_problem(task) is not None:
        raise ApiError(400, '"task" must be a task name')
    try:
        waits.check_key(key)
        text = waits.value_text(fields["value"])
        return {"sent": waits.send(store, task, key, text)}
    except UsageError as e:
        raise ApiError(400, str(e)) from None
    except UnknownTask as e:
        raise ApiError(404, str(e)) from None
    except NotSent as e:
        raise ApiError(409, str(e)) from None


def pause(store: Store, body: object, paused: bool) -> dict[str, Any]:
    """``POST /api/pause`` and ``POST /api/resume`` (body ``{}``): workers stop claiming, or start again."""
    _object(body, allowed=set())
    changed = store.set_paused(paused)
    return {"paused": paused, "changed": changed}


# --- helpers --------------------------------------------------------------------------------------------
def _whole_number(query: Mapping[str, str], key: str, default: int, low: int, high: int) -> int:
    raw = query.get(key, "")
    if raw == "":
        return default
    # Length first: int() refuses more than 4300 digits with a ValueError of its own.
    if not raw.isascii() or not raw.isdigit() or len(raw) > len(str(high)):
        raise ApiError(400, f"{key} must be a whole number from {low} to {high}")
    value = int(raw)
    if not low <= value <= high:
        raise ApiError(400, f"{key} must be a whole number from {low} to {high}")
    return value


def _object(body: object, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    unknown = set(body) - allowed
    if unknown:
        raise ApiError(400, f"unknown field {sorted(unknown)[0]!r}")
    return body


def _names(value: object) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise ApiError(400, '"tasks" must be a non-empty list of task names')
    if len(value) > MAX_NAMES:
        raise ApiError(400, f'"tasks" may name at most {MAX_NAMES} tasks')
    for name in value:
        problem = task_name_problem(name)
        if problem is not None:
            raise ApiError(400, f"a task name {problem}")
    return list(dict.fromkeys(value))


def _task_line(row: TaskRow, error_chars: int | None = ERROR_CHARS) -> dict[str, Any]:
    error = row.error
    if error is not None and error_chars is not None and len(error) > error_chars:
        error = error[:error_chars] + "…"
    return {
        "id": row.task_id, "task": row.name, "state": row.state, "attempts": row.attempts,
        "added_at": iso_time(row.added_at), "started_at": iso_time(row.started_at) if row.started_at else None,
        "finished_at": iso_time(row.finished_at) if row.finished_at else None,
        "seconds": _seconds(row.started_at, row.finished_at), "error": error,
    }


def _result_preview(store: Store, name: str) -> dict[str, Any] | None:
    stored = store.result(name)
    if stored is None:
        return None
    head = stored.data[:RESULT_PREVIEW_BYTES]
    return {"kind": stored.kind, "bytes": len(stored.data), "truncated": len(stored.data) > len(head),
            # A cut may fall inside a character, and a bytes result need not be text: shown with U+FFFD.
            "preview": head.decode("utf-8", "replace")}


def _attempts(events: list[Event]) -> list[dict[str, Any]]:
    """Each attempt found in the journal: when it was claimed, how it ended and how long it took. An
    attempt whose claim is older than the events kept is left out."""
    attempts: list[dict[str, Any]] = []
    open_ones: dict[int, tuple[float, dict[str, Any]]] = {}  # attempt -> (claimed at, its entry)
    for e in events:
        if e.attempt is None:
            continue
        if e.kind == "claimed":
            entry: dict[str, Any] = {"attempt": e.attempt, "started_at": iso_time(e.at, precise=True),
                                     "ended_at": None, "seconds": None, "outcome": "running", "detail": None}
            attempts.append(entry)
            open_ones[e.attempt] = (e.at, entry)
        elif e.kind in _ATTEMPT_ENDS and e.attempt in open_ones:
            started, entry = open_ones.pop(e.attempt)
            entry.update(ended_at=iso_time(e.at, precise=True), seconds=_seconds(started, e.at), outcome=e.kind,
                         detail=e.detail)
    return attempts


def _event(e: Event) -> dict[str, Any]:
    return {"id": e.event_id, "at": iso_time(e.at, precise=True), "kind": e.kind, "pid": e.pid, "host": e.host,
            "attempt": e.attempt, "detail": e.detail}


def _seconds(start: float | None, end: float | None) -> float | None:
    if start is None or end is None or not math.isfinite(end - start):
        return None
    return round(max(end - start, 0.0), 3)


__all__ = ["ApiError", "activity", "cancel", "pause", "retry", "status", "task_detail", "tasks"]
