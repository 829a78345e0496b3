"""The progress bar: one line saying how far a job is (finished out of total, rate, ETA), drawn by
``onward status --watch`` at the top of its view and by ``onward run`` on a terminal, under its log lines
(GNU parallel's ``--bar``).

The run bar costs the worker nothing per task: a thread redraws it on a timer from what the worker knows
anyway (the counts its heartbeat reads from the store, plus its own tally of finished tasks since), and
never queries the store itself.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from .durations import duration
from .log import Log
from .store.base import CANCELLED, DONE, FAILED, PENDING, RUNNING

# How often the run bar is redrawn (seconds), and the window its rate is measured over.
REDRAW_SECONDS = 0.5
RATE_WINDOW_SECONDS = 60.0
_ERASE_LINE = "\r\x1b[2K"


@dataclass(frozen=True)
class Progress:
    """Where a job stands, for one bar: tasks finished for good (done, failed or cancelled) out of total."""

    total: int
    done: int
    failed: int
    rate: float  # tasks finished per second, recently
    eta_seconds: int | None  # None: cannot be told
    no_worker: bool = False  # nobody is working: say so instead of an ETA
    # Cancelled tasks are finished but no failure (README): counted apart, and named only when there are some.
    cancelled: int = 0

    @property
    def finished(self) -> int:
        return min(self.done + self.failed + self.cancelled, self.total)

    def words(self) -> str:
        """The bar's text: counts, percentage, rate and ETA (or why there is none)."""
        pct = 100 * self.finished / self.total if self.total else 100.0
        cancelled = f"  cancelled {self.cancelled}" if self.cancelled else ""
        text = (f"{self.finished}/{self.total} {pct:.1f}%  done {self.done}  failed {self.failed}{cancelled}"
                f"  {self.rate:.1f}/s")
        if self.no_worker:
            return text + "  no worker running"
        return text + "  eta " + ("-" if self.eta_seconds is None else duration(self.eta_seconds))


def progress_of_status(report: dict[str, Any]) -> Progress:
    """The bar's figures from ``status_dict``'s report (what ``onward status --json`` prints)."""
    eta = report["eta_seconds"]
    return Progress(total=int(report["total"]), done=int(report[DONE]),
                    failed=int(report[FAILED]), cancelled=int(report.get(CANCELLED, 0)),
                    rate=float(report["rate_per_second"]), eta_seconds=eta if isinstance(eta, int) else None,
                    no_worker=eta is None and not report["workers_alive"])


def bar_line(progress: Progress, width: int) -> str:
    """The bar as plain text in at most ``width`` columns: ``[####......] 12/40 30.0% …``. The words come
    first in priority: the bar itself takes what room is left, and disappears on a very narrow terminal."""
    words = progress.words()
    room = width - len(words) - 3  # "[", "]", one space
    if room < 10:
        return words[:width]
    filled = math.floor(room * progress.finished / progress.total) if progress.total else room
    return "[" + "#" * filled + "." * (room - filled) + "] " + words


class RunBar:
    """The bar under ``onward run``'s log lines on a terminal: log lines are written above it (through
    ``Log.pinned``), and a thread redraws it every REDRAW_SECONDS from ``read()``, which returns the
    worker's latest estimate (total, done, failed, cancelled, left) without touching the store."""

    def __init__(self, stream: TextIO, read: Callable[[], tuple[int, int, int, int, int]]) -> None:
        self.stream = stream
        self.read = read
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._shown = ""
        self._history: deque[tuple[float, int]] = deque()  # (monotonic time, finished) for the rate
        self._thread = threading.Thread(target=self._redraw_loop, name="onward-run-bar", daemon=True)

    def start(self, log: Log) -> None:
        try:
            self._thread.start()
        except RuntimeError:
            # "can't start new thread": no process left for it (a pids cgroup, ulimit -u). The bar only shows
            # what the log says: the work goes on without it. It was a traceback and exit 1, on a terminal
            # alone, before the worker could meet the shortfall where it knows what to do about it.
            return
        log.pinned = self

    def stop(self, log: Log) -> None:
        """Draw the bar a last time and leave it on its own line (the log goes on below it)."""
        if self._thread.ident is None:  # never started (see ``start``): nothing was drawn
            return
        self._stop.set()
        self._thread.join()
        log.pinned = None
        with self._lock:
            self._draw()
            self._put("\n")

    def write_above(self, line: str) -> None:
        """Write a whole log line (ending in a newline) above the bar, and the bar again under it."""
        with self._lock:
            self._put(_ERASE_LINE + line + self._shown)

    def _redraw_loop(self) -> None:
        while not self._stop.wait(REDRAW_SECONDS):
            with self._lock:
                self._draw()

    def _draw(self) -> None:
        try:
            total, done, failed, cancelled, left = self.read()
        except Exception:  # noqa: BLE001 - a figure read mid-update must never stop the worker
            return
        now = time.monotonic()
        finished = done + failed + cancelled
        self._history.append((now, finished))
        while len(self._history) > 2 and self._history[0][0] < now - RATE_WINDOW_SECONDS:
            self._history.popleft()
        first_at, first_finished = self._history[0]
        rate = (finished - first_finished) / (now - first_at) if now - first_at >= 1.0 else 0.0
        eta = (0 if not left else math.ceil(left / rate) if rate > 0 else None)
        progress = Progress(total=total, done=done, failed=failed, rate=max(rate, 0.0), eta_seconds=eta,
                            cancelled=cancelled)
        try:
            width = os.get_terminal_size(self.stream.fileno()).columns
        except (OSError, ValueError):
            width = 80
        self._shown = bar_line(progress, max(width - 1, 20))  # one column spare: no wrap at the margin
        self._put(_ERASE_LINE + self._shown)

    def _put(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            pass  # a closed or full stderr must never stop the work


def run_bar_reader(counts_seen: Callable[[], tuple[dict[str, int], int, int]],
                   tally: Callable[[], tuple[int, int]]) -> Callable[[], tuple[int, int, int, int, int]]:
    """``RunBar.read`` for a worker: the store's counts as of its last heartbeat, moved on by the tasks it
    finished itself since (``tally``: done and failed for good so far; ``counts_seen``: the counts and the
    tally when they were read). Returns (total, done, failed, cancelled, left)."""
    def read() -> tuple[int, int, int, int, int]:
        counts, done_then, failed_then = counts_seen()
        done_now, failed_now = tally()
        total = sum(counts.values())
        done = counts.get(DONE, 0) + done_now - done_then
        failed = counts.get(FAILED, 0) + failed_now - failed_then
        left = max(counts.get(PENDING, 0) + counts.get(RUNNING, 0) - (done_now - done_then)
                   - (failed_now - failed_then), 0)
        return total, min(done, total), failed, counts.get(CANCELLED, 0), left
    return read
