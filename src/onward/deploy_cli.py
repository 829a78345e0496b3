"""The deployment commands, ``onward supervise`` and ``onward service install|uninstall|status``: they parse,
call ``onward.supervise`` or ``onward.systemd``, and print. ``onward.cli`` registers them on its group."""

from __future__ import annotations

import click

from onward import systemd
from onward.cli_types import FINITE_FLOAT, NOT_EMPTY, JobName
from onward.supervise import (
    DEFAULT_MAX_RESTARTS,
    DEFAULT_RESTART_DELAY,
    DEFAULT_START_TIMEOUT,
    DEFAULT_WINDOW,
    Supervisor,
)

# Not required for click: an empty command is reported by the library as a UsageError, like other bad input.
_COMMAND = click.argument("command", nargs=-1, type=click.UNPROCESSED)


@click.command("supervise", context_settings={"allow_interspersed_args": False})
@click.option("--restart-delay", type=FINITE_FLOAT, default=DEFAULT_RESTART_DELAY, show_default=True, metavar="S",
              help="Wait this long before a restart; doubles while the worker keeps dying within 2 s"
                   " without settling a task.")
@click.option("--max-restarts", type=int, default=DEFAULT_MAX_RESTARTS, show_default=True, metavar="N",
              help="Give up (exit 1) after N restarts within --window of a worker that settles no task.")
@click.option("--window", type=FINITE_FLOAT, default=DEFAULT_WINDOW, show_default=True, metavar="S",
              help="The period over which restarts are counted.")
@click.option("--watchdog", type=FINITE_FLOAT, default=None, metavar="S",
              help="Kill and restart a worker that sends no WATCHDOG=1 heartbeat for S seconds once it is"
                   " ready.")
@click.option("--start-timeout", type=FINITE_FLOAT, default=DEFAULT_START_TIMEOUT, show_default=True, metavar="S",
              help="Kill and restart an `onward run` worker not ready (READY=1) S seconds after its start"
                   " (0: no limit).")
@click.option("--stop-timeout", type=FINITE_FLOAT, default=None, metavar="S",
              help="Kill a worker still running S seconds after a stop was passed on to it (0: no limit)"
                   " [default: the worker's --grace + 10].")
@click.option("--db", "db", default=None, metavar="URL", type=NOT_EMPTY,
              help="Store to record restarts in [default: the worker's --db, $ONWARD_DB, .onward/onward.db].")
@click.option("--job", "job", default=None, metavar="NAME", type=JobName(),
              help="The job: passed on to every worker started (as ONWARD_JOB), and where restarts are"
                   " recorded [default: the worker's --job, $ONWARD_JOB, default].")
@_COMMAND
@click.pass_context
def supervise_command(ctx: click.Context, restart_delay: float, max_restarts: int, window: float,
                      watchdog: float | None, start_timeout: float, stop_timeout: float | None, db: str | None,
                      job: str | None, command: tuple[str, ...]) -> None:
    """Run CMD (usually `onward run ...`) and keep it running: restart it when it crashes or hangs.

    \b
    Example:
      onward supervise --watchdog 10 -- onward run --tasks urls.txt -- curl -fsS {task}

    Exit 0 or 3 from the worker (work finished) and 2 (usage error) end the supervisor with the same
    status, giving up on a crash loop with 1; SIGTERM and SIGINT (SIGHUP as SIGTERM) are passed on to the
    worker, which then is not restarted, and killed if it has not exited within --stop-timeout.
    """
    supervisor = Supervisor(list(command), restart_delay=restart_delay, max_restarts=max_restarts,
                            window=window, watchdog=watchdog, store_url=db, job=job,
                            start_timeout=start_timeout, stop_timeout=stop_timeout)
    ctx.exit(supervisor.run())


@click.group("service")
def service_group() -> None:
    """Run a worker as a systemd service (on machines where systemd is PID 1)."""


@service_group.command("install", context_settings={"allow_interspersed_args": False})
@click.option("--name", required=True, help="The service is NAME.service.")
@click.option("--user", default=None, help="Run the worker as this user [default: root].")
@click.option("--workdir", default=None,
              help="Working directory; relative paths in CMD are taken from here [default: the current one].")
@click.option("--env", "env", multiple=True, metavar="K=V", help="An environment variable (repeatable).")
@click.option("--watchdog", type=FINITE_FLOAT, default=systemd.DEFAULT_WATCHDOG, show_default=True, metavar="S",
              help="WatchdogSec: systemd kills and restarts a worker silent for S seconds (0: no watchdog).")
@click.option("--start-timeout", type=FINITE_FLOAT, default=DEFAULT_START_TIMEOUT, show_default=True, metavar="S",
              help="TimeoutStartSec: systemd kills and restarts a worker not ready (READY=1) S seconds after its"
                   " start (0: no limit).")
@click.option("--job", "job", default=None, metavar="NAME", type=JobName(),
              help="The job the worker works on (ONWARD_JOB in the unit) [default: the command's --job,"
                   " $ONWARD_JOB, default].")
@click.option("--dry-run", is_flag=True, help="Print the unit and change nothing.")
@_COMMAND
def install_command(name: str, user: str | None, workdir: str | None, env: tuple[str, ...],
                    watchdog: float, start_timeout: float, job: str | None, dry_run: bool,
                    command: tuple[str, ...]) -> None:
    """Write /etc/systemd/system/NAME.service for CMD, then enable and start it. Secrets (a password in
    the store URL, --env values named like PASSWORD or TOKEN) go to /etc/onward/NAME.env, mode 0600.

    \b
    Example:
      onward service install --name crawl -- onward run --tasks urls.txt -- fetch {task}
    """
    if dry_run:
        unit = systemd.render_unit(name, command, user=user, workdir=workdir, env=env, watchdog=watchdog, job=job,
                                   start_timeout=start_timeout)
        systemd.check_startable(unit)  # as the install would: a dry run that passes is one the install takes
        click.echo(unit.dry_run_text(), nl=False)
        return
    path = systemd.install(name, command, user=user, workdir=workdir, env=env, watchdog=watchdog, job=job,
                           start_timeout=start_timeout)
    click.echo(f"installed {path}; {systemd.unit_name(name)} enabled and started")


@service_group.command("uninstall")
@click.argument("name")
def uninstall_command(name: str) -> None:
    """Stop and disable NAME.service and remove its unit file."""
    click.echo(f"removed {systemd.uninstall(name)}")


@service_group.command("status")
@click.argument("name")
def status_command(name: str) -> None:
    """What systemd says about NAME.service: state, main pid, restarts, the job's progress."""
    status = systemd.service_status(name)
    click.echo(f"{status.unit}: {status.active_state} ({status.sub_state})")
    click.echo(f"main pid: {status.main_pid or '-'}")
    click.echo(f"restarts: {status.restarts}")
    if status.result and status.result != "success":
        click.echo(f"result: {status.result}")
    click.echo(f"progress: {status.status_text or '-'}")
