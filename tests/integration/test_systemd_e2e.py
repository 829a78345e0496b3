"""End to end under a real systemd: PID 1 of a container booted with systemd-nspawn (recipe in
../shared/TESTING.md). `onward service install` installs the unit inside it; then

- SIGKILL of the main pid: systemd restarts the worker (NRestarts=1), which resumes at the task it was
  running, finishes the job, and redoes no finished task (counted through a side-effect log);
- a real wedge (a Python task's catastrophic regex holding the GIL, so the main loop stops sending
  WATCHDOG=1): systemd's watchdog kills the worker and restarts it, and the job finishes.

The container sees the host's /usr read-only on a volatile root; the interpreter, the source tree and the
test's folder are bound in at the same paths. Without systemd-nspawn the tests skip, unless CI is set.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import onward_argv

pytestmark = pytest.mark.systemd

REPO = Path(__file__).resolve().parents[2]
SRC = str(REPO / "src")
PY = sys.executable
ONWARD = onward_argv()  # the installed console script, in the unit's ExecStart too
CGROUP_ROOTS = [Path("/sys/fs/cgroup/systemd"), Path("/sys/fs/cgroup/unified")]  # hybrid v1 + v2


def wait_for(condition: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


@dataclass
class Container:
    leader: int  # the container's PID 1 (systemd), as the host sees it
    work: Path  # bound into the container at the same path, writable

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(["nsenter", "-t", str(self.leader), "-a", *args], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": SRC}, timeout=60)
        if check and done.returncode != 0:
            raise AssertionError(f"{args} failed ({done.returncode}): {done.stderr}")
        return done

    def show(self, unit: str) -> dict[str, str]:
        from onward.systemd import parse_show

        out = self.run("systemctl", "show", unit, "-p", "ActiveState", "-p", "SubState", "-p", "MainPID",
                       "-p", "NRestarts", "-p", "Result", "-p", "StatusText").stdout
        return parse_show(out)

    def journal(self, unit: str) -> str:
        return self.run("journalctl", "--no-pager", "-u", unit).stdout


def _requirements() -> str | None:
    if shutil.which("systemd-nspawn") is None:
        return "systemd-nspawn is missing (apt-get install -y systemd-container)"
    if os.geteuid() != 0:
        return "booting a container needs root"
    if not all((root / "cgroup.procs").exists() for root in CGROUP_ROOTS):
        return "the recipe needs the hybrid cgroup layout (/sys/fs/cgroup/systemd and /unified)"
    if shutil.which("nsenter") is None:
        return "nsenter is missing"
    return None


def _binds(work: Path) -> list[str]:
    """The interpreter (and its virtualenv) and the source tree, read-only at the same paths; /usr is
    there already."""
    binds = [f"--bind={work}"]
    for path in sorted({sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(PY)), str(REPO)}):
        if not path.startswith("/usr"):
            binds.append(f"--bind-ro={path}")
    return binds


@pytest.fixture(scope="module")
def container(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Container]:
    missing = _requirements()
    if missing:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI must run the systemd end-to-end tests: {missing}")
        pytest.skip(missing)
    work = tmp_path_factory.mktemp("systemd-e2e")
    target = work / "t.target"
    target.write_text("[Unit]\nDescription=onward end-to-end test target\n")
    group = f"onward-e2e-{uuid.uuid4().hex[:8]}"
    cgroups = [root / group for root in CGROUP_ROOTS]
    for cgroup in cgroups:
        cgroup.mkdir()

    def into_cgroups() -> None:
        # nspawn must start from a cgroup of its own, or it leaves empty groups at the hierarchy roots.
        for cgroup in cgroups:
            with open(cgroup / "cgroup.procs", "w") as f:
                f.write(str(os.getpid()))

    console = open(work / "console.log", "wb")
    nspawn = subprocess.Popen(
        ["systemd-nspawn", "-D", "/", "--volatile=yes", "--register=no", "--keep-unit", f"--machine={group}",
         "--console=passive", *_binds(work), f"--bind-ro={target}:/etc/systemd/system/t.target",
         "-b", "--", "systemd.unit=t.target", "systemd.firstboot=off"],
        stdin=subprocess.DEVNULL, stdout=console, stderr=subprocess.STDOUT, preexec_fn=into_cgroups,
        start_new_session=True)
    try:
        leader: list[int] = []

        def booted() -> bool:
            if nspawn.poll() is not None:
                raise AssertionError(f"systemd-nspawn exited: {(work / 'console.log').read_text()[-2000:]}")
            if not leader:
                init = cgroups[0] / "payload" / "init.scope" / "cgroup.procs"
                pids = init.read_text().split() if init.exists() else []
                if not pids:
                    return False
                leader.append(int(pids[0]))
            state = Container(leader[0], work).run("systemctl", "is-system-running", check=False).stdout
            return state.strip() in ("running", "degraded")

        started = time.monotonic()
        wait_for(booted, 60, "the container's systemd to boot")
        print(f"container booted in {time.monotonic() - started:.1f} s")
        yield Container(leader[0], work)
    finally:
        nspawn.send_signal(signal.SIGTERM)  # a clean halt of the container
        try:
            nspawn.wait(30)
        except subprocess.TimeoutExpired:
            nspawn.kill()
            nspawn.wait()
        console.close()
        for cgroup in cgroups:
            for folder in sorted((p for p in cgroup.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                folder.rmdir()
            cgroup.rmdir()


TASK = r'''
import os, sys, time
effects = os.path.join(os.path.dirname(os.path.abspath(__file__)), "effects.log")
def note(line):
    with open(effects, "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())
note(f"start {sys.argv[1]} {os.environ['ONWARD_ATTEMPT']}")
time.sleep(0.3)
note(f"end {sys.argv[1]}")
print("result of", sys.argv[1])
'''


def effects(folder: Path) -> list[list[str]]:
    path = folder / "effects.log"
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def test_sigkill_of_the_main_pid_is_restarted_and_resumes(container: Container) -> None:
    started = time.monotonic()
    job = container.work / "kill job 100%"  # a path that needs quoting and %-escaping in the unit
    job.mkdir()
    (job / "task.py").write_text(TASK)
    names = [f"t{i:02d}" for i in range(1, 21)]
    (job / "tasks.txt").write_text("\n".join(names) + "\n")
    unit = "onward-e2e-kill.service"
    command = [*ONWARD, "run", "--db", "job.db", "--tasks", "tasks.txt", "--out", "out", "--heartbeat", "1",
               "--", PY, "task.py", "{task}"]
    odd = "a b %n 'single' \"double\" \\ $HOME ;"
    container.run(*ONWARD, "service", "install", "--name", unit, "--workdir", str(job),
                  "--env", f"PYTHONPATH={SRC}", "--env", f"ODD={odd}", "--watchdog", "5", "--", *command)
    assert container.show(unit)["ActiveState"] == "active"  # Type=notify: active once READY=1 came

    first = int(container.show(unit)["MainPID"])
    cmdline = container.run("cat", f"/proc/{first}/cmdline").stdout.split("\0")[:-1]
    expected = [*ONWARD, "run", "--db", f"{job}/job.db", "--tasks", f"{job}/tasks.txt", "--out", f"{job}/out",
                "--heartbeat", "1", "--", PY, "task.py", "{task}"]
    assert cmdline[-len(expected):] == expected  # survived the quoting (a script's interpreter comes first)
    environ = container.run("cat", f"/proc/{first}/environ").stdout.split("\0")
    assert f"ODD={odd}" in environ
    assert container.run("readlink", f"/proc/{first}/cwd").stdout.strip() == str(job)

    def mid_task() -> bool:
        lines = effects(job)
        return sum(1 for line in lines if line[0] == "end") >= 4 and lines[-1][0] == "start"

    # The worker reports its progress (STATUS=) with every lease renewal (--heartbeat 1).
    wait_for(lambda: "/20 done" in container.run(*ONWARD, "service", "status", unit).stdout, 10,
             "the job's progress in `onward service status`")
    shown = container.run(*ONWARD, "service", "status", unit).stdout
    assert f"{unit}: active (running)" in shown and f"main pid: {first}" in shown, shown
    assert "restarts: 0" in shown, shown
    wait_for(mid_task, 30, "the worker to be in the middle of its fifth task or later")
    container.run("kill", "-KILL", str(first))
    killed_at = time.monotonic()
    wait_for(lambda: container.show(unit)["NRestarts"] == "1"
             and container.show(unit)["MainPID"] not in ("0", str(first)), 30, "systemd to restart the worker")
    print(f"worker restarted {time.monotonic() - killed_at:.1f} s after the SIGKILL")
    wait_for(lambda: container.show(unit)["ActiveState"] == "inactive", 60, "the job to finish")

    state = container.show(unit)
    assert state["Result"] == "success" and state["NRestarts"] == "1", state
    # Tasks run one at a time, so the side-effect log is in order. The kill interrupted one task X: it is
    # the only one started twice (attempt 2 right after the restart); every other task ran exactly once.
    starts = [(line[1], line[2]) for line in effects(job) if line[0] == "start"]
    ends = [line[1] for line in effects(job) if line[0] == "end"]
    again = [i for i, (_, attempt) in enumerate(starts) if attempt != "1"]
    assert len(again) == 1, starts
    interrupted = starts[again[0]][0]
    assert starts[again[0] - 1] == (interrupted, "1"), "the restarted worker did not resume at the same task"
    assert sorted(name for name, attempt in starts if attempt == "1") == names, "a task ran twice"
    assert set(ends) == set(names) and all(ends.count(n) == 1 for n in names if n != interrupted)
    status = json.loads(subprocess.run([*ONWARD, "status", "--db", str(job / "job.db"), "--json"],
                                       capture_output=True, text=True, check=True,
                                       env={**os.environ, "PYTHONPATH": SRC}).stdout)
    assert (status["done"], status["failed"], status["pending"], status["running"]) == (20, 0, 0, 0)
    assert sorted(p.name for p in (job / "out").iterdir()) == [f"{n}.txt" for n in names]

    assert "restarts: 1" in container.run(*ONWARD, "service", "status", unit).stdout
    container.run(*ONWARD, "service", "uninstall", unit)
    assert container.run("test", "-e", f"/etc/systemd/system/{unit}", check=False).returncode == 1
    gone = container.run(*ONWARD, "service", "status", unit, check=False)
    assert gone.returncode == 2 and "no such service" in gone.stderr, gone
    print(f"kill test took {time.monotonic() - started:.1f} s")


WEDGE_WORKER = r'''
import os, re, sys, time
from onward import Job
here = os.path.dirname(os.path.abspath(__file__))
def note(line):
    with open(os.path.join(here, "effects.log"), "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())
job = Job(os.path.join(here, "wedge.db"))
@job.task
def handle(task, ctx):
    note(f"start {task} {ctx.attempt} {time.monotonic()}")
    if task == "wedge" and ctx.attempt == 1:
        # Catastrophic backtracking: 2**40 steps in C, holding the GIL, so the worker's main loop stops
        # and with it the WATCHDOG=1 heartbeat.
        re.match(r"(a+)+$", "a" * 40 + "b")
    time.sleep(0.2)
    note(f"end {task}")
    return task
job.add(["a", "b", "wedge", "c"])
summary = job.run()
sys.exit(0)
'''


def test_systemd_watchdog_kills_and_restarts_a_wedged_worker(container: Container) -> None:
    started = time.monotonic()
    job = container.work / "wedge"
    job.mkdir()
    (job / "worker.py").write_text(WEDGE_WORKER)
    unit = "onward-e2e-wedge.service"
    container.run(*ONWARD, "service", "install", "--name", unit, "--workdir", str(job),
                  "--env", f"PYTHONPATH={SRC}", "--watchdog", "2", "--", PY, "worker.py")
    wait_for(lambda: container.show(unit)["ActiveState"] == "inactive", 60, "the job to finish")
    state = container.show(unit)
    assert state["Result"] == "success" and state["NRestarts"] == "1", state
    assert "Watchdog timeout" in container.journal(unit)
    lines = effects(job)
    starts = [(line[1], line[2]) for line in lines if line[0] == "start"]
    assert starts.count(("wedge", "1")) == 1 and starts.count(("wedge", "2")) == 1
    assert sorted(line[1] for line in lines if line[0] == "end") == ["a", "b", "c", "wedge"]
    wedged_at = next(float(line[3]) for line in lines if line[:3] == ["start", "wedge", "1"])
    resumed_at = next(float(line[3]) for line in lines if line[:3] == ["start", "wedge", "2"])
    print(f"wedge to the worker's next attempt: {resumed_at - wedged_at:.1f} s (WatchdogSec=2)")
    # The last WATCHDOG=1 may precede the wedge by a quarter period (the worker's ping interval).
    assert 1.5 <= resumed_at - wedged_at < 6.0
    assert not list(job.glob("core*"))
    container.run(*ONWARD, "service", "uninstall", unit)
    print(f"wedge test took {time.monotonic() - started:.1f} s")


def test_secrets_reach_the_worker_from_a_private_file_not_the_unit(container: Container) -> None:
    # A token with the characters that systemd's EnvironmentFile and ExecStart quoting care about, and a
    # command word holding a URL with a password: both reach the task exactly, and neither is in the unit.
    job = container.work / "secrets"
    job.mkdir()
    token = 'p#w?d"q"$HOME`x`\\%n; two  spaces'
    word = "postgresql://u:p#w$X@h/db"
    (job / "tasks.txt").write_text("a\n")
    unit = "onward-e2e-secrets.service"
    container.run(*ONWARD, "service", "install", "--name", unit, "--workdir", str(job),
                  "--env", f"PYTHONPATH={SRC}", "--env", f"API_TOKEN={token}", "--",
                  *ONWARD, "run", "--db", "job.db", "--tasks", "tasks.txt", "--", "sh", "-c",
                  'printf "%s|%s" "$API_TOKEN" "$1"', "sh", word)
    wait_for(lambda: container.show(unit)["ActiveState"] == "inactive", 30, "the job to finish")
    assert container.show(unit)["Result"] == "success"
    result = subprocess.run([*ONWARD, "result", "--db", str(job / "job.db"), "a"], capture_output=True,
                            env={**os.environ, "PYTHONPATH": SRC}, check=True).stdout.decode()
    assert result == f"{token}|{word}"
    text = container.run("cat", f"/etc/systemd/system/{unit}").stdout
    assert "p#w" not in text and "EnvironmentFile=/etc/onward/onward-e2e-secrets.env" in text
    assert container.run("stat", "-c", "%a", "/etc/onward/onward-e2e-secrets.env").stdout.strip() == "600"
    container.run(*ONWARD, "service", "uninstall", unit)
    assert container.run("test", "-e", "/etc/onward/onward-e2e-secrets.env", check=False).returncode == 1


def test_a_usage_error_leaves_the_unit_failed_and_not_restarted(container: Container) -> None:
    job = container.work / "misconfigured"
    job.mkdir()
    unit = "onward-e2e-usage.service"
    container.run(*ONWARD, "service", "install", "--name", unit, "--workdir", str(job), "--env",
                  f"PYTHONPATH={SRC}", "--", *ONWARD, "run", "--db", "job.db", "--concurrency", "0", "--", "true",
                  check=False)  # `restart` reports the failed start
    wait_for(lambda: container.show(unit)["ActiveState"] == "failed", 30, "the unit to fail")
    state = container.show(unit)
    assert state["Result"] == "exit-code" and state["NRestarts"] == "0", state
    assert unit in container.run("systemctl", "--failed", "--no-legend").stdout
    container.run(*ONWARD, "service", "uninstall", unit)


def test_a_watchdog_shorter_than_the_heartbeat_leaves_a_healthy_worker_alone(container: Container) -> None:
    # WatchdogSec=2 with onward run's default --heartbeat of 5 s and a task of 4 s.
    job = container.work / "short-watchdog"
    job.mkdir()
    (job / "tasks.txt").write_text("a\n")
    unit = "onward-e2e-short-watchdog.service"
    container.run(*ONWARD, "service", "install", "--name", unit, "--workdir", str(job), "--env",
                  f"PYTHONPATH={SRC}", "--watchdog", "2", "--", *ONWARD, "run", "--db", "job.db", "--tasks",
                  "tasks.txt", "--", "sleep", "4")
    assert container.show(unit)["ActiveState"] == "active"
    wait_for(lambda: container.show(unit)["ActiveState"] == "inactive", 30, "the job to finish")
    state = container.show(unit)
    assert state["Result"] == "success" and state["NRestarts"] == "0", state
    assert "Watchdog timeout" not in container.journal(unit)
    container.run(*ONWARD, "service", "uninstall", unit)
