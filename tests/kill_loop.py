"""Kill-and-resume loops for the agent crash tests (tests/crash/test_agent_crash.py and
tests/integrations/test_agent_crashes.py): run an agent script as a worker process, SIGKILL it at seeded
random moments (some chosen by a watcher of its progress, some by strace as it enters its N-th fdatasync,
i.e. inside a commit) and run it again, until it finishes.

Every run is a real process killed with a real SIGKILL, but not a fresh interpreter: it is forked from a
server process (``ForkServer``) that imported the agent's SDKs once, so that a run costs a fork rather than
an interpreter start and one to three seconds of imports (the bulk of these tests' time when each run was
a new process). The forked child runs the script from the top (``runpy``), as ``python script ...`` would.
A run meant to die inside a commit first blocks on a FIFO; strace attaches to it (``strace -p``, allowed
under Yama's ptrace scope 1 by ``PR_SET_PTRACER``) and the FIFO lets it go.
"""

from __future__ import annotations

import json
import os
import random
import select
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_for

# The server: imports the modules named on its command line, then for each request line on stdin (JSON:
# argv, stderr file, optional gate FIFO) forks a child that runs argv[0] as __main__ and prints
# "pid N", then "exit CODE" once the child has ended (a negative code: killed by that signal). The child is
# reaped only when the next request (or EOF) comes: until then its pid cannot be reused, so a SIGKILL
# the test sends after the child ended hits a zombie, never another process.
SERVER = r'''
import ctypes, importlib, json, os, runpy, sys, traceback

for name in sys.argv[1:]:
    importlib.import_module(name)


def child(request):
    code = 1
    try:
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(null, 1)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.dup2(err, 2)
        if request.get("gate"):
            ctypes.CDLL(None, use_errno=True).prctl(0x59616D61, ctypes.c_ulong(-1), 0, 0, 0)  # PR_SET_PTRACER_ANY
            with open(request["gate"], "rb") as gate:
                gate.read(1)  # until strace is attached
        sys.argv = list(request["argv"])
        sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
        runpy.run_path(sys.argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


previous = None
for line in sys.stdin:
    if previous is not None:
        os.waitpid(previous, 0)
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        child(request)
    previous = pid
    print(f"pid {pid}", flush=True)
    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
    print(f"exit {code}", flush=True)
os._exit(0)  # nothing to flush: skip the imported SDKs' exit hooks (one waits for a tracing thread)
'''


class ForkServer:
    """A process that imported ``preload`` once and forks one run of a script per request."""

    def __init__(self, folder: Path, preload: list[str], env: dict[str, str] | None = None) -> None:
        self.folder = folder
        script = folder / "fork_server.py"
        script.write_text(SERVER)
        self.stderr = folder / "runs.log"  # every run's stderr, appended
        self.process = subprocess.Popen([sys.executable, str(script), *preload], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=env)
        self._buffer = b""
        self._runs = 0
        self._current: Run | None = None

    def _line(self, timeout: float) -> str | None:
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            # Always look once, even with no time left: poll() asks with timeout 0, and a run that ended
            # after its "pid" line was read is known only from the "exit" line waiting in the pipe.
            if not select.select([fd], [], [], max(deadline - time.monotonic(), 0.0))[0]:
                return None
            data = os.read(fd, 4096)
            if not data:
                raise AssertionError(f"the fork server ended (status {self.process.wait()})")
            self._buffer += data
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()

    def start(self, argv: list[str], *, gated: bool = False) -> Run:
        """Fork a run of ``argv`` (``argv[0]``: the script). ``gated``: it waits for ``Run.open_gate``."""
        self._runs += 1
        gate = None
        if gated:
            gate = self.folder / f"gate{self._runs}"
            os.mkfifo(gate, 0o600)
        assert self.process.stdin is not None
        request = {"argv": argv, "stderr": str(self.stderr), "gate": str(gate) if gate else None}
        self.process.stdin.write((json.dumps(request) + "\n").encode())
        self.process.stdin.flush()
        line = self._line(60)
        assert line is not None and line.startswith("pid "), line
        self._current = Run(self, int(line.split()[1]), gate)
        return self._current

    def close(self) -> None:
        """Stop the server, and a run still going (a test that failed half way)."""
        if self._current is not None and self.process.poll() is None:
            self._current.kill()
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class Run:
    """One forked run: ``poll``/``wait`` give its exit code (negative: the signal that killed it)."""

    def __init__(self, server: ForkServer, pid: int, gate: Path | None) -> None:
        self.server, self.pid, self.gate = server, pid, gate
        self.returncode: int | None = None

    def poll(self, timeout: float = 0.0) -> int | None:
        if self.returncode is None:
            line = self.server._line(timeout)
            if line is not None:
                assert line.startswith("exit "), line
                self.returncode = int(line.split()[1])
        return self.returncode

    def wait(self, timeout: float) -> int:
        code = self.poll(timeout)
        assert code is not None, f"run {self.pid} still going after {timeout} s"
        return code

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)  # not reaped yet: this pid is still the run's

    def open_gate(self) -> None:
        assert self.gate is not None
        with open(self.gate, "wb") as gate:
            gate.write(b"g")


@dataclass(frozen=True)
class KillPlan:
    """How an agent is interrupted: ``random_kills`` SIGKILLs sent once ``0..max_new`` more calls were made
    and then ``0..max_pause`` seconds later (inside a call, a commit, a replay, between steps), and
    ``commit_kills`` by strace as the run enters its N-th fdatasync (N in ``nth``), among the first
    ``2 * commit_kills`` runs so that they happen before the agent can finish."""

    random_kills: int
    commit_kills: int
    max_new: int
    max_pause: float
    nth: tuple[int, int] = (2, 8)


@dataclass
class Kills:
    kills: int = 0  # runs that ended by SIGKILL
    in_commit: int = 0  # of them, by strace inside an fdatasync


def kill_until_done(server: ForkServer, argv: list[str], progress: Callable[[], int], db: Path, plan: KillPlan,
                    rng: random.Random) -> Kills:
    """Run ``argv`` through ``server``, killing it as ``plan`` says, then once more to the end. After each
    kill the SQLite store ``db`` must pass integrity_check. ``progress``: how many calls the agent has made
    so far (model calls and tool executions seen from outside)."""
    strace = shutil.which("strace")
    if strace is None and os.environ.get("CI") == "true":
        pytest.fail("strace is needed for the kills inside commits")
    runs = ["random"] * (plan.random_kills + plan.commit_kills)
    if strace is not None:
        for at in rng.sample(range(2 * plan.commit_kills), plan.commit_kills):
            runs[at] = "commit"
    done = Kills()
    for kind in runs:
        if kind == "commit":
            assert strace is not None
            run = server.start(argv, gated=True)
            nth = rng.randint(*plan.nth)  # the run dies entering its N-th fdatasync: inside a commit
            tracer = subprocess.Popen([strace, "-f", "-o", "/dev/null", "-e", "trace=fdatasync",
                                       "-e", f"inject=fdatasync:signal=KILL:when={nth}", "-p", str(run.pid)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            assert tracer.stderr is not None
            said = tracer.stderr.readline()
            assert "attached" in said, f"strace could not attach: {said}"
            run.open_gate()
            code = run.wait(120)
            tracer.wait(timeout=30)
            tracer.stderr.close()
        else:
            run = server.start(argv)
            target = progress() + rng.randint(0, plan.max_new)
            wait_for(lambda: run.poll() is not None or progress() >= target, 60, "the agent to make progress")
            time.sleep(rng.uniform(0, plan.max_pause))
            run.kill()
            code = run.wait(30)
        if code == 0:
            return done
        assert code == -signal.SIGKILL, f"a run ended with {code}; its stderr:\n{server.stderr.read_text()[-3000:]}"
        done.kills += 1
        done.in_commit += kind == "commit"
        assert integrity(db) == "ok"
    code = server.start(argv).wait(120)
    assert code == 0, f"the last run ended with {code}; its stderr:\n{server.stderr.read_text()[-3000:]}"
    return done


def integrity(db: Path) -> str:
    if not db.exists():
        return "ok"
    c = sqlite3.connect(db)
    try:
        return str(c.execute("PRAGMA integrity_check").fetchone()[0])
    finally:
        c.close()


def json_lines(path: Path) -> list[Any]:
    """The JSON lines a killed run's side-effect log holds (none if it was never written); a last line cut
    by the kill is skipped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line cut by the kill
    return out
