"""SIGKILL at scale, on both backends: at random moments, at each named phase of the runner (the test-only
crash points of onward.crashpoints, where the worker kills itself), and for SQLite inside a commit (strace
kills the worker as it enters its N-th fdatasync). Command tasks (`onward run`), Python tasks and durable
steps (the Job API, tests/crash/torture_worker.py), with one worker process and with several at once on
one store (4 processes, or one process running 4 tasks at once).

A driver keeps the case's worker processes running: each launch is given one way to die (a phase and the
n-th time it passes it, or a random moment, or a commit), and a worker that died is replaced at once, the
way a supervisor would. After the kill budget is spent, clean workers finish the job, and the checker
(tests/crash/kill_checker.py) counts every breach: lost tasks, executions after a commit, overlapping
executions, fence violations, integrity failures, stray files, a wrong keep-awake marker. Every count must
be 0; they are recorded for RELIABILITY.md as counted, with the recovery time (kill -> the next task
started by the restarted worker). A second test freezes a worker (SIGSTOP) past its lease and times how
long the other worker takes to reclaim its task (watchdog detection).

In the normal suite: >= 100 kills per backend. Under `make torture`: >= 1,000 per backend.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from onward.crashpoints import PHASES
from onward.store import open_store
from onward.supervise import DEFAULT_RESTART_DELAY
from tests import pgutil
from tests.conftest import onward_argv, require_tool, wait_for
from tests.crash.kill_checker import Verdict, check_run, query, sqlite_integrity
from tests.reliability import record

ROOT = Path(__file__).resolve().parents[2]
HEARTBEAT = 0.25  # short, so that "lease renewed" comes round often; leases stay 5 s (no spurious takeovers)
LEASE = 5.0
RANDOM_SHARE = 0.3  # share of launches killed at a random moment rather than at a phase
BACKSTOP = 3.0  # a worker whose phase did not come round within this is killed from outside (a random kill)
CASES_AT_ONCE = 4
# Each execution of a command task: three slices of ~10 ms, a line in the execution log for each (bash's
# EPOCHREALTIME: no process per timestamp). Tasks whose number is a multiple of 3 fail their first attempt.
COMMAND = r'''L="$1"; t="$2"; a="$ONWARD_ATTEMPT"
echo "start $t a$a $$ $EPOCHREALTIME" >> "$L"
for ((i = 0; i < ${TORTURE_SLICES:-3}; i++)); do
    sleep "${TORTURE_SLICE_SECONDS:-0.01}"; echo "tick $t a$a $$ $EPOCHREALTIME" >> "$L"
done
echo "end $t a$a $$ $EPOCHREALTIME" >> "$L"
n="${t##*-}"
if [ $((10#$n % 3)) -eq 0 ] && [ "$a" = 1 ]; then echo "fails its first attempt (on purpose)" >&2; exit 1; fi
echo "result of $t attempt=$a"
'''


@dataclass(frozen=True)
class Case:
    kind: str  # "command", "python" (plain Python tasks) or "steps" (Python tasks of durable steps)
    processes: int  # worker processes at once on the store
    concurrency: int  # tasks at once in each
    kills: int  # the budget of kills (SIGKILL) for this case
    commit_kills: int = 0  # of which inside fdatasync, by strace (SQLite command tasks)

    @property
    def label(self) -> str:
        return f"{self.kind} tasks, {self.processes} worker process(es) x --concurrency {self.concurrency}"


def phases_for(kind: str) -> list[str]:
    # (No case waits: the wait phases have their own test, tests/crash/test_wait_kills.py.)
    return [p for p in PHASES if (p != "step_recorded" or kind == "steps") and (p != "child_noted" or kind == "command")
            and not p.startswith("wait_")]


# CI: >= 100 kills per backend in three cases that together cover both task kinds, steps, 1 and 4 workers.
CI_CASES = [Case("command", 1, 1, 36), Case("python", 4, 1, 36), Case("steps", 1, 4, 36)]
CI_COMMIT_KILLS = 10
# make torture: every kind with every layout; >= 1,000 kills per backend.
# The lone-worker cases come first: they take longest (one start-up per kill), so they start at once.
TORTURE_CASES = [Case(kind, procs, conc, 115) for procs, conc in ((1, 1), (4, 1), (1, 4))
                 for kind in ("command", "python", "steps")]
TORTURE_COMMIT_KILLS = 60


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def store_for(backend: str, tmp_path: Path) -> Iterator[str]:
    if backend == "sqlite":
        (tmp_path / "store").mkdir()
        yield str(tmp_path / "store" / "onward.db")
    else:
        with pgutil.fresh_database() as url:
            yield url


def test_kills_lose_nothing_and_redo_nothing(backend: str, tmp_path: Path, seed: int) -> None:
    """The CI-scale torture: >= 100 SIGKILLs on this backend, every one checked."""
    run_cases(backend, tmp_path, seed, CI_CASES, CI_COMMIT_KILLS, mode="ci")


@pytest.mark.torture
@pytest.mark.timeout(1800)  # several minutes per backend on a busy machine (the suite's limit is 300 s)
def test_torture_kills_lose_nothing_and_redo_nothing(backend: str, tmp_path: Path, seed: int) -> None:
    """The make-torture scale: >= 1,000 SIGKILLs on this backend."""
    run_cases(backend, tmp_path, seed, TORTURE_CASES, TORTURE_COMMIT_KILLS, mode="torture")


def run_cases(backend: str, tmp_path: Path, seed: int, cases: list[Case], commit_kills: int, mode: str) -> None:
    rng = random.Random(seed)
    strace = require_tool("strace") if backend == "sqlite" else None
    total = 0
    failures: list[str] = []
    recoveries: list[float] = []
    runs = []
    for i, case in enumerate(cases):
        if strace and case.kind == "command" and case.processes == 1 and case.concurrency == 1:
            case = Case(case.kind, case.processes, case.concurrency, case.kills, commit_kills)
        runs.append((i, case, random.Random(rng.getrandbits(64))))

    def one(i: int, case: Case, case_rng: random.Random) -> RunResult:
        folder = tmp_path / f"case{i}"
        folder.mkdir()
        for url in store_for(backend, folder):
            return KillRun(backend, url, folder, case, case_rng, strace).run()
        raise AssertionError("no store")

    # Cases run side by side (four at a time): a lone worker's case waits on process start-ups, not on
    # the processors. Their kills do not interact: each case has its own store and folders.
    with concurrent.futures.ThreadPoolExecutor(max_workers=CASES_AT_ONCE) as pool:
        results = list(pool.map(lambda r: one(*r), runs))
    for (_, case, _), result in zip(runs, results, strict=True):
        total += result.kills
        recoveries += result.recovery
        breaches = result.verdict.breaches()
        record("kills", backend=backend, case=f"{case.label} ({mode})", seed=seed, kills=result.kills,
               by_way=dict(sorted(result.by_way.items())), tasks=result.verdict.tasks,
               executions=result.verdict.executions, step_executions=result.verdict.step_executions,
               seconds=round(result.seconds, 1), worker_errors=len(result.errors), **breaches)
        print(f"{backend} {case.label}: {result.kills} kills {dict(result.by_way)} in {result.seconds:.1f}s;"
              f" executions={result.verdict.executions} steps={result.verdict.step_executions} {breaches}")
        if any(breaches.values()) or result.errors:
            failures.append(f"{case.label}: {breaches} {result.verdict.problems[:10]} {result.errors[:3]}")
    if recoveries:
        record("recovery", backend=backend, case="kill of a lone worker -> next task started, the worker restarted"
               f" at once, {CASES_AT_ONCE} cases at a time (a restart killed again before it starts a task"
               f" adds its time) ({mode})",
               seed=seed, samples=len(recoveries), median_s=round(statistics.median(recoveries), 3),
               p90_s=round(quantile(recoveries, 0.9), 3), max_s=round(max(recoveries), 3))
    median = f"{statistics.median(recoveries):.3f}s" if recoveries else "-"
    print(f"{backend}: {total} kills in all (seed {seed}); recovery median {median} over {len(recoveries)}")
    assert not failures, f"seed {seed}: " + "\n".join(failures)
    budget = sum(c.kills for c in cases)
    assert total >= budget, f"only {total} kills of {budget} (seed {seed})"


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Launch:
    proc: subprocess.Popen[bytes]
    way: str  # how it is to die: a phase, "random", or "commit"
    kill_at: float  # monotonic time at which it is killed from outside, if still running
    started: float


class KillRun:
    """One case on one store: keep its workers dying and coming back until the kill budget is spent."""

    def __init__(self, backend: str, url: str, folder: Path, case: Case, rng: random.Random,
                 strace: str | None) -> None:
        self.backend, self.url, self.case, self.rng, self.strace = backend, url, case, rng, strace
        self.out = folder / "out"
        self.exec_log = folder / "executions.log"
        self.keep_awake = folder / "awake" / "marker"
        self.stderr_path = folder / "workers.stderr"
        self.names: list[str] = []
        self.kills = 0
        self.by_way: Counter[str] = Counter()
        self.deaths: list[float] = []  # wall-clock times at which a lone worker was seen dead
        self.errors: list[str] = []
        self.integrity_failures = 0  # SQLite: checked after every kill
        self.env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}", ONWARD_TEST_HOOKS="1")
        self.env.pop("ONWARD_CRASH_AT", None)

    def add_tasks(self, n: int) -> None:
        first = len(self.names)
        new = [f"t-{i:05d}" for i in range(first, first + n)]
        store = open_store(self.url)
        try:
            store.add(new)
        finally:
            store.close()
        self.names += new

    def argv(self) -> list[str]:
        c = self.case
        if c.kind == "command":
            return onward_argv("run", "--db", self.url, "--out", str(self.out), "--concurrency", str(c.concurrency),
                               "--max-attempts", "1000", "--retry-delay", "0", "--heartbeat", str(HEARTBEAT),
                               "--lease", str(LEASE), "--keep-awake", str(self.keep_awake), "-q", "--",
                               "bash", "-c", COMMAND, "x", str(self.exec_log), "{task}")
        return [sys.executable, "-m", "tests.crash.torture_worker", self.url, str(self.out), str(self.exec_log),
                c.kind, str(c.concurrency), str(self.keep_awake)]

    def launch(self, way: str | None = None) -> Launch:
        c, rng = self.case, self.rng
        env = dict(self.env)
        now = time.monotonic()
        argv = self.argv()
        if way is None:
            # Kills inside a commit spread evenly over the case: their share is what is left of their budget.
            if rng.random() < (c.commit_kills - self.by_way["commit"]) / max(1, c.kills - self.kills):
                way = "commit"
            elif rng.random() < RANDOM_SHARE:
                way = "random"
            else:
                way = rng.choice(phases_for(c.kind))
        if way == "commit":
            assert self.strace is not None
            # strace kills the worker as it enters its n-th fdatasync: inside a commit of the store.
            argv = [self.strace, "-f", "-qq", "-o", "/dev/null", "-e", "trace=fdatasync",
                    "-e", f"inject=fdatasync:signal=KILL:when={rng.randint(2, 10)}", *argv]
            kill_at = now + 30
        elif way == "random":
            kill_at = now + rng.uniform(0.05, 0.5)
        elif way == "clean":
            env.pop("ONWARD_TEST_HOOKS")
            kill_at = float("inf")
        else:
            n = rng.randint(1, 2) if way in ("retry_scheduled", "reclaim", "lease_renewed") else rng.randint(1, 4)
            env["ONWARD_CRASH_AT"] = f"{way}:{n}"
            kill_at = now + BACKSTOP
        with open(self.stderr_path, "ab") as err:
            proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT)
        return Launch(proc, way, kill_at, now)

    def run(self) -> RunResult:
        c = self.case
        began = time.monotonic()
        self.add_tasks(c.kills + 10)
        running: list[Launch] = []
        while self.kills < c.kills:
            while len(running) < c.processes:
                running.append(self.launch())
            time.sleep(0.005)
            for launch in list(running):
                code = launch.proc.poll()
                if code is None and time.monotonic() >= launch.kill_at:
                    launch.proc.send_signal(signal.SIGKILL)
                    code = launch.proc.wait()
                    way = "random" if launch.way in ("random", "commit") else "backstop (phase not reached)"
                    self.died(launch, way, running)
                elif code is None:
                    continue
                elif code == -signal.SIGKILL or (launch.way == "commit" and code != 0):
                    self.died(launch, launch.way, running)
                elif code == 0:
                    running.remove(launch)
                    if not any(self.store_counts().get(s, 0) for s in ("pending", "running")):
                        self.add_tasks(max(10, c.kills // 3))  # finished early: more work for the next kills
                else:
                    running.remove(launch)
                    self.errors.append(f"a worker ({launch.way}) exited {code}: {self.stderr_tail()}")
            if self.errors:
                break
        for launch in running:  # the budget is spent: the last ones die too (counted, as they are kills)
            launch.proc.send_signal(signal.SIGKILL)
            launch.proc.wait()
            self.kills += 1
            self.by_way["random"] += 1
        finals = [self.launch("clean") for _ in range(c.processes)]
        for launch in finals:
            try:
                code = launch.proc.wait(timeout=600)
            except subprocess.TimeoutExpired:
                launch.proc.kill()
                code = launch.proc.wait()
            if code != 0:
                self.errors.append(f"the final clean worker exited {code}: {self.stderr_tail()}")
        verdict = check_run(self.url, self.names, c.kind, self.exec_log, self.out, self.keep_awake)
        verdict.integrity_failures += self.integrity_failures
        return RunResult(self.kills, self.by_way, verdict, self.recovery_times(), self.errors,
                         time.monotonic() - began)

    def died(self, launch: Launch, way: str, running: list[Launch]) -> None:
        running.remove(launch)
        self.kills += 1
        self.by_way[way] += 1
        if self.case.processes == 1:
            self.deaths.append(time.time())
        if self.backend == "sqlite" and sqlite_integrity(self.url) is not None:
            self.integrity_failures += 1
            self.errors.append(f"integrity_check failed after a kill ({way}): {sqlite_integrity(self.url)}")

    def store_counts(self) -> dict[str, int]:
        return {s: int(n) for s, n in query(self.url, "SELECT state, count(*) FROM {t}tasks GROUP BY state")}

    def stderr_tail(self) -> str:
        try:
            return self.stderr_path.read_bytes()[-1500:].decode(errors="replace")
        except OSError:
            return ""

    def recovery_times(self) -> list[float]:
        """For a lone worker: from its death (as its restarter saw it) to the next execution started. The
        worker started next may be killed before it starts one (a kill at "reclaim", a random kill during
        its start-up): then the time runs on to the one after (the supervise test measures clean restarts)."""
        if not self.deaths or not self.exec_log.exists():
            return []
        starts = sorted(float(line.split()[4]) for line in self.exec_log.read_text().splitlines()
                        if line.startswith("start "))
        times = []
        for death in self.deaths:
            i = bisect.bisect_left(starts, death)
            if i < len(starts):
                times.append(starts[i] - death)
        return times


@dataclass
class RunResult:
    kills: int
    by_way: Counter[str]
    verdict: Verdict
    recovery: list[float]
    errors: list[str]
    seconds: float


# --- watchdog: a frozen worker's task taken over ----------------------------------------------------------
WATCH_HEARTBEAT = 0.2
WATCH_LEASE = 1.0


def test_frozen_worker_is_detected_and_its_task_taken_over(backend: str, tmp_path: Path, seed: int) -> None:
    freeze_and_reclaim(backend, tmp_path, seed, samples=2, mode="ci")


@pytest.mark.torture
def test_torture_frozen_workers(backend: str, tmp_path: Path, seed: int) -> None:
    freeze_and_reclaim(backend, tmp_path, seed, samples=6, mode="torture")


def freeze_and_reclaim(backend: str, tmp_path: Path, seed: int, *, samples: int, mode: str) -> None:
    """Two workers; one is frozen (SIGSTOP) while it runs a task, past its lease. The other must take the
    task over (its journal says "reclaimed"): the detection time is SIGSTOP -> that reclaim's commit. Then the
    frozen one is thawed (SIGCONT): it must find its claim gone and commit nothing of it. The checker then
    runs as after the kills (overlaps above all: the frozen worker's command must be stopped before the task
    runs again)."""
    rng = random.Random(seed)
    for url in store_for(backend, tmp_path):
        out, exec_log = tmp_path / "out", tmp_path / "executions.log"
        store = open_store(url)
        names = [f"w-{i:04d}" for i in range(1, samples + 4)]
        store.add(names)
        store.close()
        argv = onward_argv("run", "--db", url, "--out", str(out), "--concurrency", "1", "--max-attempts", "1000",
                           "--retry-delay", "0", "--heartbeat", str(WATCH_HEARTBEAT), "--lease", str(WATCH_LEASE),
                           "-q", "--", "bash", "-c", COMMAND, "x", str(exec_log), "{task}")
        # Each task: 8 slices of 0.1 s (its command logs a line each), long enough to be frozen mid-way.
        env = dict(os.environ, TORTURE_SLICES="8", TORTURE_SLICE_SECONDS="0.1")
        workers = [subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                   for _ in range(2)]
        detections: list[float] = []
        logs: list[str] = []  # the workers' stderr, shown if the check of their fenced outcomes fails
        try:
            while len(detections) < samples:
                frozen = workers[rng.randrange(2)]
                wait_for(lambda: running_task_of(url, frozen.pid) or top_up(url, names), 60,
                         "a task running on the worker")
                time.sleep(rng.uniform(0.0, 0.3))
                stopped_at = time.time()
                frozen.send_signal(signal.SIGSTOP)
                try:
                    # Read once it is frozen: its task may have ended meanwhile (then the sample is taken again).
                    task_id = running_task_of(url, frozen.pid)
                    if task_id is None:
                        continue
                    reclaimed_at = wait_for(lambda: reclaim_after(url, task_id, stopped_at), 30,
                                            "the frozen worker's task reclaimed")
                finally:
                    frozen.send_signal(signal.SIGCONT)
                detections.append(float(str(reclaimed_at)) - stopped_at)
            for worker in workers:
                _, err = worker.communicate(timeout=120)
                assert worker.returncode == 0, err.decode()[-2000:]
                logs.append(err.decode(errors="replace"))
        finally:
            for worker in workers:
                if worker.poll() is None:
                    worker.kill()
                    worker.wait()
        verdict = check_run(url, names, "command", exec_log, out, None)
        fenced = query(url, "SELECT count(*) FROM {t}events WHERE kind = 'fenced'")[0][0]
        record("watchdog", backend=backend, case=f"worker frozen (SIGSTOP) past its {WATCH_LEASE:g} s lease,"
               f" heartbeat {WATCH_HEARTBEAT:g} s ({mode})", seed=seed, samples=len(detections),
               median_s=round(statistics.median(detections), 3), max_s=round(max(detections), 3),
               fenced_outcomes=int(fenced), **verdict.breaches())
        print(f"{backend}: frozen worker detected after {[round(d, 3) for d in detections]} s; fenced={fenced};"
              f" {verdict.breaches()}")
        assert not any(verdict.breaches().values()), verdict.problems
        # Each thawed worker learnt of its loss, none committed (checked above): it journaled a fenced
        # outcome, or, when the store did not answer it in time after the thaw (a loaded machine), it found
        # its lease run out by its own clock and said so, with nothing to journal it in.
        ran_out = sum(log.count("lease ran out task=") for log in logs)
        assert fenced + ran_out >= samples, "\n---\n".join(log[-3000:] for log in logs)


def top_up(url: str, names: list[str]) -> bool:
    """More tasks when none is left to claim, so that a worker always gets one to be frozen in (False: the
    caller goes on waiting)."""
    if query(url, "SELECT count(*) FROM {t}tasks WHERE state = 'pending'")[0][0] == 0:
        more = [f"w-{i:04d}" for i in range(len(names) + 1, len(names) + 5)]
        store = open_store(url)
        try:
            store.add(more)
        finally:
            store.close()
        names += more
    return False


def running_task_of(url: str, pid: int) -> int | None:
    rows = query(url, "SELECT t.id FROM {t}tasks t JOIN {t}workers w ON w.id = t.worker_id"
                      f" WHERE t.state = 'running' AND w.pid = {int(pid)}")
    return int(rows[0][0]) if rows else None


def reclaim_after(url: str, task_id: int, since: float) -> float | None:
    rows = query(url, f"SELECT min(at) FROM {{t}}events WHERE kind = 'reclaimed' AND task_id = {int(task_id)}"
                      f" AND at >= {since!r}")
    return float(rows[0][0]) if rows and rows[0][0] is not None else None


# --- recovery under onward supervise ----------------------------------------------------------------------
@pytest.mark.torture
def test_torture_recovery_under_supervise(backend: str, tmp_path: Path, seed: int) -> None:
    """`onward supervise` keeps one worker; the worker is SIGKILLed while it runs a task, again and again.
    Recovery time: the kill -> the next task started by the worker that the supervisor restarted. Then the
    checker runs on the whole job."""
    rng = random.Random(seed)
    samples = 8
    for url in store_for(backend, tmp_path):
        out, exec_log = tmp_path / "out", tmp_path / "executions.log"
        names = [f"s-{i:04d}" for i in range(1, 3 * samples)]
        store = open_store(url)
        store.add(names)
        store.close()
        # The default restart delay: the recovery figure is the one a user gets.
        argv = onward_argv("supervise", "--max-restarts", "1000", "--db", url, "--",
                           *onward_argv("run", "--db", url, "--out", str(out), "--max-attempts", "1000",
                                        "--retry-delay", "0", "-q", "--", "bash", "-c", COMMAND, "x",
                                        str(exec_log), "{task}"))
        env = dict(os.environ, TORTURE_SLICES="5", TORTURE_SLICE_SECONDS="0.1")
        supervisor = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        recoveries: list[float] = []
        try:
            for _ in range(samples):
                worker = int(str(wait_for(lambda: worker_running_a_task(url, supervisor.pid), 60,
                                          "the supervised worker running a task")))
                time.sleep(rng.uniform(0.0, 0.3))
                killed_at = time.time()
                os.kill(worker, signal.SIGKILL)
                started = wait_for(lambda: next_start(exec_log, killed_at), 60, "a task started after the kill")
                recoveries.append(float(str(started)) - killed_at)
            _, err = supervisor.communicate(timeout=300)
            assert supervisor.returncode == 0, err.decode()[-2000:]
        finally:
            if supervisor.poll() is None:
                supervisor.kill()
                supervisor.wait()
        verdict = check_run(url, names, "command", exec_log, out, None)
        record("recovery", backend=backend, case="kill -> next task started, under onward supervise"
               f" (default --restart-delay {DEFAULT_RESTART_DELAY:g}) (torture)", seed=seed, samples=len(recoveries),
               median_s=round(statistics.median(recoveries), 3), max_s=round(max(recoveries), 3),
               kills=len(recoveries), **verdict.breaches())
        print(f"{backend}: recovery under supervise {[round(r, 3) for r in recoveries]} s; {verdict.breaches()}")
        assert not any(verdict.breaches().values()), verdict.problems


def worker_running_a_task(url: str, supervisor_pid: int) -> int | None:
    """The pid of the supervisor's worker while it runs a task (from the store: the task's owner), once it
    finished one."""
    try:
        children = Path(f"/proc/{supervisor_pid}/task/{supervisor_pid}/children").read_text().split()
    except OSError:
        return None
    for child in children:
        # Only once it has settled a task since its start: a worker killed before it got anywhere is a
        # crash loop to the supervisor, which then waits longer and longer (that is its policy, not recovery).
        settled = query(url, "SELECT count(*) FROM {t}events e JOIN {t}workers w ON w.id = e.worker_id"
                             f" WHERE e.kind = 'done' AND w.pid = {int(child)}")[0][0]
        if settled and running_task_of(url, int(child)) is not None:
            return int(child)
    return None


def next_start(exec_log: Path, after: float) -> float | None:
    if not exec_log.exists():
        return None
    starts = [float(line.split()[4]) for line in exec_log.read_text().splitlines() if line.startswith("start ")]
    later = [s for s in starts if s > after]
    return min(later) if later else None
