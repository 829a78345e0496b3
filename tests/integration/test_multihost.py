"""Several worker hosts on one PostgreSQL server, one host cut off the network and another killed mid-run.

Each host is a network namespace (with its own host name, a UTS namespace) joined to this machine by a
veth pair on a private subnet that the test creates and removes; a PostgreSQL cluster of the test's own
listens on the host side of every pair. Each host runs `onward run --heartbeat 0.5` (lease 1.5 s). Mid-run,
host 1's link goes down and host 2's worker gets SIGKILL. Every execution of a task appends lines to a
side-effect log (start, a tick every 0.1 s, end) with its host, pid and the time; with the journal, that is
how the test checks, precisely:

- the cut host's tasks (and the killed host's) are taken over only after their lease expired, on the
  server's clock; an execution taken over never overlaps in time with the next execution of that task;
- the cut host stops its tasks and commits nothing about them; reconnected, it moves on to other tasks;
- every task ends done, committed exactly once (one "done" in the journal, the result of an execution
  that ran to its end); only tasks running on the cut or killed host at the fault ran more than once
  (at-least-once execution), and none is lost.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from onward.store import open_store
from onward.store.base import CANCELLED, DONE, FAILED, PENDING, RUNNING, WAITING
from tests import pgutil
from tests.conftest import result_bytes, run_onward, wait_for
from tests.reliability import record

pytestmark = pytest.mark.postgres
SRC = str(Path(__file__).resolve().parents[2] / "src")
N_HOSTS = 4
N_TASKS = 32
TICKS = 30  # an execution logs a tick every 0.1 s for 3 s: twice the lease, so a cut host is caught mid-task
HEARTBEAT = 0.5
LEASE = 3 * HEARTBEAT  # the runner's default: three heartbeats
NETNS_PREFIX = "onwt-"


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


class Hosts:
    """Network namespaces h1..hN, each joined to this machine by a veth pair: this side 10.A.i.1, the
    host's side 10.A.i.2, on a /16 no interface or route of this machine uses."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tag = str(os.getpid())
        self.net = self._free_network()
        self.made: list[int] = []

    @staticmethod
    def _free_network() -> ipaddress.IPv4Network | ipaddress.IPv6Network:
        used = ip("-4", "-o", "addr").stdout + ip("-4", "route", "show", "table", "all").stdout
        for second in random.SystemRandom().sample(range(16, 250), 234):
            net = ipaddress.ip_network(f"10.{second}.0.0/16")
            if f"10.{second}." not in used:
                return net
        raise RuntimeError("no free 10.x.0.0/16 subnet for the test hosts")

    def netns(self, i: int) -> str:
        return f"{NETNS_PREFIX}{self.tag}-h{i}"

    def link(self, i: int) -> str:
        return f"ow{self.tag}h{i}"[-15:]

    def server_address(self, i: int) -> str:
        return str(self.net.network_address + (i << 8) + 1)

    def __enter__(self) -> Hosts:
        _drop_stale_namespaces()
        try:
            for i in range(1, self.n + 1):
                ns, here, there = self.netns(i), self.link(i), f"ow{self.tag}n{i}"[-15:]
                ip("netns", "add", ns)
                self.made.append(i)
                ip("link", "add", here, "type", "veth", "peer", "name", there)
                ip("link", "set", there, "netns", ns)
                ip("addr", "add", f"{self.server_address(i)}/24", "dev", here)
                ip("link", "set", here, "up")
                ip("-n", ns, "addr", "add", f"{self.net.network_address + (i << 8) + 2}/24", "dev", there)
                ip("-n", ns, "link", "set", there, "up")
                ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for i in self.made:
            ip("netns", "del", self.netns(i), check=False)  # takes its end of the pair, and so the pair
            ip("link", "del", self.link(i), check=False)
        self.made = []

    def cut(self, i: int) -> None:
        ip("link", "set", self.link(i), "down")

    def reconnect(self, i: int) -> None:
        ip("link", "set", self.link(i), "up")

    def command(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` run on host i: in its network namespace, under its own host name."""
        return ["ip", "netns", "exec", self.netns(i), "unshare", "--uts", "sh", "-c",
                'hostname "$1" && shift && exec "$@"', "sh", f"onward-h{i}", *argv]


def _drop_stale_namespaces() -> None:
    """Namespaces (and so veth pairs) left by test processes that died before cleaning up."""
    for line in ip("netns", "list").stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if name.startswith(NETNS_PREFIX):
            owner = name[len(NETNS_PREFIX):].split("-")[0]
            if owner.isdigit() and not Path(f"/proc/{owner}").exists():
                ip("netns", "del", name, check=False)


@dataclass
class Execution:
    task: str
    attempt: int
    host: str
    pid: int
    start: float
    last: float  # time of its last line in the side-effect log
    ended: bool  # reached its last line (then printed its result and exited 0)


def executions(side: Path) -> list[Execution]:
    runs: dict[tuple[str, int, str, int], Execution] = {}
    for line in side.read_text().splitlines():
        what, task, attempt, host, pid, at = line.split()
        key = (task, int(attempt), host, int(pid))
        run = runs.setdefault(key, Execution(task, int(attempt), host, int(pid), float(at), float(at), False))
        run.start, run.last = min(run.start, float(at)), max(run.last, float(at))
        run.ended |= what == "end"
    return list(runs.values())


def running_on(sql, host: str) -> dict[str, float]:
    """Tasks the store shows running for ``host``'s worker, with their lease_until (server clock)."""
    return dict(sql.execute("SELECT t.name, t.lease_until FROM onward.tasks AS t JOIN onward.workers AS w"
                            " ON w.id = t.worker_id WHERE t.state = 'running' AND w.host = %s", (host,)).fetchall())


def _prerequisites() -> None:
    if os.geteuid() != 0:
        pgutil.unavailable("the multi-host test needs root (network namespaces)")
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            pgutil.unavailable(f"the multi-host test needs {tool}")


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    _prerequisites()
    with Hosts(N_HOSTS) as made:
        yield made


def test_hosts_cut_off_or_killed_mid_run_lose_nothing_and_complete_nothing_twice(hosts: Hosts, tmp_path: Path,
                                                                                  seed: int) -> None:
    rng = random.Random(seed)
    names = [f"t{i:03d}" for i in range(N_TASKS)]
    side = tmp_path / "side.log"
    # Each execution: "start", then a tick every 0.1 s, then "end", each line with its host, pid and time.
    script = (f'log() {{ echo "$1 $ONWARD_TASK $ONWARD_ATTEMPT $TEST_HOST $$ $(date +%s.%N)" >> {side}; }};'
              f' log start; i=0; while [ $i -lt {TICKS} ]; do sleep 0.1; log tick; i=$((i+1)); done; log end;'
              ' printf "%s %s %s" "$ONWARD_TASK" "$TEST_HOST" "$ONWARD_ATTEMPT"')
    listen = ["127.0.0.1"] + [hosts.server_address(i) for i in range(1, N_HOSTS + 1)]
    with pgutil.private_cluster(listen=listen, trust=[str(hosts.net)]) as cluster:
        local_url = cluster.url(cluster.create_database("onward"))
        store = open_store(local_url)
        store.add(names)
        store.close()
        sql = cluster.admin("onward")
        workers: dict[int, subprocess.Popen[bytes]] = {}
        logs = {i: tmp_path / f"h{i}.log" for i in range(1, N_HOSTS + 1)}
        try:
            for i in range(1, N_HOSTS + 1):
                url = f"postgresql://{pgutil.PG_USER}@{hosts.server_address(i)}:{cluster.port}/onward"
                argv = hosts.command(i, [sys.executable, "-m", "onward", "run", "--db", url, "--heartbeat",
                                         str(HEARTBEAT), "--concurrency", "2", "--", "sh", "-c", script])
                env = dict(os.environ, PYTHONPATH=SRC, TEST_HOST=f"onward-h{i}")
                with open(logs[i], "wb") as err:
                    workers[i] = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err)

            # `onward status` shows every worker: its host, pid, heartbeat age, tasks done.
            def all_workers() -> dict | None:
                r = run_onward("status", "--db", local_url, "--json")
                report = json.loads(r.stdout) if r.returncode == 0 else {}
                hosts_seen = {w["host"] for w in report.get("workers", [])}
                return report if hosts_seen == {f"onward-h{i}" for i in range(1, N_HOSTS + 1)} else None
            report = wait_for(all_workers, 30, "status to show a worker on every host")
            assert all({"pid", "heartbeat_age", "done"} <= w.keys() for w in report["workers"])  # type: ignore[index]

            # Fault 1: host 1 drops off the network while it runs tasks, at a (seeded) random moment.
            wait_for(lambda: sql.execute("SELECT count(*) FROM onward.tasks WHERE state = 'done'").fetchone()[0]
                     >= 4, 60, "the job to get going")
            time.sleep(rng.uniform(0, TICKS * 0.1))
            wait_for(lambda: running_on(sql, "onward-h1"), 30, "host 1 to be running tasks")
            hosts.cut(1)
            cut_at = time.time()
            time.sleep(0.2)  # what host 1 sent before the cut has arrived; it can send nothing more
            cut_tasks = running_on(sql, "onward-h1")
            # Fault 2: host 2's worker dies (SIGKILL; its tasks' processes die with it).
            wait_for(lambda: running_on(sql, "onward-h2"), 30, "host 2 to be running tasks")
            workers[2].send_signal(signal.SIGKILL)
            workers[2].wait()
            killed_tasks = running_on(sql, "onward-h2")
            assert cut_tasks and killed_tasks

            # The other hosts take both hosts' tasks over, and finish them, while host 1 is still cut off.
            def taken_over() -> bool:
                done = {r[0] for r in sql.execute("SELECT name FROM onward.tasks WHERE state = 'done'")}
                return set(cut_tasks) | set(killed_tasks) <= done
            wait_for(taken_over, 60, "the cut and killed hosts' tasks to be done elsewhere")
            assert workers[1].poll() is None, "the cut-off worker must keep going, not crash"
            reconnected_at = time.time()
            hosts.reconnect(1)
            codes = {i: workers[i].wait(120) for i in (1, 3, 4)}
        finally:
            for p in workers.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
        texts = {i: log.read_text() for i, log in logs.items()}
        assert codes == {1: 0, 3: 0, 4: 0}, texts

        store = open_store(local_url, create=False)
        try:
            journal = store.events(limit=1_000_000)
            assert store.counts() == {PENDING: 0, RUNNING: 0, DONE: N_TASKS, FAILED: 0, CANCELLED: 0, WAITING: 0}
            results = {n: result_bytes(store, n).decode() for n in names}
        finally:
            store.close()
        sql.close()

    # Committed exactly once each, by an execution that ran to its end; none lost.
    done = [e for e in journal if e.kind == "done"]
    done_count = Counter(str(e.task) for e in done)
    runs = executions(side)
    record("fault matrix", backend="postgres",
           case=f"one of {N_HOSTS} hosts cut off the network (netns link down) past its lease, another SIGKILLed",
           seed=seed, tasks=N_TASKS, exit_statuses=sorted(codes.values()),
           lost=sum(1 for n in names if done_count[n] == 0), doubled=sum(1 for k in done_count.values() if k > 1),
           taken_over=len(cut_tasks) + len(killed_tasks), recovered=all(c == 0 for c in codes.values()))
    assert sorted(str(e.task) for e in done) == names
    by_task: dict[str, list[Execution]] = defaultdict(list)
    for run in runs:
        by_task[run.task].append(run)
    for name in names:
        task, host, attempt = results[name].split()
        committed = [r for r in by_task[name] if r.host == host and r.attempt == int(attempt)]
        assert task == name and len(committed) == 1 and committed[0].ended, (name, results[name], by_task[name])

    # More than one execution only for tasks that were running on host 1 or host 2 at the fault.
    repeated = {name for name, rs in by_task.items() if len(rs) > 1}
    assert repeated <= set(cut_tasks) | set(killed_tasks), repeated
    # The execution taken over never overlaps the next one: its last sign of life comes before the start.
    for name in repeated:
        ordered = sorted(by_task[name], key=lambda r: r.start)
        for before, after in zip(ordered, ordered[1:]):  # noqa: B905
            print(f"{name}: {before.host} attempt {before.attempt} last seen {after.start - before.last:.3f}s"
                  f" before {after.host} attempt {after.attempt} started")
            assert before.last < after.start, f"{name}: {before} still ran when {after} started"

    # Taken over only after the lease expired, on the server's clock (this machine's clock here).
    reclaims = {e.task: e for e in journal if e.kind == "reclaimed"}
    for name, lease_until in {**cut_tasks, **killed_tasks}.items():
        if name in reclaims:  # (a task that finished before the fault's lease ran out needs no takeover)
            assert reclaims[name].at >= lease_until and "lease expired" in (reclaims[name].detail or "")
        later = [r for r in by_task[name] if r.start > cut_at and r.host not in ("onward-h1", "onward-h2")]
        assert all(r.start >= lease_until for r in later), (name, lease_until, later)

    # The cut host stopped its tasks and committed none of them, before and after it was reconnected, and said
    # so: a task still running when its lease ran out (or was lost) it stopped; one whose command had ended,
    # its commit failing for the cut, it kept until its try again was refused, for the task was taken over...
    h1_done = {e.task for e in done if e.host == "onward-h1"}
    assert not h1_done & set(cut_tasks)
    for name in cut_tasks:
        assert any(f'task="{name}"' in line and ("lease ran out" in line or "lease lost" in line
                                                 or "it was taken over, outcome dropped" in line)
                   for line in texts[1].splitlines()), f"host 1 never said it gave up {name}"
    # ... and moved on: it completed other tasks once it could reach the server again.
    assert any(e.host == "onward-h1" and e.at > reconnected_at for e in done), "host 1 did nothing after reconnecting"


# A Python task run by the Job API: a thread, which cannot be killed. It writes a line (host, time) every
# 0.05 s for 8 s and never looks at its cancellation.
PY_WORKER = """
import socket, sys, time
from onward import Job
job = Job(sys.argv[1])
@job.task(max_attempts=5)
def handle(task, ctx):
    for _ in range(160):
        with open(sys.argv[2], "a") as f:
            f.write(f"{socket.gethostname()} {time.time():.6f}\\n")
        time.sleep(0.05)
    return "ok"
job.run(heartbeat=float(sys.argv[3]))
"""


@pytest.fixture
def two_hosts() -> Iterator[Hosts]:
    _prerequisites()
    with Hosts(2) as made:
        yield made


def test_a_cut_off_python_task_that_ignores_its_cancellation_never_overlaps_the_takeover(two_hosts: Hosts,
                                                                                        tmp_path: Path) -> None:
    """Host 1 runs a Python task that never checks for cancellation, and is cut off the network. Its lease
    runs out unrenewed: a command would be killed, a thread cannot be, so the worker must exit before the
    lease expires on the server. It exited only after --grace (10 s), and the task ran on beside the attempt
    that host 2 started once the lease expired (seen here: 4 s of both hosts' side effects interleaved)."""
    hosts = two_hosts
    side = tmp_path / "side.log"
    script = tmp_path / "worker.py"
    script.write_text(PY_WORKER)
    heartbeat = 1.0  # lease 3 s
    listen = ["127.0.0.1"] + [hosts.server_address(i) for i in (1, 2)]
    with pgutil.private_cluster(listen=listen, trust=[str(hosts.net)]) as cluster:
        local_url = cluster.url(cluster.create_database("onward"))
        store = open_store(local_url)
        store.add(["only"])
        store.close()
        sql = cluster.admin("onward")
        workers: dict[int, subprocess.Popen[bytes]] = {}
        logs = {i: tmp_path / f"h{i}.log" for i in (1, 2)}

        def start(i: int) -> None:
            url = f"postgresql://{pgutil.PG_USER}@{hosts.server_address(i)}:{cluster.port}/onward"
            with open(logs[i], "wb") as err:
                workers[i] = subprocess.Popen(
                    hosts.command(i, [sys.executable, str(script), url, str(side), str(heartbeat)]),
                    env=dict(os.environ, PYTHONPATH=SRC), stdout=subprocess.DEVNULL, stderr=err)
        try:
            start(1)
            wait_for(lambda: running_on(sql, "onward-h1") and side.exists(), 60, "host 1 to run the task")
            hosts.cut(1)
            start(2)
            assert workers[2].wait(120) == 0, logs[2].read_text()
            hosts.reconnect(1)
            code_1 = workers[1].wait(60)
        finally:
            for p in workers.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
        assert sql.execute("SELECT state FROM onward.tasks").fetchall() == [(DONE,)]
        journal = sql.execute("SELECT e.kind, w.host FROM onward.events AS e LEFT JOIN onward.workers AS w"
                              " ON w.id = e.worker_id WHERE e.kind IN ('done', 'reclaimed')").fetchall()
        sql.close()
    assert ("done", "onward-h2") in journal, journal
    lines = [line.split() for line in side.read_text().splitlines()]
    h1 = [float(at) for host, at in lines if host == "onward-h1"]
    h2 = [float(at) for host, at in lines if host == "onward-h2"]
    assert h1 and h2
    print(f"host 1's last side effect {min(h2) - max(h1):.3f} s before host 2's first")
    assert max(h1) < min(h2), f"host 1's task ran on {max(h1) - min(h2):.2f} s after host 2 took it over"
    # Host 1's worker gave up on its own, cut off as it was: it exited, since it cannot stop the thread.
    text_1 = logs[1].read_text()
    assert code_1 != 0 and "ignored cancellation (lease ran out" in text_1, text_1
