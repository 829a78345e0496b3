"""A worker of Python tasks for the kill torture, run in a real subprocess through the Job API:

    python -m tests.crash.torture_worker STORE OUT EXECLOG KIND CONCURRENCY KEEP_AWAKE

KIND "python": each task works ~30 ms in three slices; KIND "steps": the same work as three durable steps.
Every execution appends its side effects to EXECLOG (one write per line, O_APPEND: lines of concurrent
processes do not interleave), in the format tests/crash/kill_checker.py reads:

    start|tick|end TASK f<fence> PID TIME            an execution of the task (its claim's fence)
    sstart|send TASK f<fence> PID TIME IDX           the body of step IDX ran (started, ended)

Tasks whose number is a multiple of 3 fail their first attempt (retries are part of what is tortured).
The result names the fence of the execution that produced it, and for steps the fence each recorded step
ran under: the checker compares them with the store.
"""

from __future__ import annotations

import os
import sys
import time

from onward import Job
from onward.context import TaskContext

WORK_SLICE = 0.01


def main(store: str, out: str, exec_log: str, kind: str, concurrency: int, keep_awake: str) -> int:
    log_fd = os.open(exec_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    pid = os.getpid()

    def note(what: str, task: str, fence: int, extra: str = "") -> None:
        os.write(log_fd, f"{what} {task} f{fence} {pid} {time.time():.6f}{extra}\n".encode())

    job = Job(store, concurrency=concurrency, max_attempts=1000, retry_delay=0, heartbeat=0.25, out=out,
              keep_awake=keep_awake, log_level=0)

    @job.task
    def handle(task: str, ctx: TaskContext) -> str:
        # The fence of this execution's claim: test-only access (the fence is not part of the public context).
        fence = ctx._attempt.claim.fence
        note("start", task, fence)
        ran: list[str] = []
        for idx in range(3):
            if kind == "steps":
                def body(i: int = idx) -> str:
                    note("sstart", task, fence, f" {i}")
                    time.sleep(WORK_SLICE)
                    note("send", task, fence, f" {i}")
                    return f"{i}:{fence}"
                ran.append(ctx.step(f"s{idx}", body))
            else:
                time.sleep(WORK_SLICE)
                note("tick", task, fence)
        if int(task.rsplit("-", 1)[1]) % 3 == 0 and ctx.attempt == 1:
            note("end", task, fence)
            raise RuntimeError("fails its first attempt (on purpose)")
        note("end", task, fence)
        return f"result of {task} fence={fence} steps={','.join(ran)}"

    summary = job.run()
    return summary.exit_code


if __name__ == "__main__":
    a = sys.argv[1:]
    sys.exit(main(a[0], a[1], a[2], a[3], int(a[4]), a[5]))
