"""The event journal and the task list as people and scripts read them: ``onward logs`` lines and its
``--since`` times, and the objects of ``onward logs --json`` and ``onward list --json``."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from .log import iso_time, one_line, printable

if TYPE_CHECKING:
    from .store.base import Event, Store, TaskRow


def format_event(event: Event) -> str:
    """One journal line for ``onward logs``, its control characters escaped (the stored detail stays raw)."""
    parts = [iso_time(event.at, precise=True), f"pid={event.pid}", event.kind]
    if event.task is not None:
        parts.append("task=" + json.dumps(event.task, ensure_ascii=False))
    if event.attempt is not None:
        parts.append(f"attempt={event.attempt}")
    if event.detail:
        parts.append(one_line(event.detail, 500))
    return printable(" ".join(parts))


# --- scripting: one JSON object per line (onward list --json, onward logs --json) ------------------------
def task_json(row: TaskRow) -> dict[str, Any]:
    """A task for ``onward list --json``: its text and error as stored (JSON-escaped, not shown escaped),
    times as ISO 8601 UTC with milliseconds, or null."""
    return {"name": row.name, "state": row.state, "attempts": row.attempts,
            "added_at": _iso_or_none(row.added_at), "started_at": _iso_or_none(row.started_at),
            "finished_at": _iso_or_none(row.finished_at), "error": row.error}


def event_json(event: Event) -> dict[str, Any]:
    """A journal event for ``onward logs --json``: every field as stored, the time as ISO 8601 UTC."""
    return {"id": event.event_id, "at": iso_time(event.at, precise=True), "kind": event.kind, "pid": event.pid,
            "host": event.host, "task": event.task, "attempt": event.attempt, "detail": event.detail}


def _iso_or_none(t: float | None) -> str | None:
    return None if t is None else iso_time(t, precise=True)


_AGE = re.compile(r"([0-9]{1,9})([smhd])")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# An age beyond this is a typo, not a question about the journal (and would overflow a date).
MAX_AGE_SECONDS = 100 * 365 * 86400


def parse_since(text: str, now: float) -> float:
    """The time meant by ``--since TEXT``, seconds since the epoch: an age before ``now`` (``90s``, ``10m``,
    ``2h``, ``3d``) or an ISO 8601 time (``2026-11-30T03:30:00Z``, ``2026-11-30 03:30``, ``2026-11-30``;
    UTC unless it carries an offset). Raises ``ValueError`` with a one-line message for anything else."""
    from datetime import datetime, timezone

    shown = text.encode("utf-8", "surrogateescape").decode("ascii", "backslashreplace")[:60]
    age = _AGE.fullmatch(text)
    if age:
        seconds = int(age[1]) * _UNIT_SECONDS[age[2]]
        if seconds > MAX_AGE_SECONDS:
            raise ValueError(f"'{shown}' is too far back (at most 100 years)")
        return now - seconds
    iso = text[:-1] + "+00:00" if text.endswith(("Z", "z")) else text
    try:
        if not iso.isascii() or not iso[:1].isdigit():
            raise ValueError
        when = datetime.fromisoformat(iso)
    except ValueError:
        raise ValueError(f"'{shown}' is not a time: give ISO 8601 (2026-11-30T03:30:00Z) or an age"
                         " (90s, 10m, 2h, 3d)") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.timestamp()


def first_event_after(store: Store, since: float) -> int:
    """The event id after which the journal's events are at ``since`` or later (for ``events(after_id=…)``).
    The journal is appended in time order (one clock: the store's), so a binary search over event ids
    finds it in a few reads of one event each, on a journal of millions of events; ids may have gaps."""
    last = store.events(last=1)
    if not last:
        return 0
    lo, hi = 0, last[0].event_id
    while lo < hi:
        mid = (lo + hi) // 2
        first = store.events(after_id=mid, limit=1)  # the first event with an id above mid
        if not first or first[0].at >= since:
            hi = mid
        else:
            lo = first[0].event_id
    return lo
