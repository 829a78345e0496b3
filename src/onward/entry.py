"""The ``onward`` console script. ``onward status [--db URL] [--job NAME] [--json]`` on a SQLite store that
is plainly fine is answered by ``status.print_plain_status``, without loading click, rich or the store's
classes (a start-up near that of Python with sqlite3); every other command line, and every case that one
declines, goes to the CLI (``onward.cli``), unchanged.

A worker that ``onward supervise`` restarts is started ahead of the restart, behind a start gate
(``onward.gate``): it loads its code, then waits for the supervisor's go before it does anything else, so
a restart waits for the delay, not for the interpreter's start-up."""

from __future__ import annotations

import os
import sys


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["status"]:
        options = plain_status_options(args[1:])
        if options is not None:
            try:
                from .status import print_plain_status

                if print_plain_status(*options):
                    sys.exit(0)
            except KeyboardInterrupt:  # as the CLI says it (cli.entry)
                sys.stderr.write("onward: aborted\n")
                sys.exit(130)
    if args[:1] == ["run"]:
        from .gate import START_GATE

        gate = os.environ.pop(START_GATE, None)  # popped: never passed on to the tasks
        if gate is not None:
            wait_at_gate(gate)
    from .cli import cli_main

    cli_main()


def plain_status_options(args: list[str]) -> tuple[str | None, str | None, bool] | None:
    """``--db``, ``--job`` and ``--json`` of ``onward status``, when they are all it was given, each at most
    once, and read by click the same way for sure: ``--db URL`` or ``--db=URL`` with a value that is not
    empty, does not start with "-" and holds no "://" (a URL, whose password the CLI hides from ``ps``);
    None for anything else (``--watch``, ``--help``, a typo), which the CLI then reads and answers."""
    db: str | None = None
    job: str | None = None
    as_json = False
    seen: set[str] = set()
    rest = iter(args)
    for arg in rest:
        name, equals, value = arg.partition("=")
        if name in seen:
            return None
        seen.add(name)
        if arg == "--json":
            as_json = True
            continue
        if name not in ("--db", "--job"):
            return None
        if not equals:
            value = next(rest, "")
        if not value or value.startswith("-") or "://" in value:
            return None
        if name == "--db":
            db = value
        else:
            job = value
    return db, job, as_json


def wait_at_gate(value: str) -> None:
    """Load what ``onward run`` needs, then wait at the gate described by ``value`` (``onward.gate``):
    return on the go, exit quietly if the supervisor closes it without one (it is stopping, not
    restarting). A value that does not describe a gate of our parent's is ignored."""
    fd_text, _, rest = value.partition(",")
    parent, _, backend = rest.partition(",")
    if not all(text.isascii() and text.isdigit() and len(text) <= 10 for text in (fd_text, parent)):
        return
    fd = int(fd_text)
    if int(parent) != os.getppid() or fd < 3:
        return
    import stat
    import time

    loading_since = time.time()

    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return
    except (OSError, OverflowError):  # not open; beyond any descriptor
        return
    # Before the wait, which may be long (a backoff): a password on the command line is blanked out as
    # soon as a worker starts, gated or not.
    from .cli import hide_passwords_from_ps

    hide_passwords_from_ps(sys.argv)
    from . import commands  # noqa: F401 - loaded now (with the runner, worker and command handler it imports)
    from .errors import StoreError
    from .store import load_backend

    try:
        load_backend(postgres=backend == "postgres")
    except StoreError:
        pass  # psycopg missing: the run itself says so, in its own words, after the gate
    from .gate import GO
    from .spawn import spawn_mode
    from .spawner import launch_early

    if spawn_mode() == "spawner":
        launch_early()  # this thread (the main one) is the one that will start the commands
    try:
        go = os.read(fd, len(GO))
    finally:
        os.close(fd)
    if go != GO:
        sys.exit(0)
    if code_changed_since(loading_since):
        # The code was loaded before the restart, maybe long before (a standby waits for as long as its
        # worker lives): what was installed since (an upgrade of onward) runs instead, as in a worker
        # started now. The same process, started again: its gate is behind it (START_GATE was popped); a
        # spawner it started ends when it finds its end of their socket closed by the exec.
        os.execv(sys.executable, sys.orig_argv)


# What a worker runs that an upgrade replaces: onward, its store driver, its command line.
UPGRADABLE = ("onward", "psycopg", "psycopg_binary", "click")


def code_changed_since(when: float) -> bool:
    """Whether a file of a loaded module of ``UPGRADABLE`` was written, replaced or removed since ``when``
    (the wall clock; the change time, which no tool can set back). A few hundred ``stat`` calls."""
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path and name.partition(".")[0] in UPGRADABLE:
            try:
                if os.stat(path).st_ctime >= when:
                    return True
            except OSError:
                return True
    return False
