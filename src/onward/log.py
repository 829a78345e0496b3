"""Log lines: one per event on stderr, ``pid=<pid>`` on each, fit for journald.

Under systemd (``JOURNAL_STREAM`` set) the journal stamps every line itself, so no second timestamp.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from typing import Protocol, TextIO

QUIET, NORMAL, VERBOSE = 0, 1, 2


# What must not reach a terminal or a log raw: C0 and C1 control characters and DEL (escape sequences clear
# the screen, retitle the window, move the cursor), line and paragraph separators (they split a line), bidi
# embeddings, overrides and isolates (they reorder what is shown), and lone surrogates (undecodable bytes,
# which a UTF-8 stream cannot even write).
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def printable(text: str) -> str:
    """``text`` as it may be shown on a terminal or in a log: every control character escaped (ESC as
    ``\\x1b``, U+202E as ``\\u202e``), the rest as it is. For display only: stored data stays raw."""
    return _UNPRINTABLE.sub(lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100 else f"\\u{ord(m[0]):04x}", text)


def json_line(value: object) -> str:
    """``value`` as one line of JSON for a terminal or a pipe (``--json`` outputs): UTF-8 text kept as it
    is, but every character ``printable`` escapes written as a JSON escape (U+202E as ``\\u202e``), which
    ``json.dumps`` leaves raw for DEL, the C1 controls, the line separators and the bidi overrides. Reads
    back as the same value."""
    return _UNPRINTABLE.sub(lambda m: f"\\u{ord(m[0]):04x}", json.dumps(value, ensure_ascii=False))


def quote(text: str, limit: int = 200) -> str:
    """A task text as it appears in a log line: JSON-quoted (so it stays on one line), cut if long."""
    if len(text) > limit:
        text = text[:limit] + "…"
    return json.dumps(text, ensure_ascii=False)


def iso_time(t: float | None, precise: bool = False) -> str:
    """UTC time as ISO 8601 (``2026-11-30T03:30:01Z``; with ``precise``, milliseconds too); "-" for None."""
    if t is None:
        return "-"
    base = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t))
    return base + (f".{int(t % 1 * 1000):03d}Z" if precise else "Z")


def one_line(text: str | None, limit: int = 300) -> str:
    """A possibly long, multi-line message (a traceback, a stderr tail) as one line: first … last."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    if not lines:
        return ""
    line = lines[0] if len(lines) == 1 else f"{lines[0]} … {lines[-1]}"
    return line[:limit]


class PinnedLine(Protocol):
    """A line kept at the bottom of the terminal (``onward run``'s progress bar, onward.progress)."""

    def write_above(self, line: str) -> None:
        """Write ``line`` (a whole line, newline included) above the pinned line."""


class Log:
    def __init__(self, level: int = NORMAL, stream: TextIO | None = None, name: str = "onward") -> None:
        self.level = level
        self.stream = stream or sys.stderr
        self.name = name
        self.stamped = "JOURNAL_STREAM" not in os.environ
        # Set while a progress bar is drawn under the log lines on the same terminal: lines go through it.
        self.pinned: PinnedLine | None = None

    def _write(self, text: str) -> None:
        prefix = f"{self.name} pid={os.getpid()} "
        if self.stamped:
            prefix = iso_time(time.time(), precise=True) + " " + prefix
        line = prefix + printable(text.replace("\n", " ")) + "\n"
        pinned = self.pinned
        if pinned is not None:
            pinned.write_above(line)
            return
        try:
            self.stream.write(line)
            self.stream.flush()
        except (OSError, ValueError):
            pass  # a closed or full stderr must never stop the work

    def debug(self, text: str) -> None:
        if self.level >= VERBOSE:
            self._write(text)

    def info(self, text: str) -> None:
        if self.level >= NORMAL:
            self._write(text)

    def warning(self, text: str) -> None:
        self._write(text)


class Throttled:
    """Warnings that can repeat many times a second (a store that keeps failing, on every turn of the loop):
    the first line of a kind is written, further ones within ``window`` seconds are only counted, and the
    count rides on the next line written: ``store error, will retry: … (41 more in the last 10 s)``."""

    def __init__(self, log: Log, window: float = 10.0) -> None:
        self.log = log
        self.window = window
        self._held: dict[str, tuple[float, int]] = {}  # kind -> (when its last line was written, lines held back)

    def warning(self, kind: str, detail: str) -> None:
        now = time.monotonic()
        last = self._held.get(kind)
        if last is not None and now - last[0] < self.window:
            self._held[kind] = (last[0], last[1] + 1)
            return
        more = f" ({last[1]} more in the last {now - last[0]:.0f} s)" if last is not None and last[1] else ""
        self.log.warning(f"{kind}: {detail}{more}")
        self._held[kind] = (now, 0)

    def flush(self, kind: str | None = None) -> None:
        """The trouble is over (of one kind, or of every kind): its next occurrence is written at once, and
        lines still held back are counted now."""
        for key in [kind] if kind is not None else list(self._held):
            last = self._held.pop(key, None)
            if last is not None and last[1]:
                self.log.warning(f"{key}: {last[1]} more in the last {time.monotonic() - last[0]:.0f} s")
