"""`onward demo`: the whole story in about 16 seconds, on a temporary embedded store.

40 tasks of ~0.3 s each run under `onward supervise`; the demo SIGKILLs the worker in the middle of a task,
the supervisor restarts it, and it resumes at that same task with nothing finished redone; then the whole
process tree is paused (SIGSTOP … SIGCONT, as a sandbox pause would) and the job carries on; a final
`onward status` and a count of executions prove the point.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import click

from .errors import StoreError
from .proc import stat_fields
from .status import render_status, status_dict
from .store import open_store

N_TASKS = 40
TASK_SECONDS = 0.3
PAUSE_SECONDS = 3.0


def _descendants(root: int) -> list[int]:
    """The processes under ``root``, parents before children."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = stat_fields(entry)
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    order, queue = [], [root]
    while queue:
        pid = queue.pop(0)
        order.append(pid)
        queue.extend(children.get(pid, []))
    return order


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _started(executions: Path, task: dict) -> bool:
    """Whether the running ``task``'s command has begun (written its line): a task shows as running from its
    claim on, a moment before its command starts, and a worker killed in that moment runs it only once."""
    line = f"{task['task']} {task['attempt']}\n"
    try:
        return line in executions.read_text()
    except FileNotFoundError:
        return False


def _snapshot(db: str) -> dict:
    store = open_store(db, create=False)
    try:
        return status_dict(store)
    finally:
        store.close()


def run_demo(keep: bool = False) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(highlight=False)
    work = Path(tempfile.mkdtemp(prefix="onward-demo-"))
    db = str(work / "onward.db")
    tasks = work / "tasks.txt"
    executions = work / "executions.log"
    out = work / "out"
    tasks.write_text("".join(f"doc-{i:02d}\n" for i in range(1, N_TASKS + 1)))
    onward = [sys.executable, "-m", "onward"]
    task_cmd = ["sh", "-c", f'echo "$1 $ONWARD_ATTEMPT" >> {executions}; sleep {TASK_SECONDS}; echo "summary of $1"',
                "task", "{task}"]
    command = [*onward, "supervise", "--db", db, "--",
               *onward, "run", "--db", db, "--tasks", str(tasks), "--out", str(out), "--heartbeat", "1", "-q", "--",
               *task_cmd]
    console.print(f"[bold]onward demo[/bold]: {N_TASKS} tasks of ~{TASK_SECONDS}s under `onward supervise`,"
                  f" store {db}")
    console.print("  task: " + " ".join(task_cmd), markup=False)
    log = open(work / "supervisor.log", "wb")
    sup = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    killed: tuple[str, float] | None = None
    paused = False
    notes: list[str] = []
    try:
        with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console, transient=False) as progress:
            bar = progress.add_task("working", total=N_TASKS)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                time.sleep(0.1)
                if sup.poll() is not None:
                    break
                try:
                    snap = _snapshot(db)
                except StoreError:  # the store does not exist for the first few milliseconds
                    continue
                progress.update(bar, completed=snap["done"])
                running = snap["tasks_running"]
                if killed is None and snap["done"] >= N_TASKS // 4 and running and _started(executions, running[0]):
                    victim = running[0]
                    pid = victim["worker_pid"]
                    os.kill(pid, signal.SIGKILL)
                    killed = (victim["task"], time.monotonic())
                    notes.append(f"SIGKILL worker pid {pid} while it ran {victim['task']} (attempt {victim['attempt']})")
                    progress.console.print(f"[red]✗ {notes[-1]}[/red]")
                elif killed is not None and len(notes) == 1 and running and running[0]["worker_pid"] != pid:
                    took = time.monotonic() - killed[1]
                    again = next((t for t in running if t["task"] == killed[0]), None)
                    what = (f"{killed[0]} again (attempt {again['attempt']})" if again else f"{running[0]['task']}")
                    notes.append(f"supervisor restarted the worker (pid {running[0]['worker_pid']}) within {took:.2f}s;"
                                 f" it resumed at {what}")
                    progress.console.print(f"[green]↻ {notes[-1]}[/green]")
                elif not paused and snap["done"] >= (N_TASKS * 3) // 5:
                    tree = _descendants(sup.pid)
                    _signal_all(tree, signal.SIGSTOP)
                    progress.console.print(f"[yellow]⏸ paused the whole tree ({len(tree)} processes) for"
                                           f" {PAUSE_SECONDS:.0f}s, as a sandbox pause would[/yellow]")
                    time.sleep(PAUSE_SECONDS)
                    _signal_all(list(reversed(tree)), signal.SIGCONT)
                    paused = True
                    progress.console.print("[yellow]▶ resumed: the worker notices the gap and renews its leases;"
                                           " the supervisor re-arms its watchdog[/yellow]")
            progress.update(bar, completed=_snapshot(db)["done"])
        code = sup.wait(timeout=60)
    finally:
        if sup.poll() is None:
            os.killpg(sup.pid, signal.SIGTERM)
            sup.wait(timeout=30)
        log.close()
    console.print()
    store = open_store(db, create=False)
    try:
        render_status(status_dict(store))
    finally:
        store.close()
    runs = Counter(line.split()[0] for line in executions.read_text().splitlines())
    twice = sorted(name for name, n in runs.items() if n > 1)
    console.print()
    console.print(f"executions: {sum(runs.values())} for {len(runs)} tasks; run more than once: {twice or 'none'}")
    if killed is not None:
        expected = [killed[0]]
        verdict = "as expected: only the task that was running when its worker died" if twice == expected else \
            "UNEXPECTED"
        console.print(f"  {verdict}")
    console.print(f"supervisor exit status {code}; results in {out} ({len(list(out.iterdir()))} files)")
    if keep:
        console.print(f"kept {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    ok = code == 0 and killed is not None and paused and twice == [killed[0]]
    return 0 if ok else 1


@click.command(name="demo")
@click.option("--keep", is_flag=True, help="Keep the temporary folder (store, logs, results).")
def demo_command(keep: bool) -> None:
    """Watch a job survive a kill -9 and a pause, in about 16 seconds."""
    sys.exit(run_demo(keep))
