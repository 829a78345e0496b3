"""Native systemd: a unit file for ``onward run`` such as an admin would write by hand, and installing,
removing and querying it with ``systemctl`` (never through a shell).

The unit makes systemd do what ``onward supervise`` does elsewhere (see ``onward.supervise``):
``Type=notify`` with ``NotifyAccess=main`` (the worker sends ``READY=1``, ``STATUS=``, ``WATCHDOG=1`` and
``STOPPING=1`` from its main loop), ``Restart=on-failure`` after a short ``RestartSec``, ``WatchdogSec=`` for
a wedged worker (on by default: ``DEFAULT_WATCHDOG``), and a start limit equal to the supervisor's
crash-loop limit. systemd 252 has no exponential restart backoff (``RestartSteps=`` came in 254), so the
start limit is what stops a crash loop; unlike ``onward supervise`` it counts every start, progress or not.

Secrets. The unit file is world-readable (0644) and ``--dry-run`` prints it, so it holds no secret. A
secret goes to the unit's ``EnvironmentFile=`` (``ENV_DIR/NAME.env``, 0600 in a 0700 folder, read by
systemd as root before it starts the worker): a store URL with a password given as ``onward run --db``
(it becomes ``ONWARD_DB``, so it is never in the worker's command line either), any other command word
holding a URL with a password (``${ONWARD_SECRET_N}`` in ``ExecStart``, which systemd expands to the same
single word), and every ``--env`` (or carried ``ONWARD_DB``) whose value holds a URL with a password or
whose name says it is one (``SECRET_NAME``: PGPASSWORD, API_TOKEN, APIKEY ...). ``--dry-run`` shows them as ``***``.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from onward.errors import OnwardError, UsageError
from onward.folders import create_private_folders
from onward.redact import redact_url
from onward.supervise import (
    DEFAULT_MAX_RESTARTS,
    DEFAULT_RESTART_DELAY,
    DEFAULT_START_TIMEOUT,
    DEFAULT_WINDOW,
    MIN_WATCHDOG,
    STOP_MARGIN,
    find_run_option,
    onward_run_span,
    run_grace,
)

UNIT_DIR = "/etc/systemd/system"
ENV_DIR = "/etc/onward"  # the units' EnvironmentFiles, holding their secrets
DEFAULT_WATCHDOG = 30.0  # WatchdogSec unless --watchdog says otherwise (0: none)
# The unit's start limit: more than START_LIMIT_BURST starts within START_LIMIT_INTERVAL seconds leave it
# failed for good, as a crash loop that `onward supervise` gives up on.
START_LIMIT_INTERVAL = DEFAULT_WINDOW
START_LIMIT_BURST = DEFAULT_MAX_RESTARTS + 1
# A worker that exits 75 (store or output unavailable) lives at least this long (seconds): see
# space_unavailable_exit. More than INTERVAL / BURST, so that BURST + 1 such starts span more than INTERVAL.
UNAVAILABLE_SPACING = START_LIMIT_INTERVAL / (START_LIMIT_BURST - 1)

# Options of ``onward run`` naming files, made absolute in ExecStart (the service runs elsewhere).
PATH_OPTIONS = ("--db", "--tasks", "--out", "--keep-awake")

# The first line of every unit onward writes: how install and uninstall tell its units from an admin's.
WRITTEN_BY = "# Written by `onward service install`."
# A unit name as systemd accepts it (unit_name_is_valid), without templates: "@" needs an instance.
_UNIT_NAME = re.compile(r"[A-Za-z0-9:_.\\-]+")
_USER_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\$?")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Words that need no quotes in ExecStart (after doubling % and $).
_PLAIN_WORD = re.compile(r"[A-Za-z0-9_@%+=:,./{}-]+")
_ENV_FILE_SPECIAL = re.compile(r'["\\`$]')
# An --env variable whose name says that its value is a secret: a name part that ends with one of these
# words, so that PGPASSWORD (libpq's own, which onward's PostgreSQL store reads), MYSQL_PWD and APIKEY are
# secrets as well as API_TOKEN. A harmless name taken for a secret only moves to the private file.
SECRET_NAME = re.compile(r"(PASSWORD|PASSWD|PASS|PWD|PASSPHRASE|SECRET|TOKEN|KEY|CREDENTIALS?|AUTH)(_|$)",
                         re.IGNORECASE)


def unit_name(name: str) -> str:
    """``NAME.service`` for a valid NAME (given with or without the suffix); UsageError otherwise."""
    base = name[: -len(".service")] if name.endswith(".service") else name
    if not base or not _UNIT_NAME.fullmatch(base) or len(base) > 255 - len(".service") or base[0] == ".":
        raise UsageError(f"not a valid service name: {name!r} (use letters, digits and : _ . - \\)")
    return base + ".service"


def environment_file_path(service: str, env_dir: str = ENV_DIR) -> str:
    """Where the secrets of ``NAME.service`` go: ``ENV_DIR/NAME.env``."""
    return os.path.join(env_dir, service[: -len(".service")] + ".env")


def _escape(text: str, what: str, dollar: bool) -> str:
    """Escape for a double-quoted systemd word: backslash and quote get C escapes, ``%`` (specifiers)
    becomes ``%%``, ``$`` becomes ``$$`` where variables expand (ExecStart). Control characters are refused:
    a command line may not contain them, and an admin would not want them in a unit."""
    if _has_control(text):
        raise UsageError(f"{what} contains a control character: {redact_url(text)!r}")
    text = text.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
    return text.replace("$", "$$") if dollar else text


def quote_exec_word(word: str) -> str:
    """One ExecStart word, quoted only when needed (systemd.service(5) "Command lines",
    systemd.syntax(7) "Quoting"). Quoted words keep ``;`` and spaces literal."""
    if _PLAIN_WORD.fullmatch(word):
        return word.replace("%", "%%")
    return '"' + _escape(word, "the command", dollar=True) + '"'


def _has_control(text: str) -> bool:
    return any(ord(c) < 32 or ord(c) == 127 for c in text)


def _plain_path(path: str) -> str:
    """A path for a setting that takes it unquoted (WorkingDirectory=): only specifiers are expanded."""
    if _has_control(path) or path != path.strip():
        raise UsageError(f"the working directory cannot be written in a unit: {path!r}")
    return path.replace("%", "%%")


def _timespan(seconds: float) -> str:
    """A systemd time span: ``5s``, ``250ms``."""
    if seconds == int(seconds):
        return f"{int(seconds)}s"
    return f"{math.ceil(seconds * 1000)}ms"


def resolve_command(command: Sequence[str], base: str) -> list[str]:
    """The command with absolute paths, as ExecStart needs them: the executable found on PATH (or made
    absolute), the file options of ``onward run`` (``--db --tasks --out --keep-awake``) and the task
    command's own executable. Relative paths are taken relative to ``base`` (the working directory of the
    service). A URL given as ``--db`` (``scheme://...``) and ``--tasks -`` are left alone."""
    if not command:
        raise UsageError("service install: no command given (put it after --)")
    words = list(command)
    words[0] = _executable(words[0], base)
    for option in PATH_OPTIONS:
        found = find_run_option(words, option)
        if found is None:
            continue
        index, prefix, value = found
        if value != "-" and "://" not in value:
            words[index] = prefix + os.path.normpath(os.path.join(base, os.path.expanduser(value)))
    span = onward_run_span(words)
    if span is not None and span[1] + 1 < len(words):
        # The task command after "--" would be looked up on systemd's PATH, which is not the installing
        # user's (no virtualenv, no ~/.local/bin).
        words[span[1] + 1] = _executable(words[span[1] + 1], base, required=False)
    return words


def _executable(word: str, base: str, required: bool = True) -> str:
    if "/" in word:
        return os.path.normpath(os.path.join(base, os.path.expanduser(word)))
    found = shutil.which(word)
    if found:
        return os.path.abspath(found)
    if required:
        raise UsageError(f"{word}: not found on PATH; give its absolute path")
    return word


@dataclass(frozen=True)
class Unit:
    """A rendered service: ``text`` is the unit file, which holds no secret; ``secrets`` are the variables of
    its EnvironmentFile ``environment_file`` (none: the unit names no such file and none is written)."""

    service: str  # NAME.service
    text: str
    environment_file: str
    secrets: dict[str, str]
    workdir: str  # WorkingDirectory=, absolute
    executable: str  # ExecStart's program, absolute
    user: str | None  # User=, None for root

    def environment_file_text(self) -> str:
        """The EnvironmentFile: one ``KEY="VALUE"`` line each, quoted by systemd's rules for such files (a
        backslash before each of ``" \\ ` $``, the only characters it unescapes inside double quotes)."""
        return "".join(f'{key}="{_env_file_quote(value)}"\n' for key, value in self.secrets.items())

    def dry_run_text(self) -> str:
        """The unit, then what the EnvironmentFile would hold, with every secret shown as ``***``."""
        if not self.secrets:
            return self.text
        shown = "".join(f"# {key}={_masked(value)}\n" for key, value in self.secrets.items())
        return f"{self.text}\n# {self.environment_file} (mode 0600):\n{shown}"


def _env_file_quote(value: str) -> str:
    return _ENV_FILE_SPECIAL.sub(lambda m: "\\" + m[0], value)


def _masked(value: str) -> str:
    redacted = redact_url(value)
    return redacted if redacted != value else "***"


def _is_secret(name: str, value: str) -> bool:
    return bool(SECRET_NAME.search(name)) or redact_url(value) != value


def render_unit(name: str, command: Sequence[str], user: str | None = None, workdir: str | None = None,
                env: Iterable[str] = (), watchdog: float = DEFAULT_WATCHDOG, grace: float | None = None,
                environ: Mapping[str, str] | None = None, env_dir: str = ENV_DIR, job: str | None = None,
                start_timeout: float = DEFAULT_START_TIMEOUT) -> Unit:
    """``NAME.service`` running ``command`` (usually ``onward run ...``), and its secrets (see the module
    docstring).

    ``workdir`` defaults to the current directory; relative paths in the command are resolved against it
    (see ``resolve_command``). ``env`` holds ``K=V`` strings. ``watchdog`` is ``WatchdogSec`` in seconds, 0
    for none, else at least ``MIN_WATCHDOG``. ``start_timeout`` is ``TimeoutStartSec`` in seconds (how long
    the worker may take to say ``READY=1``), 0 for none, else at least ``UNAVAILABLE_SPACING``. ``grace`` is the worker's ``--grace``; when None it is read from the command, else onward's
    default of 10 s. ``environ`` (default ``os.environ``) gives an exported ``ONWARD_DB``, carried into the
    unit when neither the command's ``--db`` nor ``env`` sets the store; likewise ``ONWARD_JOB``. ``job``
    (``--job``) is set as ``ONWARD_JOB`` in the unit, over any ``env`` one (a ``--job`` in the command still
    wins in the worker, as on a command line). Nothing is written or started: the function only reads the
    file system to find executables.
    """
    service = unit_name(name)
    environ = os.environ if environ is None else environ
    workdir = os.path.abspath(os.path.expanduser(workdir or os.getcwd()))
    words = resolve_command(command, workdir)
    if grace is None:
        grace = run_grace(words)
    if not (grace >= 0 and math.isfinite(grace)):
        raise UsageError(f"grace must be 0 or more seconds, not {grace}")
    if not ((watchdog == 0 or watchdog >= MIN_WATCHDOG) and math.isfinite(watchdog)):
        # systemd takes microseconds, but the worker cannot heartbeat that fast (see MIN_WATCHDOG).
        raise UsageError(f"--watchdog must be 0 (none) or at least {MIN_WATCHDOG:g} seconds (the worker's loop"
                         f" cannot heartbeat faster), not {watchdog:g}")
    if not ((start_timeout == 0 or start_timeout >= UNAVAILABLE_SPACING) and math.isfinite(start_timeout)):
        # A worker whose store is down waits until it has lived UNAVAILABLE_SPACING before it exits 75, not
        # yet ready: a shorter start timeout would cut that wait, and the start limit would fail the unit.
        raise UsageError(f"--start-timeout must be 0 (none) or at least {UNAVAILABLE_SPACING:g} seconds (the"
                         f" spacing of restarts while the store is unavailable), not {start_timeout:g}")
    if user is not None and not _USER_NAME.fullmatch(user):
        raise UsageError(f"not a valid user name: {user!r}")
    variables: dict[str, str] = {}
    for item in env:
        key, sep, value = item.partition("=")
        if not sep or not _ENV_NAME.fullmatch(key):
            raise UsageError(f"--env wants NAME=VALUE with NAME made of letters, digits and _: {item!r}")
        if _has_control(value):  # the value may be a secret: not in the message
            raise UsageError(f"--env {key}: the value contains a control character")
        variables[key] = value
    db = find_run_option(words, "--db")
    if db is not None and redact_url(db[2]) != db[2]:
        # The store's password: passed as ONWARD_DB (a secret, below), out of the unit and of the worker's
        # command line. It wins over an --env ONWARD_DB, as --db does on the command line.
        index, prefix, value = db
        del words[index if prefix else index - 1: index + 1]
        variables["ONWARD_DB"] = value
    elif db is None and "ONWARD_DB" not in variables and environ.get("ONWARD_DB"):
        value = environ["ONWARD_DB"]
        # A relative path is taken from the working directory, as --db's is (resolve_command).
        variables["ONWARD_DB"] = value if "://" in value else os.path.normpath(
            os.path.join(workdir, os.path.expanduser(value)))
    if job is not None:
        variables["ONWARD_JOB"] = job
    elif find_run_option(words, "--job") is None and "ONWARD_JOB" not in variables and environ.get("ONWARD_JOB"):
        from .store import job_name

        variables["ONWARD_JOB"] = job_name(environ["ONWARD_JOB"])  # a bad one refused now, not at each start
    secrets: dict[str, str] = {}
    for i, word in enumerate(words):
        if redact_url(word) != word:
            _escape(word, "the command", dollar=True)  # refuses control characters, as for any word
            key = f"ONWARD_SECRET_{len(secrets) + 1}"
            secrets[key] = word
            words[i] = "${" + key + "}"  # systemd puts the value back as this one word
    environment = []
    for key, value in variables.items():
        if _is_secret(key, value):
            secrets[key] = value
        else:
            environment.append(f'Environment="{key}={_escape(value, "--env " + key, dollar=False)}"')
    environment_file = environment_file_path(service, env_dir)

    lines = [
        WRITTEN_BY + " After editing: systemctl daemon-reload",
        "[Unit]",
        f"Description=onward worker {service[: -len('.service')]}",
        "After=network-online.target",
        "Wants=network-online.target",
        "# Give up (state failed) after as many restarts in as short a time as `onward supervise` would.",
        f"StartLimitIntervalSec={_timespan(START_LIMIT_INTERVAL)}",
        f"StartLimitBurst={START_LIMIT_BURST}",
        "",
        "[Service]",
        "# onward run speaks sd_notify: READY=1 once its store is open, STATUS=, WATCHDOG=1 from its main loop.",
        "Type=notify",
        "NotifyAccess=main",
        "# A worker not ready in time (its store does not open) is killed and restarted; as `onward supervise`.",
        f"TimeoutStartSec={_timespan(start_timeout) if start_timeout else 'infinity'}",
        "ExecStart=" + " ".join(word if word.startswith("${ONWARD_SECRET_") else quote_exec_word(word)
                                for word in words),
        f"WorkingDirectory={_plain_path(workdir)}",
    ]
    if user is not None:
        lines.append(f"User={user}")
    lines += environment
    if secrets:
        lines += ["# Secrets (the store's password, tokens): a file only root can read.",
                  f"EnvironmentFile={_plain_path(environment_file)}"]
    lines += [
        "Restart=on-failure",
        f"RestartSec={_timespan(DEFAULT_RESTART_DELAY)}",
    ]
    if watchdog:
        lines.append(f"WatchdogSec={_timespan(watchdog)}")
    lines += [
        "# SIGTERM goes to the worker alone: it stops claiming and lets running tasks finish within its",
        "# --grace; whatever is left of the unit is SIGKILLed afterwards (control-group would SIGTERM the",
        "# tasks at once and cut them short).",
        "KillSignal=SIGTERM",
        "KillMode=mixed",
        "# The unit's cgroup subtree is the worker's to manage: each attempt of a command runs in a cgroup",
        "# of its own there and is ended with cgroup.kill, also when the worker runs as an unprivileged User=.",
        "Delegate=yes",
        f"TimeoutStopSec={_timespan(grace + STOP_MARGIN)}",
        "# 2: a usage or configuration error, 3: the job finished with some tasks failed; a restart would",
        "# only repeat either. 3 is a success; 2 leaves the unit failed, so `systemctl --failed` shows it.",
        "SuccessExitStatus=3",
        "RestartPreventExitStatus=2 3",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ]
    return Unit(service=service, text="\n".join(lines), environment_file=environment_file, secrets=secrets,
                workdir=workdir, executable=words[0], user=user)


def space_unavailable_exit(reset_signals: bool = True) -> None:
    """Called by the main process of a systemd service about to exit 75: wait until it has lived
    ``UNAVAILABLE_SPACING`` seconds. systemd restarts status 75 (Restart=on-failure) after RestartSec=100ms,
    but counts every start toward the start limit: a worker that finds its database server down exits in
    a fraction of a second, and without this wait the unit was failed for good within 3 s of an outage
    (6 starts), and stayed failed when the server came back. Spaced so, systemd restarts it for as long as
    the outage lasts, and it resumes within this spacing of the server's return; a crash loop (any other
    status) still hits the limit. ``onward supervise`` needs none of this: it backs off itself, and never
    counts these restarts.

    A stop (SIGTERM, SIGINT) ends the wait at once (with ``reset_signals``, whatever handlers were set); a
    watchdog, if one is armed already, is kept fed."""
    import signal
    import time

    from onward.notify import Notifier
    from onward.proc import pid_start_time

    started = pid_start_time(os.getpid())
    if started is None:
        return
    lived = time.clock_gettime(time.CLOCK_BOOTTIME) - started / os.sysconf("SC_CLK_TCK")
    until = time.monotonic() + UNAVAILABLE_SPACING - lived
    if until <= time.monotonic():
        return
    if reset_signals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
    notifier = Notifier.from_env()
    notifier.status(f"store or output unavailable; exiting in {until - time.monotonic():.0f} s, to be restarted")
    try:
        while (left := until - time.monotonic()) > 0:
            notifier.watchdog()
            time.sleep(min(left, notifier.watchdog_every or left))
    finally:
        notifier.close()


# --- systemctl -------------------------------------------------------------------------------------------
def _require_systemd() -> None:
    # sd_booted(3): systemd is the running init exactly when this directory exists.
    if not os.path.isdir("/run/systemd/system"):
        raise UsageError("systemd is not running on this machine; use `onward supervise` instead")
    if shutil.which("systemctl") is None:
        raise UsageError("systemctl not found")


def _systemctl(*args: str, unit: str | None = None) -> str:
    """``systemctl ARGS [-- UNIT]``: the unit after ``--``, so that a name starting with "-" (which systemd
    accepts, and ``unit_name`` too) is not taken for an option."""
    if unit is not None:
        args = (*args, "--", unit)
    done = subprocess.run(["systemctl", *args], capture_output=True, text=True)
    if done.returncode != 0:
        message = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise OnwardError(f"systemctl {' '.join(args)}: {message}")
    return done.stdout


def _write_atomically(path: str, text: str, mode: int) -> None:
    """Write a unique temporary file next to ``path``, fsync it, rename it over ``path``, fsync the folder:
    systemd never reads half a unit, and the unit survives a power cut once this returns."""
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_unit(unit: Unit, unit_dir: str = UNIT_DIR) -> str:
    """Write the unit's EnvironmentFile (0600, in a 0700 folder) and then the unit file (0644), each
    atomically: the unit never names a file that is not there yet. A unit without secrets removes the file
    an earlier install may have left. Returns the unit file's path."""
    if unit.secrets:
        create_private_folders(os.path.dirname(unit.environment_file))
        _write_atomically(unit.environment_file, unit.environment_file_text(), 0o600)
    path = os.path.join(unit_dir, unit.service)
    _write_atomically(path, unit.text, 0o644)
    if not unit.secrets:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(unit.environment_file)
    return path


def install(name: str, command: Sequence[str], user: str | None = None, workdir: str | None = None,
            env: Iterable[str] = (), watchdog: float = DEFAULT_WATCHDOG, grace: float | None = None,
            unit_dir: str = UNIT_DIR, env_dir: str = ENV_DIR, job: str | None = None,
            start_timeout: float = DEFAULT_START_TIMEOUT) -> str:
    """Write the unit and its secrets (``write_unit``), reload systemd, enable and (re)start the service.
    Returns the unit file's path."""
    unit = render_unit(name, command, user=user, workdir=workdir, env=env, watchdog=watchdog, grace=grace,
                       env_dir=env_dir, job=job, start_timeout=start_timeout)
    check_startable(unit)
    _require_systemd()
    _require_writable(unit_dir)
    service = unit.service
    _refuse_foreign_unit(service, os.path.join(unit_dir, service))
    try:
        path = write_unit(unit, unit_dir)
    except PermissionError as exc:  # /etc/onward, say, where the unit folder was writable
        raise UsageError(f"cannot write {exc.filename}: {exc.strerror} (install services as root)") from None
    _systemctl("daemon-reload")
    _systemctl("enable", unit=service)
    # restart, not start: a reinstall over a running service must take the new unit into use
    _systemctl("restart", unit=service)
    return path


def _require_writable(unit_dir: str) -> None:
    """A user who may not write the unit folder (not root) is told so in one line, before anything is done,
    rather than by a traceback half-way."""
    if not os.access(unit_dir, os.W_OK):
        raise UsageError(f"cannot write to {unit_dir}: install and uninstall services as root")


def check_startable(unit: Unit) -> None:
    """Refuse, before anything is written, what would make every start of the unit fail at once (systemd's
    CHDIR, EXEC or USER failures): the unit would be left installed and enabled, failed after its start
    limit, for input that can be checked here. The command runs on this machine."""
    if not os.path.isdir(unit.workdir):
        raise UsageError(f"the working directory {unit.workdir} does not exist (give --workdir)")
    if not (os.path.isfile(unit.executable) and os.access(unit.executable, os.X_OK)):
        raise UsageError(f"{unit.executable}: not an executable file")
    if unit.user is not None and not unit.user.isdigit():  # a bare uid needs no entry in the user database
        import pwd

        try:
            pwd.getpwnam(unit.user)
        except KeyError:
            raise UsageError(f"no such user: {unit.user}") from None


def _written_by_onward(path: str) -> bool:
    """Whether ``path`` is a unit file that onward wrote: a regular file (not an alias or a mask, which are
    symlinks) starting with ``WRITTEN_BY``."""
    if os.path.islink(path) or not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.readline().startswith(WRITTEN_BY)


def _refuse_foreign_unit(service: str, path: str) -> None:
    """Refuse to install over a unit onward did not write: an admin's file (or alias, or mask) at ``path``
    would be replaced, and a unit of the same name elsewhere (a packaged ``/lib/systemd/system`` one, a
    runtime one) would be overridden by ``path`` and then restarted as the worker: the service it ran is
    stopped."""
    if os.path.lexists(path):
        if not _written_by_onward(path):
            raise UsageError(f"{path} was not written by onward service install; choose another --name,"
                             " or remove it first")
        return
    values = parse_show(_systemctl("show", "-p", "LoadState", "-p", "FragmentPath", unit=service))
    if values.get("LoadState", "not-found") != "not-found" and values.get("FragmentPath") != path:
        where = values.get("FragmentPath") or values["LoadState"]
        raise UsageError(f"{service} is already a unit of this machine ({where}); choose another --name")


def uninstall(name: str, unit_dir: str = UNIT_DIR, env_dir: str = ENV_DIR) -> str:
    """Stop and disable the service, remove its unit file and EnvironmentFile, reload systemd. Returns the
    removed unit file's path. A unit file onward did not write is left alone, and so is its service."""
    service = unit_name(name)
    path = os.path.join(unit_dir, service)
    if not os.path.lexists(path):
        raise UsageError(f"no unit file {path}")
    if not _written_by_onward(path):
        raise UsageError(f"{path} was not written by onward service install; not removing it")
    _require_systemd()
    _require_writable(unit_dir)  # before the service is stopped: its unit file could not be removed
    _systemctl("disable", "--now", unit=service)
    os.unlink(path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(environment_file_path(service, env_dir))
    _systemctl("daemon-reload")
    # Forget a failed state and restart counter of the unit that no longer exists; absent is fine.
    subprocess.run(["systemctl", "reset-failed", "--", service], capture_output=True)
    return path


@dataclass(frozen=True)
class ServiceStatus:
    """What systemd knows about the service. ``status_text`` is the worker's last ``STATUS=`` (its job's
    progress, e.g. ``12/40 done``)."""

    unit: str
    load_state: str
    active_state: str
    sub_state: str
    main_pid: int | None
    restarts: int
    result: str
    status_text: str


def parse_show(output: str) -> dict[str, str]:
    """The ``KEY=VALUE`` lines of ``systemctl show`` as a dict."""
    values = {}
    for line in output.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            values[key] = value
    return values


def service_status(name: str) -> ServiceStatus:
    """ActiveState, SubState, MainPID, NRestarts, Result and StatusText from ``systemctl show``."""
    service = unit_name(name)
    _require_systemd()
    values = parse_show(_systemctl("show", "-p", "LoadState", "-p", "ActiveState", "-p", "SubState", "-p", "MainPID",
                                   "-p", "NRestarts", "-p", "Result", "-p", "StatusText", unit=service))
    if values.get("LoadState") == "not-found":
        raise UsageError(f"no such service: {service}")
    pid = int(values.get("MainPID") or 0)
    return ServiceStatus(
        unit=service,
        load_state=values.get("LoadState", ""),
        active_state=values.get("ActiveState", ""),
        sub_state=values.get("SubState", ""),
        main_pid=pid or None,
        restarts=int(values.get("NRestarts") or 0),
        result=values.get("Result", ""),
        status_text=values.get("StatusText", ""),
    )
