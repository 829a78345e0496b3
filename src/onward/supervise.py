"""Keep a worker running where systemd is not PID 1: restarts with backoff, a crash-loop limit, a heartbeat
watchdog, and an sd_notify server speaking systemd's own protocol to the child.

``Supervisor(["onward", "run", ...]).run()`` is what ``onward supervise -- onward run ...`` does. It plays the
part of systemd for one service with ``Type=notify``, ``NotifyAccess=main``, ``Restart=on-failure``,
``KillMode=mixed``, ``TimeoutStartSec=`` and ``WatchdogSec=``, so a worker behaves the same under both
(see ``onward.systemd``).

The protocol. The supervisor binds a private ``AF_UNIX`` datagram socket in a fresh 0700 directory and starts
the child with ``NOTIFY_SOCKET`` naming it, and with ``WATCHDOG_USEC`` when a watchdog is set (at least
``MIN_WATCHDOG``). It reads the newline-separated ``KEY=VALUE`` datagrams of
``sd_notify(3)``: ``READY=1``, ``STATUS=...``, ``WATCHDOG=1``, ``WATCHDOG=trigger`` and ``STOPPING=1``;
other keys are ignored. The socket has ``SO_PASSCRED`` on, so every datagram carries its sender's pid,
and only the child's own pid is listened to (systemd's ``NotifyAccess=main``): a task the worker runs
inherits ``NOTIFY_SOCKET`` but cannot keep a wedged worker alive with heartbeats of its own. ``WATCHDOG_PID`` is not set: systemd sets it to the main pid after its
fork, which ``subprocess`` cannot do before ``exec``; ``sd_watchdog_enabled(3)`` and onward's ``Notifier``
treat an absent ``WATCHDOG_PID`` as "the watchdog is meant for me", and the pid filter above makes a
grandchild's heartbeats harmless anyway.

Restart rules (exit statuses are those of ``onward run``):

- exit 0 (finished) or 3 (finished, some tasks failed): the supervisor exits with the same status;
- exit 2 (usage or configuration error): exit 2, no restart, since a restart would fail the same way;
- exit 75 (the store or the output folder unavailable: a disk fault, the database server down): restart
  with the backoff below, for as long as it takes, its first delay at least ``UNAVAILABLE_FIRST_DELAY``;
  these restarts never count toward ``max_restarts``;
- any other exit status, death by a signal, a watchdog kill, or a kill for not being ready within the start
  timeout (``onward run`` only, see ``onward.child_watch``): restart after a delay. The delay is
  ``restart_delay * 2 ** (streak - 1)``, at most ``MAX_BACKOFF`` seconds, where ``streak`` counts the
  consecutive runs that lasted less than ``FAST_CRASH`` seconds and made no progress (a run that lasted
  longer, or made progress, resets it to 1). A worker killed once in a while, or however often as long as
  it gets somewhere, is back after ``restart_delay``; one that dies at start-up backs off.
- the next worker, when the command is ``onward run`` itself (``starts_onward_run``), is started ahead of
  need, behind a start gate (``onward.gate``): once the current worker has been ready for ``STANDBY_AFTER``
  seconds, a standby is started, which loads its code and does nothing else until its gate opens. When the
  worker dies, the standby's gate opens as soon as the delay is over: a restart waits for the delay, not
  for an interpreter's start-up. Where there is no standby (the worker died sooner, or the standby ended
  on its own), one is started right away and loads its code while the delay runs. Its gate says when the
  restart begins (``Gate.wake``), so that a worker on PostgreSQL connects to the server while the delay
  runs, reading only (``onward.store.open_ahead``). A stop during the delay, or an end without a restart,
  kills the standby unstarted. The cost is one idle process, about the size of a worker that has loaded
  its code and run nothing (24 MB resident on SQLite, 38 MB with psycopg, measured on Linux x86_64). A
  standby that finds, at its go, that onward was upgraded since it loaded runs itself again from the new
  code (``onward.entry``).
- more than ``max_restarts`` restarts within ``window`` seconds: one line on stderr and exit 1. Only runs
  without progress count, and a run with progress forgets the restarts before it: a worker that keeps
  settling tasks is never given up on, however often it is killed; one that settles nothing (it dies at
  start-up, or before it finishes any task) is stopped as before.
- SIGTERM, SIGINT or SIGHUP (as SIGTERM; not while SIGHUP is ignored, under nohup: ``onward.stopsignals``)
  to the supervisor is forwarded to the child's pid (not its group: the worker stops its tasks itself,
  within its ``--grace``), the watchdog is disarmed as systemd does once a stop begins, and no
  restart follows: the supervisor exits with the child's status (128 + N for death by signal N). A child
  still running ``stop_timeout`` seconds after the first stop was forwarded (systemd's ``TimeoutStopSec``:
  by default the worker's ``--grace`` and ``STOP_MARGIN``, as in the units of ``onward.systemd``) is wedged,
  or frozen alone: its process group is SIGKILLed, as when the watchdog fires, and the supervisor exits 137.

Progress. A run made progress when the child said ``READY=1`` and then ``X_ONWARD_PROGRESS=1``, a custom
sd_notify field (``X_`` prefix, which systemd ignores) that ``onward run`` sends once, as soon as its first
commit that settled a task (done, failed, or a failed attempt to be retried) is durable, before it tells
anything of it (the log line, the ``--out`` file): a worker killed in between did get somewhere. It is an explicit message,
not read from ``STATUS=``: that text is only sent every ``--heartbeat``, and a worker killed more often
would never show its progress in it. A child that does not speak it is treated as making no progress, as
before. What the supervisor prints when a child dies says how long it ran, whether it made progress, and
its last ``STATUS=`` with that status's age, so an old count is not mistaken for the current one.

Whenever a child is gone, its process group is SIGKILLed before it is reaped (while its pid still pins the
group id), so no helper it left behind outlives it. The supervisor is a child subreaper
(``PR_SET_CHILD_SUBREAPER``) meanwhile: whatever the worker's tasks leave behind, in any process group or
session, is re-parented to it once its parent dies; it reaps those while the worker runs and SIGKILLs them all
when the worker is gone, together with the worker's cgroups (see ``onward.cgroups``); the standby is not a
leftover. The child (like the standby) runs in its own process group with ``PR_SET_PDEATHSIG=SIGKILL``, so it
dies with the supervisor even when the supervisor is SIGKILLed. Being in its own group, it gets a terminal's
^C only through the supervisor, which forwards it; and it cannot read from the terminal (give ``--tasks`` a
file, or a pipe, rather than a terminal's stdin).

Watchdog and freeze safety: see ``onward.child_watch``, where the watchdog is kept.

Restarts are journaled in the store (event kind ``restart``, the cause in its detail) when a store is known,
so ``onward status`` counts them like systemd's ``NRestarts``; without a store they are only logged. The
store is looked up at each restart (``--db`` of the supervisor, else the worker's ``--db``, ``ONWARD_DB``,
or the default file once it exists), so the restarts of a job whose first worker created its store are
counted too; no store is ever created just to journal. It is looked up before the restart, while no worker
runs, and written to once the next worker is started, on a thread of its own (``RestartJournal``): the
loop never waits for the store, which may be locked (SQLite's busy timeout is 30 s) or a server that takes
connections and never answers; the loop kept its tick, its signals and its watchdog meanwhile. The code that
writes it (psycopg, for PostgreSQL) is loaded while the first worker runs, so that no restart shares the CPU
with that load.
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import select
import shlex
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import NamedTuple

from onward.cgroups import sweep_dead_workers
from onward.child_watch import Watchdog, exit_fd, exited, receive
from onward.config import MAX_SECONDS, MIN_HEARTBEAT, RunConfig
from onward.durations import doubling
from onward.errors import RESOURCE_ERRNOS, UNAVAILABLE_EXIT, StoreError, UsageError
from onward.gate import START_GATE, Gate
from onward.keepawake import KeepAwake, chosen_marker, keep_after_death, keeper_pids
from onward.log import Log
from onward.notify import MARKER_FIELD, PROGRESS_FIELD
from onward.proc import (
    children,
    describe_status,
    die_with_parent_preexec,
    kill_orphans,
    prepare_die_with_parent,
    reap_orphans,
    set_child_subreaper,
)
from onward.redact import redact_one_url, redact_url, scrub, url_secrets
from onward.stopsignals import STOP_SIGNALS, stop_signals
from onward.store import DEFAULT_DB, is_postgres_url, load_backend, open_store
from onward.store import store_url as checked_store_url

# systemd's own default RestartSec. The delay is not what stops a crash loop (the backoff and
# max_restarts do): it only spaces a lone crash from the restart, which then resumes the task at once.
DEFAULT_RESTART_DELAY = 0.1
DEFAULT_MAX_RESTARTS = 5
DEFAULT_WINDOW = 60.0
# systemd's own default TimeoutStartSec: how long `onward run` may take to say READY=1 (0: no bound).
DEFAULT_START_TIMEOUT = 90.0
# How long a stop may take beyond the worker's --grace before the worker is killed: time to terminate its
# tasks, commit and record the stop. The same margin in a unit's TimeoutStopSec (onward.systemd).
STOP_MARGIN = 10.0
# The shortest watchdog, here and in a unit's WatchdogSec. The worker sends WATCHDOG=1 from its main loop, no
# faster than that loop turns: a commit on a busy disk or a garbage collection outlasts a shorter period,
# and a healthy worker was killed as wedged (measured on 2 cores: at 2 ms every start, at 20 ms under load
# now and then; never at 50 ms). The same bound as the shortest heartbeat, for the same reason.
MIN_WATCHDOG = MIN_HEARTBEAT

FAST_CRASH = 2.0  # a run shorter than this (seconds) counts as crashing fast, for the backoff
# The first delay before restarting a worker that exited 75 (its store or output folder unavailable), even
# with --restart-delay 0: a crash is restarted at once if asked, but a database server down or a full disk is
# not back at once either, and restarting at once kept a core busy starting workers (some ten a second) for
# as long as the outage lasted. The backoff doubles from here as for a crash.
UNAVAILABLE_FIRST_DELAY = 0.1
MAX_BACKOFF = 30.0  # the restart delay never grows beyond this (seconds)
ORPHAN_KILL_WAIT = 2.0  # how long a dead worker's leftovers may take to die (frozen ones are left; seconds)
NOT_RESTARTED = {0: "finished", 3: "finished, some tasks failed", 2: "usage or configuration error"}
# The store or the output folder is down (a disk fault, a database server away): restarted with the
# backoff, however long it takes, and never counted as a crash loop: the worker is not what is broken.
UNAVAILABLE = UNAVAILABLE_EXIT
# A worker that cannot be started for want of processes or memory is tried again this often (seconds), and
# that is said again this often, as the worker does for its commands (runner.RESOURCE_PAUSE, RESOURCE_WARN_EVERY).
SPAWN_RETRY = 1.0
SPAWN_WARN_EVERY = 60.0


# The next `onward run` worker (the standby) is started once the current one has been ready for this long
# (seconds), and waits at its start gate until a restart needs it. Not at once: its start-up would share the
# CPU with the current worker's first claims and commands; and a worker that keeps dying sooner than this is
# in a crash loop, where the backoff, not the start-up, is what a restart waits for.
STANDBY_AFTER = 0.5


class Standby(NamedTuple):
    """The next worker, started ahead of need: it loads its code, then waits at its start gate."""

    proc: subprocess.Popen[bytes]
    gate: Gate
    since: float  # when it was started (monotonic)


_log = Log(name="onward supervise")


def log(message: str) -> None:
    """One line on stderr, in the style of every onward process (``pid=``, fit for journald)."""
    _log.info(message)


def backoff_delay(restart_delay: float, streak: int) -> float:
    """The wait before a restart: ``restart_delay * 2 ** (streak - 1)``, capped at ``MAX_BACKOFF``, where
    ``streak`` (1 or more) counts the consecutive runs that ended within ``FAST_CRASH`` seconds."""
    return doubling(restart_delay, streak - 1, max(restart_delay, MAX_BACKOFF))


def exit_code(returncode: int) -> int:
    """The status a shell would report: the exit status, or 128 + N for death by signal N."""
    return returncode if returncode >= 0 else 128 - returncode


def onward_run_span(command: Sequence[str]) -> tuple[int, int] | None:
    """Where the options of ``onward run`` are in ``command``: ``(start, end)`` such that ``command[start:end]``
    are the words after ``run`` up to ``--`` (``end`` is the index of ``--``, or the length). None when the
    command is not an onward command: ``run`` must follow a word named ``onward`` (an executable path, or
    the module after ``python -m``)."""
    onward = next((i for i, word in enumerate(command)
                   if os.path.basename(word) == "onward" or word in ("onward.cli", "onward.__main__")), None)
    if onward is None:
        return None
    try:
        start = command.index("run", onward + 1) + 1
    except ValueError:
        return None
    end = command.index("--", start) if "--" in command[start:] else len(command)
    return start, end


def starts_onward_run(command: Sequence[str]) -> bool:
    """Whether ``command`` is ``onward run`` itself (an ``onward`` executable or ``python -m onward``), which
    understands the start gate, rather than a wrapper that might fork it and never read the gate."""
    if os.path.basename(command[0]) == "onward":
        return command[1:2] == ["run"]
    return os.path.basename(command[0]).startswith("python") and command[1:4] == ["-m", "onward", "run"]


def find_run_option(command: Sequence[str], name: str) -> tuple[int, str, str] | None:
    """Where ``onward run`` in ``command`` is given option ``name`` (``--db X`` or ``--db=X``):
    ``(index of the word holding the value, the part of that word before the value, value)``, or None.
    The last occurrence wins, as with click. Both the supervisor (which store to journal to) and the unit
    generator (which paths to make absolute) read options through this one function."""
    span = onward_run_span(command)
    if span is None:
        return None
    found = None
    for i in range(*span):
        if command[i] == name and i + 1 < span[1]:
            found = (i + 1, "", command[i + 1])
        elif command[i].startswith(name + "="):
            found = (i, name + "=", command[i][len(name) + 1:])
    return found


def run_grace(command: Sequence[str]) -> float:
    """The ``--grace`` of ``onward run`` in ``command``, or its default when not given; ``UsageError`` when it is
    not a number. Read by the supervisor (its stop timeout) and the unit generator (``TimeoutStopSec``)."""
    found = find_run_option(command, "--grace")
    if found is None:
        return RunConfig.grace
    try:
        return float(found[2])
    except ValueError:
        raise UsageError(f"--grace: not a number of seconds: {found[2]!r}") from None


def default_stop_timeout(command: Sequence[str]) -> float:
    """How long a stopped worker may take to exit, unless ``--stop-timeout`` says: the ``--grace`` of ``onward run``
    in ``command`` (its default when not given, or when the worker will refuse it) and ``STOP_MARGIN``."""
    try:
        grace = run_grace(command)
    except UsageError:
        grace = RunConfig.grace
    if not (0 <= grace <= MAX_SECONDS):
        grace = RunConfig.grace
    return grace + STOP_MARGIN


def store_url_for(command: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """The store a worker command uses, as far as the supervisor can tell: its ``--db``, else ``ONWARD_DB``,
    else onward's default ``.onward/onward.db`` if that file exists (no store is created just to journal)."""
    found = find_run_option(command, "--db")
    if found:
        return found[2]
    if environ.get("ONWARD_DB"):
        return environ["ONWARD_DB"]
    return DEFAULT_DB if os.path.isfile(DEFAULT_DB) else None


def job_for(command: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """The job a worker command works on, as far as the supervisor can tell: its ``--job``, else
    ``ONWARD_JOB``, else None (the default job)."""
    found = find_run_option(command, "--job")
    if found:
        return found[2]
    return environ.get("ONWARD_JOB") or None


# How long a supervisor about to exit waits for the restarts still being recorded (a store locked, a server
# not answering): past this it exits and says which were not recorded.
JOURNAL_CLOSE_WAIT = 2.0
# The most restarts waiting to be recorded: a store that answers slowly while the worker keeps exiting 75
# with --restart-delay 0 (a hundred restarts a second) must not grow the backlog without end.
JOURNAL_BACKLOG = 64


class RestartJournal:
    """Records restarts in the store, one after another, on a thread of its own (see the module docstring).
    Best effort on purpose: a restart must never fail or wait because the store cannot be reached, so an
    error is reported on stderr and the next restart is recorded all the same."""

    def __init__(self) -> None:
        self._pending: queue.Queue[tuple[str, str | None, str] | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def record(self, store_and_job: tuple[str, str | None] | None, cause: str) -> None:
        if store_and_job is None:
            return
        if self._thread is None:
            self._pending = queue.Queue(JOURNAL_BACKLOG + 1)  # and room for close's end mark
            self._thread = threading.Thread(target=self._write, args=(self._pending,), name="onward-restart-journal",
                                            daemon=True)
            self._thread.start()
        if self._pending.qsize() >= JOURNAL_BACKLOG:
            log(f"restart not recorded in {redact_url(store_and_job[0])}: {JOURNAL_BACKLOG} restarts before it"
                " still wait for the store")
            return
        self._pending.put((*store_and_job, cause))

    @staticmethod
    def _write(pending: queue.Queue[tuple[str, str | None, str] | None]) -> None:
        while (item := pending.get()) is not None:
            url, job, cause = item
            try:
                store = open_store(url, create=False, job=job)  # journaling never creates a store (nor a job)
                try:
                    store.log_event("restart", detail=cause, durable=True)
                finally:
                    store.close()
            except Exception as exc:  # noqa: BLE001 - see the class
                log(f"could not record the restart in {redact_url(url)}: {scrub(str(exc), url_secrets(url))}")

    def close(self, wait: float) -> None:
        """Let the restarts not recorded yet be recorded, for ``wait`` seconds at most."""
        if self._thread is None:
            return
        thread, self._thread = self._thread, None
        self._pending.put(None)
        thread.join(wait)
        if thread.is_alive():
            log(f"the store did not answer within {wait:g} s: the last restarts may not be recorded in it")


class Supervisor:
    """Run ``command`` as a child and keep it running; ``run()`` returns the supervisor's exit status.

    Call ``run()`` from the main thread: it installs handlers for SIGTERM, SIGINT and SIGHUP (restored on return),
    and the child's ``PR_SET_PDEATHSIG`` fires when the *thread* that started it ends. While it runs the
    process is a child subreaper, and when the worker ends every child of the process started since
    ``run()`` began, other than the worker and its standby, is killed as the worker's leftover: nothing
    else in the process may start children meanwhile (``onward supervise`` starts none).
    """

    def __init__(self, command: Sequence[str], restart_delay: float = DEFAULT_RESTART_DELAY,
                 max_restarts: int = DEFAULT_MAX_RESTARTS, window: float = DEFAULT_WINDOW,
                 watchdog: float | None = None, store_url: str | None = None, job: str | None = None,
                 start_timeout: float = DEFAULT_START_TIMEOUT, stop_timeout: float | None = None) -> None:
        if not command:
            raise UsageError("supervise: no command given (put it after --)")
        # Finite numbers only: nan passes no comparison, and inf overflows select() and WATCHDOG_USEC.
        if not (restart_delay >= 0 and math.isfinite(restart_delay)):
            raise UsageError(f"--restart-delay must be 0 or more seconds, not {restart_delay}")
        if max_restarts < 0:
            raise UsageError(f"--max-restarts must be 0 or more, not {max_restarts}")
        if not (window > 0 and math.isfinite(window)):
            raise UsageError(f"--window must be more than 0 seconds, not {window}")
        if watchdog is not None and not (watchdog >= MIN_WATCHDOG and math.isfinite(watchdog)):
            raise UsageError(f"--watchdog must be at least {MIN_WATCHDOG:g} seconds (the worker's loop cannot"
                             f" heartbeat faster), not {watchdog:g}")
        if not (start_timeout >= 0 and math.isfinite(start_timeout)):
            raise UsageError(f"--start-timeout must be 0 or more seconds, not {start_timeout}")
        if stop_timeout is not None and not (stop_timeout >= 0 and math.isfinite(stop_timeout)):
            raise UsageError(f"--stop-timeout must be 0 or more seconds, not {stop_timeout}")
        self.command = list(command)
        self.restart_delay = restart_delay
        self.max_restarts = max_restarts
        self.window = window
        self.watchdog = watchdog
        self.start_timeout = start_timeout
        self.stop_timeout = default_stop_timeout(command) if stop_timeout is None else stop_timeout
        if store_url is not None:
            try:
                store_url = checked_store_url(store_url)
            except StoreError as e:  # refused before anything starts, as `onward run` refuses it
                raise UsageError(str(e)) from None
        self.store_url = store_url  # the explicit --db; else found anew at each restart (see _journal_store)
        # The explicit --job: passed on to every worker started (as ONWARD_JOB: a worker's own --job wins) and
        # where restarts are journaled; else the worker's --job or ONWARD_JOB.
        self.job = job
        # A gap in the supervisor's own loop above pause_threshold means it was frozen (see the module
        # docstring); the loop wakes every tick so that a gap of that size cannot be its own doing.
        self.pause_threshold = min([1.0] + [period / 2 for period in (watchdog, start_timeout) if period])
        self.tick = min(0.1, self.pause_threshold / 5)
        # What the current child said: its latest STATUS= and when it came (monotonic), and whether it
        # reported progress (see the module docstring). Shown and used when it dies.
        self.last_status: tuple[str, float] | None = None
        self.progressed = False
        self._stop_signal: int | None = None
        self._wake_r: socket.socket | None = None
        self._not_orphans: frozenset[int] = frozenset()  # our children that are not the worker's leftovers
        self._standby: Standby | None = None  # the next worker, waiting at its start gate (see _watch)
        self._kept_marker: str | None = None  # the worker's keep-awake marker, if any (see run)
        self._journal = RestartJournal()
        self._woke_at: float | None = None  # when _sleep last returned, while it watches one worker

    # --- the restart loop ----------------------------------------------------------------------------
    def run(self) -> int:
        """Start the child, restart it by the rules in the module docstring, return the exit status."""
        self._stop_signal = None
        # Leftovers of workers that died with an earlier supervisor (kill -9 of it) go first.
        sweep_dead_workers()
        self._kept_marker = self._marker()
        self._keep_marker_after_death()
        with tempfile.TemporaryDirectory(prefix="onward-supervise-") as private_dir, \
                socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as notify, \
                self._signals_forwarded(), self._orphans_reparented():
            # mkdtemp made the directory 0700: only our user can send to the socket.
            path = os.path.join(private_dir, "notify")
            notify.bind(path)
            notify.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            notify.setblocking(False)
            return self._restart_loop(notify, path)

    def _restart_loop(self, notify: socket.socket, path: str) -> int:
        restarts: deque[float] = deque()  # when each restart within the window happened (monotonic)
        streak = 0
        child = self._spawn(path, first=True)
        # How long a worker ran counts from its start (for the log, and for a crash that counts as fast), not
        # from when the supervisor, done loading or journaling beside it, goes back to watching it.
        started = time.monotonic()
        self._load_journal_backend()
        try:
            while child is not None:
                returncode, watchdog_cause = self._watch(child, notify, path)
                ran_for = time.monotonic() - started
                status = describe_status(returncode)
                if self._stop_signal is not None:
                    log(f"worker {child.pid} stopped ({status}) after {signal.Signals(self._stop_signal).name}; "
                        "not restarting")
                    return exit_code(returncode)
                if watchdog_cause is None and returncode in NOT_RESTARTED:
                    log(f"worker {child.pid} exited with status {returncode} ({NOT_RESTARTED[returncode]}); "
                        "not restarting")
                    return returncode
                cause = watchdog_cause or status
                now = time.monotonic()
                log(f"worker {child.pid} died: {cause} after {ran_for:.1f} s{self._last_words(now)}")
                while restarts and restarts[0] <= now - self.window:
                    restarts.popleft()
                if self.progressed:
                    # Not a crash loop: the restarts before this progress do not count against it either.
                    restarts.clear()
                    counted = "it made progress, not counted toward --max-restarts"
                elif returncode == UNAVAILABLE and watchdog_cause is None:
                    counted = "store or output unavailable, not counted toward --max-restarts"
                elif len(restarts) >= self.max_restarts:
                    log(f"giving up after {len(restarts)} restarts within {self.window:g} s "
                        f"(--max-restarts {self.max_restarts}): the worker keeps dying, last by {cause}")
                    self._let_marker_go()
                    return 1
                else:
                    restarts.append(now)
                    counted = f"restart {len(restarts)} in {self.window:g} s window"
                streak = streak + 1 if ran_for < FAST_CRASH and not self.progressed else 1
                first = self.restart_delay
                if returncode == UNAVAILABLE and watchdog_cause is None:
                    first = max(first, UNAVAILABLE_FIRST_DELAY)
                delay = backoff_delay(first, streak)
                log(f"restarting worker after {cause} ({counted}"
                    + (f", backing off {delay:g} s)" if delay > self.restart_delay else ")"))
                # The store is chosen now, while no worker runs (one may be about to create it), but written
                # to once the next worker is started: opening it (on PostgreSQL, connecting) can take longer
                # than the delay, and the restart must not wait for it.
                journal = self._journal_store()
                # An `onward run` worker waits at its start gate (onward.gate) until the delay is over: the
                # standby, or one started now that loads its code while the delay runs. Woken now, it may
                # prepare meanwhile what writes nothing (on PostgreSQL, connect to the server).
                early = self._take_standby(path)
                if early is not None:
                    early.gate.wake()
                if not self._wait_unless_stopped(now + delay):
                    if early is not None:
                        self._drop(early)
                    self._journal.record(journal, cause)
                    log(f"{signal.Signals(self._stop_signal or signal.SIGTERM).name} received while waiting to "
                        "restart; not restarting")
                    self._let_marker_go()
                    return exit_code(returncode)
                self.last_status, self.progressed = None, False
                if early is not None and exited(early.proc.pid):
                    # Gone by the end of the delay: killed with the worker (a kill of both, the OOM killer), it
                    # was still dying when taken. Let through, it would count as one more restart.
                    status = describe_status(self._drop(early))
                    log(f"standby {early.proc.pid} ended during the restart delay ({status}); starting another")
                    early = None
                child = self._spawn(path, first=False) if early is None else self._let_through(early)
                started = time.monotonic()
                self._journal.record(journal, cause)
            return self._stopped_before_start()
        finally:
            standby, self._standby = self._standby, None
            if standby is not None:
                self._drop(standby)  # no restart will need it
            self._journal.close(JOURNAL_CLOSE_WAIT)

    def _stopped_before_start(self) -> int:
        """No worker could be started: a stop came while the supervisor waited for processes or memory to
        start one (see ``_spawn``), exit 75 (unavailable), or a restart could not start it at all, exit 1."""
        if self._stop_signal is None:
            return 1
        log(f"{signal.Signals(self._stop_signal).name} received while waiting to start the worker; not"
            " starting it")
        self._let_marker_go()
        return UNAVAILABLE

    def _let_marker_go(self) -> None:
        """No worker of ours runs again, and the last one died without a word (else it let the keep-awake marker
        go itself): remove its marker unless another worker holds it, so that a job nobody works on no longer
        keeps the sandbox awake."""
        if self._kept_marker:
            KeepAwake(self._kept_marker, _log).release()

    def _keep_marker_after_death(self) -> None:
        """A supervisor killed outright takes its worker with it (PDEATHSIG) and can let the marker go no more
        than the worker could: a marker keeper does it then. Called at every tick of ``_watch`` too, so that a
        keeper killed on its own is replaced (``keep_after_death``); a keeper is never taken for a dead
        worker's leftover (``_ours``)."""
        if self._kept_marker:
            failed = keep_after_death(self._kept_marker, "supervisor")
            if failed:
                log(failed)

    def _marker(self) -> str | None:
        """The keep-awake marker the worker keeps, if any, as its command line shows it: only for ``onward run``
        itself (or the environment it inherits). A worker behind a wrapper says it with its READY=1
        (``MARKER_FIELD``, see ``_heard``)."""
        if onward_run_span(self.command) is None:
            return None
        found = find_run_option(self.command, "--keep-awake")
        return chosen_marker(found[2] if found else None)

    # --- the standby ---------------------------------------------------------------------------------
    def _start_standby(self, notify_path: str) -> Standby | None:
        """Start the next worker behind its start gate; None if it cannot be started (said on stderr)."""
        journal = self._journal_store()
        gate = Gate("postgres" if journal is not None and is_postgres_url(journal[0]) else "sqlite")
        proc = self._spawn(notify_path, first=False, gate=gate)
        return None if proc is None else Standby(proc, gate, time.monotonic())

    def _shown_command(self) -> str:
        # Word by word: a word holding a store URL is one URL, whose password is hidden whole however it is
        # written (a space and a "/" in it defeat the rule for free text, see redact.redact_one_url).
        return redact_url(shlex.join(redact_one_url(word) for word in self.command))

    def _take_standby(self, notify_path: str) -> Standby | None:
        """The worker for this restart, waiting at its gate: the standby, or one started now (there was none
        yet, or it ended on its own); None when the command is not ``onward run`` itself (it is started
        after the delay, like any command)."""
        if not starts_onward_run(self.command):
            return None
        standby, self._standby = self._standby, None
        if standby is not None and exited(standby.proc.pid):
            status = describe_status(self._drop(standby))
            log(f"standby {standby.proc.pid} ended before a restart needed it ({status}); starting another")
            standby = None
        return standby if standby is not None else self._start_standby(notify_path)

    def _let_through(self, standby: Standby) -> subprocess.Popen[bytes]:
        """Open the standby's gate: from now on it is the worker."""
        standby.gate.open()
        log(f"worker {standby.proc.pid} started: {self._shown_command()} (the standby, started"
            f" {time.monotonic() - standby.since:.1f} s before)")
        return standby.proc

    def _drop(self, standby: Standby) -> int:
        """End a standby that no restart will let through, and return its returncode. Its gate is closed
        (so it would leave by itself at the gate) and it is killed (it may still be loading its code): it
        has done nothing else."""
        standby.gate.close()
        return self._reap(standby.proc, None)

    def _spawn(self, notify_path: str, first: bool, gate: Gate | None = None) -> subprocess.Popen[bytes] | None:
        """Start the child (behind ``gate``, if given); None if a restart cannot start it (a first start
        raises UsageError)."""
        env = dict(os.environ)
        env.pop(START_GATE, None)
        if gate is not None:
            env[START_GATE] = gate.value
        env["NOTIFY_SOCKET"] = notify_path
        if self.job is not None:
            env["ONWARD_JOB"] = self.job
        env.pop("WATCHDOG_PID", None)  # see the module docstring
        if self.watchdog:
            env["WATCHDOG_USEC"] = str(math.ceil(self.watchdog * 1_000_000))
        else:
            env.pop("WATCHDOG_USEC", None)
        prepare_die_with_parent()  # load libc's prctl now: nothing may be loaded between fork and exec

        def in_child() -> None:  # runs between fork and exec: a few system calls, nothing more
            os.setpgid(0, 0)
            die_with_parent_preexec()

        warned: float | None = None
        while True:
            try:
                child = subprocess.Popen(self.command, env=env, preexec_fn=in_child,
                                         pass_fds=gate.passed if gate is not None else ())
                break
            except OSError as exc:
                if exc.errno in RESOURCE_ERRNOS and gate is None:
                    # Out of processes (a pids cgroup, ulimit -u) or memory: neither a usage error (exit 2,
                    # never restarted) nor a reason to give up (a restart that could not fork ended the
                    # supervisor with 1). Tried again every second, said once a minute, until it starts or
                    # a stop comes. A standby is not waited for: the restart starts its worker itself.
                    now = time.monotonic()
                    if warned is None or now - warned >= SPAWN_WARN_EVERY:
                        log(f"cannot start the worker: {exc.strerror} (out of processes or memory); trying"
                            " again every second")
                        warned = now
                    if self._wait_unless_stopped(now + SPAWN_RETRY):
                        continue
                    return None
                if first:
                    raise UsageError(f"supervise: cannot start {self.command[0]}: {exc.strerror}") from exc
                log(f"cannot start the worker again: {exc}")
                if gate is not None:
                    gate.close()
                return None
            finally:
                if gate is not None:
                    gate.started()
        if gate is None:
            log(f"worker {child.pid} started: {self._shown_command()}")
        else:
            log(f"standby {child.pid} started, waiting at its start gate: {self._shown_command()}")
        return child

    # --- watching one child --------------------------------------------------------------------------
    def _watch(self, child: subprocess.Popen[bytes], notify: socket.socket,
               notify_path: str) -> tuple[int, str | None]:
        """Serve the child's notifications until it is gone, and start the standby once the child has been
        ready for ``STANDBY_AFTER`` seconds. Returns its returncode, and the cause if the watchdog killed it."""
        pidfd = exit_fd(child.pid)
        self._woke_at = None  # (see _sleep: the time since the last worker's loop is no pause)
        # `onward run` says READY=1 once it is up: until then the start timeout applies, not the watchdog
        # (systemd's Type=notify). Another command may never say it: it counts as started at once.
        start_timeout = self.start_timeout if starts_onward_run(self.command) else None
        watchdog = Watchdog(self.watchdog, time.monotonic(), start_timeout)
        ready = False
        ready_since: float | None = None
        standby_due = self._standby is None and starts_onward_run(self.command)
        try:
            while True:
                now = self._sleep(notify, pidfd, watchdog)
                if self._forward_signals(child):
                    # A stop has begun: like systemd, no watchdog while stopping, and a limit to the stop.
                    watchdog.stop(now, self.stop_timeout)
                for message in receive(notify, child.pid):
                    ready = self._heard(child, message, watchdog, now, ready)
                if ready and ready_since is None:
                    ready_since = now
                if standby_due and ready_since is not None and now - ready_since >= STANDBY_AFTER \
                        and self._stop_signal is None:
                    standby_due = False  # once per worker: a standby that cannot be started is said once
                    self._standby = self._start_standby(notify_path)
                self._keep_marker_after_death()
                reap_orphans(keep=self._ours(child.pid))
                if exited(child.pid):
                    # What it said between the look at the socket above and its exit is read now: a worker
                    # that settled a task and died at once had its progress taken for a crash loop's run.
                    for message in receive(notify, child.pid):
                        ready = self._heard(child, message, watchdog, now, ready)
                    return self._reap(child, pidfd), None
                if watchdog.expired(time.monotonic()):
                    cause = watchdog.cause(time.monotonic())
                    log(f"worker {child.pid}: {cause}; killing its process group")
                    return self._reap(child, pidfd), cause
        finally:
            if pidfd is not None:
                os.close(pidfd)

    def _sleep(self, notify: socket.socket, pidfd: int | None, watchdog: Watchdog) -> float:
        """Wait for a datagram, a signal, the child's exit or the next tick; return when it woke. Waking
        much later than asked means the supervisor was not running either (see the module docstring)."""
        timeout = watchdog.wait(self.tick, time.monotonic())
        asleep_from = time.monotonic()
        assert self._wake_r is not None
        select.select([notify, self._wake_r] + ([pidfd] if pidfd is not None else []), [], [], timeout)
        now = time.monotonic()
        # Counted from the last wake, not from this sleep's start: a pause that falls while the loop works
        # between two sleeps (reading the socket, reaping, starting the standby) is a pause all the same. It
        # went unnoticed then, and the watchdog, not re-armed, could take the thawed worker for wedged.
        since = asleep_from if self._woke_at is None else min(asleep_from, self._woke_at)
        self._woke_at = now
        late = now - since - timeout
        if late > self.pause_threshold:
            # We were not running either: a pause of the whole tree, not a wedged child.
            log(f"supervisor resumed after {late:.1f} s pause" + ("; watchdog re-armed" if watchdog.armed else ""))
            watchdog.rearm(now)
        return now

    def _heard(self, child: subprocess.Popen[bytes], message: dict[str, str], watchdog: Watchdog, now: float,
               ready: bool) -> bool:
        """Act on one sd_notify message of the child (received at ``now``); returns whether it is ready."""
        if message.get("WATCHDOG") == "trigger":
            watchdog.trigger(now)
        elif "WATCHDOG" in message or "READY" in message:
            watchdog.heard(now)
        if message.get("READY") == "1":
            watchdog.started(now)
            ready = True
            log(f"worker {child.pid} ready")
        if "STATUS" in message:
            self.last_status = (message["STATUS"], now)
        marker = message.get(MARKER_FIELD)
        if marker and marker != self._kept_marker and os.path.isabs(marker):
            # The marker the worker says it keeps: the one on its command line, or one a wrapped command's
            # worker took, which the command line does not show (`sh -c "exec onward run --keep-awake M ..."`).
            if self._kept_marker is None:
                log(f"worker {child.pid} keeps the keep-awake marker {marker}")
            self._kept_marker = marker
            self._keep_marker_after_death()
        if message.get(PROGRESS_FIELD) == "1" and ready and not self.progressed:
            self.progressed = True
            log(f"worker {child.pid} made progress")
        if message.get("STOPPING") == "1":
            log(f"worker {child.pid} stopping")
            watchdog.disarm()
        return ready

    def _reap(self, child: subprocess.Popen[bytes], pidfd: int | None) -> int:
        """SIGKILL the child's process group (the child too, if still alive), wait for the child to be gone,
        reap it, and return its returncode.

        The group is killed before the child is reaped: until then the child's pid, which is the group id,
        cannot be reused, so the signal cannot reach an unrelated group. The wait keeps taking stop signals
        (no restart will follow them): a SIGKILLed process can take a while to die, e.g. forever while a
        cgroup v1 freezer holds it, and the supervisor must stay responsive meanwhile.
        """
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)
        assert self._wake_r is not None
        killed_at = time.monotonic()
        warned = False
        while not exited(child.pid):
            select.select([self._wake_r] + ([pidfd] if pidfd is not None else []), [], [], self.tick)
            received = self._pending_stop_signals()
            if received:
                self._stop_signal = received[-1]
            if not warned and time.monotonic() - killed_at > 1.0:
                log(f"worker {child.pid} has not died 1 s after SIGKILL (frozen?); waiting for it")
                warned = True
        # What its tasks left running is ours now (we are their subreaper), or in its cgroups: kill it
        # before the worker is reaped (or restarted), not when a later worker reclaims the tasks.
        left = kill_orphans(keep=self._ours(child.pid), timeout=ORPHAN_KILL_WAIT)
        swept = sweep_dead_workers()
        if left or swept:
            log(f"worker {child.pid} left {left} processes and {swept} cgroups; killed them")
        return child.wait()

    def _ours(self, worker: int) -> frozenset[int]:
        """Our children that are not a worker's leftovers: those from before ``run()``, the worker (or the
        standby being dropped), the standby and the marker keepers."""
        standby = {self._standby.proc.pid} if self._standby is not None else set()
        return self._not_orphans | {worker} | standby | keeper_pids()

    def _last_words(self, now: float) -> str:
        """What the dead child last told about itself, dated: its STATUS= may be older than its progress."""
        words = "; it made progress" if self.progressed else ""
        if self.last_status is not None:
            text, when = self.last_status
            words += f"; its last status, {now - when:.1f} s before: {text}"
        return words

    @contextlib.contextmanager
    def _orphans_reparented(self) -> Iterator[None]:
        """While the supervisor runs it is a child subreaper: a process left behind by the worker's tasks
        (its parent died, or it double-forked away) is re-parented to the supervisor instead of init, so
        ``_reap`` can kill it when the worker dies. Turned off again on return (``run`` may be called in a
        process that lives on). Children this process already had when ``run`` began are left alone; a
        child that another thread starts meanwhile would be taken for a leftover (see the class)."""
        self._not_orphans = frozenset(children())
        set_child_subreaper(True)
        try:
            yield
        finally:
            set_child_subreaper(False)

    # --- signals -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _signals_forwarded(self) -> Iterator[None]:
        """While the supervisor runs, SIGTERM, SIGINT and SIGHUP only write their number to a socket that the loop
        watches (``signal.set_wakeup_fd``): the loop forwards them, so no work happens in a handler."""
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        wake_w.setblocking(False)
        # Not SIGHUP under nohup: it stays ignored, and the worker inherits the ignore (onward.stopsignals).
        previous = {sig: signal.signal(sig, lambda *_: None) for sig in stop_signals()}
        old_fd = signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
        self._wake_r = wake_r
        try:
            yield
        finally:
            signal.set_wakeup_fd(old_fd)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            wake_r.close()
            wake_w.close()
            self._wake_r = None

    def _pending_stop_signals(self) -> list[int]:
        assert self._wake_r is not None
        received: list[int] = []
        while True:
            try:
                data = self._wake_r.recv(64)
            except BlockingIOError:
                return received
            received += [s for s in data if s in STOP_SIGNALS]

    def _forward_signals(self, child: subprocess.Popen[bytes]) -> bool:
        """Forward every SIGTERM/SIGINT/SIGHUP received since the last call to the child. True if any."""
        received = self._pending_stop_signals()
        for signum in received:
            self._stop_signal = signum
            # SIGHUP (the terminal closed) stops the worker as SIGTERM does: the worker gets SIGTERM.
            sent = signal.SIGTERM if signum == signal.SIGHUP else signum
            log(f"forwarding {signal.Signals(signum).name} to worker {child.pid}"
                + (f" as {signal.Signals(sent).name}" if sent != signum else "") + "; it will not be restarted")
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, sent)
        return bool(received)

    def _wait_unless_stopped(self, until: float) -> bool:
        """Sleep until ``until`` (monotonic); False as soon as a SIGTERM/SIGINT/SIGHUP arrives."""
        assert self._wake_r is not None
        while True:
            received = self._pending_stop_signals()
            if received:
                self._stop_signal = received[-1]
                return False
            remaining = until - time.monotonic()
            if remaining <= 0:
                return True
            select.select([self._wake_r], [], [], remaining)

    # --- the journal ---------------------------------------------------------------------------------
    def _journal_store(self) -> tuple[str, str | None] | None:
        """Where restarts are journaled, looked up at each restart rather than once at start (in a fresh
        folder the first worker creates the store): the store's URL and the job, or None."""
        url = self.store_url if self.store_url is not None else store_url_for(self.command, os.environ)
        if url is None:
            return None
        return url, self.job if self.job is not None else job_for(self.command, os.environ)

    def _load_journal_backend(self) -> None:
        """Load the code that journals a restart (the store's module and, on PostgreSQL, psycopg) now, while
        the first worker runs. Loaded at the first restart, it took the CPU from the restarted worker, whose
        start-up runs meanwhile: measured, 0.03 s of that restart on SQLite and 0.2 s or more on PostgreSQL
        (2 cores, loaded). Best effort, like the journal: a missing psycopg is reported when journaling."""
        journal = self._journal_store()  # None: the default file, which the first worker is about to create
        with contextlib.suppress(StoreError):
            load_backend(postgres=journal is not None and is_postgres_url(journal[0]))


