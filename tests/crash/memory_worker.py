"""A worker of Python tasks for the memory tests, run in a real subprocess through the Job API:

    python -m tests.crash.memory_worker STORE OUT MODE EXECLOG [MAX_ATTEMPTS]

Tasks ``t<n>`` work a little and return ``result of TASK fence=F`` (also written to the folder OUT); every
execution appends ``start`` and ``end`` lines to EXECLOG in the format of tests/crash/kill_checker.py (one
write per line, O_APPEND). The
task named ``hog`` is where memory runs out, as MODE says:

- ``fill``: it allocates until not even 64 bytes more can be had (RLIMIT_AS set by the test's launcher),
  holding everything in its own locals, then lets the MemoryError go: the attempt must fail with it and
  the worker go on;
- ``touch``: it allocates and touches 600 MiB, for the kernel's OOM killer to end the whole worker (a
  cgroup's memory limit set by the test);
- ``async-fill``: ``fill`` in an ``async def`` task;
- ``fill-hold``: ``fill``, then it holds everything for 0.8 s (longer than the worker's heartbeat, 0.5 s)
  before it lets the MemoryError go: the worker's own heartbeat finds no memory meanwhile;
- ``big-result``: it returns 1,000,000,001 bytes, more than SQLite holds in a row;
- ``big-step``: it records a durable step whose value is one byte more than a store takes;
- ``random``: there is no ``hog``; the tasks are ``t0`` to ``t<N-1>`` (N in $MEMORY_TASKS), four run at
  once, and each execution touches a share of memory drawn from $MEMORY_SEED, its name and its fence (10
  to 70 MiB) for a moment: in a cgroup limited to 200 MiB the OOM killer ends the worker whenever the tasks
  running at that moment need more, which is at random moments (drawn anew for each execution: tasks
  claimed together again after a kill do not die together for ever);
- ``together``: there is no ``hog``; the tasks are ``g0`` to ``g11``, four run at once, and each touches 60
  MiB and holds it for 0.2 s: in a cgroup limited to 200 MiB each fits alone, and three at once do not.
"""

from __future__ import annotations

import os
import random
import sys
import time
from typing import Any

from onward import Job
from onward.config import MAX_STORED_BYTES

HOLD = 0.8  # seconds the task ``hog`` holds all memory in the mode ``fill-hold``


def main(store: str, out: str, mode: str, exec_log: str, max_attempts: int) -> int:
    log_fd = os.open(exec_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    pid = os.getpid()

    def note(what: str, task: str, fence: int) -> None:
        os.write(log_fd, f"{what} {task} f{fence} {pid} {time.time():.6f}\n".encode())

    job = Job(store, max_attempts=max_attempts, retry_delay=0, heartbeat=0.5, out=out, log_level=1)

    def fill(hold: float = 0.0) -> None:
        keep: list[bytearray] = []
        size = 1 << 20
        while True:
            try:
                keep.append(bytearray(size))
            except MemoryError:
                if size <= 64:
                    time.sleep(hold)
                    raise
                size //= 2

    def touch() -> None:
        hog = bytearray(600 << 20)
        for i in range(0, len(hog), 4096):
            hog[i] = 1

    def touch_share(task: str, fence: int) -> None:
        rng = random.Random(f"{os.environ.get('MEMORY_SEED', '0')}-{task}-{fence}")
        share = bytearray(rng.randint(10, 70) << 20)
        for i in range(0, len(share), 4096):
            share[i] = 1
        time.sleep(rng.uniform(0, 0.05))

    def work(task: str, ctx: Any) -> str | bytes:
        fence = ctx._attempt.claim.fence  # test-only: the claim's fence names the execution
        note("start", task, fence)
        if task == "hog" and mode == "big-result":
            return b"x" * 1_000_000_001
        if task == "hog" and mode == "big-step":
            ctx.step("big", lambda: "x" * (MAX_STORED_BYTES + 1))
        if task == "hog" and mode in ("fill", "async-fill"):
            fill()
        if task == "hog" and mode == "fill-hold":
            fill(hold=HOLD)
        if task == "hog" and mode == "touch":
            touch()
        if mode == "random":
            touch_share(task, fence)
        if mode == "together":
            share = bytearray(60 << 20)
            for i in range(0, len(share), 4096):
                share[i] = 1
            time.sleep(0.2)
            del share
        time.sleep(0.01)
        note("end", task, fence)
        return f"result of {task} fence={fence}"

    if mode == "async-fill":
        @job.task
        async def handle_async(task: str, ctx: Any) -> str | bytes:
            return work(task, ctx)
    else:
        job.task(work)
    if mode == "random":
        job.add([f"t{i}" for i in range(int(os.environ["MEMORY_TASKS"]))])
        return job.run(concurrency=4).exit_code
    if mode == "together":
        job.add([f"g{i}" for i in range(12)])
        return job.run(concurrency=4).exit_code
    job.add([f"t{i}" for i in range(10)] + ["hog"] + [f"t{i}" for i in range(10, 20)])
    return job.run().exit_code


if __name__ == "__main__":
    a = sys.argv[1:]
    sys.exit(main(a[0], a[1], a[2], a[3], int(a[4]) if len(a) > 4 else 3))
