"""`onward supervise`, the installed command, against real processes and real signals: restarts, give-up,
progress and backoff, forwarding, the watchdog (silent and truly wedged workers), freezes of the whole tree
(cgroup freezer, SIGSTOP), the restart journal, passwords hidden from ps.

Most workers are small Python scripts (CHILD below) that speak sd_notify over the datagram socket
themselves; the last tests supervise a real `onward run`. Every wait polls for a condition with a
deadline; the only fixed sleeps are the length of a freeze, which is the fault being tested.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from onward.proc import pid_start_time
from onward.store import open_store
from onward.supervise import (
    DEFAULT_RESTART_DELAY,
    MIN_WATCHDOG,
    STOP_MARGIN,
    backoff_delay,
    default_stop_timeout,
    find_run_option,
    store_url_for,
)
from tests import pgutil
from tests.conftest import cgroup_v1, keeper_of, keepers_of, onward_argv, run_onward, wait_for

SRC = str(Path(__file__).resolve().parents[2] / "src")

# A worker whose behaviour on its Nth start is the Nth word of its plan (the last word repeats):
#   beat          READY=1, WATCHDOG=1 every 50 ms until SIGTERM/SIGINT, then STOPPING=1 and exit 0;
#                 after a pause of its own (a gap over 1 s between two turns) it first works 0.5 s without
#                 beating, as a worker does that renews its leases after a thaw
#   beatfor:S     the same for S seconds, then exit 0
#   exit:N        READY=1, exit N at once
#   sleep:S/N     READY=1, beat for S seconds, exit N
#   termdie       READY=1, beat, no SIGTERM handler (dies of the signal)
#   nobeat        READY=1, three beats, then silence (sleeping, not wedged)
#   wedge         READY=1, three beats, then a catastrophic-backtracking regex in the main thread (SIGTERM
#                 and SIGINT have a handler, as in onward run, which never gets to run)
#   grandbeat     READY=1, silence, but a grandchild in its process group sends WATCHDOG=1
#   notifier:S    onward.notify.Notifier: ready() and watchdog() every 10 ms for S seconds, exit 0
#   progress:N    onward.notify.Notifier: ready(), then progress() (it settled a task), then exit N
#   unready:N     onward.notify.Notifier: progress() without ready() first, then exit N
# Each start appends "pid monotonic-time" to STATE/starts; the last beat's time goes to STATE/lastbeat.
CHILD = r'''
import os, re, signal, socket, sys, time
state, plan = sys.argv[1], sys.argv[2].split()
with open(os.path.join(state, "starts"), "a+") as f:
    f.seek(0)
    run = len(f.read().splitlines())
    f.write(f"{os.getpid()} {time.monotonic()}\n")
word = plan[min(run, len(plan) - 1)]
kind, _, arg = word.partition(":")
sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

def send(message):
    try:
        sock.sendto(message.encode(), os.environ["NOTIFY_SOCKET"])
    except OSError:
        pass  # like onward's Notifier: a supervisor that is gone must not end the worker

last_sent = time.monotonic()

def beat():
    global last_sent
    # The pause check sits right before the send, so that a stop can hardly fall between the two.
    if time.monotonic() - last_sent > 1.0:
        record("resumed")
        time.sleep(0.5)
    send("WATCHDOG=1")
    last_sent = time.monotonic()
    with open(os.path.join(state, "lastbeat"), "w") as f:
        f.write(str(last_sent))

def record(event):
    with open(os.path.join(state, "events"), "a") as f:
        f.write(event + "\n")

stop = []
if kind in ("beat", "beatfor", "sleep", "wedge"):  # (a wedge never gets to run the handler)
    def on_signal(signum, frame):
        stop.append(signum)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

if kind in ("progress", "unready"):
    from onward.notify import Notifier
    notifier = Notifier.from_env()
    if kind == "progress":
        notifier.ready()
    notifier.progress()
    sys.exit(int(arg))

if kind == "notifier":
    from onward.notify import Notifier
    notifier = Notifier.from_env()
    notifier.ready()
    until = time.monotonic() + float(arg)
    while time.monotonic() < until:
        notifier.watchdog()
        time.sleep(0.01)
    sys.exit(0)

send("READY=1\nSTATUS=run %d" % (run + 1))
if kind == "exit":
    sys.exit(int(arg))
if kind in ("beat", "beatfor", "sleep", "termdie"):
    seconds, _, code = arg.partition("/")
    until = time.monotonic() + float(seconds) if seconds else float("inf")
    while not stop and time.monotonic() < until:
        beat()
        time.sleep(0.05)
    if stop:
        record(signal.Signals(stop[0]).name)
        send("STOPPING=1")
    sys.exit(int(code or 0))
if kind in ("nobeat", "wedge"):
    for _ in range(3):
        beat()
        time.sleep(0.05)
    if kind == "wedge":
        record("wedged")
        re.match(r"(a+)+$", "a" * 40 + "b")  # 2**40 steps holding the GIL: never returns in a test
    while True:
        time.sleep(1)
if kind == "grandbeat":
    helper = ("import os, socket, sys, time\n"
              "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
              "open(sys.argv[1], 'w').write(str(os.getpid()))\n"
              "while True:\n"
              "    s.sendto(b'WATCHDOG=1', os.environ['NOTIFY_SOCKET'])\n"
              "    time.sleep(0.05)\n")
    import subprocess
    subprocess.Popen([sys.executable, "-c", helper, os.path.join(state, "grandchild")])
    while True:
        time.sleep(1)
'''

# The supervisor's options, as `onward supervise` spells them.
OPTIONS = {"restart_delay": "--restart-delay", "max_restarts": "--max-restarts", "window": "--window",
           "watchdog": "--watchdog", "store_url": "--db", "stop_timeout": "--stop-timeout"}


def alive(pid: int) -> bool:
    """Running or stopped, not a zombie (an orphan may stay a zombie when PID 1 is slow to reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


class Run:
    """One supervisor process started by a test, with its worker's state folder and its stderr."""

    def __init__(self, tmp: Path, plan: str, env: dict[str, str] | None = None, **options: object) -> None:
        self.state = tmp / f"state-{uuid.uuid4().hex[:8]}"
        self.state.mkdir()
        script = tmp / "child.py"
        script.write_text(CHILD)
        flags = [word for key, value in options.items() for word in (OPTIONS[key], str(value))]
        self.stderr_path = self.state / "stderr"
        environment = {**os.environ, "PYTHONPATH": SRC, **(env or {})}
        with open(self.stderr_path, "wb") as err:
            # Its own session: signals for the test's process group never reach it, and SIGSTOP can be
            # sent to its group alone.
            self.proc = subprocess.Popen(
                onward_argv("supervise", *flags, "--", sys.executable, str(script), str(self.state), plan),
                stderr=err, env=environment, start_new_session=True)

    @property
    def log(self) -> str:
        return self.stderr_path.read_text()

    def starts(self) -> list[tuple[int, float]]:
        path = self.state / "starts"
        if not path.exists():
            return []
        return [(int(p), float(t)) for p, t in (line.split() for line in path.read_text().splitlines())]

    def events(self) -> list[str]:
        path = self.state / "events"
        return path.read_text().split() if path.exists() else []

    def child(self, n: int = 1) -> int:
        """The pid of the worker's Nth start, once it has started and said READY=1."""
        wait_for(lambda: len(self.starts()) >= n and f"worker {self.starts()[n - 1][0]} ready" in self.log,
                 10, f"start {n} of the worker")
        return self.starts()[n - 1][0]

    def wait(self, timeout: float = 15) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"supervisor still running after {timeout} s; its log:\n{self.log}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()  # its workers follow (PR_SET_PDEATHSIG)
            self.proc.wait()
        for pid, _ in self.starts():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def supervise(tmp_path: Path) -> Iterator[Callable[..., Run]]:
    runs: list[Run] = []

    def start(plan: str, env: dict[str, str] | None = None, **options: object) -> Run:
        runs.append(Run(tmp_path, plan, env, **options))
        return runs[-1]

    yield start
    for run in runs:
        run.kill()


# --- restarts --------------------------------------------------------------------------------------------
def test_restarts_a_worker_killed_by_sigkill(supervise: Callable[..., Run]) -> None:
    run = supervise("beat")
    first = run.child(1)
    killed_at = time.monotonic()
    os.kill(first, signal.SIGKILL)
    second = run.child(2)
    recovery = run.starts()[1][1] - killed_at
    assert second != first
    assert "restarting worker after signal SIGKILL (restart 1 in 60 s window)" in run.log
    assert recovery < 1.0, f"worker back {recovery:.2f} s after the kill"
    os.kill(run.proc.pid, signal.SIGTERM)
    assert run.wait() == 0
    assert len(run.starts()) == 2
    assert run.events() == ["SIGTERM"]


def test_the_last_status_of_a_dead_worker_is_shown_with_its_age(supervise: Callable[..., Run]) -> None:
    # The worker said "STATUS=run 1" at its start and nothing since: when it dies, that text is shown as
    # what it is, an old status, not as the worker's state at its death.
    run = supervise("beat")
    first = run.child(1)
    started = run.starts()[0][1]
    wait_for(lambda: time.monotonic() - started > 2.5, 10, "the worker to run 2.5 s")
    os.kill(first, signal.SIGKILL)
    run.child(2)
    found = re.search(r"worker \d+ died: signal SIGKILL after (\d+\.\d) s; its last status, (\d+\.\d) s before: "
                      r"run 1\n", run.log)
    assert found, run.log
    # The worker ran at least 2.5 s from its spawn. Its status is dated when the supervisor read it, which on
    # a loaded machine can be some tenths of a second after the worker sent it (the supervisor loads the
    # journal's code meanwhile): 1.5 s at least.
    assert float(found[1]) >= 2.5 and float(found[2]) >= 1.5, run.log
    os.kill(run.proc.pid, signal.SIGTERM)
    assert run.wait() == 0


def test_how_long_a_worker_ran_counts_from_its_start_not_from_the_end_of_the_restarts_journal(
        supervise: Callable[..., Run], slow_server: Callable[[int, float], SlowServer]) -> None:
    # The supervisor journals restart 1 in a store whose first connection is held 3 s, after it started the
    # next worker. That worker is killed once it has run 4 s by its own clock: the supervisor must say it ran
    # 4 s at least, not 4 s less the journal's wait (it said about 1 s). How long a worker ran also decides
    # whether its crash counts as fast, for the backoff.
    server = slow_server(1, 3.0)
    run = supervise("beat", store_url=server.url)
    os.kill(run.child(1), signal.SIGKILL)
    second = run.child(2)
    started = run.starts()[1][1]
    wait_for(lambda: time.monotonic() - started > 4.0, 15, "the second worker to run 4 s")
    os.kill(second, signal.SIGKILL)
    run.child(3)
    found = re.search(rf"worker {second} died: signal SIGKILL after (\d+\.\d) s", run.log)
    assert found and float(found[1]) >= 4.0, run.log
    os.kill(run.proc.pid, signal.SIGTERM)
    assert run.wait() == 0


@pytest.mark.parametrize("status", [0, 2, 3])
def test_no_restart_after_exit_0_2_3(supervise: Callable[..., Run], status: int) -> None:
    run = supervise(f"exit:{status} beat")
    assert run.wait() == status
    assert len(run.starts()) == 1
    assert "not restarting" in run.log


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_stop_signal_is_forwarded_and_not_followed_by_a_restart(supervise: Callable[..., Run],
                                                               signum: signal.Signals) -> None:
    run = supervise("beat", watchdog=1.0)
    run.child(1)
    os.kill(run.proc.pid, signum)
    assert run.wait() == 0
    assert run.events() == [signum.name]
    assert len(run.starts()) == 1
    assert f"forwarding {signum.name} to worker" in run.log


def test_stopped_worker_dying_of_the_signal_gives_128_plus_n(supervise: Callable[..., Run]) -> None:
    run = supervise("termdie")
    run.child(1)
    os.kill(run.proc.pid, signal.SIGTERM)
    assert run.wait() == 128 + signal.SIGTERM
    assert len(run.starts()) == 1


def test_a_stopped_worker_that_does_not_exit_is_killed_after_the_stop_timeout(supervise: Callable[..., Run]) -> None:
    # A worker wedged holding the GIL never acts on the SIGTERM passed on to it. Before, the supervisor then
    # waited for good (the watchdog is disarmed once a stop begins, as systemd does), and more signals were
    # only passed on again: ^C never returned. Like systemd's TimeoutStopSec, it now kills it.
    run = supervise("wedge", stop_timeout=1.0)
    worker = run.child(1)
    wait_for(lambda: run.events() == ["wedged"], 10, "the worker to wedge")
    os.kill(run.proc.pid, signal.SIGTERM)
    assert run.wait() == 128 + signal.SIGKILL
    assert re.search(rf"worker {worker}: stop timeout: still running 1\.\d s after the stop was passed on; killing"
                     r" its process group", run.log), run.log
    assert not alive(worker)
    assert len(run.starts()) == 1


def test_a_stopped_worker_frozen_alone_is_killed_after_the_stop_timeout(supervise: Callable[..., Run]) -> None:
    # The same for a worker stopped by SIGSTOP (frozen alone, not with its supervisor): a second SIGTERM
    # gives it no more time than the first.
    run = supervise("beat", stop_timeout=2.0)
    worker = run.child(1)
    os.kill(worker, signal.SIGSTOP)
    wait_for(lambda: not _running(worker), 5, "the worker to stop")
    os.kill(run.proc.pid, signal.SIGTERM)
    wait_for(lambda: "forwarding SIGTERM" in run.log, 5, "the stop to be passed on")
    os.kill(run.proc.pid, signal.SIGTERM)
    assert run.wait() == 128 + signal.SIGKILL
    assert "stop timeout: still running 2." in run.log, run.log
    assert not alive(worker) and run.events() == []


def test_a_stopped_worker_that_exits_in_time_is_not_killed(supervise: Callable[..., Run]) -> None:
    # The timeout is a bound, not a wait: a worker that exits on the stop ends the supervisor with its status.
    run = supervise("beat", stop_timeout=30.0)
    run.child(1)
    os.kill(run.proc.pid, signal.SIGTERM)
    assert run.wait() == 0
    assert run.events() == ["SIGTERM"] and "stop timeout" not in run.log, run.log


def test_the_default_stop_timeout_is_the_workers_grace_and_a_margin() -> None:
    assert default_stop_timeout(["onward", "run", "--grace", "3", "--", "true"]) == 3 + STOP_MARGIN
    assert default_stop_timeout(["onward", "run", "--grace=0", "--", "true"]) == STOP_MARGIN
    assert default_stop_timeout(["onward", "run", "--", "sleep", "--grace", "99"]) == 10 + STOP_MARGIN
    # A --grace the worker refuses (it exits 2 on it) leaves the default, and so does another command.
    for words in (["onward", "run", "--grace", "nan"], ["onward", "run", "--grace", "-1"], ["sh", "-c", "x"]):
        assert default_stop_timeout(words) == 10 + STOP_MARGIN


def test_gives_up_after_a_crash_loop_with_one_line(supervise: Callable[..., Run]) -> None:
    run = supervise("exit:1", restart_delay=0.05, max_restarts=3)
    assert run.wait() == 1
    assert len(run.starts()) == 4  # the first run and 3 restarts
    give_up = [line for line in run.log.splitlines() if "giving up" in line]
    assert len(give_up) == 1, run.log
    assert "giving up after 3 restarts within 60 s (--max-restarts 3)" in give_up[0]
    # Crashing fast, the worker is restarted after 0.05, then 0.1, then 0.2 s.
    assert "backing off 0.1 s" in run.log and "backing off 0.2 s" in run.log
    times = [t for _, t in run.starts()]
    assert times[3] - times[2] >= 0.2


def test_a_worker_that_makes_progress_is_restarted_at_once_and_never_given_up(
        supervise: Callable[..., Run]) -> None:
    # Each run reaches READY and settles a task before it dies: no backoff, and dying more often than
    # --max-restarts allows within the window is not a crash loop.
    run = supervise("progress:1 progress:1 progress:1 progress:1 progress:1 exit:0", max_restarts=2)
    assert run.wait() == 0, run.log
    assert len(run.starts()) == 6
    assert "giving up" not in run.log and "backing off" not in run.log
    assert run.log.count("it made progress, not counted toward --max-restarts") == 5


def test_progress_then_a_crash_loop_is_still_given_up_on(supervise: Callable[..., Run]) -> None:
    run = supervise("progress:1 exit:1", restart_delay=0.01, max_restarts=2)
    assert run.wait() == 1
    assert len(run.starts()) == 4  # the progressing run, then a first start and 2 restarts without progress
    assert "giving up after 2 restarts" in run.log


def test_progress_without_ready_is_no_progress(supervise: Callable[..., Run]) -> None:
    run = supervise("unready:1", restart_delay=0.01, max_restarts=2)
    assert run.wait() == 1
    assert len(run.starts()) == 3 and "made progress" not in run.log


def test_restarts_older_than_the_window_do_not_count(supervise: Callable[..., Run]) -> None:
    # Each run lasts 1.2 s, longer than the 1 s window: one restart allowed per window is always enough.
    run = supervise("sleep:1.2/1 sleep:1.2/1 sleep:1.2/1 exit:0", max_restarts=1, window=1.0)
    assert run.wait(20) == 0
    assert len(run.starts()) == 4
    assert "giving up" not in run.log


def test_backoff_formula() -> None:
    assert [backoff_delay(0.2, n) for n in (1, 2, 3, 4)] == [0.2, 0.4, 0.8, 1.6]
    assert backoff_delay(0.2, 50) == 30.0
    assert backoff_delay(0.0, 5) == 0.0


def test_worker_dies_with_the_supervisor(supervise: Callable[..., Run]) -> None:
    run = supervise("beat")
    child = run.child(1)
    os.kill(run.proc.pid, signal.SIGKILL)
    wait_for(lambda: not alive(child), 5, "the worker to die with its supervisor (PR_SET_PDEATHSIG)")


def test_worker_runs_in_its_own_process_group(supervise: Callable[..., Run]) -> None:
    run = supervise("beat")
    child = run.child(1)
    assert os.getpgid(child) == child
    assert os.getpgid(run.proc.pid) != child


# --- the watchdog ----------------------------------------------------------------------------------------
def test_watchdog_kills_and_restarts_a_silent_worker(supervise: Callable[..., Run]) -> None:
    run = supervise("nobeat exit:0", watchdog=1.0)
    assert run.wait() == 0
    starts = run.starts()
    assert len(starts) == 2
    assert "watchdog: no heartbeat for 1.0 s" in run.log
    last_beat = float((run.state / "lastbeat").read_text())
    # The second start follows the kill by the restart delay plus the interpreter's start-up.
    detection = starts[1][1] - last_beat - DEFAULT_RESTART_DELAY
    assert 1.0 <= detection < 2.0, f"killed {detection:.2f} s after the last heartbeat (watchdog 1.0 s)"


def test_watchdog_leaves_a_beating_worker_alone(supervise: Callable[..., Run]) -> None:
    run = supervise("beatfor:2.5", watchdog=0.5)  # five watchdog periods
    assert run.wait() == 0
    assert len(run.starts()) == 1
    assert "watchdog:" not in run.log


def test_watchdog_kills_a_real_wedge_holding_the_gil(supervise: Callable[..., Run]) -> None:
    run = supervise("wedge exit:0", watchdog=1.0)
    assert run.wait() == 0
    assert run.events() == ["wedged"]
    assert len(run.starts()) == 2
    assert "restarting worker after watchdog: no heartbeat for" in run.log


def test_heartbeats_from_other_processes_do_not_count(supervise: Callable[..., Run]) -> None:
    # NotifyAccess=main: a grandchild beating on the socket does not keep a silent worker alive; the kill
    # of the worker's process group takes the grandchild with it.
    run = supervise("grandbeat exit:0", watchdog=1.0)
    assert run.wait() == 0
    assert len(run.starts()) == 2
    assert "watchdog: no heartbeat" in run.log
    grandchild = int((run.state / "grandchild").read_text())
    wait_for(lambda: not alive(grandchild), 5, "the grandchild to be killed with the worker's group")


def test_onward_notifier_keeps_the_watchdog_fed(supervise: Callable[..., Run]) -> None:
    # The worker's own Notifier (quarter-period heartbeats from WATCHDOG_USEC) against this server.
    run = supervise("notifier:2", watchdog=0.4)
    assert run.wait() == 0
    assert len(run.starts()) == 1
    assert "watchdog:" not in run.log


# --- freezes of the whole tree ---------------------------------------------------------------------------
@pytest.fixture
def freezer() -> Iterator[Path]:
    hierarchy = cgroup_v1("freezer")
    group = hierarchy / f"onward-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        yield group
    finally:
        (group / "freezer.state").write_text("THAWED")
        for pid in (group / "cgroup.procs").read_text().split():
            # Back to the root group so that ours can be removed; the test's cleanup kills them.
            (hierarchy / "cgroup.procs").write_text(pid)
        group.rmdir()


def freeze(group: Path, pids: list[int], seconds: float) -> None:
    for pid in pids:
        (group / "cgroup.procs").write_text(str(pid))
    (group / "freezer.state").write_text("FROZEN")
    wait_for(lambda: (group / "freezer.state").read_text().strip() == "FROZEN", 5, "the freeze")
    time.sleep(seconds)  # the fault itself: the tree stays frozen this long
    (group / "freezer.state").write_text("THAWED")


def test_freezing_supervisor_and_worker_together_is_not_a_hang(supervise: Callable[..., Run],
                                                               freezer: Path) -> None:
    run = supervise("beat", watchdog=1.0)
    child = run.child(1)
    freeze(freezer, [run.proc.pid, child], 3.0)
    wait_for(lambda: "supervisor resumed after" in run.log, 5, "the supervisor to notice its pause")
    # The killing would come within a watchdog period of the thaw; give it three.
    time.sleep(3.0)
    assert len(run.starts()) == 1, run.log
    assert "watchdog:" not in run.log
    os.kill(run.proc.pid, signal.SIGTERM)
    assert run.wait() == 0
    assert run.events() == ["resumed", "SIGTERM"]


def test_freezing_the_worker_alone_is_a_hang(supervise: Callable[..., Run], freezer: Path) -> None:
    # The control for the test above: the freeze really silences the worker, and without a pause of its
    # own the supervisor treats it as wedged.
    run = supervise("beat exit:0", watchdog=1.0)
    child = run.child(1)
    (freezer / "cgroup.procs").write_text(str(child))
    (freezer / "freezer.state").write_text("FROZEN")
    wait_for(lambda: "killing its process group" in run.log, 5, "the watchdog to fire")
    # A cgroup v1 freezer holds even a SIGKILLed process until the thaw; the supervisor waits for it.
    wait_for(lambda: "has not died 1 s after SIGKILL" in run.log, 5, "the supervisor to say it waits")
    (freezer / "freezer.state").write_text("THAWED")
    assert run.wait() == 0
    assert len(run.starts()) == 2
    assert "watchdog: no heartbeat" in run.log
    assert "resumed after" not in run.log


def test_sigstop_of_supervisor_and_worker_together_is_not_a_hang(supervise: Callable[..., Run]) -> None:
    run = supervise("beat", watchdog=1.0)
    child = run.child(1)
    os.killpg(run.proc.pid, signal.SIGSTOP)
    os.killpg(child, signal.SIGSTOP)
    wait_for(lambda: not _running(run.proc.pid) and not _running(child), 5, "both to stop")
    time.sleep(3.0)  # the pause itself
    # The supervisor first: it must see its own gap before it looks at the stale heartbeat.
    os.killpg(run.proc.pid, signal.SIGCONT)
    os.killpg(child, signal.SIGCONT)
    wait_for(lambda: "supervisor resumed after" in run.log, 5, "the supervisor to notice its pause")
    time.sleep(3.0)
    assert len(run.starts()) == 1, run.log
    assert "watchdog:" not in run.log
    os.kill(run.proc.pid, signal.SIGTERM)
    assert run.wait() == 0
    assert run.events() == ["resumed", "SIGTERM"], run.log


def _running(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "T"


# --- the restart journal ---------------------------------------------------------------------------------
def test_restarts_are_journaled_in_the_store(supervise: Callable[..., Run], tmp_path: Path) -> None:
    db = tmp_path / "store" / "onward.db"
    open_store(str(db)).close()
    run = supervise("beat nobeat beat", watchdog=1.0, env={"ONWARD_DB": str(db)})
    os.kill(run.child(1), signal.SIGKILL)
    run.child(3)  # the second start goes silent and is killed by the watchdog
    os.kill(run.proc.pid, signal.SIGTERM)
    assert run.wait() == 0
    store = open_store(str(db), create=False)
    try:
        restarts = [e.detail for e in store.events() if e.kind == "restart"]
        assert store.stats().restarts == 2
    finally:
        store.close()
    assert restarts[0] == "signal SIGKILL"
    assert restarts[1] is not None and restarts[1].startswith("watchdog: no heartbeat for 1.0 s")


def test_restart_goes_on_when_the_store_cannot_be_opened(supervise: Callable[..., Run],
                                                         tmp_path: Path) -> None:
    missing = tmp_path / "no-such-store.db"
    run = supervise("exit:1 exit:0", store_url=str(missing))
    assert run.wait() == 0
    assert len(run.starts()) == 2
    assert f"could not record the restart in {missing}" in run.log
    assert not missing.exists()  # journaling never creates a store


LOCK_HOLDER = """
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN IMMEDIATE")  # the write lock, held until killed
print("locked", flush=True)
time.sleep(600)
"""


def test_a_locked_store_holds_up_neither_the_restarts_nor_a_stop(supervise: Callable[..., Run],
                                                                    tmp_path: Path) -> None:
    """A restart was journaled on the supervisor's own loop: with the store's write lock held by someone else
    (SQLite waits up to 30 s for it), the loop stood still that long, seeing no worker die, passing on no
    signal. Now the journal is written beside the loop, and a stop waits for it 2 s at most."""
    db = tmp_path / "s.db"
    open_store(str(db)).close()
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(db)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        run = supervise("exit:1 exit:1 beat", store_url=str(db), restart_delay=0.05)
        run.child(3)  # two restarts while the first one's journal still waits for the lock
        os.kill(run.proc.pid, signal.SIGTERM)
        assert run.wait(timeout=10) == 0, run.log  # not the 30 s of the lock's wait
        assert "SIGTERM" in " ".join(run.events())  # passed on to the worker
        assert "the last restarts may not be recorded in it" in run.log
    finally:
        holder.kill()
        holder.wait()


def test_an_unsupported_db_of_the_supervisor_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """``supervise --db mysql://x`` was taken, and each restart then said it could not be recorded there."""
    marker = tmp_path / "started"
    for location in ("mysql://user:secret@host/db", "file:x.db"):
        r = run_onward("supervise", "--db", location, "--", sys.executable, "-c",
                       f"open({str(marker)!r}, 'w')", cwd=tmp_path)
        err = r.stderr.decode()
        assert r.returncode == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "unsupported store location" in lines[0] and "secret" not in lines[0], lines
        assert not marker.exists()


def test_store_is_found_like_onward_run_finds_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    run = ["onward", "run", "--db", "a.db", "--tasks", "t", "--", "cmd", "--db", "not-this"]
    assert store_url_for(run, {"ONWARD_DB": "env.db"}) == "a.db"
    assert store_url_for(["/venv/bin/onward", "run", "--db=b.db"], {}) == "b.db"
    assert store_url_for([sys.executable, "-m", "onward.cli", "run", "--", "x"], {"ONWARD_DB": "e"}) == "e"
    assert store_url_for(["onward", "run", "--", "x"], {}) is None  # the default file does not exist
    os.makedirs(".onward")
    Path(".onward/onward.db").touch()
    assert store_url_for(["onward", "run", "--", "x"], {}) == ".onward/onward.db"
    assert find_run_option(["worker", "--db", "x"], "--db") is None  # not an onward command


# --- the command line ------------------------------------------------------------------------------------
def test_supervise_restarts_then_exits_with_the_workers_3(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    done = run_onward("supervise", "--restart-delay", "0.01", "--", sys.executable, str(script), str(state),
                      "exit:1 exit:3")
    assert done.returncode == 3, done.stderr
    assert len((state / "starts").read_text().splitlines()) == 2


# --- with the real worker --------------------------------------------------------------------------------
TASK = r'''
import os, sys, time
with open(os.environ["EFFECTS"], "a") as f:
    f.write(f"start {sys.argv[1]} {os.environ['ONWARD_ATTEMPT']}\n")
time.sleep(0.2)
print("result of", sys.argv[1])
'''


def test_onward_run_under_onward_supervise(tmp_path: Path) -> None:
    # `onward supervise -- onward run ...`: the worker is SIGKILLed mid-task and restarted; the restart
    # is in `onward status --json` (restarts) and `onward logs` with its cause; the job finishes with
    # only the interrupted task run twice.
    onward = onward_argv()
    names = [f"t{i:02d}" for i in range(1, 11)]
    (tmp_path / "tasks.txt").write_text("\n".join(names) + "\n")
    (tmp_path / "task.py").write_text(TASK)
    effects = tmp_path / "effects.log"
    db = str(tmp_path / "job.db")
    env = {**os.environ, "PYTHONPATH": SRC, "EFFECTS": str(effects)}
    stderr = tmp_path / "stderr"

    def starts() -> list[tuple[str, str]]:
        lines = effects.read_text().splitlines() if effects.exists() else []
        return [(line.split()[1], line.split()[2]) for line in lines]

    with open(stderr, "wb") as err:
        supervisor = subprocess.Popen(
            [*onward, "supervise", "--watchdog", "5", "--", *onward, "run", "--db", db, "--tasks",
             str(tmp_path / "tasks.txt"), "--", sys.executable, str(tmp_path / "task.py"), "{task}"],
            stderr=err, env=env, start_new_session=True)
    try:
        wait_for(lambda: len(starts()) >= 3, 20, "the third task to start")
        worker = int(stderr.read_text().split(" worker ")[1].split()[0])
        os.kill(worker, signal.SIGKILL)
        assert supervisor.wait(30) == 0, stderr.read_text()
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
    log = stderr.read_text()
    assert "restarting worker after signal SIGKILL (it made progress, not counted toward --max-restarts)" in log
    report = json.loads(subprocess.run([*onward, "status", "--db", db, "--json"], env=env, check=True,
                                       capture_output=True, text=True).stdout)
    assert (report["done"], report["failed"], report["restarts"]) == (10, 0, 1)
    journal = subprocess.run([*onward, "logs", "--db", db], env=env, check=True, capture_output=True,
                             text=True).stdout
    assert [line for line in journal.splitlines() if "restart" in line and "signal SIGKILL" in line]
    again = [task for task, attempt in starts() if attempt != "1"]
    assert len(again) <= 1 and sorted(task for task, attempt in starts() if attempt == "1") == names


class Supervised:
    """``onward supervise [OPTIONS] -- onward run [RUN...]`` started in ``cwd`` as a user would, with its
    stderr in a file."""

    def __init__(self, cwd: Path, options: list[str], run: list[str], env: dict[str, str] | None = None,
                 wrapped: bool = False) -> None:
        self.cwd = cwd
        self.stderr_path = cwd / f"supervise-{uuid.uuid4().hex[:8]}.err"
        # wrapped: `sh -c 'exec onward run ...'`, whose options the supervisor cannot read from its command line.
        command = onward_argv("run", *run)
        if wrapped:
            command = ["sh", "-c", "exec " + shlex.join(command)]
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(onward_argv("supervise", *options, "--", *command),
                                         stderr=err, cwd=cwd, env={**os.environ, "PYTHONPATH": SRC, **(env or {})},
                                         start_new_session=True)

    @property
    def log(self) -> str:
        return self.stderr_path.read_text()

    def workers(self) -> list[int]:
        return [int(pid) for pid in re.findall(r"onward supervise pid=\d+ worker (\d+) started: ", self.log)]

    def standbys(self) -> list[int]:
        """The pids of the workers started ahead of need, behind their start gate, in order."""
        return [int(pid) for pid in re.findall(r"onward supervise pid=\d+ standby (\d+) started, waiting at its"
                                               r" start gate: ", self.log)]

    def ready(self, n: int, timeout: float = 20) -> int:
        """The pid of the Nth worker, once it said READY=1."""
        wait_for(lambda: len(self.workers()) >= n and f"worker {self.workers()[n - 1]} ready" in self.log,
                 timeout, f"worker {n} to be ready; log:\n{self.log}")
        return self.workers()[n - 1]

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"supervisor still running after {timeout} s; its log:\n{self.log}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # its worker follows (PR_SET_PDEATHSIG)
            self.proc.wait()


@pytest.fixture
def supervised(tmp_path: Path) -> Iterator[Callable[..., Supervised]]:
    started: list[Supervised] = []

    def start(options: list[str], run: list[str], env: dict[str, str] | None = None,
              wrapped: bool = False) -> Supervised:
        started.append(Supervised(tmp_path, options, run, env, wrapped))
        return started[-1]

    yield start
    for job in started:
        job.kill()


def status_of(cwd: Path) -> dict[str, Any]:
    done = run_onward("status", "--json", cwd=cwd)
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def test_a_restart_is_journaled_in_the_store_the_worker_created(supervised: Callable[..., Supervised],
                                                                tmp_path: Path) -> None:
    # A fresh folder: no store exists when the supervisor starts; the worker creates the default one.
    (tmp_path / "t.txt").write_text("a\n")
    job = supervised([], ["--tasks", "t.txt", "--grace", "0.5", "--", "sleep", "60"])
    os.kill(job.ready(1), signal.SIGKILL)
    job.ready(2)
    assert job.stop() == 0
    assert "could not record" not in job.log
    assert status_of(tmp_path)["restarts"] == 1
    journal = run_onward("logs", cwd=tmp_path).stdout.decode().splitlines()
    assert [line for line in journal if "restart" in line and "signal SIGKILL" in line], journal


def test_the_supervisor_loads_the_journal_driver_before_the_first_restart(
        supervised: Callable[..., Supervised], tmp_path: Path) -> None:
    # Loaded at the first restart, psycopg would share the CPU with the restarted worker's start-up.
    (tmp_path / "t.txt").write_text("a\n")
    with pgutil.fresh_database() as url:
        job = supervised(["--db", url], ["--db", url, "--tasks", "t.txt", "--grace", "0.5", "--", "sleep", "60"])
        job.ready(1)
        maps = Path(f"/proc/{job.proc.pid}/maps")
        wait_for(lambda: "psycopg" in maps.read_text(), 20, "the supervisor to load psycopg")
        assert "restarting" not in job.log
        os.kill(job.workers()[0], signal.SIGKILL)
        job.ready(2)
        assert job.stop() == 0, job.log
        assert "could not record" not in job.log
        store = open_store(url, create=False)
        try:
            assert store.stats().restarts == 1
        finally:
            store.close()


def test_journaling_a_restart_creates_no_store(tmp_path: Path) -> None:
    done = run_onward("supervise", "--max-restarts", "1", "--restart-delay", "0", "--", "sh", "-c", "exit 1",
                      cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert b"could not record" not in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_short_watchdog_does_not_kill_a_healthy_worker(supervised: Callable[..., Supervised],
                                                         tmp_path: Path) -> None:
    # --watchdog 2 is shorter than the worker's heartbeat (5 s by default) and than its task.
    (tmp_path / "t.txt").write_text("a\n")
    job = supervised(["--watchdog", "2"], ["--tasks", "t.txt", "--", "sleep", "3"])
    assert job.proc.wait(60) == 0, job.log
    assert "watchdog:" not in job.log and len(job.workers()) == 1
    report = status_of(tmp_path)
    assert (report["done"], report["restarts"]) == (1, 0)


def test_backoff_does_not_starve_a_worker_killed_often_while_finishing_tasks(
        supervised: Callable[..., Supervised], tmp_path: Path) -> None:
    # The worker is SIGKILLed once it has settled a task, five times, fast (each run well under 2 s), with
    # --max-restarts 2: every restart comes after the plain --restart-delay, and none counts as a crash loop.
    (tmp_path / "t.txt").write_text("".join(f"t{i}\n" for i in range(200)))
    job = supervised(["--max-restarts", "2"], ["--tasks", "t.txt", "-q", "--", "sleep", "0.05"])
    for n in range(1, 6):
        worker = job.ready(n)
        done_before = int(status_of(tmp_path)["done"])
        wait_for(lambda: int(status_of(tmp_path)["done"]) > done_before, 20,
                 "the worker to settle a task")
        os.kill(worker, signal.SIGKILL)
    job.ready(6)
    assert job.stop() == 0, job.log
    assert "backing off" not in job.log and "giving up" not in job.log
    assert job.log.count("it made progress, not counted toward --max-restarts") == 5


def test_a_worker_killed_between_its_durable_commit_and_its_report_made_progress(
        supervised: Callable[..., Supervised], tmp_path: Path) -> None:
    # Every worker kills itself (SIGKILL) at its first completion that is durable in the store but not yet
    # told (no log line, no --out file): that run got somewhere, and its death must not count toward
    # --max-restarts. Before, the progress message came after the reports, so these deaths were counted
    # and the supervisor gave up after 1 restart with tasks left.
    (tmp_path / "t.txt").write_text("a\nb\nc\n")
    job = supervised(["--max-restarts", "1", "--restart-delay", "0.05"],
                     ["--tasks", "t.txt", "--out", "out", "--", "echo", "{task}"],
                     env={"ONWARD_TEST_HOOKS": "1", "ONWARD_CRASH_AT": "completion_committed:1"})
    assert job.proc.wait(60) == 0, job.log
    assert "giving up" not in job.log
    assert job.log.count("it made progress, not counted toward --max-restarts") == 3, job.log
    report = status_of(tmp_path)
    assert (report["done"], report["failed"]) == (3, 0)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a.txt", "b.txt", "c.txt"]


def test_a_worker_that_dies_without_settling_a_task_is_still_given_up_on(
        supervised: Callable[..., Supervised], tmp_path: Path) -> None:
    # The control: READY, but killed before any task is settled, each time.
    (tmp_path / "t.txt").write_text("a\n")
    job = supervised(["--max-restarts", "2", "--restart-delay", "0.05"],
                     ["--tasks", "t.txt", "--max-attempts", "9", "--", "sleep", "60"])
    for n in range(1, 4):
        os.kill(job.ready(n), signal.SIGKILL)
    assert job.proc.wait(30) == 1, job.log
    assert "giving up after 2 restarts" in job.log and "made progress" not in job.log


def test_giving_up_on_a_crash_loop_lets_the_keep_awake_marker_go(supervised: Callable[..., Supervised],
                                                                 tmp_path: Path) -> None:
    """Once the supervisor gives up, no worker will run the job: a marker its killed workers left must not keep
    the sandbox awake for ever. One that another job's live worker holds stays."""
    (tmp_path / "t.txt").write_text("a\n")
    marker = tmp_path / "awake" / "keep-awake"
    job = supervised(["--max-restarts", "1", "--restart-delay", "0.05"],
                     ["--tasks", "t.txt", "--max-attempts", "9", "--keep-awake", str(marker), "--", "sleep", "60"])
    for n in range(1, 3):
        os.kill(job.ready(n), signal.SIGKILL)
        if n == 1:
            assert marker.exists(), "a killed worker's marker stays while its supervisor restarts it"
    assert job.proc.wait(30) == 1, job.log
    assert "giving up after 1 restarts" in job.log
    assert not marker.exists(), job.log
    # The same, while a worker of another job holds the marker: it is left to that worker.
    gate, started = tmp_path / "gate", tmp_path / "started"
    assert run_onward("add", "--job", "other", "b", cwd=tmp_path).returncode == 0
    other = subprocess.Popen(onward_argv("run", "--job", "other", "--keep-awake", str(marker), "--", "sh", "-c",
                                         f"touch {started}; while [ ! -e {gate} ]; do sleep 0.02; done"),
                             cwd=tmp_path, env={**os.environ, "PYTHONPATH": SRC}, stderr=subprocess.PIPE)
    try:
        wait_for(started.exists, 30, "the other job's task to start")
        job = supervised(["--max-restarts", "1", "--restart-delay", "0.05"],
                         ["--max-attempts", "9", "--keep-awake", str(marker), "--", "sleep", "60"])
        for n in range(1, 3):
            os.kill(job.ready(n), signal.SIGKILL)
        assert job.proc.wait(30) == 1, job.log
        assert marker.exists(), "the other job's worker still holds the marker"
    finally:
        gate.touch()
        other.communicate(timeout=30)
    assert other.returncode == 0
    assert not marker.exists()


def test_giving_up_on_a_wrapped_worker_lets_its_keep_awake_marker_go(supervised: Callable[..., Supervised],
                                                                     tmp_path: Path) -> None:
    """A worker started through a wrapper (`sh -c 'exec onward run --keep-awake M ...'`): the supervisor could
    not read the marker from its command line, and left it after giving up, keeping the sandbox awake with
    nobody to work. The worker now says which marker it keeps, with its READY=1."""
    (tmp_path / "t.txt").write_text("a\n")
    marker = tmp_path / "awake" / "keep-awake"
    job = supervised(["--max-restarts", "1", "--restart-delay", "0.05"],
                     ["--tasks", "t.txt", "--max-attempts", "9", "--keep-awake", str(marker), "--", "sleep", "60"],
                     wrapped=True)
    for n in range(1, 3):
        os.kill(job.ready(n), signal.SIGKILL)
        if n == 1:
            assert marker.exists(), "a killed worker's marker stays while its supervisor restarts it"
    assert job.proc.wait(30) == 1, job.log
    assert "giving up after 1 restarts" in job.log and f"keeps the keep-awake marker {marker}" in job.log
    assert not marker.exists(), job.log


def supervised_worker_keeping_a_marker(supervised: Callable[..., Supervised], tmp_path: Path,
                                       wrapped: bool = False) -> tuple[Supervised, int, Path]:
    """``onward supervise`` (not itself supervised) of a worker keeping a marker, its one task sleeping;
    returned once the worker holds the marker, with the worker's pid and the marker."""
    (tmp_path / "t.txt").write_text("a\n")
    marker = tmp_path / "awake" / "keep-awake"
    job = supervised([], ["--tasks", "t.txt", "--keep-awake", str(marker), "--", "sleep", "60"],
                     env={"NOTIFY_SOCKET": ""}, wrapped=wrapped)  # (not itself supervised, whatever runs the tests)
    worker = job.ready(1)
    wait_for(marker.exists, 20, "the worker to hold the marker")
    return job, worker, marker


def kill_the_supervisor_and_see_the_marker_go(job: Supervised, worker: int, marker: Path) -> None:
    job.proc.kill()
    assert job.proc.wait(30) == -signal.SIGKILL
    wait_for(lambda: pid_start_time(worker) is None, 20, "the worker to die with its supervisor")
    wait_for(lambda: not marker.exists(), 20, "the marker to be removed by the supervisor's keeper")


def test_a_supervisor_killed_outright_leaves_no_keep_awake_marker(supervised: Callable[..., Supervised],
                                                                   tmp_path: Path) -> None:
    """``kill -9`` of the supervisor (or the OOM killer taking it) takes its worker with it (PDEATHSIG), and
    neither can let the marker go: the supervisor's marker keeper does, so that the sandbox is not kept
    awake with nobody left to work. (Before, the marker stayed until a worker ran the job again.)"""
    job, worker, marker = supervised_worker_keeping_a_marker(supervised, tmp_path)
    kill_the_supervisor_and_see_the_marker_go(job, worker, marker)


def test_a_supervisor_of_a_wrapped_worker_killed_outright_leaves_no_keep_awake_marker(
        supervised: Callable[..., Supervised], tmp_path: Path) -> None:
    """The same for a worker behind a wrapper, whose marker the supervisor knows only from its READY=1: no
    keeper was started, and the marker stayed for good."""
    job, worker, marker = supervised_worker_keeping_a_marker(supervised, tmp_path, wrapped=True)
    wait_for(lambda: keepers_of(marker, job.proc.pid), 10, "the supervisor's keeper")
    kill_the_supervisor_and_see_the_marker_go(job, worker, marker)


def test_a_supervisors_keeper_killed_on_its_own_is_replaced_and_outlives_the_workers_leftovers(
        supervised: Callable[..., Supervised], tmp_path: Path) -> None:
    """The supervisor's keeper killed while the supervisor lives (a ``pkill`` meant for something else, the
    OOM killer) would leave the marker after a later ``kill -9`` of the supervisor: the supervisor starts
    another within a tick and says so. The new keeper, started while the supervisor is a subreaper, is not
    taken for a dead worker's leftover (which the supervisor kills when the worker dies)."""
    job, worker, marker = supervised_worker_keeping_a_marker(supervised, tmp_path)
    first = keeper_of(marker, job.proc.pid)
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: [k for k in keepers_of(marker, job.proc.pid) if k != first], 20, "another keeper")
    (second,) = keepers_of(marker, job.proc.pid)
    # The new keeper shows in /proc as soon as it is started, a moment before the supervisor says so.
    said = f"(pid {first}) ended first (signal SIGKILL); started another (pid {second})"
    wait_for(lambda: said in job.log, 10, "the supervisor to say it replaced its keeper")
    os.kill(worker, signal.SIGKILL)
    job.ready(2)
    assert keepers_of(marker, job.proc.pid) == [second], job.log
    kill_the_supervisor_and_see_the_marker_go(job, job.workers()[1], marker)


# --- secrets ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def url_with_a_password() -> Iterator[tuple[str, str]]:
    """A fresh PostgreSQL database's URL with a password in it (trust auth ignores it), and the password."""
    secret = f"pw-{uuid.uuid4().hex[:8]}"
    with pgutil.fresh_database() as url:
        yield url.replace(f"{pgutil.PG_USER}@", f"{pgutil.PG_USER}:{secret}@"), secret


def test_a_password_given_as_db_equals_url_is_hidden_from_ps_of_the_supervisor(
        supervised: Callable[..., Supervised], tmp_path: Path) -> None:
    # `--db=postgresql://u:pw@...` (one word, with "="), to the worker and to the supervisor itself: ps of
    # the running supervisor (its /proc/PID/cmdline) must not show the password before any restart.
    (tmp_path / "t.txt").write_text("a\n")
    with url_with_a_password() as (with_password, secret):
        job = supervised([f"--db={with_password}"],
                         [f"--db={with_password}", "--tasks", "t.txt", "--grace", "0.5", "--", "sleep", "60"])
        worker = job.ready(1)
        for pid in (job.proc.pid, worker):
            title = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
            assert secret not in title, title
            assert f"--db=postgresql://{pgutil.PG_USER}:{'*' * len(secret)}@" in title  # wiped in place
        assert job.stop() == 0, job.log
    assert secret not in job.log


# --- the start gate: the next worker loads its code ahead of the restart -----------------------------------
def log_time(line: str) -> float:
    """The wall-clock time at the start of one of onward's log lines (``2026-12-01T19:08:29.480Z ...``)."""
    return datetime.strptime(line.split()[0], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc).timestamp()


def line_of(log: str, text: str) -> str:
    return next(line for line in log.splitlines() if text in line)


def at_its_gate(pid: int) -> bool:
    """Whether the process waits at its start gate, not yet woken: its main thread blocked in ``select`` on
    the gate's two pipes (``select`` or ``pselect6``, system calls 23 and 270 on x86_64 Linux; their first
    argument is the highest descriptor + 1). The gate's descriptors are read from its environment."""
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        pytest.skip("reads a system call number of x86_64 Linux")
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        call = Path(f"/proc/{pid}/task/{pid}/syscall").read_text().split()
    except OSError:
        return False
    gate = next(item for item in environ if item.startswith(b"ONWARD_START_GATE=")).split(b"=", 1)[1].split(b",")
    return len(call) > 1 and call[0] in ("23", "270") and int(call[1], 16) == max(int(gate[0]), int(gate[3])) + 1


def running_its_task(supervised: Callable[..., Supervised], tmp_path: Path,
                     restart_delay: float) -> tuple[Supervised, Path]:
    """A supervised worker whose one task appends its start time to the returned file, once the task has
    started."""
    (tmp_path / "t.txt").write_text("a\n")
    starts = tmp_path / "starts"
    job = supervised(["--restart-delay", str(restart_delay)],
                     ["--tasks", "t.txt", "--grace", "0.5", "--", "sh", "-c", f"date +%s.%N >> {starts}; exec sleep 60"])
    job.ready(1)
    wait_for(lambda: starts.exists() and len(starts.read_text().split()) == 1, 20, "the task to start")
    return job, starts


def killed_during_its_task(supervised: Callable[..., Supervised], tmp_path: Path,
                           restart_delay: float) -> tuple[Supervised, Path, float]:
    """``running_its_task``, its worker SIGKILLed at once (a standby may or may not have been started yet);
    also returns when (wall clock) it was killed, give or take the kill itself."""
    job, starts = running_its_task(supervised, tmp_path, restart_delay)
    killed = time.time()
    os.kill(job.workers()[0], signal.SIGKILL)
    return job, starts, killed


def test_a_restarted_worker_loads_before_the_delay_is_over_and_runs_its_task_only_after_it(
        supervised: Callable[..., Supervised], tmp_path: Path) -> None:
    job, starts, killed = killed_during_its_task(supervised, tmp_path, 3)
    second = job.ready(2)
    wait_for(lambda: len(starts.read_text().split()) == 2, 20, "the task to start again")
    again = float(starts.read_text().split()[1])
    started = log_time(line_of(job.log, f"standby {second} started, waiting at its start gate"))
    # The task waited out the whole delay, counted from after the kill; the worker's process did not: it
    # was started before the kill (the standby) or right after it, and waited at its gate.
    assert again >= killed + 3.0
    assert again - started > 2.0, job.log
    assert job.stop() == 0, job.log


def test_a_standby_waits_at_its_gate_having_done_nothing_and_takes_over_after_the_delay(
        supervised: Callable[..., Supervised], tmp_path: Path) -> None:
    job, starts = running_its_task(supervised, tmp_path, 1)
    standby = int(str(wait_for(lambda: job.standbys() and job.standbys()[0], 20, "the standby to be started")))
    first = job.workers()[0]
    wait_for(lambda: at_its_gate(standby), 20, "the standby to wait at its gate")
    report = status_of(tmp_path)
    assert [w["pid"] for w in report["workers"]] == [first], report["workers"]  # not registered
    assert f"onward pid={standby} " not in job.log and alive(standby)
    killed = time.time()
    os.kill(first, signal.SIGKILL)
    assert job.ready(2) == standby
    wait_for(lambda: len(starts.read_text().split()) == 2, 20, "the task to start again")
    assert float(starts.read_text().split()[1]) >= killed + 1.0  # after the delay
    assert f"worker {standby} started: " in job.log and "(the standby, started " in job.log
    assert job.stop() == 0, job.log


def test_a_standby_that_ended_on_its_own_is_replaced_at_the_restart(
        supervised: Callable[..., Supervised], tmp_path: Path) -> None:
    job, starts = running_its_task(supervised, tmp_path, 0.1)
    standby = int(str(wait_for(lambda: job.standbys() and job.standbys()[0], 20, "the standby to be started")))
    os.kill(standby, signal.SIGKILL)
    # Dead (a zombie the supervisor has not reaped) before the restart begins: on a loaded machine a
    # SIGKILLed process can take a moment to die, and the restart would find it still alive (the next test).
    wait_for(lambda: not alive(standby), 20, "the standby to die")
    os.kill(job.workers()[0], signal.SIGKILL)
    second = job.ready(2)
    assert second != standby and second == job.standbys()[1]
    assert f"standby {standby} ended before a restart needed it (signal SIGKILL); starting another" in job.log
    wait_for(lambda: len(starts.read_text().split()) == 2, 20, "the task to start again")
    assert not alive(standby)
    assert job.stop() == 0, job.log


def test_a_standby_that_ends_during_the_restart_delay_is_not_let_through(
        supervised: Callable[..., Supervised], tmp_path: Path) -> None:
    # Taken for the restart alive, it is killed while the delay runs (as when a kill of both reaches it
    # later than the worker): at the end of the delay a fresh worker starts instead, and this is one restart,
    # not a second one for a worker that "died after 0.0 s".
    job, starts = running_its_task(supervised, tmp_path, 2.0)
    standby = int(str(wait_for(lambda: job.standbys() and job.standbys()[0], 20, "the standby to be started")))
    os.kill(job.workers()[0], signal.SIGKILL)
    wait_for(lambda: "restarting worker" in job.log, 20, "the restart to begin")
    os.kill(standby, signal.SIGKILL)
    second = job.ready(2)
    assert second != standby and second not in job.standbys()
    assert f"standby {standby} ended during the restart delay (signal SIGKILL); starting another" in job.log
    assert f"worker {standby} started" not in job.log
    wait_for(lambda: len(starts.read_text().split()) == 2, 20, "the task to start again")
    assert job.log.count("restarting worker") == 1, job.log
    assert status_of(tmp_path)["restarts"] == 1
    assert job.stop() == 0, job.log


def test_the_standby_is_ended_unstarted_when_no_restart_needs_it(
        supervised: Callable[..., Supervised], tmp_path: Path) -> None:
    # The worker finishes its one task (exit 0): the supervisor exits, and the standby with it, having
    # done nothing (no worker of its in the store, not a line of its own in the log).
    (tmp_path / "t.txt").write_text("a\n")
    job = supervised([], ["--tasks", "t.txt", "--", "sleep", "2"])
    standby = int(str(wait_for(lambda: job.standbys() and job.standbys()[0], 20, "the standby to be started")))
    assert job.proc.wait(60) == 0, job.log
    assert not alive(standby) and f"onward pid={standby} " not in job.log
    journal = run_onward("logs", cwd=tmp_path).stdout.decode()
    assert journal.count("worker started") == 1, journal


def test_a_stop_during_the_delay_ends_the_waiting_worker_before_it_does_anything(
        supervised: Callable[..., Supervised], tmp_path: Path) -> None:
    job, starts, _ = killed_during_its_task(supervised, tmp_path, 60)
    wait_for(lambda: "restarting worker" in job.log and job.standbys(), 20, "the next worker to be waiting")
    second = job.standbys()[-1]
    assert b"run" in Path(f"/proc/{second}/cmdline").read_bytes().split(b"\0")  # alive, at its gate
    assert job.stop() == 128 + signal.SIGKILL, job.log  # the status of the last worker that ran
    assert "received while waiting to restart; not restarting" in job.log
    assert not Path(f"/proc/{second}").exists()  # reaped by the supervisor, which has exited
    assert f"onward pid={second} " not in job.log  # it said nothing: it never got past its gate
    assert len(starts.read_text().split()) == 1
    assert status_of(tmp_path)["restarts"] == 1


def test_a_password_is_blanked_out_while_the_worker_waits_at_its_gate(
        supervised: Callable[..., Supervised], tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("a\n")
    with url_with_a_password() as (with_password, secret):
        job = supervised(["--restart-delay", "60"],
                         [f"--db={with_password}", "--tasks", "t.txt", "--grace", "0.5", "--", "sleep", "60"])
        os.kill(job.ready(1), signal.SIGKILL)
        wait_for(lambda: "restarting worker" in job.log and job.standbys(), 20, "the next worker to be waiting")
        second = job.standbys()[-1]
        title = Path(f"/proc/{second}/cmdline")
        wait_for(lambda: secret not in title.read_bytes().decode(), 20, "the password to be blanked out")
        assert f"worker {second} ready" not in job.log  # still at its gate
        assert job.stop() == 128 + signal.SIGKILL, job.log
    assert secret not in job.log


# A value of ONWARD_START_GATE that is not a gate of the worker's own parent is ignored: the run goes on at
# once, as without a supervisor, and its tasks never see the variable. "{ppid}" is this test's pid.
NOT_A_GATE = ["", "garbage", "3", ",,", "3,1,sqlite", "\u0663,{ppid},sqlite", "0,{ppid},sqlite", "2,{ppid}",
              "3,{ppid},sqlite", "9999999999,{ppid},sqlite", "99999999999,{ppid},sqlite", "{file},{ppid},sqlite",
              "{file},{ppid},postgres"]


@pytest.mark.parametrize("value", NOT_A_GATE)
def test_a_start_gate_value_that_is_not_a_gate_is_ignored(tmp_path: Path, value: str) -> None:
    (tmp_path / "t.txt").write_text("a\n")
    with open(tmp_path / "plain", "w") as plain:
        gate = value.format(ppid=os.getpid(), file=plain.fileno())
        done = subprocess.run(
            onward_argv("run", "--db", "s.db", "--tasks", "t.txt", "--", "sh", "-c",
                        'printf "%s" "${ONWARD_START_GATE-unset}" > seen'),
            cwd=tmp_path, env={**os.environ, "PYTHONPATH": SRC, "ONWARD_START_GATE": gate},
            pass_fds=[plain.fileno()], capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "seen").read_text() == "unset"


def test_a_gate_closed_without_the_go_ends_the_worker_having_done_nothing(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("a\n")
    read, write = os.pipe()
    try:
        worker = subprocess.Popen(
            onward_argv("run", "--db", "s.db", "--tasks", "t.txt", "--", "touch", "ran"), cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": SRC, "ONWARD_START_GATE": f"{read},{os.getpid()},sqlite"},
            pass_fds=[read], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    finally:
        os.close(read)
    os.close(write)
    out, err = worker.communicate(timeout=60)
    assert (worker.returncode, out, err) == (0, b"", b"")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.txt"]  # no store, no task run


@pytest.mark.parametrize("spawn", ["clone", "spawner"])
def test_a_gate_opened_lets_the_worker_run_and_its_command_dies_with_it(tmp_path: Path, spawn: str) -> None:
    # Before the gate the worker chose how it starts commands: it loaded the clone module (the default
    # where it is built), or started its spawner (ONWARD_SPAWN=spawner); a command it starts that way
    # keeps every guarantee, e.g. it dies with the worker, even by SIGKILL (PDEATHSIG).
    from onward import clonespawn

    if spawn == "clone" and not clonespawn.available():
        pytest.skip("the clone path is not built here (test_spawner.py says why where it should be)")
    (tmp_path / "t.txt").write_text("a\n")
    read, write = os.pipe()
    try:
        worker = subprocess.Popen(
            onward_argv("run", "--db", "s.db", "--tasks", "t.txt", "--", "sh", "-c", "touch ran; exec sleep 60"),
            cwd=tmp_path, env={**os.environ, "PYTHONPATH": SRC, "ONWARD_START_GATE": f"{read},{os.getpid()},sqlite",
                               "ONWARD_SPAWN": spawn},
            pass_fds=[read], stderr=subprocess.DEVNULL)
    finally:
        os.close(read)

    def children(name: bytes) -> list[int]:
        pids = Path(f"/proc/{worker.pid}/task/{worker.pid}/children").read_text().split()
        return [int(pid) for pid in pids if name in Path(f"/proc/{pid}/cmdline").read_bytes()]

    def ready_to_spawn() -> bool:
        if spawn == "spawner":
            return bool(children(b"spawner"))
        return "_clonespawn" in Path(f"/proc/{worker.pid}/maps").read_text()

    try:
        # Waiting: the worker has loaded its code and made ready to start commands (the last step before
        # the gate), but touched nothing.
        wait_for(ready_to_spawn, 20, f"the worker to make ready to start commands ({spawn})")
        assert not (tmp_path / "s.db").exists() and worker.poll() is None
        os.write(write, b"g")
        wait_for(lambda: (tmp_path / "ran").exists() and children(b"sleep"), 20, "the command to run")
        command = children(b"sleep")[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(10)

        def gone() -> bool:
            try:
                return Path(f"/proc/{command}/stat").read_text().split(") ")[1][0] in "ZX"
            except FileNotFoundError:
                return True
        wait_for(gone, 10, "the command to die with its worker")
    finally:
        os.close(write)
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def test_a_worker_that_finds_onward_changed_at_its_go_runs_the_new_code(tmp_path: Path) -> None:
    # A standby may wait at its gate for as long as its worker lives, and onward may be upgraded meanwhile.
    # At the go the worker finds files of the code it loaded changed, and runs itself again from them (no
    # gate any more), as a worker started then would. The change comes once the worker is at its gate (its
    # spawner started, the last step before it), to a module it loaded: only running again can pick it up.
    code = tmp_path / "code"
    shutil.copytree(Path(SRC) / "onward", code / "onward", ignore=shutil.ignore_patterns("__pycache__"))
    work = tmp_path / "work"
    work.mkdir()
    (work / "t.txt").write_text("a\n")
    read, write = os.pipe()
    try:
        worker = subprocess.Popen(
            onward_argv("run", "--db", "s.db", "--tasks", "t.txt", "--", "touch", "ran"), cwd=work,
            env={**os.environ, "PYTHONPATH": str(code), "ONWARD_START_GATE": f"{read},{os.getpid()},sqlite",
                 "ONWARD_SPAWN": "spawner"},
            pass_fds=[read], stderr=subprocess.PIPE)
    finally:
        os.close(read)
    try:
        wait_for(lambda: any(b"spawner" in Path(f"/proc/{pid}/cmdline").read_bytes() for pid in
                             Path(f"/proc/{worker.pid}/task/{worker.pid}/children").read_text().split()),
                 20, "the worker to wait at its gate")
        with open(code / "onward" / "commands.py", "a") as f:
            f.write('\nimport pathlib\npathlib.Path("upgraded").write_text("the new code ran\\n")\n')
        os.write(write, b"g")
        _, err = worker.communicate(timeout=60)
    finally:
        os.close(write)
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert worker.returncode == 0, err.decode()
    assert (work / "upgraded").read_text() == "the new code ran\n"
    assert (work / "ran").exists()


# --- woken at its gate: a PostgreSQL worker connects while the restart delay runs ---------------------------
class Gated:
    """``onward run RUN...`` started behind a start gate of this process's, as ``onward supervise`` starts
    one: ``wake`` says the restart has begun, ``go`` lets it through, ``close`` shuts the gate."""

    def __init__(self, cwd: Path, run: list[str]) -> None:
        read, self._go = os.pipe()
        wake_read, self._wake = os.pipe()
        self.gate_fd = read
        try:
            self.proc = subprocess.Popen(
                onward_argv("run", *run), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env={**os.environ, "PYTHONPATH": SRC,
                     "ONWARD_START_GATE": f"{read},{os.getpid()},postgres,{wake_read}"},
                pass_fds=[read, wake_read])
        finally:
            os.close(read)
            os.close(wake_read)

    def _send(self, end: str, byte: bytes) -> None:
        fd = getattr(self, end)
        if fd >= 0:
            if byte:
                os.write(fd, byte)
            os.close(fd)
            setattr(self, end, -1)

    def wake(self) -> None:
        self._send("_wake", b"w")

    def go(self) -> None:
        self._send("_go", b"g")

    def close(self) -> None:
        self._send("_wake", b"")
        self._send("_go", b"")

    def waiting_for_the_go(self) -> bool:
        """Whether its main thread is blocked reading its gate (``read``, system call 0 on x86_64)."""
        try:
            call = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/syscall").read_text().split()
        except OSError:
            return False
        return call[:2] == ["0", hex(self.gate_fd)]

    def finish(self, timeout: float = 60) -> tuple[bytes, bytes]:
        try:
            return self.proc.communicate(timeout=timeout)
        finally:
            self.close()
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def gated_on_postgres(tmp_path: Path) -> Iterator[tuple[Callable[[list[str]], Gated], str, Any]]:
    """A fresh PostgreSQL store holding the task "a", a way to start gated workers on it, and an autocommit
    connection to its database (to look at its rows and sessions)."""
    import psycopg

    if sys.platform != "linux" or os.uname().machine != "x86_64":
        pytest.skip("reads a system call number of x86_64 Linux")
    with pgutil.fresh_database() as url:
        assert run_onward("add", "--db", url, "a").returncode == 0
        started: list[Gated] = []

        def start(run: list[str]) -> Gated:
            started.append(Gated(tmp_path, ["--db", url, *run]))
            return started[-1]

        with psycopg.connect(url, autocommit=True) as db:
            try:
                yield start, url, db
            finally:
                for gated in started:
                    gated.close()
                    if gated.proc.poll() is None:
                        gated.proc.kill()
                        gated.proc.wait()


def onward_sessions(db: Any) -> list[tuple[int, datetime]]:
    """The pid and start of each session of onward's on the database (none but the gated worker's here)."""
    return [(int(pid), start) for pid, start in db.execute(
        "SELECT pid, backend_start FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name = 'onward'")]


def rows_written(db: Any) -> tuple[int, int]:
    """How many workers and journal events the store holds."""
    row = db.execute("SELECT (SELECT count(*) FROM onward.workers), (SELECT count(*) FROM onward.events)").fetchone()
    return int(row[0]), int(row[1])


def test_a_woken_worker_connects_ahead_and_without_the_go_exits_having_written_nothing(
        gated_on_postgres: tuple[Callable[[list[str]], Gated], str, Any]) -> None:
    start, _, db = gated_on_postgres
    before = rows_written(db)
    worker = start(["--", "touch", "ran"])
    worker.wake()
    wait_for(lambda: len(onward_sessions(db)) == 2 and worker.waiting_for_the_go(), 30,
             "the worker to open its store and its LISTEN session, then wait for the go")
    assert rows_written(db) == before
    worker.close()
    assert worker.finish() == (b"", b"")
    assert worker.proc.returncode == 0
    wait_for(lambda: onward_sessions(db) == [], 10, "the worker's sessions to end")
    assert rows_written(db) == before


def test_a_woken_worker_runs_on_the_sessions_it_opened_before_the_go(
        gated_on_postgres: tuple[Callable[[list[str]], Gated], str, Any], tmp_path: Path) -> None:
    start, url, db = gated_on_postgres
    worker = start(["--", "sh", "-c", f"while [ ! -e {tmp_path / 'done'} ]; do sleep 0.02; done"])
    worker.wake()
    wait_for(lambda: len(onward_sessions(db)) == 2 and worker.waiting_for_the_go(), 30,
             "the worker to open its store and its LISTEN session, then wait for the go")
    go_at = db.execute("SELECT clock_timestamp()").fetchone()[0]
    worker.go()
    wait_for(lambda: rows_written(db)[0] == 1 and db.execute(
        "SELECT count(*) FROM onward.tasks WHERE state = 'running'").fetchone()[0] == 1, 30, "the task to run")
    sessions = onward_sessions(db)
    assert len(sessions) == 2 and all(started < go_at for _, started in sessions), (sessions, go_at)
    (tmp_path / "done").touch()
    out, err = worker.finish()
    assert worker.proc.returncode == 0, err.decode()
    assert run_onward("status", "--db", url, "--json").stdout.count(b'"done": 1') == 1


def test_a_session_opened_ahead_and_lost_before_the_go_is_replaced(
        gated_on_postgres: tuple[Callable[[list[str]], Gated], str, Any], tmp_path: Path) -> None:
    # The server ends the sessions while the worker waits (a restart of the server, an administrator): at
    # the go the worker finds its connection closed and opens another, instead of failing its first call.
    start, url, db = gated_on_postgres
    worker = start(["--", "touch", str(tmp_path / "ran")])
    worker.wake()
    wait_for(lambda: len(onward_sessions(db)) == 2 and worker.waiting_for_the_go(), 30,
             "the worker to open its store and its LISTEN session, then wait for the go")
    lost = {pid for pid, _ in onward_sessions(db)}
    db.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database()"
               " AND application_name = 'onward'")
    wait_for(lambda: not lost & {pid for pid, _ in onward_sessions(db)}, 10, "the sessions to end")
    worker.go()
    out, err = worker.finish()
    assert worker.proc.returncode == 0, err.decode()
    assert (tmp_path / "ran").exists()
    assert b"error" not in err and b"unavailable" not in err, err.decode()


# --- start-up: the start timeout, and the watchdog armed at READY=1 --------------------------------------
class SlowServer:
    """A TCP relay to the local PostgreSQL server that holds each of its first ``held`` connections until
    ``release()`` or for ``hold`` seconds (a slow server, a slow network), then relays it; later ones at
    once. Its ``url`` names a store whose opening takes that long."""

    def __init__(self, url: str, held: int, hold: float) -> None:
        self.released = threading.Event()
        self.hold, self.held = hold, held
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = url.replace(f":{pgutil.PG_PORT}/", f":{self.listener.getsockname()[1]}/")
        threading.Thread(target=self._accept, daemon=True).start()

    def release(self) -> None:
        self.released.set()

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            hold, self.held = self.held > 0, self.held - 1
            threading.Thread(target=self._relay, args=(client, hold), daemon=True).start()

    def _relay(self, client: socket.socket, hold: bool) -> None:
        if hold:
            self.released.wait(self.hold)
        try:
            server = socket.create_connection((pgutil.PG_HOST, pgutil.PG_PORT))
        except OSError:
            client.close()
            return
        threading.Thread(target=self._pump, args=(server, client), daemon=True).start()
        self._pump(client, server)

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


@pytest.fixture
def slow_server() -> Iterator[Callable[[int, float], SlowServer]]:
    with pgutil.fresh_database() as url:
        servers: list[SlowServer] = []

        def start(held: int, hold: float) -> SlowServer:
            servers.append(SlowServer(url, held, hold))
            return servers[-1]

        yield start
        for server in servers:
            server.release()
            server.close()


def test_a_start_up_longer_than_the_watchdog_is_not_a_hang(supervised: Callable[..., Supervised],
                                                           slow_server: Callable[[int, float], SlowServer],
                                                           tmp_path: Path) -> None:
    # The worker's store takes 2 s to open (its first connection is held), four times its watchdog: the
    # watchdog only runs once the worker said READY=1, as systemd arms WatchdogSec, so it is not killed.
    server = slow_server(1, 2.0)
    (tmp_path / "t.txt").write_text("a\nb\n")
    job = supervised(["--watchdog", "0.5", "--max-restarts", "2"],
                     ["--db", server.url, "--tasks", "t.txt", "--", "true"])
    assert job.proc.wait(60) == 0, job.log
    assert "watchdog:" not in job.log and len(job.workers()) == 1, job.log
    assert run_onward("status", "--db", server.url, "--json").stdout.count(b'"done": 2') == 1


def test_a_worker_not_ready_within_the_start_timeout_is_restarted(supervised: Callable[..., Supervised],
                                                                  slow_server: Callable[[int, float], SlowServer],
                                                                  tmp_path: Path) -> None:
    # The first worker's store does not open within --start-timeout (its connection is held 8 s): it is
    # killed and restarted like systemd's TimeoutStartSec; the next one, whose connection is not held, runs.
    # 3 s, not less: the next one creates the store's schema before its READY=1, and on a loaded 2-core
    # machine (the suite's other tests beside it) that start took just over 1 s once.
    server = slow_server(1, 8.0)
    (tmp_path / "t.txt").write_text("a\n")
    job = supervised(["--start-timeout", "3"], ["--db", server.url, "--tasks", "t.txt", "--", "true"])
    assert job.proc.wait(60) == 0, job.log
    assert "restarting worker after start timeout: no READY=1 for 3.0 s (restart 1 in 60 s window)" in job.log
    assert len(job.workers()) == 2, job.log
    assert run_onward("status", "--db", server.url, "--json").stdout.count(b'"done": 1') == 1


@pytest.mark.parametrize("option", ["--start-timeout", "--stop-timeout"])
@pytest.mark.parametrize("bad", ["-1", "nan", "inf", "1e30", "ten"])
def test_a_bad_start_or_stop_timeout_is_refused_in_one_line(option: str, bad: str, tmp_path: Path) -> None:
    ran = tmp_path / "ran"
    done = run_onward("supervise", f"{option}={bad}", "--", sys.executable, "-c",
                      f"open({str(ran)!r}, 'w')")
    assert done.returncode == 2
    assert done.stderr.decode().count("\n") == 1 and option in done.stderr.decode(), done.stderr
    assert not ran.exists()


def test_the_shortest_watchdog_is_fed_by_a_real_worker(supervised: Callable[..., Supervised],
                                                       tmp_path: Path) -> None:
    # --watchdog takes nothing shorter than MIN_WATCHDOG (a shorter one killed healthy workers at once);
    # at the minimum, a worker that claims and commits 20 tasks at 4 at a time is never taken for wedged.
    (tmp_path / "t.txt").write_text("".join(f"t{i}\n" for i in range(20)))
    job = supervised(["--watchdog", str(MIN_WATCHDOG), "--max-restarts", "0"],
                     ["--tasks", "t.txt", "--concurrency", "4", "--", "sleep", "0.05"])
    assert job.proc.wait(60) == 0, job.log
    assert "watchdog:" not in job.log and len(job.workers()) == 1, job.log


def test_a_stopped_supervisor_does_not_stall_its_worker(supervised: Callable[..., Supervised],
                                                       tmp_path: Path) -> None:
    # The supervisor alone is SIGSTOPped: nobody reads the worker's sd_notify datagrams, and the socket's
    # queue (10 datagrams by default) is full within a second of WATCHDOG=1 every 0.1 s. A blocking send
    # then held the worker's loop: no task finished and its leases ran out. The worker must go on.
    (tmp_path / "t.txt").write_text("".join(f"t{i}\n" for i in range(200)))
    job = supervised(["--watchdog", "0.4"], ["--tasks", "t.txt", "--heartbeat", "0.2", "--", "sleep", "0.1"])
    job.ready(1)

    def done() -> int:
        return job.log.count(" done task=")

    os.kill(job.proc.pid, signal.SIGSTOP)
    try:
        before = done()
        # 20 tasks of 0.1 s: well past the second the queue takes to fill.
        wait_for(lambda: done() >= before + 20, 15, f"20 tasks done while the supervisor is stopped; log:\n{job.log}")
    finally:
        os.kill(job.proc.pid, signal.SIGCONT)
    assert job.stop() == 0, job.log
    assert "worker stopped: stopped by SIGTERM" in job.log and len(job.workers()) == 1, job.log


def test_sighup_stops_the_supervisor_and_its_worker_gracefully(supervise: Callable[..., Run]) -> None:
    # The terminal a supervisor was started from closes: SIGHUP stops it like SIGTERM, not by its default
    # action (which left the worker to die of PR_SET_PDEATHSIG with its tasks cut short).
    run = supervise("beat")
    run.child(1)
    os.kill(run.proc.pid, signal.SIGHUP)
    assert run.wait() == 0, run.log
    assert run.events() == ["SIGTERM"] and len(run.starts()) == 1, run.log
    assert "forwarding SIGHUP to worker" in run.log and "as SIGTERM; it will not be restarted" in run.log


# A worker that says READY=1, waits for the file GO, then says it settled a task and exits 1 at once.
SAYS_PROGRESS_THEN_DIES = r'''
import os, sys, time
from onward.notify import Notifier
go, plan = sys.argv[1], sys.argv[2]
with open(plan, "a+") as f:
    f.seek(0)
    first = not f.read()
    f.write("x")
notifier = Notifier.from_env()
notifier.ready()
if not first:
    sys.exit(0)
while not os.path.exists(go):
    time.sleep(0.005)
notifier.progress()
sys.exit(1)
'''

# `onward supervise` itself, with one look at the worker's socket held: once that look has read READY=1, the
# worker is let go and the look returns only once the worker is dead, so its progress arrives after the look
# and before the supervisor sees the exit. The order a loaded machine made now and then, made every time.
SUPERVISE_WITH_A_SLOW_LOOK = r'''
import os, sys, time
import onward.supervise as supervise
go = sys.argv[1]
real_receive = supervise.receive

def state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return "gone"

def receive(sock, pid):
    messages = list(real_receive(sock, pid))
    if any(m.get("READY") == "1" for m in messages) and not os.path.exists(go):
        open(go, "w").close()
        deadline = time.monotonic() + 30
        while state(pid) not in ("Z", "gone") and time.monotonic() < deadline:
            time.sleep(0.005)
    return iter(messages)

supervise.receive = receive
sys.argv = ["onward", *sys.argv[2:]]
from onward.cli import cli_main
cli_main()
'''


def test_progress_said_just_before_the_worker_dies_is_not_lost(tmp_path: Path) -> None:
    # Before, the supervisor looked at the socket, then at the exit: progress said in between was never
    # read, the run counted as one without progress, and with --max-restarts 0 the supervisor gave up.
    (tmp_path / "worker.py").write_text(SAYS_PROGRESS_THEN_DIES)
    (tmp_path / "supervise.py").write_text(SUPERVISE_WITH_A_SLOW_LOOK)
    go, plan = tmp_path / "go", tmp_path / "plan"
    done = subprocess.run(
        [sys.executable, str(tmp_path / "supervise.py"), str(go), "supervise", "--max-restarts", "0", "--",
         sys.executable, str(tmp_path / "worker.py"), str(go), str(plan)],
        env={**os.environ, "PYTHONPATH": SRC}, capture_output=True, timeout=120)
    log = done.stderr.decode()
    assert go.exists() and plan.read_text() == "xx", log
    assert done.returncode == 0 and "giving up" not in log, log
    assert len(re.findall(r"worker \d+ made progress\n", log)) == 1, log
    assert "it made progress, not counted toward --max-restarts" in log, log
