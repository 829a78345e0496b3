"""Running out of memory for real: the kernel's OOM killer (a cgroup v1 memory limit) ending a task's command
or the whole worker, and RLIMIT_AS making Python raise MemoryError in a Python task or in onward's own code;
and values bigger than a store takes. Whatever runs out, nothing is lost, nothing committed runs again, the
store stays sound, and the worker neither hangs nor crash-loops for ever.

The OOM-killer tests need root and the cgroup v1 memory controller (/sys/fs/cgroup/memory); they skip
without them, except under CI (CI=true), where that is a failure.
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import pytest

from onward.config import MAX_STORED_BYTES
from tests.conftest import in_cgroup, onward_argv, own_cgroup_v1, run_onward
from tests.crash.kill_checker import check_run, integrity_problems, query
from tests.reliability import record

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
NAMES = [f"t{i}" for i in range(20)]  # memory_worker's tasks besides "hog"


def address_space(limit: int) -> Callable[[], None]:
    """A preexec function: the child's RLIMIT_AS (``ulimit -v``) is ``limit`` bytes."""
    def limit_it() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return limit_it


def memory_worker(store: str, tmp_path: Path, mode: str, max_attempts: int) -> list[str]:
    """The argv of tests/crash/memory_worker.py on ``store``; its results go to tmp_path/out, its executions
    to tmp_path/exec.log."""
    return [sys.executable, "-m", "tests.crash.memory_worker", store, str(tmp_path / "out"), mode,
            str(tmp_path / "exec.log"), str(max_attempts)]


def assert_the_others_done_once(store: str, tmp_path: Path) -> None:
    """Every task but ``hog`` done exactly once, by the execution whose result the store holds, and the
    store sound (tests/crash/kill_checker.py)."""
    verdict = check_run(store, NAMES, "python", tmp_path / "exec.log", tmp_path / "out", None)
    assert not any(verdict.breaches().values()), verdict.problems


def hog(store: str) -> tuple[str, int, str]:
    """The state, attempts and error of the task ``hog``."""
    rows = query(store, "SELECT state, attempts, error FROM {t}tasks WHERE name = 'hog'")
    state, attempts, error = rows[0]
    return state, int(attempts), error or ""


# --- MemoryError (RLIMIT_AS) --------------------------------------------------------------------------------
def hog_failed_and_the_worker_went_on(store: str, tmp_path: Path, mode: str, max_attempts: int) -> str:
    """Run memory_worker in ``mode`` under a 700 MiB RLIMIT_AS and check that the worker went on: exit 3, no
    traceback of a thread of its own, ``hog`` failed after ``max_attempts``, every other task done once.
    Returns ``hog``'s error."""
    worker = subprocess.run(memory_worker(store, tmp_path, mode, max_attempts), env=ENV, capture_output=True,
                            timeout=120, preexec_fn=address_space(700 * 2**20))
    err = worker.stderr.decode(errors="replace")
    assert worker.returncode == 3, err[-3000:]
    # The log's lines only: no thread died with a traceback of its own.
    assert "Exception in thread" not in err and "\nTraceback" not in err, err[-3000:]
    state, attempts, error = hog(store)
    assert (state, attempts) == ("failed", max_attempts), (state, attempts, error)
    assert_the_others_done_once(store, tmp_path)
    return error


# The async path fails the same way on both backends: SQLite's case is enough.
@pytest.mark.parametrize(("store_url", "mode"), [("sqlite", "fill"), ("postgres", "fill"), ("sqlite", "async-fill")],
                         indirect=["store_url"])
def test_a_python_task_out_of_memory_fails_its_attempts_and_the_worker_goes_on(store_url: str, tmp_path: Path,
                                                                               mode: str) -> None:
    """The task ``hog`` allocates until not even 64 bytes more can be had (RLIMIT_AS), holding it all, and
    lets the MemoryError go: each attempt fails with it, the task ends failed after max attempts, every
    other task is done once, and the worker exits 3 on its own. Formatting the traceback of a MemoryError
    needs memory too: where that failed, the task's thread died without reporting its attempt, and the
    worker renewed its lease for ever (here the 4th or 5th attempt, in 4 runs of 4)."""
    error = hog_failed_and_the_worker_went_on(store_url, tmp_path, mode, 6)
    assert "MemoryError" in error or "out of memory" in error, error


def test_a_worker_whose_heartbeat_finds_no_memory_while_its_task_holds_it_all_goes_on(store_url: str,
                                                                                     tmp_path: Path) -> None:
    """The task ``hog`` holds all the memory there is for 0.8 s before its MemoryError ends its attempt: the
    worker's heartbeats meanwhile (every 0.5 s: the store's checks, the lease renewal) find none either.
    Before, such a heartbeat's MemoryError ended the worker (the Python API raised it, exit 1 here; seen in
    the test above when a heartbeat fell in the moment the task held it all). Now the heartbeat is skipped
    with a warning, the task's attempts fail with their MemoryError, and the worker goes on."""
    hog_failed_and_the_worker_went_on(store_url, tmp_path, "fill-hold", 1)


def test_a_worker_out_of_memory_in_its_own_code_says_one_line_and_exits_75(store_url: str,
                                                                           tmp_path: Path) -> None:
    """`onward run --concurrency 4` of commands that each print 16 MB, under a 100 MiB RLIMIT_AS: the worker
    runs out of memory in its own code (reading the outputs, or SQLite's copy of a result in its commit).
    It says so in one line and exits 75, as for ENOMEM (a supervisor restarts it), instead of a traceback
    and exit 1; what it had not committed is not done, and the next worker finishes the job, each task done
    once."""
    tasks = tmp_path / "tasks.txt"
    names = [str(i) for i in range(8)]
    tasks.write_text("".join(n + "\n" for n in names))
    run = onward_argv("run", "-q", "--db", store_url, "--tasks", str(tasks), "--concurrency", "4", "--",
                      "head", "-c", "16000000", "/dev/zero")
    limited = subprocess.run(run, env=ENV, capture_output=True, timeout=120,
                             preexec_fn=address_space(100 * 2**20))
    err = limited.stderr.decode(errors="replace")
    assert limited.returncode == 75, err[-3000:]
    assert err.splitlines() == ["onward: error: out of memory"], err[-3000:]
    assert integrity_problems(store_url) == []
    again = subprocess.run(run, env=ENV, capture_output=True, timeout=120)
    assert again.returncode == 0, again.stderr.decode()[-3000:]
    states = dict(query(store_url, "SELECT name, state FROM {t}tasks"))
    assert states == {n: "done" for n in names}
    assert query(store_url, "SELECT task_id FROM {t}events WHERE kind = 'done' GROUP BY task_id"
                            " HAVING count(*) > 1") == []
    assert integrity_problems(store_url) == []


# --- values bigger than a store takes ------------------------------------------------------------------------
# A step's value is refused before any store call: SQLite's case is enough.
@pytest.mark.parametrize(("store_url", "mode"),
                         [("sqlite", "big-result"), ("postgres", "big-result"), ("sqlite", "big-step")],
                         indirect=["store_url"])
def test_a_value_bigger_than_a_store_takes_fails_its_attempt_at_once(store_url: str, tmp_path: Path,
                                                                    mode: str) -> None:
    """A result of 1,000,000,001 bytes (more than SQLite holds in a row), or a durable step's value one byte
    over MAX_STORED_BYTES: the attempt fails naming the size, before any commit. The result failed its
    commit with "string or blob too big" instead, and the worker retried that commit, with every other
    task's outcome, for good."""
    worker = subprocess.run(memory_worker(store_url, tmp_path, mode, 1), env=ENV, capture_output=True,
                            timeout=120)
    err = worker.stderr.decode(errors="replace")
    assert worker.returncode == 3, err[-3000:]
    state, attempts, error = hog(store_url)
    assert state == "failed" and f"more than a store takes ({MAX_STORED_BYTES:,} at most)" in error, error[-500:]
    if mode == "big-step":  # it said "step 'big''s value is ..."
        assert f"the value of step 'big' is {MAX_STORED_BYTES + 3:,} bytes" in error, error[-500:]
    assert_the_others_done_once(store_url, tmp_path)


def test_max_result_bytes_over_what_a_store_takes_is_refused(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("a\n")
    r = run_onward("run", "--db", str(tmp_path / "s.db"), "--tasks", str(tasks), "--max-result-bytes",
                   str(MAX_STORED_BYTES + 1), "--", "echo", "{task}")
    assert r.returncode == 2 and r.stderr.decode().count("\n") == 1, r.stderr
    assert "--max-result-bytes must be at most" in r.stderr.decode()
    assert not (tmp_path / "s.db").exists()


# --- the kernel's OOM killer (cgroup v1 memory limit) -------------------------------------------------------
@pytest.fixture
def memory_cgroup() -> Iterator[Path]:
    """A cgroup v1 memory cgroup of the test's own, limited to 200 MiB."""
    with own_cgroup_v1("memory") as cgroup:
        (cgroup / "memory.limit_in_bytes").write_text(str(200 * 2**20))
        yield cgroup


def oom_kills(cgroup: Path) -> int:
    """How many processes the OOM killer killed in ``cgroup`` (memory.oom_control)."""
    text = (cgroup / "memory.oom_control").read_text()
    return int(re.search(r"^oom_kill (\d+)$", text, re.M).group(1))  # type: ignore[union-attr]


def test_a_command_oom_killed_every_time_is_failed_after_max_attempts_and_the_worker_goes_on(
        store_url: str, tmp_path: Path, memory_cgroup: Path) -> None:
    """The command of task ``hog`` moves itself into a cgroup limited to 200 MiB and touches 600 MiB: the
    OOM killer kills it each time. Each attempt fails as killed by SIGKILL, the task ends failed after
    --max-attempts, and the worker (outside the cgroup) goes on with the others and exits 3."""
    tasks = tmp_path / "tasks.txt"
    names = ["a", "hog", "b", "c"]
    tasks.write_text("".join(n + "\n" for n in names))
    script = (f'if [ "$1" = hog ]; then echo $$ > {memory_cgroup}/cgroup.procs; exec "$2" -c '
              '"x = bytearray(600 << 20)\nfor i in range(0, len(x), 4096): x[i] = 1"; fi; echo "result of $1"')
    r = run_onward("run", "--db", store_url, "--tasks", str(tasks), "--max-attempts", "3", "--retry-delay", "0",
                   "--", "sh", "-c", script, "sh", "{task}", sys.executable)
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 3, err[-3000:]
    assert oom_kills(memory_cgroup) == 3
    assert err.count('attempt failed task="hog"') == 2 and 'failed task="hog" after 3 attempts: killed by signal' \
        ' SIGKILL' in err, err[-3000:]
    assert hog(store_url) == ("failed", 3, "killed by signal SIGKILL")
    states = dict(query(store_url, "SELECT name, state FROM {t}tasks"))
    assert states == {"a": "done", "hog": "failed", "b": "done", "c": "done"}
    shown = run_onward("status", "--db", store_url).stdout.decode()
    assert "killed by signal SIGKILL" in shown, shown


def test_a_task_that_gets_the_worker_oom_killed_is_failed_as_poison_under_supervise(
        store_url: str, tmp_path: Path, memory_cgroup: Path) -> None:
    """`onward supervise` of a Python worker in a cgroup limited to 200 MiB, whose task ``hog`` touches 600
    MiB: the OOM killer kills the whole worker each time it runs it. The supervisor restarts it in well
    under a second each time, each restart's reclaim counts the attempt, the task ends failed after max
    attempts instead of crash-looping, every other task is done once, and the supervisor exits 3."""
    argv = onward_argv("supervise", "--db", store_url, "--",
                       *in_cgroup(memory_cgroup, memory_worker(store_url, tmp_path, "touch", 3)))
    r = subprocess.run(argv, env=ENV, capture_output=True, timeout=120)
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 3, err[-3000:]
    assert oom_kills(memory_cgroup) == 3, err[-3000:]
    state, attempts, error = hog(store_url)
    assert (state, attempts) == ("failed", 3) and "owner died" in error, (state, attempts, error)
    assert_the_others_done_once(store_url, tmp_path)
    # From each death to the next worker's READY: the restart delay (0.1 s, doubling while runs die fast
    # without progress) plus a Python worker's start-up, 0.3-0.7 s here. How fast is measured by the
    # recovery benchmark; this bound only catches a restart held back by seconds (a crash loop's growing
    # backoff), and holds on a loaded machine (up to 3 s seen at a load of 10 on 2 cores).
    died = [at for at, line in _timed(err) if " died: signal SIGKILL" in line]
    ready = [at for at, line in _timed(err) if line.endswith(" ready")]
    assert len(died) == 3 and len(ready) == 4, err[-3000:]
    gaps = [(next(r for r in ready if r > d) - d).total_seconds() for d in died]
    print(f"restart (death -> ready), seconds: {gaps}")
    assert all(gap < 6.0 for gap in gaps), gaps
    restarts = query(store_url, "SELECT count(*) FROM {t}events WHERE kind = 'restart'")[0][0]
    assert restarts == 3


def test_tasks_that_only_together_need_more_memory_than_there_is_all_end_done_under_supervise(
        store_url: str, tmp_path: Path, memory_cgroup: Path) -> None:
    """`onward supervise` of a Python worker at concurrency 4 in a cgroup limited to 200 MiB, whose twelve
    tasks each hold 60 MiB for a moment: each fits alone, three at once do not. Every crash comes with
    several tasks running, so none is counted; they run alone afterwards, and all end done, each once.
    (Before, each crash counted an attempt of the four tasks it ended: four of them ended failed, and the
    supervisor gave up on restarts without progress, no task done.)"""
    argv = onward_argv("supervise", "--db", store_url, "--",
                       *in_cgroup(memory_cgroup, memory_worker(store_url, tmp_path, "together", 3)))
    r = subprocess.run(argv, env=ENV, capture_output=True, timeout=300)
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 0, err[-3000:]
    assert oom_kills(memory_cgroup) >= 1, err[-3000:]
    names = [f"g{i}" for i in range(12)]
    verdict = check_run(store_url, names, "python", tmp_path / "exec.log", tmp_path / "out", None)
    assert not any(verdict.breaches().values()), verdict.problems
    rows = query(store_url, "SELECT count(*) FROM {t}tasks WHERE state = 'done'")
    assert rows[0][0] == 12, err[-3000:]


def _timed(stderr: str) -> list[tuple[datetime, str]]:
    """The lines of a supervisor's and worker's stderr with their ISO times."""
    lines = []
    for line in stderr.splitlines():
        stamp = line.split(" ", 1)[0]
        if stamp.endswith("Z"):
            lines.append((datetime.fromisoformat(stamp[:-1]), line))
    return lines



def oom_kills_at_random_moments(store_url: str, tmp_path: Path, cgroup: Path, seed: int, tasks: int) -> int:
    """`onward supervise` of a Python worker running four tasks at once in a cgroup limited to 200 MiB,
    each task touching 20 to 80 MiB for a moment (drawn from ``seed``): the OOM killer kills the worker
    whenever the tasks of the moment need more, and the supervisor restarts it, until every task is done.
    Nothing may be lost, run again after its completion was committed, or overlap; the store stays sound.
    Returns the number of OOM kills."""
    env = dict(ENV, MEMORY_SEED=str(seed), MEMORY_TASKS=str(tasks))
    argv = onward_argv("supervise", "--db", store_url, "--max-restarts", "1000", "--",
                       *in_cgroup(cgroup, memory_worker(store_url, tmp_path, "random", 1000)))
    r = subprocess.run(argv, env=env, capture_output=True, timeout=1500)
    err = r.stderr.decode(errors="replace")
    kills = oom_kills(cgroup)
    names = [f"t{i}" for i in range(tasks)]
    verdict = check_run(store_url, names, "python", tmp_path / "exec.log", tmp_path / "out", None)
    backend = "postgres" if store_url.startswith("postgresql") else "sqlite"
    record("OOM killer", backend=backend, case="worker OOM-killed at random moments (cgroup v1 memory limit),"
           " Python tasks x 4, onward supervise", seed=seed, tasks=tasks, oom_kills=kills,
           exit_status=r.returncode, **verdict.breaches())
    print(f"seed={seed}: {kills} OOM kills over {tasks} tasks, {verdict.executions} executions")
    assert r.returncode == 0, err[-3000:]
    assert not any(verdict.breaches().values()), verdict.problems
    assert kills >= 1, err[-3000:]
    return kills


def test_a_worker_oom_killed_at_random_moments_loses_nothing_and_redoes_nothing(
        store_url: str, tmp_path: Path, memory_cgroup: Path, seed: int) -> None:
    oom_kills_at_random_moments(store_url, tmp_path, memory_cgroup, seed, 40)


@pytest.mark.torture
@pytest.mark.timeout(1800)
def test_torture_a_worker_oom_killed_at_random_moments(store_url: str, tmp_path: Path, memory_cgroup: Path,
                                                       seed: int) -> None:
    oom_kills_at_random_moments(store_url, tmp_path, memory_cgroup, seed, 600)

