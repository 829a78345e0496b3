"""The checker of a kill-torture run: reads the store (SQLite file or PostgreSQL database), the append-only
execution log the tasks wrote, the --out folder and the keep-awake marker, and COUNTS every breach of
onward's guarantees. A run passes when every count is 0; the counts go to RELIABILITY.md as measured.

The execution log (one line per side effect, written by the tasks themselves):

    start|tick|end TASK ID PID TIME     an execution of TASK; ID is a<attempt> for commands (a command's
                                        attempt number grows with every claim, a crash's reclaim included)
                                        and f<fence> for Python tasks (the claim's fence: attempts of a task
                                        that recorded new steps before a crash are given back, the fence
                                        moves on every claim)
    sstart|send TASK ID PID TIME IDX    the body of durable step IDX ran under that execution

What each count means:

- ``lost``: a task that is not done, or whose stored result or --out file is not the right one.
- ``executed_after_commit``: an execution of a task started after the one whose completion was committed
  (a later id), or an id started twice; a step body run by an execution later than the one whose record
  was committed.
- ``overlaps``: two executions of one task alive at the same time (the later one started before the last
  line the earlier one wrote).
- ``fence_violations``: the committed result is not from the claim that holds the task (its id is not the
  store's attempt/fence of the task), or the journal has not exactly one completion, by that claim.
- ``integrity_failures``: ``PRAGMA integrity_check`` / ``foreign_key_check`` (SQLite); on both backends:
  states outside the schema's, a name twice in a job, per-state counts that disagree with the rows, a done
  task without a result, a running task without an owner.
- ``stray_files``: anything in --out but the tasks' result files (temporary files left behind).
- ``keep_awake_wrong``: the keep-awake marker still exists once every task is done.
"""

from __future__ import annotations

import os
import sqlite3
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onward.outdir import file_name
from onward.step_records import unframe

STATES = ("pending", "running", "waiting", "done", "failed", "cancelled")


@dataclass
class Execution:
    task: str
    ident: int  # the attempt (commands) or the fence (Python tasks)
    pids: set[int] = field(default_factory=set)
    starts: int = 0
    first: float = float("inf")
    last: float = 0.0
    ended: bool = False


@dataclass
class Verdict:
    tasks: int = 0
    executions: int = 0
    step_executions: int = 0
    lost: int = 0
    executed_after_commit: int = 0
    overlaps: int = 0
    fence_violations: int = 0
    integrity_failures: int = 0
    stray_files: int = 0
    keep_awake_wrong: int = 0
    problems: list[str] = field(default_factory=list)

    def breaches(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in ("lost", "executed_after_commit", "overlaps", "fence_violations",
                                              "integrity_failures", "stray_files", "keep_awake_wrong")}

    def note(self, counter: str, text: str) -> None:
        setattr(self, counter, getattr(self, counter) + 1)
        if len(self.problems) < 30:
            self.problems.append(f"{counter}: {text}")


# --- reading the store, whichever backend ---------------------------------------------------------------
def query(url: str, sql: str) -> list[tuple[Any, ...]]:
    """Rows of ``sql`` on the store at ``url``; table names written as ``{t}tasks`` get the backend's schema."""
    if url.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(url, autocommit=True) as pg:
            return [tuple(r) for r in pg.execute(sql.replace("{t}", "onward.")).fetchall()]
    lite = sqlite3.connect(url)
    try:
        return lite.execute(sql.replace("{t}", "")).fetchall()
    finally:
        lite.close()


def sqlite_integrity(path: str) -> str | None:
    """None when the file passes ``integrity_check`` and ``foreign_key_check``, else what they said."""
    conn = sqlite3.connect(path)
    try:
        said = conn.execute("PRAGMA integrity_check").fetchone()[0]
        if said != "ok":
            return str(said)
        bad = conn.execute("PRAGMA foreign_key_check").fetchall()
        return f"foreign keys: {bad[:3]}" if bad else None
    finally:
        conn.close()


def integrity_problems(url: str) -> list[str]:
    """Every structural problem of the store (empty when sound)."""
    problems: list[str] = []
    if not url.startswith("postgresql://"):
        said = sqlite_integrity(url)
        if said is not None:
            return [f"integrity_check: {said}"]
    bad_states = query(url, "SELECT state, count(*) FROM {t}tasks WHERE state NOT IN "
                            f"({', '.join(repr(s) for s in STATES)}) GROUP BY state")
    problems += [f"{n} task(s) in unknown state {s!r}" for s, n in bad_states]
    twice = query(url, "SELECT job_id, name, count(*) FROM {t}tasks GROUP BY job_id, name HAVING count(*) > 1")
    problems += [f"task {name!r} {n} times in job {job}" for job, name, n in twice]
    actual = dict(query(url, "SELECT state, count(*) FROM {t}tasks GROUP BY state"))
    kept: dict[str, int] = {}
    for state, n in query(url, "SELECT state, sum(n) FROM {t}counts GROUP BY state"):
        kept[state] = int(n)
    for state in set(actual) | set(kept):
        if int(actual.get(state, 0)) != kept.get(state, 0):
            problems.append(f"counts say {kept.get(state, 0)} {state}, the rows {actual.get(state, 0)}")
    no_result = query(url, "SELECT count(*) FROM {t}tasks WHERE state = 'done' AND result IS NULL")[0][0]
    if no_result:
        problems.append(f"{no_result} done task(s) without a result")
    orphans = query(url, "SELECT count(*) FROM {t}tasks WHERE state = 'running' AND worker_id IS NULL")[0][0]
    if orphans:
        problems.append(f"{orphans} running task(s) without an owner")
    return problems


# --- the execution log ------------------------------------------------------------------------------------
def read_exec_log(path: Path) -> tuple[dict[str, dict[int, Execution]], dict[tuple[str, int], list[int]]]:
    """Executions per task and id, and for each (task, step index) the ids of the executions that ran its
    body (one entry per body start)."""
    executions: dict[str, dict[int, Execution]] = defaultdict(dict)
    step_runs: dict[tuple[str, int], list[int]] = defaultdict(list)
    if not path.exists():
        return executions, step_runs
    for line in path.read_text().splitlines():
        parts = line.split()
        what, task, ident, pid, at = parts[0], parts[1], int(parts[2][1:]), int(parts[3]), float(parts[4])
        ex = executions[task].setdefault(ident, Execution(task, ident))
        ex.first = min(ex.first, at)
        ex.last = max(ex.last, at)
        ex.pids.add(pid)
        if what == "start":
            ex.starts += 1
        elif what == "end":
            ex.ended = True
        elif what == "sstart":
            step_runs[(task, int(parts[5]))].append(ident)
    return executions, step_runs


def committed_id(result: bytes, kind: str) -> tuple[int, list[int]]:
    """The execution id a result names, and for steps the fence each recorded step ran under."""
    text = result.decode()
    if kind == "command":
        return int(text.split("attempt=", 1)[1]), []
    fence_part, _, steps_part = text.partition(" steps=")
    steps = [int(s.split(":")[1]) for s in steps_part.split(",") if s]
    return int(fence_part.rsplit("fence=", 1)[1]), steps


# --- the check ---------------------------------------------------------------------------------------------
def check_run(url: str, names: Sequence[str], kind: str, exec_log: Path, out: Path,
              keep_awake: Path | None) -> Verdict:
    """Check a finished run (every worker gone). ``kind``: "command", "python" or "steps"."""
    v = Verdict(tasks=len(names))
    for problem in integrity_problems(url):
        v.note("integrity_failures", problem)
    rows = {name: (task_id, state, attempts, fence, bytes(result) if result is not None else None)
            for task_id, name, state, attempts, fence, result in
            query(url, "SELECT id, name, state, attempts, fence, result FROM {t}tasks")}
    done_events: dict[int, list[int]] = defaultdict(list)
    for task_id, attempt in query(url, "SELECT task_id, attempt FROM {t}events WHERE kind = 'done'"):
        done_events[task_id].append(attempt)
    recorded_steps: dict[int, dict[int, int]] = defaultdict(dict)  # task id -> step idx -> fence it ran under
    if kind == "steps":
        # The store numbers a task's steps from 1; the execution log and the result from 0.
        for task_id, idx, data in query(url, "SELECT task_id, idx, data FROM {t}steps"):
            recorded_steps[task_id][idx - 1] = unframe(bytes(data)).fence
    executions, step_runs = read_exec_log(exec_log)
    v.executions = sum(len(e) for e in executions.values())
    v.step_executions = sum(len(r) for r in step_runs.values())
    present = {p.name for p in out.iterdir()} if out.is_dir() else set()
    expected_files = set()
    for name in names:
        expected_files.add(file_name(name))
        row = rows.get(name)
        if row is None or row[1] != "done" or row[4] is None:
            v.note("lost", f"{name}: {row[1] if row else 'missing from the store'}")
            continue
        task_id, _, attempts, fence, result = row
        assert result is not None
        if not result.startswith(f"result of {name} ".encode()):
            v.note("lost", f"{name}: wrong result {result[:80]!r}")
            continue
        try:
            exported = (out / file_name(name)).read_bytes()
        except OSError as e:
            v.note("lost", f"{name}: no --out file ({e.strerror})")
        else:
            if exported != result:
                v.note("lost", f"{name}: --out file {exported[:80]!r} is not the result {result[:80]!r}")
        ident, step_fences = committed_id(result, kind)
        holder = attempts if kind == "command" else fence
        if ident != holder:
            v.note("fence_violations", f"{name}: result from execution {ident}, the task's claim is {holder}")
        if kind == "command" and done_events[task_id] != [attempts]:
            v.note("fence_violations", f"{name}: completions journaled {done_events[task_id]}, claim {attempts}")
        elif kind != "command" and len(done_events[task_id]) != 1:
            v.note("fence_violations", f"{name}: {len(done_events[task_id])} completions journaled")
        runs = executions.get(name, {})
        if ident not in runs:
            v.note("lost", f"{name}: its result's execution {ident} left no trace in the execution log")
        for other in runs.values():
            if other.ident > ident:
                v.note("executed_after_commit", f"{name}: execution {other.ident} after the committed {ident}")
            if other.starts > 1:
                v.note("executed_after_commit", f"{name}: execution {other.ident} started {other.starts} times")
        ordered = sorted(runs.values(), key=lambda e: e.first)
        for earlier, later in zip(ordered, ordered[1:], strict=False):
            if later.first < earlier.last:
                v.note("overlaps", f"{name}: execution {later.ident} started at {later.first:.6f}, while "
                                   f"{earlier.ident} was still running (its last sign at {earlier.last:.6f})")
        if kind == "steps":
            committed_steps = recorded_steps.get(task_id, {})
            if step_fences != [committed_steps.get(i) for i in range(len(step_fences))]:
                v.note("fence_violations", f"{name}: result's steps {step_fences}, store's {committed_steps}")
            for idx, step_fence in committed_steps.items():
                later_runs = [f for f in step_runs.get((name, idx), []) if f > step_fence]
                if later_runs:
                    v.note("executed_after_commit",
                           f"{name}: step {idx} recorded by {step_fence}, run again by {later_runs}")
    for stray in sorted(present - expected_files):
        v.note("stray_files", f"--out holds {stray!r}")
    if keep_awake is not None and os.path.lexists(keep_awake):
        v.note("keep_awake_wrong", f"keep-awake marker {keep_awake} still there with every task done")
    return v
