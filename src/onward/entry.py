"""The ``onward`` console script. ``onward status [--db URL] [--job NAME] [--json]`` on a SQLite store that
is plainly fine is answered by ``status.print_plain_status``, without loading click, rich or the store's
classes (a start-up near that of Python with sqlite3); every other command line, and every case that one
declines, goes to the CLI (``onward.cli``), unchanged.

A worker that ``onward supervise`` restarts is started ahead of the restart, behind a start gate
(``onward.gate``): it loads its code, then waits for the supervisor's go before it does anything else, so
a restart waits for the delay, not for the interpreter's start-up. Woken when its restart begins, a worker
on PostgreSQL opens its store meanwhile (connects, checks the schema and its job: reads only), so the go
finds it connected."""

from __future__ import annotations

import os
import sys


def main() -> None:
    fill_closed_standard_streams()
    args = sys.argv[1:]
    if args[:1] == ["status"]:
        options = plain_status_options(args[1:])
        if options is not None:
            # No cyclic garbage collection while the plain status runs. It makes a few hundred objects (its
            # modules' functions and constants, one report) and exits; on top of the interpreter's own, they
            # would start a collection of generation 1, which walks every object that has lived through a
            # young collection since start-up (0.6 to 1.5 ms here, up to a twentieth of the whole command)
            # and frees a few dozen. At exit the interpreter collects as it always does. Back on if the full
            # command takes over: it may run for long (--watch).
            import gc

            gc.disable()
            try:
                from .status import print_plain_status

                if print_plain_status(*options):
                    sys.exit(0)
            except KeyboardInterrupt:  # as the CLI says it (cli.entry)
                sys.stderr.write("onward: aborted\n")
                sys.exit(130)
            except OSError as e:  # as the CLI says it (cli._run_cli): stdout on a full disk, no descriptor left
                from .pipes import unavailable_line

                line = unavailable_line(e, "cannot write the output")  # what it reads is checked inside
                if line is None:
                    raise
                sys.stderr.write(f"onward: error: {line}\n")
                sys.exit(75)
            except MemoryError as e:  # as the CLI says it (cli._run_cli)
                from .pipes import out_of_memory_line

                sys.stderr.write(f"onward: error: {out_of_memory_line(e)}\n")
                sys.exit(75)
            gc.enable()
    if args[:1] == ["run"]:
        from .gate import START_GATE

        gate = os.environ.pop(START_GATE, None)  # popped: never passed on to the tasks
        if gate is not None:
            wait_at_gate(gate)
        # A stop while the CLI loads and reads its options (a few tenths of a second, before `onward run` takes
        # the signals over itself, and puts this back when it is done with them) ends the run there, quietly,
        # exit 0, as a stop before the first task does: it was a KeyboardInterrupt traceback from inside
        # click's import, or "aborted" with exit 130.
        import signal

        from .stopsignals import stop_signals

        for sig in stop_signals():  # not SIGHUP under nohup: it stays ignored (onward.stopsignals)
            signal.signal(sig, _stopped_while_loading)
    from .cli import cli_main

    cli_main()


def _stopped_while_loading(signum: int, frame: object) -> None:
    raise SystemExit(0)


def fill_closed_standard_streams() -> None:
    """Give /dev/null to stdin, stdout or stderr if the command was started with it closed (``onward run ... >&-``),
    as daemons do: Python then leaves ``sys.stdout`` (or ``sys.stderr``) None, and the first line printed
    raised AttributeError, a traceback and exit 1 after a finished job, or before the worker started when it
    was stderr; and the next file opened would take that number, where a stray write meant for the terminal
    would land. Output to a closed stream is dropped, as the user asked; ``sys.stdin`` is left None (see
    ``tasksfile.check_tasks_file``)."""
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        try:
            os.fstat(fd)
            continue  # open: the usual case, one system call
        except OSError:
            pass
        opened = os.open(os.devnull, os.O_RDWR)  # the lowest free number: this one, as the lower ones are open
        if opened != fd:
            os.dup2(opened, fd)
            os.close(opened)
        # sys.stdin stays None: `--tasks -` with stdin closed is refused (nothing to read), not an empty list.
        if fd > 0 and getattr(sys, name) is None:
            setattr(sys, name, open(fd, "w", buffering=1, closefd=False,
                                    errors="backslashreplace" if fd == 2 else None))


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
    parent, _, rest = rest.partition(",")
    backend, _, wake_text = rest.partition(",")
    if not (_number(fd_text) and _number(parent)) or int(parent) != os.getppid():
        return
    import time

    loading_since = time.time()
    fd = int(fd_text)
    if not _a_pipe(fd):
        return
    wake = int(wake_text) if _number(wake_text) and _a_pipe(int(wake_text)) else None
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
        if wake is not None:
            _wait_for_wakeup(fd, wake, backend)
        go = os.read(fd, len(GO))
    finally:
        os.close(fd)
        if wake is not None:
            os.close(wake)
    if go != GO:
        sys.exit(0)
    if code_changed_since(loading_since):
        # The code was loaded before the restart, maybe long before (a standby waits for as long as its
        # worker lives): what was installed since (an upgrade of onward) runs instead, as in a worker
        # started now. The same process, started again: its gate is behind it (START_GATE was popped); a
        # spawner it started ends when it finds its end of their socket closed by the exec.
        os.execv(sys.executable, sys.orig_argv)


def _number(text: str) -> bool:
    return text.isascii() and text.isdigit() and len(text) <= 10


def _a_pipe(fd: int) -> bool:
    """Whether ``fd`` is open on a pipe (and not stdin, stdout or stderr)."""
    import stat

    try:
        return fd >= 3 and stat.S_ISFIFO(os.fstat(fd).st_mode)
    except (OSError, OverflowError):  # not open; beyond any descriptor
        return False


def _wait_for_wakeup(gate: int, wake: int, backend: str) -> None:
    """Return once the supervisor said the restart has begun (then, on PostgreSQL, with the store opened
    ahead), or once anything came on the gate itself (the go, or its end)."""
    import select

    from .gate import WAKEUP

    readable, _, _ = select.select([gate, wake], [], [])
    if wake in readable and os.read(wake, len(WAKEUP)) == WAKEUP and backend == "postgres":
        _open_store_ahead()


def _open_store_ahead() -> None:
    """Open the store this run is about to open, between the wake-up and the go: connecting to the server
    (and the connection that LISTENs) and checking its schema and job then take none of the restart's time
    (on SQLite, opening a file, there is nothing worth it). Reads only: nothing is written before the go.
    The store is found from the command line as the supervisor finds it; the run takes it only if it is the
    one it opens (``onward.store.open_ahead``). A failure is left for the run to meet, and report, itself."""
    from .errors import OnwardError
    from .store import open_ahead
    from .supervise import job_for, store_url_for

    command = ["onward", *sys.argv[1:]]
    try:
        open_ahead(store_url_for(command, os.environ), job_for(command, os.environ))
    except OnwardError:
        pass


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
