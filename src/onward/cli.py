"""The ``onward`` command: a thin face over the library. It parses, calls, prints; nothing more.

Exit statuses (one table, here): 0 success (a job that ends with cancelled tasks but none failed too:
cancelled is final, not a failure); 1 a task asked for is not done or unknown (`result`, `retry`,
`cancel`: nothing is changed then); 2 bad input or configuration (one line on stderr, nothing changed);
3 the job finished but some tasks failed for good; 4 a Python task ignored cancellation and the worker quit
so that a supervisor restarts it; 75 the store or the output folder is unavailable right now (a disk fault,
a database server down): supervisors restart it later.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING

import click

from . import __version__
from .cli_types import FINITE_FLOAT, NOT_EMPTY, TASK_TEXT, db_option, job_option
from .config import DEFAULT_MAX_RESULT_BYTES, RunConfig
from .errors import (
    UNAVAILABLE_EXIT,
    JobMissing,
    OnwardError,
    StoreError,
    StoreMissing,
    TaskNotDone,
    Unavailable,
    UnknownTask,
    UsageError,
    WedgedTask,
)
from .log import NORMAL, QUIET, VERBOSE, Log, iso_time, json_line
from .pipes import out_of_memory_line, quiet_broken_pipe, unavailable_line
from .store.base import STATES

if TYPE_CHECKING:
    from .store.base import Event, Store

EXIT_CODES: list[tuple[type[BaseException], int]] = [
    (Unavailable, UNAVAILABLE_EXIT),  # before StoreError: a store that is down is not a configuration error
    (TaskNotDone, 1),
    (UnknownTask, 1),
    (WedgedTask, 4),
    (UsageError, 2),
    (StoreError, 2),
    (OnwardError, 1),
]


def _log_level(quiet: bool, verbose: bool) -> int:
    return QUIET if quiet else VERBOSE if verbose else NORMAL


class LazyGroup(click.Group):
    """Commands that live in their own modules load only when used, so that `onward status` does not pay
    for importing the supervisor, systemd units or the step machinery."""

    lazy = {
        "supervise": ("onward.deploy_cli", "supervise_command"),
        "service": ("onward.deploy_cli", "service_group"),
        "steps": ("onward.steps_cli", "steps_command"),
        "db": ("onward.db_cli", "db_group"),
        "demo": ("onward.demo", "demo_command"),
        "pause": ("onward.steer_cli", "pause_command"),
        "resume": ("onward.steer_cli", "resume_command"),
        "cancel": ("onward.steer_cli", "cancel_command"),
        "send": ("onward.steer_cli", "send_command"),
        "jobs": ("onward.steer_cli", "jobs_command"),
        "dashboard": ("onward.dashboard.command", "dashboard_command"),
    }

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.lazy])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy:
            import importlib

            module, attribute = self.lazy[cmd_name]
            command: click.Command = getattr(importlib.import_module(module), attribute)
            return command
        return super().get_command(ctx, cmd_name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="onward")
def main() -> None:
    """Run long jobs that resume after a crash: every finished task is checkpointed durably."""


# --- run ------------------------------------------------------------------------------------------------
@main.command(context_settings={"ignore_unknown_options": False})
@db_option
@job_option
@click.option("--tasks", "tasks_file", metavar="FILE", type=NOT_EMPTY, help="Tasks file, one task per line ('-': stdin).")
@click.option("--out", "out_dir", metavar="DIR", type=NOT_EMPTY, help="Also write each result to DIR/<name>.txt.")
@click.option("--concurrency", default=RunConfig.concurrency, show_default=True, type=int, help="Tasks run at once.")
@click.option("--max-attempts", default=RunConfig.max_attempts, show_default=True, type=int,
              help="Attempts before a task fails.")
@click.option("--retry-delay", default=RunConfig.retry_delay, show_default=True, type=FINITE_FLOAT,
              help="First retry backoff in seconds; doubles each attempt.")
@click.option("--timeout", default=RunConfig.timeout, type=FINITE_FLOAT,
              help="Kill an attempt after this many seconds.")
@click.option("--heartbeat", default=RunConfig.heartbeat, show_default=True, type=FINITE_FLOAT,
              help="Lease renewal period (s).")
@click.option("--lease", default=RunConfig.lease, type=FINITE_FLOAT, help="Lease length (s); default 3 heartbeats.")
@click.option("--grace", default=RunConfig.grace, show_default=True, type=FINITE_FLOAT,
              help="On SIGTERM, how long running tasks may finish (s).")
@click.option("--stall-timeout", default=RunConfig.stall_timeout, type=FINITE_FLOAT,
              help="Cancel a task with no output, heartbeat-file touch or beat for this long (s).")
@click.option("--max-result-bytes", default=DEFAULT_MAX_RESULT_BYTES, show_default=True, type=int,
              help="Largest stdout kept as a result (at least 1); more fails the attempt.")
@click.option("--keep-awake", "keep_awake", metavar="PATH", default=None, type=NOT_EMPTY,
              help="Marker file kept while work remains (env ONWARD_KEEP_AWAKE).")
@click.option("-q", "--quiet", is_flag=True, help="Log only warnings and failures.")
@click.option("-v", "--verbose", is_flag=True, help="Log every event.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def run(db: str | None, job: str, tasks_file: str | None, out_dir: str | None, concurrency: int, max_attempts: int,
        retry_delay: float, timeout: float | None, heartbeat: float, lease: float | None, grace: float,
        stall_timeout: float | None, max_result_bytes: int, keep_awake: str | None, quiet: bool,
        verbose: bool, command: tuple[str, ...]) -> None:
    """Run CMD once per pending task: `onward run --tasks FILE -- CMD [ARG...]`, `{task}` in any ARG
    replaced by the task text. Exit 0 when all is done, 3 when some tasks failed for good."""
    from .commands import run_command

    config = RunConfig(concurrency=concurrency, max_attempts=max_attempts, retry_delay=retry_delay,
                       timeout=timeout, heartbeat=heartbeat, lease=lease, grace=grace, stall_timeout=stall_timeout)
    code = run_command(config, Log(_log_level(quiet, verbose)), command=list(command), db=db,
                       tasks_file=tasks_file, out_dir=out_dir, max_result_bytes=max_result_bytes,
                       keep_awake=keep_awake, job=job, progress_bar=_stderr_is_a_terminal())
    sys.exit(code)


# --- add ------------------------------------------------------------------------------------------------
@main.command()
@db_option
@job_option
@click.option("--tasks", "tasks_file", metavar="FILE", type=NOT_EMPTY, help="Tasks file, one task per line ('-': stdin).")
@click.argument("tasks", nargs=-1, type=TASK_TEXT)
def add(db: str | None, job: str, tasks_file: str | None, tasks: tuple[str, ...]) -> None:
    """Add tasks (by name, or from a file). Adding an existing task does nothing."""
    from .commands import add_tasks, held_back_warning

    if bool(tasks) == bool(tasks_file):
        raise UsageError("give tasks as arguments or --tasks FILE (one of the two)")
    result = add_tasks(db, list(tasks), tasks_file, job=job)
    warning = held_back_warning(str(tasks_file), result)
    if warning:
        click.echo(f"onward: warning: {warning}", err=True)
    click.echo(f"added {result.added} new task{'s' if result.added != 1 else ''}", err=True)


# --- status ---------------------------------------------------------------------------------------------
@main.command()
@db_option
@job_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
@click.option("--watch", is_flag=True, help="Redraw every --interval seconds until Ctrl-C (a pipe gets a line each time).")
@click.option("--interval", type=FINITE_FLOAT, default=None, metavar="S", help="Seconds between refreshes of --watch (default 1).")
def status(db: str | None, job: str, as_json: bool, watch: bool, interval: float | None) -> None:
    """Where the job stands: counts, running tasks, workers, latest errors, rate and ETA."""
    from .status import render_status, status_dict
    from .store import open_store

    if interval is not None and not watch:
        raise UsageError("--interval goes with --watch")
    if watch and as_json:
        raise UsageError("--watch and --json do not go together (give one)")
    if interval is not None and interval <= 0:
        raise UsageError(f"--interval must be more than 0 seconds (got {interval:g})")
    store = open_store(db, create=False, job=job)
    try:
        if watch:
            from .watch import watch as watch_status

            watch_status(store, 1.0 if interval is None else interval, terminal=sys.stdout.isatty())
            return
        report = status_dict(store)
    finally:
        store.close()
    if as_json:
        click.echo(json_line(report))
    else:
        render_status(report)


# --- list -----------------------------------------------------------------------------------------------
@main.command(name="list")
@db_option
@job_option
@click.option("--state", type=click.Choice(list(STATES)), default=None)
@click.option("--long", "long_", is_flag=True, help="Add state, attempts and times (tab-separated).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per task and line.")
def list_(db: str | None, job: str, state: str | None, long_: bool, as_json: bool) -> None:
    """The tasks' texts, one per line, exactly as added."""
    from .journal import task_json
    from .store import open_store

    if long_ and as_json:
        raise UsageError("--long and --json do not go together (give one)")
    store = open_store(db, create=False, job=job)
    out = sys.stdout
    try:
        for row in store.iter_tasks(state):
            if as_json:
                out.write(json_line(task_json(row)) + "\n")
            elif long_:
                out.write(f"{row.state}\t{row.attempts}\t{iso_time(row.added_at)}\t{iso_time(row.finished_at)}\t{row.name}\n")
            else:
                out.write(row.name + "\n")
    except BrokenPipeError:
        quiet_broken_pipe()
    finally:
        store.close()


# --- result ---------------------------------------------------------------------------------------------
@main.command()
@db_option
@job_option
@click.argument("task", type=TASK_TEXT)
def result(db: str | None, job: str, task: str) -> None:
    """Write a done task's result to stdout, byte for byte (a JSON value as JSON)."""
    from .store import open_store

    store = open_store(db, create=False, job=job)
    try:
        stored = store.result(task)
        if stored is None:
            row = store.task(task)
            if row is None:
                raise UnknownTask(f"no task {task!r} in {store.url}")
            raise TaskNotDone(f"task {task!r} is {row.state}, it has no result")
    finally:
        store.close()
    sys.stdout.buffer.write(stored.data)
    sys.stdout.buffer.flush()


# --- retry ----------------------------------------------------------------------------------------------
@main.command()
@db_option
@job_option
@click.option("--failed", "all_failed", is_flag=True, help="Every failed task.")
@click.argument("tasks", nargs=-1, type=TASK_TEXT)
def retry(db: str | None, job: str, all_failed: bool, tasks: tuple[str, ...]) -> None:
    """Put failed tasks (and cancelled ones, when named) back to pending, with their attempts reset."""
    from .store import open_store

    if all_failed == bool(tasks):
        raise UsageError("give --failed or task names (one of the two)")
    store = open_store(db, create=False, job=job)
    try:
        rows = {t: store.task(t) for t in tasks}
        unknown = [t for t, row in rows.items() if row is None]
        if unknown:
            raise UnknownTask(f"no task {unknown[0]!r} in {store.url}")
        n = store.retry(None if all_failed else list(tasks))
    finally:
        store.close()
    for name, row in rows.items():
        if row is not None and row.state not in ("failed", "cancelled"):
            click.echo(f"task {name!r} is {row.state}, not failed: left as it is", err=True)
    click.echo(f"{n} task{'s' if n != 1 else ''} back to pending", err=True)


# --- logs -----------------------------------------------------------------------------------------------
class SinceTime(click.ParamType):
    """``--since``: an ISO 8601 time (UTC unless it says otherwise) or an age like ``90s``, ``10m``, ``2h``,
    ``3d``; kept as text here and turned into a time once the store's clock is known."""

    name = "time"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> str:
        from .journal import parse_since

        text = str(value)
        try:
            parse_since(text, now=time.time())
        except ValueError as e:
            self.fail(str(e), param, ctx)
        return text


@main.command()
@db_option
@job_option
@click.option("--task", "task", type=TASK_TEXT, default=None, help="Only this task's events.")
@click.option("-n", "--lines", "last", type=click.IntRange(min=1, max=2**63 - 1), default=None,
              help="Only the last N events.")
@click.option("--since", type=SinceTime(), default=None,
              help="Only events from TIME on: ISO 8601 (UTC unless an offset is given) or an age (10m, 2h).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per event and line.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new events (waits for the store to exist).")
def logs(db: str | None, job: str, task: str | None, last: int | None, since: str | None, as_json: bool,
         follow: bool) -> None:
    """The event journal: one line per event with ISO time, pid and task."""
    from .journal import event_json, first_event_after, format_event, parse_since
    from .store import open_store

    def show(event: Event) -> str:
        return json_line(event_json(event)) if as_json else format_event(event)

    try:
        store = _open_when_there(db, job) if follow else open_store(db, create=False, job=job)
    except KeyboardInterrupt:
        return  # Ctrl-C while waiting for the store: nothing to say
    try:
        since_at = None if since is None else parse_since(since, now=store.now())
        after = 0 if since_at is None else first_event_after(store, since_at)
        events = store.events(task=task, last=last) if last else store.events(after_id=after, task=task, limit=10_000)
        outage = False
        while True:
            for event in events:
                after = event.event_id
                if since_at is None or event.at >= since_at:
                    click.echo(show(event))
            if events and len(events) >= 10_000 and not last:
                events = store.events(after_id=after, task=task, limit=10_000)
                continue
            if not follow:
                break
            time.sleep(0.5)
            try:
                store.idle()
                events = store.events(after_id=after, task=task, limit=10_000)
            except Unavailable as e:
                # A database server restarting, a connection dropped: following goes on once it is back, as
                # `status --watch` does (it exited 75 at the first drop, and a follower died with every restart).
                if not outage:
                    click.echo(f"onward: store unavailable, following again once it is back: {e}", err=True)
                outage, events = True, []
                continue
            if outage:
                click.echo("onward: store back; following", err=True)
                outage = False
    except (BrokenPipeError, KeyboardInterrupt):
        quiet_broken_pipe()
    finally:
        store.close()


def _open_when_there(db: str | None, job: str | None = None) -> Store:
    """The store, waiting for it (and its job) to be created (`onward logs -f` started before the first
    `onward run` or `onward add`), with one line on stderr saying so. A store counts as there once it can be opened
    without initialising it: a file still empty (its creator is at work) is waited for too."""
    from .redact import redact_url
    from .store import exists, job_name, open_store, store_url

    url = store_url(db)  # a location no backend takes is refused at once, not waited for
    told: str | None = None
    while True:
        waiting_for = f"a store at {redact_url(url)}"
        if exists(url):
            try:
                return open_store(url, create=False, job=job)
            except JobMissing:
                # The store is there, its job is not: a typo as likely as a job not started yet. Said so:
                # "waiting for a store" sent the user looking at the wrong thing.
                waiting_for = f"job {job_name(job)!r} in {redact_url(url)} (there is no such job yet)"
            except StoreMissing:
                pass  # being made by its first run or add
        if told != waiting_for:
            click.echo(f"onward: waiting for {waiting_for}", err=True)
            told = waiting_for
        time.sleep(0.5)


# --- metrics --------------------------------------------------------------------------------------------
@main.command()
@db_option
@job_option
def metrics(db: str | None, job: str) -> None:
    """Print the job's Prometheus metrics once (text format, e.g. for node-exporter's textfile collector)."""
    from .metrics import metrics_text
    from .store import open_store

    store = open_store(db, create=False, job=job)
    try:
        text = metrics_text(store)
    finally:
        store.close()
    sys.stdout.buffer.write(text)
    sys.stdout.buffer.flush()


def _stderr_is_a_terminal() -> bool:
    """Whether ``onward run`` draws its progress bar: only on a terminal that can move its cursor (never
    into journald, a file or a pipe, which keep one line per event), and not under a supervisor (it sets
    NOTIFY_SOCKET), whose own lines on the same terminal would land in the middle of the bar."""
    try:
        return (os.isatty(sys.stderr.fileno()) and os.environ.get("TERM") != "dumb"
                and "NOTIFY_SOCKET" not in os.environ)
    except (OSError, ValueError):
        return False


def hide_passwords_from_ps(argv: list[str]) -> None:
    """A store URL with a password on the command line (``--db postgresql://u:secret@…`` or
    ``--db=postgresql://…``, also in the command given to ``onward supervise``) is visible to every user
    through ``ps``: blank it out at once."""
    from .redact import hide_secrets_in_argv, url_secrets

    # url_secrets finds a URL inside a longer word too ("--db=URL", "ONWARD_DB=URL").
    hide_secrets_in_argv([secret for arg in argv if "://" in arg for secret in url_secrets(arg)])


def _say_error(message: str) -> None:
    """The one line every error ends as. Any URL in it loses its password here, whatever the password holds
    and even in a URL that no backend could parse (``mysql://u:pw@…``, ``sqlite://u:my pw@…``): each path
    that quotes what the user typed need not remember to."""
    from .log import printable
    from .redact import redact_url

    # One line, whatever the message quotes (SQLite's text for a damaged schema holds the schema's SQL), and
    # no control character raw: a message quotes what the user gave (a file name, a time, a store path), which
    # may hold an escape sequence that retitles or clears the terminal.
    text = " ".join(line.strip() for line in message.splitlines() if line.strip())
    click.echo(f"onward: error: {printable(redact_url(text))}", err=True)


def entry(argv: list[str] | None = None) -> int:
    """Run the CLI, mapping every error type to its exit status in one place."""
    hide_passwords_from_ps(sys.argv if argv is None else argv)
    code = _run_cli(argv)
    try:
        sys.stdout.flush()  # what a command printed reaches its file now, where a failure can be told
    except BrokenPipeError:
        quiet_broken_pipe()
    except OSError as e:
        line = unavailable_line(e, "cannot write the output")
        if line is None:
            raise
        _say_error(line)
        return code or UNAVAILABLE_EXIT
    return code


def _run_cli(argv: list[str] | None) -> int:
    try:
        # Without standalone mode click returns, instead of raising, the status given to ctx.exit() (by
        # --version, or by onward supervise passing its worker's on); a command that just returns gives None.
        status = main.main(args=argv, prog_name="onward", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("onward: aborted", err=True)
        return 130
    except click.UsageError as e:
        _say_error(e.format_message())
        return 2
    except click.ClickException as e:
        _say_error(e.format_message())
        return e.exit_code
    except SystemExit as e:
        if type(sys.stdout).__name__.endswith("PacifyFlushWrapper"):
            # click's own answer to a reader that went away (EPIPE), even outside standalone mode: it wraps
            # the streams and exits 1, the status of "a task asked for is unknown or not done". It is no
            # error here either (`onward metrics | head -1`), as below.
            quiet_broken_pipe()
            return 0
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BrokenPipeError:
        quiet_broken_pipe()
        return 0
    except OnwardError as e:
        _say_error(str(e))
        for kind, code in EXIT_CODES:
            if isinstance(e, kind):
                return code
        return 1
    except OSError as e:
        # The machine, not the input: no descriptor left (ulimit -n), no memory, a full disk or one failing
        # under the report being written (stdout on a full disk). Unavailable right now, as a store error
        # of that kind is: one line, exit 75, for a supervisor to try again later.
        line = unavailable_line(e)
        if line is None:
            raise
        _say_error(line)
        return UNAVAILABLE_EXIT
    except MemoryError as e:
        # The same, met by Python's allocator (or SQLite's) rather than by a system call: anywhere in a
        # worker, its commit of a big result included. Whatever that commit was, it did not happen, and a
        # worker's running tasks stay claimed: the next worker reclaims them at once, as after a crash.
        line = out_of_memory_line(e)
        try:
            _say_error(line)
        except MemoryError:
            os.write(2, b"onward: error: out of memory\n")
        return UNAVAILABLE_EXIT
    return status if isinstance(status, int) else 0


def cli_main() -> None:
    code = entry()
    if code == UNAVAILABLE_EXIT and os.environ.get("SYSTEMD_EXEC_PID") == str(os.getpid()):
        # The main process of a systemd service (systemd sets SYSTEMD_EXEC_PID to the pid it started): see
        # onward.systemd.space_unavailable_exit. Checked before anything is imported: a worker out of file
        # descriptors (ulimit -n) exits 75 too, and could not load one more module.
        from .systemd import space_unavailable_exit

        space_unavailable_exit()
    sys.exit(code)


if __name__ == "__main__":
    cli_main()
