"""The least a durable command runner in Python does, as a floor for ``onward run``.

    python bench/floor_commands.py TASKS_FILE CONCURRENCY DB SYNC_EVERY [BURN_US AT] -- COMMAND [ARG...]

Each line of TASKS_FILE is a task; the task is appended to COMMAND's arguments. The runner keeps its tasks in
a SQLite table (WAL, synchronous=NORMAL) and per turn commits, in one transaction, the completion it saw and
the claims of the free slots: it reads the first pending tasks (a partial index), starts each one's command
with ``os.posix_spawn`` in a session of its own (no shell) and marks it running with its pid. It waits with
``waitpid``. The log is synced (fdatasync) after every SYNC_EVERY-th completion, while the commands just
started run: 1 as onward does for commands at concurrency 1 (a sync of each commit, in place), 8 about as
often as onward's sync thread syncs at concurrency 4 on 2 cores (0.3-0.4 syncs a task). This is the
cheapest of the forms tried: a claim as one ``UPDATE ... WHERE id IN (SELECT ... LIMIT n) RETURNING``, and
the pid in an UPDATE of its own, made it about 10 % slower here (5,000 x `true` at concurrency 4: 3.3 s
against 3.0 s).

What it leaves out, all of which onward does: a command's output read through pipes into its result, its
error in the store, a journal, leases and their renewal, heartbeats, the watchdog, process groups killed
with the worker (PDEATHSIG), a process's pid noted *before* it runs, retries and timeouts, the completion
told only once synced, logs. So it is not a rival: it bounds from above what a runner of this
design (a Python process, one commit a task, a shared sync) gets on the machine, beside ``xargs -P``.

With BURN_US and AT, it also spends BURN_US microseconds of its own CPU time, busy, once a turn (a turn per
command's end, and the first), at one of two places: ``exit`` between a command's end and the next
command's start (its slot stays empty that much longer), ``start`` just after the turn's commands
started, while they run. This is how the fast benchmark measures what a microsecond of a runner's CPU costs
in throughput, and whether it matters where the runner spends it (bench_fast.part_bound).
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import sys
import time


def main(argv: list[str]) -> int:
    tasks_file, concurrency, db, sync_every = argv[0], int(argv[1]), argv[2], int(argv[3])
    burn = argv[4:argv.index("--")]
    if burn and (len(burn) != 2 or not burn[0].isdigit() or burn[1] not in ("exit", "start")):
        raise SystemExit(f"after SYNC_EVERY: BURN_US (whole microseconds) and AT (exit or start), not {burn}")
    burn_seconds, burn_at = (int(burn[0]) / 1e6, burn[1]) if burn else (0.0, "")
    command = argv[argv.index("--") + 1:]
    program = shutil.which(command[0])
    if program is None:
        raise SystemExit(f"{command[0]}: not found")
    con = sqlite3.connect(db, isolation_level=None)
    con.execute("PRAGMA journal_mode = WAL")
    con.execute("PRAGMA synchronous = NORMAL")
    con.execute("CREATE TABLE tasks (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, state TEXT NOT NULL,"
                " pid INTEGER, exit_code INTEGER)")
    con.execute("CREATE INDEX pending ON tasks (id) WHERE state = 'pending'")  # the claim's, not a scan a claim
    with open(tasks_file, encoding="utf-8") as lines:
        con.execute("BEGIN")
        con.executemany("INSERT INTO tasks (name, state) VALUES (?, 'pending')",
                        ((line.rstrip("\n"),) for line in lines if line.strip()))
        con.execute("COMMIT")
    wal = os.open(db + "-wal", os.O_RDONLY)
    env = dict(os.environ)
    running: dict[int, int] = {}  # pid -> task id
    finished: tuple[int, int] | None = None  # (task id, exit code) not yet committed
    completions = 0
    while True:
        con.execute("BEGIN IMMEDIATE")
        if finished is not None:
            con.execute("UPDATE tasks SET state = 'done', exit_code = ? WHERE id = ?", (finished[1], finished[0]))
            finished = None
        free = concurrency - len(running)
        claimed = con.execute("SELECT id, name FROM tasks WHERE state = 'pending' ORDER BY id LIMIT ?",
                              (free,)).fetchall() if free else []
        for task_id, name in claimed:
            pid = os.posix_spawn(program, [*command, name], env, setsid=True)
            running[pid] = task_id
            con.execute("UPDATE tasks SET state = 'running', pid = ? WHERE id = ?", (pid, task_id))
        con.execute("COMMIT")
        if burn_at == "start":
            spend_cpu(burn_seconds)
        if not running:
            break
        pid, status = os.waitpid(-1, 0)
        finished = (running.pop(pid), os.waitstatus_to_exitcode(status))
        if burn_at == "exit":
            spend_cpu(burn_seconds)
        completions += 1
        if completions % sync_every == 0:
            os.fdatasync(wal)
    os.fdatasync(wal)
    con.close()
    return 0


def spend_cpu(seconds: float) -> None:
    """Busy for ``seconds`` of this thread's CPU time (not of the wall clock: time it waits for a core while
    others run does not count)."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
