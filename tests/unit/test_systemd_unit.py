"""onward.systemd: generated units pass `systemd-analyze verify` with nothing on stderr (it exits 0 on bad
values, so stderr is the verdict), quoting and escaping, name and input validation, the --dry-run command."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from onward import systemd
from onward.errors import UsageError
from tests.conftest import run_onward

needs_verify = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                  reason="systemd-analyze is not installed")

# The executable in ExecStart must exist for verify: the interpreter running the tests does.
ONWARD = [sys.executable, "-m", "onward.cli"]


def verify(tmp_path: Path, name: str, text: str) -> str:
    """Run systemd-analyze verify on the unit; return its stderr (empty when the unit is clean)."""
    folder = tmp_path / "units"
    folder.mkdir(exist_ok=True)
    path = folder / systemd.unit_name(name)
    path.write_text(text)
    done = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True,
                          env={**os.environ, "SYSTEMD_LOG_COLOR": "0"})
    return done.stderr + (f"[exit status {done.returncode}]" if done.returncode else "")


ODD = "odd dir %n with 'quotes' \"double\" $HOME and \\backslash ; semicolon"

CASES = {
    "minimal": dict(command=ONWARD + ["run", "--", "true"]),
    "everything": dict(command=ONWARD + ["run", "--db", "job.db", "--tasks", "tasks.txt", "--out", "out",
                                         "--concurrency", "4", "--grace", "30", "--", "sh", "-c",
                                         "echo {task} $X; exit 0"],
                       user="root", env=["A=1", "B=two words", "C=%h \"quoted\" \\ $x"], watchdog=5,
                       start_timeout=12.5),
    "odd-paths": dict(command=ONWARD + ["run", f"--db={ODD}/s.db", "--tasks", f"{ODD}/t.txt", "--out",
                                        f"{ODD}/out", "--", "printf", "%s\\n", "{task}", ";"],
                      workdir=f"/tmp/{ODD}", env=[f"P={ODD}"], watchdog=0.25),
    "url-and-stdin": dict(command=ONWARD + ["run", "--db", "postgresql://u@h/db?sslmode=disable", "--tasks",
                                            "-", "--", "/bin/true"]),
    "plain-command": dict(command=["sh", "-c", "exec sleep 100%"], user="root"),
    "secrets": dict(command=ONWARD + ["run", "--db", "postgresql://u:pw@h/db", "--", "psql",
                                      "postgresql://u:pw2@h/db", "-c", "select {task}"],
                    env=["API_TOKEN=t0k", "LANG=C"], watchdog=0, start_timeout=0),
}


@needs_verify
@pytest.mark.parametrize("case", sorted(CASES))
def test_generated_units_verify_cleanly(tmp_path: Path, case: str) -> None:
    text = systemd.render_unit(f"onward-{case}", **CASES[case]).text  # type: ignore[arg-type]
    assert verify(tmp_path, f"onward-{case}", text) == ""


@needs_verify
def test_verify_check_can_fail(tmp_path: Path) -> None:
    # The harness itself: a bad value or a missing executable leaves a warning on stderr (exit status 0).
    text = systemd.render_unit("bad", ONWARD + ["run", "--", "true"]).text
    assert verify(tmp_path, "bad", text.replace("RestartSec=100ms", "RestartSec=soon")) != ""
    assert verify(tmp_path, "bad", text.replace(sys.executable, "/no/such/python")) != ""


def test_unit_says_what_an_admin_would_write(tmp_path: Path) -> None:
    text = systemd.render_unit("crawl", ONWARD + ["run", "--db", "j.db", "--grace", "30", "--", "true"],
                               workdir=str(tmp_path), user="crawler", env=["LANG=C"], watchdog=10).text
    lines = text.splitlines()
    for expected in ["[Unit]", "After=network-online.target", "Wants=network-online.target",
                     "StartLimitIntervalSec=60s", "StartLimitBurst=6", "[Service]", "Type=notify",
                     "NotifyAccess=main", "TimeoutStartSec=90s", f"WorkingDirectory={tmp_path}", "User=crawler",
                     'Environment="LANG=C"', "Restart=on-failure", "RestartSec=100ms", "WatchdogSec=10s",
                     "KillSignal=SIGTERM", "KillMode=mixed", "Delegate=yes", "TimeoutStopSec=40s", "SuccessExitStatus=3",
                     "RestartPreventExitStatus=2 3", "[Install]", "WantedBy=multi-user.target"]:
        assert expected in lines
    exec_start = next(line for line in lines if line.startswith("ExecStart="))
    assert exec_start == f"ExecStart={sys.executable} -m onward.cli run --db {tmp_path}/j.db --grace 30 -- " \
                         f"{shutil.which('true')}"


def test_timeout_stop_outlasts_the_grace_period() -> None:
    default = systemd.render_unit("g", ONWARD + ["run", "--", "true"]).text
    assert "TimeoutStopSec=20s" in default.splitlines()  # onward run's default --grace of 10 s
    explicit = systemd.render_unit("g", ONWARD + ["run", "--grace=2.5", "--", "true"]).text
    assert "TimeoutStopSec=12500ms" in explicit.splitlines()
    assert "TimeoutStopSec=70s" in systemd.render_unit("g", ONWARD + ["run"], grace=60).text.splitlines()


def test_timeout_start_is_said_as_onward_supervise_says_it(tmp_path: Path) -> None:
    # systemd's own default is 90 s too, but only as long as no admin changed DefaultTimeoutStartSec: the
    # unit says it, as `onward supervise --start-timeout` does.
    def said(**options: float) -> list[str]:
        text = systemd.render_unit("s", ONWARD + ["run", "--", "true"], **options).text  # type: ignore[arg-type]
        return [line for line in text.splitlines() if line.startswith("TimeoutStartSec=")]

    assert said() == ["TimeoutStartSec=90s"]
    assert said(start_timeout=600) == ["TimeoutStartSec=600s"]
    assert said(start_timeout=12.5) == ["TimeoutStartSec=12500ms"]
    assert said(start_timeout=0) == ["TimeoutStartSec=infinity"]
    done = run_onward("service", "install", "--name", "s", "--start-timeout", "30", "--dry-run", "--",
                      *ONWARD, "run", "--", "true", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert b"\nTimeoutStartSec=30s\n" in done.stdout


@pytest.mark.parametrize(("word", "quoted"), [
    ("/usr/bin/onward", "/usr/bin/onward"),
    ("{task}", "{task}"),
    ("100%", "100%%"),
    ("two words", '"two words"'),
    ("$HOME", '"$$HOME"'),
    ('say "hi"', '"say \\"hi\\""'),
    ("a\\b", '"a\\\\b"'),
    (";", '";"'),
    ("", '""'),
])
def test_exec_words_are_quoted_by_systemd_rules(word: str, quoted: str) -> None:
    assert systemd.quote_exec_word(word) == quoted


def test_relative_paths_are_resolved_against_the_working_directory(tmp_path: Path) -> None:
    words = systemd.resolve_command(ONWARD + ["run", "--db", "a.db", "--tasks=t.txt", "--out", "../o",
                                              "--keep-awake", "~/k", "--", "sh", "x.sh", "--db", "y"],
                                    str(tmp_path))
    tail = words[words.index("run"):]
    assert tail == ["run", "--db", f"{tmp_path}/a.db", f"--tasks={tmp_path}/t.txt", "--out",
                    f"{tmp_path.parent}/o", "--keep-awake", os.path.expanduser("~/k"), "--",
                    shutil.which("sh"), "x.sh", "--db", "y"]


def test_urls_and_stdin_are_left_alone(tmp_path: Path) -> None:
    words = systemd.resolve_command(ONWARD + ["run", "--db", "sqlite:///x.db", "--tasks", "-"], str(tmp_path))
    assert words[-4:] == ["--db", "sqlite:///x.db", "--tasks", "-"]


@pytest.mark.parametrize("name", ["", ".service", "a b", "a/b", "x@", "x@y", ".hidden", "é", "a" * 250])
def test_bad_unit_names_are_refused(name: str) -> None:
    with pytest.raises(UsageError, match="not a valid service name"):
        systemd.render_unit(name, ONWARD + ["run"])


def test_good_unit_names() -> None:
    assert systemd.unit_name("crawl") == "crawl.service"
    assert systemd.unit_name("crawl.service") == "crawl.service"
    assert systemd.unit_name("my-job_2:a.b") == "my-job_2:a.b.service"


@pytest.mark.parametrize("options", [
    dict(env=["NOEQUALS"]), dict(env=["1A=x"]), dict(env=["A=line\nbreak"]), dict(user="bad user"),
    dict(watchdog=-1), dict(watchdog=float("nan")), dict(watchdog=float("inf")), dict(watchdog=1e-300),
    dict(watchdog=0.0005), dict(watchdog=0.099), dict(start_timeout=-1), dict(start_timeout=float("nan")),
    dict(start_timeout=5), dict(grace=-1), dict(workdir="/tmp/tab\there"),
    dict(command=[]), dict(command=["no-such-program-anywhere"]), dict(command=ONWARD + ["run", "x\ny"]),
    dict(command=ONWARD + ["run", "--grace", "soon"]),
])
def test_bad_input_is_one_usage_error(options: dict[str, object]) -> None:
    options.setdefault("command", ONWARD + ["run"])
    with pytest.raises(UsageError):
        systemd.render_unit("job", **options)  # type: ignore[arg-type]


def test_parse_show() -> None:
    values = systemd.parse_show("ActiveState=active\nSubState=running\nMainPID=42\nNRestarts=1\nStatusText=a=b\n")
    assert values == {"ActiveState": "active", "SubState": "running", "MainPID": "42", "NRestarts": "1",
                      "StatusText": "a=b"}


@pytest.mark.skipif(os.path.isdir("/run/systemd/system"), reason="systemd is running on this machine")
def test_install_without_systemd_says_so(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="systemd is not running"):
        systemd.install("job", ONWARD + ["run", "--", "true"], unit_dir=str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_install_dry_run_prints_the_unit_and_writes_nothing(tmp_path: Path) -> None:
    done = run_onward("service", "install", "--name", "job", "--workdir", str(tmp_path), "--env", "A=1",
                      "--watchdog", "5", "--dry-run", "--", *ONWARD, "run", "--tasks", "t.txt", "--", "true",
                      cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode() == systemd.render_unit("job", ONWARD + ["run", "--tasks", "t.txt", "--", "true"],
                                                       workdir=str(tmp_path), env=["A=1"], watchdog=5).text
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("option", "said"), [
    (["--user", "no-such-user-here"], "no such user: no-such-user-here"),
    (["--workdir", "/nonexistent/folder"], "the working directory /nonexistent/folder does not exist"),
    (["--", "/nonexistent/prog"], "/nonexistent/prog: not an executable file"),
])
def test_a_dry_run_refuses_what_the_install_refuses(tmp_path: Path, option: list[str], said: str) -> None:
    """A dry run printed a unit, exit 0, for a user, a folder or a program the install then refused."""
    command = [] if "--" in option else ["--", *ONWARD, "run"]
    done = run_onward("service", "install", "--name", "job", "--dry-run", *option, *command, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.decode().splitlines()
    assert len(lines) == 1 and lines[0].startswith("onward: error: ") and said in lines[0], lines
    assert done.stdout == b"" and list(tmp_path.iterdir()) == []


def test_install_with_a_bad_name_is_a_usage_error(tmp_path: Path) -> None:
    done = run_onward("service", "install", "--name", "a b", "--dry-run", "--", *ONWARD, "run", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.decode().startswith("onward: error: not a valid service name: 'a b'")
    assert done.stdout == b"" and list(tmp_path.iterdir()) == []


# --- secrets: never in the unit (0644, printed by --dry-run), always in a 0600 EnvironmentFile ---------------
HOSTILE = 'p#w?d"q"$HOME`x`\\%n;'  # a password with characters that mean something somewhere


def test_a_store_password_goes_to_the_environment_file_not_the_unit(tmp_path: Path) -> None:
    url = "postgresql://u:s3cret@db.example/jobs"
    for db in (["--db", url], [f"--db={url}"]):
        unit = systemd.render_unit("job", ONWARD + ["run", *db, "--tasks", "t.txt", "--", "true"],
                                   workdir=str(tmp_path), env_dir=str(tmp_path / "env"))
        assert "s3cret" not in unit.text
        assert unit.secrets == {"ONWARD_DB": url}
        assert f"EnvironmentFile={tmp_path}/env/job.env" in unit.text.splitlines()
        exec_start = next(line for line in unit.text.splitlines() if line.startswith("ExecStart="))
        assert "--db" not in exec_start and f"--tasks {tmp_path}/t.txt" in exec_start  # the worker reads ONWARD_DB


def test_other_secrets_go_to_the_environment_file_too() -> None:
    unit = systemd.render_unit("job", ONWARD + ["run", "--", "psql", "postgresql://u:pw2@h/db"],
                               env=["API_TOKEN=t0k", "DB=postgresql://u:pw3@h/db", "LANG=C", "MY_KEY=k"])
    assert unit.secrets == {"ONWARD_SECRET_1": "postgresql://u:pw2@h/db", "API_TOKEN": "t0k",
                            "DB": "postgresql://u:pw3@h/db", "MY_KEY": "k"}
    assert not any(secret in unit.text for secret in ("pw2", "pw3", "t0k", "=k"))
    assert 'Environment="LANG=C"' in unit.text.splitlines()
    assert "/psql ${ONWARD_SECRET_1}\n" in unit.text  # systemd expands it to the same one word


def test_install_writes_secrets_to_a_0600_file_and_a_unit_without_them(tmp_path: Path) -> None:
    url = f"postgresql://u:{HOSTILE}@h/db"
    unit = systemd.render_unit("job", ONWARD + ["run", "--db", url, "--", "true"], env=[f"TOKEN={HOSTILE}"],
                               env_dir=str(tmp_path / "onward"))
    path = systemd.write_unit(unit, str(tmp_path))
    assert os.stat(path).st_mode & 0o777 == 0o644 and HOSTILE not in Path(path).read_text()
    secrets = tmp_path / "onward" / "job.env"
    assert os.stat(secrets).st_mode & 0o777 == 0o600 and os.stat(secrets.parent).st_mode & 0o777 == 0o700
    # systemd's rules for a double-quoted value: a backslash before " \ ` $, nothing else is special.
    escaped = 'p#w?d\\"q\\"\\$HOME\\`x\\`\\\\%n;'
    assert secrets.read_text() == f'TOKEN="{escaped}"\nONWARD_DB="postgresql://u:{escaped}@h/db"\n'
    # Installed again without secrets: the old file goes.
    systemd.write_unit(systemd.render_unit("job", ONWARD + ["run", "--", "true"], env_dir=str(tmp_path / "onward")),
                       str(tmp_path))
    assert not secrets.exists()


def test_install_dry_run_shows_secrets_as_stars(tmp_path: Path) -> None:
    done = run_onward("service", "install", "--name", "job", "--env", f"TOKEN={HOSTILE}", "--env", "LANG=C",
                      "--dry-run", "--", *ONWARD, "run", f"--db=postgresql://u:{HOSTILE}@h/db", "--", "true",
                      cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    shown = done.stdout.decode()
    assert "p#w" not in shown and "HOME" not in shown, shown
    assert "# ONWARD_DB=postgresql://u:***@h/db" in shown and "# TOKEN=***" in shown
    assert 'Environment="LANG=C"' in shown and "EnvironmentFile=/etc/onward/job.env" in shown
    assert list(tmp_path.iterdir()) == [] and not Path("/etc/onward/job.env").exists()


# --- defaults that show a misconfigured unit and keep a wedged one from hanging --------------------------
def test_watchdog_is_on_by_default_and_0_turns_it_off() -> None:
    assert "WatchdogSec=30s" in systemd.render_unit("job", ONWARD + ["run"]).text.splitlines()
    assert "WatchdogSec" not in systemd.render_unit("job", ONWARD + ["run"], watchdog=0).text
    done = run_onward("service", "install", "--name", "job", "--watchdog", "0", "--dry-run", "--", *ONWARD, "run")
    assert done.returncode == 0 and b"WatchdogSec" not in done.stdout


def test_a_usage_error_marks_the_unit_failed_and_is_not_restarted() -> None:
    lines = systemd.render_unit("job", ONWARD + ["run"]).text.splitlines()
    assert "SuccessExitStatus=3" in lines and "RestartPreventExitStatus=2 3" in lines
    assert not any(line.startswith("SuccessExitStatus=") and "2" in line for line in lines)


def test_an_exported_onward_db_is_carried_into_the_unit(tmp_path: Path) -> None:
    done = run_onward("service", "install", "--name", "job", "--dry-run", "--", *ONWARD, "run", "--", "true",
                      env={"ONWARD_DB": "job.db"}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f'Environment="ONWARD_DB={tmp_path}/job.db"' in done.stdout.decode().splitlines()
    url = "postgresql://u:pw9@h/db"
    unit = systemd.render_unit("job", ONWARD + ["run"], environ={"ONWARD_DB": url})
    assert unit.secrets == {"ONWARD_DB": url} and "pw9" not in unit.text
    # The command's --db, or --env ONWARD_DB, say which store; the exported one is then not carried.
    assert "ONWARD_DB" not in systemd.render_unit("job", ONWARD + ["run", "--db", "x.db"], environ={"ONWARD_DB": url}).text
    assert systemd.render_unit("job", ONWARD + ["run"], env=["ONWARD_DB=y.db"],
                               environ={"ONWARD_DB": url}).text.count("ONWARD_DB") == 1


def test_the_store_given_by_db_wins_over_an_env_onward_db() -> None:
    url = "postgresql://u:pw@h/db"
    unit = systemd.render_unit("job", ONWARD + ["run", "--db", url], env=["ONWARD_DB=other.db"])
    assert unit.secrets == {"ONWARD_DB": url} and "other.db" not in unit.text


def test_a_refused_secret_is_not_echoed_in_the_error() -> None:
    with pytest.raises(UsageError) as refused:
        systemd.render_unit("job", ONWARD + ["run"], env=["API_TOKEN=t0k\nen"])
    assert "t0k" not in str(refused.value)
    with pytest.raises(UsageError) as refused:
        systemd.render_unit("job", ONWARD + ["run", "--", "psql", "postgresql://u:pw7@h/db\n"])
    assert "pw7" not in str(refused.value)


def test_the_job_is_passed_on_to_the_worker() -> None:
    text = systemd.render_unit("j", ONWARD + ["run", "--", "true"], job="nightly", environ={}).text
    assert 'Environment="ONWARD_JOB=nightly"' in text.splitlines()
    carried = systemd.render_unit("j", ONWARD + ["run", "--", "true"], environ={"ONWARD_JOB": "exported"}).text
    assert 'Environment="ONWARD_JOB=exported"' in carried.splitlines()
    own = systemd.render_unit("j", ONWARD + ["run", "--job", "own", "--", "true"], environ={"ONWARD_JOB": "x"}).text
    assert "ONWARD_JOB" not in own  # the command names its job: nothing to carry
    with pytest.raises(UsageError, match="bad job name"):
        systemd.render_unit("j", ONWARD + ["run", "--", "true"], environ={"ONWARD_JOB": "../x"})


def test_libpq_and_other_run_together_secret_names_stay_out_of_the_unit(tmp_path: Path) -> None:
    # PGPASSWORD is how the README says a PostgreSQL store's password may be given; the unit is world-readable
    # and --dry-run prints it.
    names = ["PGPASSWORD", "MYSQL_PWD", "DBPASS", "APIKEY", "GITHUBTOKEN", "CLIENTSECRET_V2"]
    done = run_onward("service", "install", "--name", "job", *[f"--env={n}=s3cret-{n}" for n in names],
                      "--env", "LANG=C", "--dry-run", "--", *ONWARD, "run", "--db", "postgresql://u@h/db", "--",
                      "true", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    shown = done.stdout.decode()
    assert "s3cret" not in shown, shown
    assert all(f"# {n}=***" in shown for n in names), shown
    assert 'Environment="LANG=C"' in shown
    unit = systemd.render_unit("job", ONWARD + ["run", "--", "true"], env=[f"{n}=s3cret-{n}" for n in names])
    assert sorted(unit.secrets) == sorted(names) and "s3cret" not in unit.text
