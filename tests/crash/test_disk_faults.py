"""Real disk faults under a running worker: a full disk (a small tmpfs) and failing fsyncs (strace)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from onward.store.sqlite import PROBE_XATTR
from tests.conftest import onward_argv, require_tool, run_onward, wait_for

SRC = str(Path(__file__).resolve().parents[2] / "src")


def can_mount() -> bool:
    return os.geteuid() == 0 and shutil.which("mount") is not None


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    if not can_mount():
        if os.environ.get("CI") == "true":
            pytest.fail("the disk-fault tests need root to mount a tmpfs")
        pytest.skip("needs root to mount a tmpfs")
    mnt = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def told_done(err: str) -> list[str]:
    """The tasks a worker's log lines report done, in order (a task told twice shows twice)."""
    return [line.split('task="')[1].split('"')[0] for line in err.splitlines() if ' done task="' in line]


def done_in_store(db: Path) -> set[str]:
    """The tasks done in a SQLite store, once its integrity check passed."""
    c = sqlite3.connect(db)
    try:
        assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        return {n for (n,) in c.execute("SELECT name FROM tasks WHERE state = 'done'")}
    finally:
        c.close()


def test_full_disk_stalls_the_job_and_it_finishes_once_there_is_room(small_disk: Path, tmp_path: Path) -> None:
    db = small_disk / "s.db"
    log = tmp_path / "executions.log"
    tasks = tmp_path / "tasks.txt"
    names = [f"t{i:03d}" for i in range(60)]
    tasks.write_text("".join(n + "\n" for n in names))
    # Each result is 40 KB: 60 of them cannot fit on a 1 MB disk.
    worker = subprocess.Popen(
        onward_argv("run", "--db", str(db), "--tasks", str(tasks), "--heartbeat", "0.5", "--", "sh", "-c",
                    f'echo "$1" >> {log}; head -c 40000 /dev/zero | tr "\\0" x', "x", "{task}"),
        env=dict(os.environ, PYTHONPATH=SRC), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        first_error = wait_for(lambda: _stderr_has(worker, b"disk is full"), 60, "the store to report a full disk")
        assert first_error
        assert worker.poll() is None, "a full disk must not kill the worker"
        subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
        worker.wait(timeout=120)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert worker.returncode == 0
    c = sqlite3.connect(db)
    assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    rows = dict(c.execute("SELECT name, state FROM tasks"))
    assert rows == {n: "done" for n in names}
    assert all(len(r) == 40000 for (r,) in c.execute("SELECT result FROM tasks"))
    c.close()


def test_a_store_on_a_disk_already_full_is_unavailable_and_says_the_disk_is_full(small_disk: Path) -> None:
    """A worker or `onward status` started on a store whose disk is full cannot make the log's index
    (-shm): SQLite says only "disk I/O error", which they passed on, for a disk that is fine. They now say
    the disk is full, exit 75 (a supervisor tries again later), and leave the store as it was."""
    db = small_disk / "s.db"
    assert run_onward("add", "--db", str(db), "a", "b").returncode == 0
    filler = os.open(small_disk / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:  # every block left, written until the disk refuses
        while os.write(filler, b"\0" * 4096):
            pass
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(filler)
    for argv in (["run", "--db", str(db), "--", "true", "{task}"], ["status", "--db", str(db)]):
        done = run_onward(*argv)
        err = done.stderr.decode()
        assert done.returncode == 75, (argv, err)
        assert err.count("\n") == 1 and "no space left on the device holding it" in err, (argv, err)
    (small_disk / "filler").unlink()
    assert done_in_store(db) == set()
    assert run_onward("run", "--db", str(db), "-q", "--", "true", "{task}").returncode == 0
    assert done_in_store(db) == {"a", "b"}


_seen: dict[int, bytes] = {}


def _stderr_has(p: subprocess.Popen[bytes], needle: bytes) -> bool:
    """Read what the worker wrote to stderr so far (without blocking) and look for ``needle``."""
    assert p.stderr is not None
    os.set_blocking(p.stderr.fileno(), False)
    chunk = p.stderr.read() or b""
    _seen[p.pid] = _seen.get(p.pid, b"") + chunk
    return needle in _seen[p.pid]


def test_failing_fsync_never_reports_a_completion_that_is_not_durable(tmp_path: Path) -> None:
    """fdatasync fails with EIO (strace): the commit fails, the worker carries on, nothing is reported done
    that the store does not hold, and the store stays intact."""
    strace = require_tool("strace")
    db = tmp_path / "s.db"
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("".join(f"t{i}\n" for i in range(30)))
    # The tasks are added first, unfaulted: the failures are meant for the worker's commits, and how many
    # syncs making a store and importing a file take is no business of this test's (one more of them once
    # moved the 6th into the import, which then failed as it should, and the worker never ran).
    subprocess.run(onward_argv("add", "--db", str(db), "--tasks", str(tasks)), env=dict(os.environ, PYTHONPATH=SRC),
                   capture_output=True, timeout=60, check=True)
    run = onward_argv("run", "--db", str(db), "--", "sh", "-c", "echo ok")
    # every 4th fdatasync from the 6th on fails with EIO
    faulty = subprocess.run(
        [strace, "-f", "-qq", "-o", "/dev/null", "-e", "trace=fdatasync", "-e",
         "inject=fdatasync:error=EIO:when=6+4", *run],
        env=dict(os.environ, PYTHONPATH=SRC), capture_output=True, timeout=120)
    err = faulty.stderr.decode()
    assert "Traceback" not in err or "StoreError" in err or "disk I/O" in err, err
    assert "store error, will retry" in err, "the injected fsync failures did not reach the worker"
    reported = set(told_done(err))
    summary = next(line for line in err.splitlines() if "worker stopped" in line)
    assert f"done={len(reported)} " in summary, summary  # the summary counts only committed completions
    durable = done_in_store(db)
    assert reported <= durable, f"reported done but not in the store: {reported - durable}"
    # and a clean run finishes the job
    clean = subprocess.run(run, env=dict(os.environ, PYTHONPATH=SRC), capture_output=True, timeout=120)
    assert clean.returncode == 0, clean.stderr.decode()
    c = sqlite3.connect(db)
    assert c.execute("SELECT count(*) FROM tasks WHERE state = 'done'").fetchone()[0] == 30
    c.close()


_API_WORKER = """
import sys
from onward import Job
from onward.log import NORMAL
job = Job(sys.argv[1], log_level=NORMAL, max_attempts=10)

@job.task
def handle(task, ctx):
    return task

job.add(f"t{i}" for i in range(int(sys.argv[2])))
summary = job.run()
print(summary.done)
"""
# The same, with a short heartbeat: a task that a failed sync or probe leaves claimed waits out a short lease.
_API_WORKER_SHORT_LEASE = _API_WORKER.replace("max_attempts=10", "max_attempts=10, heartbeat=0.5")


def test_failing_fsync_beside_the_next_python_task_never_reports_what_it_did_not_sync(tmp_path: Path) -> None:
    """The Python API at concurrency 1 syncs each commit on the store's sync thread while the next task runs
    (SqliteStore.sync_ahead). Its fdatasync fails with EIO (strace, every thread): the failure reaches the
    worker, which tells none of what that sync was to vouch for, carries on with durable commits, and
    reports only completions the store holds."""
    strace = require_tool("strace")
    db = tmp_path / "s.db"
    trace = tmp_path / "trace.txt"
    # strace counts `when` per thread. The loop's thread makes 11 syncs making the store and adding the tasks,
    # so the first failure is its 20th, in the run. The sync thread shares one sync among the tasks of a 5 ms
    # window: for 200 tasks it made 20 to 41 here, and once fewer than 20, so none failed (a run in 5). For
    # 1,000 it makes well over 20. A short heartbeat keeps short the lease of each task a failed sync leaves
    # claimed (about 9 s in all here).
    faulty = subprocess.run(
        [strace, "-f", "-qq", "-y", "-o", str(trace), "-e", "trace=fdatasync", "-e",
         "inject=fdatasync:error=EIO:when=20+30", sys.executable, "-c",
         _API_WORKER_SHORT_LEASE, str(db), "1000"],
        env=dict(os.environ, PYTHONPATH=SRC), capture_output=True, timeout=180)
    err = faulty.stderr.decode()
    assert faulty.returncode == 0, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert "store error, will retry" in err, "the injected fsync failures did not reach the worker"
    assert "-wal>) = -1 EIO" in trace.read_text(), "no sync of the log failed"
    reported = told_done(err)
    assert len(reported) == len(set(reported)) == int(faulty.stdout.split()[-1])  # the tally counts what was told
    assert len(reported) < 1000  # the completions the failed syncs were to vouch for were never told
    durable = done_in_store(db)
    c = sqlite3.connect(db)
    assert c.execute("SELECT count(*) FROM tasks WHERE state <> 'done'").fetchone()[0] == 0  # and it went on
    c.close()
    assert set(reported) <= durable


def commands_at_concurrency_4_under_strace(tmp_path: Path, n: int, inject: str, traced: str = "fdatasync",
                                           ) -> tuple[subprocess.CompletedProcess[bytes], str]:
    """``onward run --concurrency 4 -- true {task}`` of ``n`` tasks, every thread under strace with ``inject``
    (its -e inject= value): the run, and strace's trace of the ``traced`` calls (descriptors with their paths)."""
    strace = require_tool("strace")
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("".join(f"t{i}\n" for i in range(n)))
    trace = tmp_path / "trace.txt"
    argv = onward_argv("run", "--db", str(tmp_path / "s.db"), "--tasks", str(tasks), "--concurrency", "4",
                       "--max-attempts", "10", "--", "true", "{task}")
    run = subprocess.run([strace, "-f", "-qq", "-y", "-o", str(trace), "-e", f"trace={traced}", "-e",
                          f"inject={inject}", *argv], env=dict(os.environ, PYTHONPATH=SRC), capture_output=True,
                         timeout=300)
    return run, trace.read_text()


def test_failing_fsync_left_to_the_sync_thread_by_the_loop_never_reports_what_it_did_not_sync(
        tmp_path: Path) -> None:
    """At --concurrency 4 the loop leaves each settling commit's fsync to the store's sync thread and goes on
    settling and starting commands (Runner._report_settled, pipelined): several commits may wait on one
    sync. Its fdatasync fails with EIO now and then (strace, every thread): the failure reaches the loop from
    that thread, what it was to vouch for is not told, the worker carries on, and the job ends done. (The
    data is not really lost here, so the store holds what was told either way: that nothing is told before
    its sync returned is tested by power cuts, test_power_cut.py.)"""
    faulty, trace = commands_at_concurrency_4_under_strace(tmp_path, 300, "fdatasync:error=EIO:when=15+11")
    err = faulty.stderr.decode()
    assert faulty.returncode == 0, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert "store error, will retry" in err, "the injected fsync failures did not reach the worker"
    assert "-wal>) = -1 EIO" in trace, "no sync of the log failed"
    reported = told_done(err)
    assert len(reported) == len(set(reported))
    assert len(reported) < 300  # the completions the failed syncs were to vouch for were never told
    durable = done_in_store(tmp_path / "s.db")
    assert set(reported) <= durable
    assert len(durable) == 300  # and it went on to the end


def test_a_hung_fsync_stalls_the_pipelined_loop_within_a_few_dozen_turns(tmp_path: Path) -> None:
    """The loop at --concurrency 4 leaves its syncs running beside its turns, but not without bound
    (runner.PIPELINED_SYNCS_MAX): when one fdatasync hangs (here one of the sync thread's, held 5 s by strace),
    the loop stops settling and starting tasks a few dozen turns later, as an fsync in place would stop it,
    rather than running the whole job with nothing made durable. Seen in the store: no task finished for over
    2 of those 5 s, and few finished after the hung sync was asked for (without the bound: no gap, and about
    2,000 tasks done in 3 s). The hang leaves a margin for those few dozen turns: they took 1.3 s of a 3 s
    hang once, on a machine with twice as many busy processes as cores."""
    # when= counts per thread: the 30th fdatasync of the sync thread (the worker's own make fewer).
    run, _ = commands_at_concurrency_4_under_strace(tmp_path, 1500, "fdatasync:delay_enter=5000000:when=30")
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    db = tmp_path / "s.db"
    c = sqlite3.connect(db)
    finished = [at for (at,) in c.execute("SELECT finished_at FROM tasks WHERE state = 'done' ORDER BY finished_at")]
    c.close()
    assert len(finished) == 1500
    gaps = [(b - a, i) for i, (a, b) in enumerate(zip(finished, finished[1:], strict=False), start=1)]
    gap, before = max(gaps)
    assert gap > 2.0, f"the loop went on while the fsync hung (longest pause between completions {gap:.2f} s)"
    # The 30th sync comes after at least 30 turns (at most 4 completions each), and the loop stops at most
    # PIPELINED_SYNCS_MAX turns after it: well under 500 completions before the pause.
    assert before < 500, f"{before} tasks finished before the loop stopped for the hung fsync"


def test_a_sync_that_fails_while_later_ones_wait_leaves_the_loop_waking_only_for_work(tmp_path: Path) -> None:
    """Several commits wait for their syncs beside the pipelined loop (--concurrency 4) while one fdatasync of
    the sync thread is held 1 s, then fails with EIO (strace). None of what those syncs were to vouch for is
    told, and they are claimed all the same: a sync left unclaimed would keep the store's descriptor
    readable, and the loop woke for it without end (44,310 waits for 600 tasks, against under 1,000)."""
    run, trace = commands_at_concurrency_4_under_strace(
        tmp_path, 600, "fdatasync:error=EIO:delay_enter=1000000:when=30", traced="fdatasync,epoll_wait")
    err = run.stderr.decode()
    assert run.returncode == 0, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert "-wal>) = -1 EIO" in trace, "no sync of the log failed"
    waits = trace.count("epoll_wait(")
    assert waits < 3 * 600, f"the loop woke {waits} times for 600 tasks: something kept it awake"
    assert len(done_in_store(tmp_path / "s.db")) == 600


@pytest.mark.parametrize("worker", ["command", "python"])
def test_a_journal_that_refuses_the_probe_after_a_sync_never_has_that_sync_vouched_for(
        tmp_path: Path, worker: str) -> None:
    """After every sync of the log (its own, on the sync thread, or SQLite's at a durable commit) the store
    asks the filesystem for a journal transaction (a replace of an extended attribute the database file does
    not have): ext4 can return 0 from an fdatasync in the moment between its journal aborting and its
    refusing writes, and lose what it was to keep. Here every 12th probe from the 6th on is refused with
    EROFS (strace, every thread): the refusal reaches the worker like a failed sync, nothing it was to vouch
    for is told, and the job goes on.
    (The file system is fine here, so a refused probe after a durable commit leaves that commit in place:
    the settling the worker then tries again finds the task done and drops its outcome as fenced, and a task
    it claimed there waits out its lease, kept short here.)"""
    strace = require_tool("strace")
    db = tmp_path / "s.db"
    trace = tmp_path / "trace.txt"
    inject = [strace, "-f", "-qq", "-y", "-o", str(trace), "-e", "trace=fsetxattr", "-e",
              "inject=fsetxattr:error=EROFS:when=6+12"]
    if worker == "command":
        tasks = tmp_path / "tasks.txt"
        tasks.write_text("".join(f"t{i}\n" for i in range(40)))
        argv = onward_argv("run", "--db", str(db), "--tasks", str(tasks), "--heartbeat", "0.5", "--", "true",
                           "{task}")
    else:
        # 1,000 tasks: strace counts `when` per thread, and the sync thread shares one probe among the tasks
        # of a 5 ms window; with 100 it made about 5 probes in all, none refused, and the 6th probe of the
        # loop's thread was the one after the stop's record, when everything had been told (a run in 6 here).
        argv = [sys.executable, "-c", _API_WORKER_SHORT_LEASE, str(db), "1000"]
    faulty = subprocess.run([*inject, *argv], env=dict(os.environ, PYTHONPATH=SRC), capture_output=True,
                            timeout=180)
    err = faulty.stderr.decode()
    assert "Traceback" not in err, err[-2000:]
    assert "cannot make the last commit durable: Read-only file system" in err, err[-2000:]
    assert f'{db}>, "{PROBE_XATTR}", "", 0, XATTR_REPLACE) = -1 EROFS' in trace.read_text(), "no probe was refused"
    reported = told_done(err)
    assert len(reported) == len(set(reported))
    durable = done_in_store(db)
    c = sqlite3.connect(db)
    total = c.execute("SELECT count(*) FROM tasks").fetchone()[0]
    c.close()
    assert set(reported) <= durable, f"reported done but not in the store: {set(reported) - durable}"
    assert len(reported) < total  # what the refused probes were to vouch for was never told
    # and a run without the fault finishes the job
    clean = subprocess.run(argv, env=dict(os.environ, PYTHONPATH=SRC), capture_output=True, timeout=180)
    assert clean.returncode == 0, clean.stderr.decode()[-2000:]
    c = sqlite3.connect(db)
    assert c.execute("SELECT count(*) FROM tasks WHERE state <> 'done'").fetchone()[0] == 0
    c.close()


# --- a store on a file system mounted read-only ----------------------------------------------------------
MAKE_STORE = """
import os, signal, sys
from onward.store import open_store
from tests.conftest import worker
store = open_store(sys.argv[1])
store.add(["a", "b", "c"])
claim = store.claim(worker(store), 1, 60.0, 3)[0]
store.complete(claim.task_id, claim.fence, b"result of a", "bytes")
if sys.argv[2] == "killed":
    os.kill(os.getpid(), signal.SIGKILL)  # its write-ahead log and index left beside the store, not checkpointed
store.close()
"""

READERS = [["status", "--json"], ["list"], ["logs"], ["result", "a"], ["jobs"], ["metrics"], ["steps", "a"]]
WRITERS = [["add", "d"], ["run", "--", "true"], ["retry", "a"], ["cancel", "b"], ["pause"], ["resume"],
           ["send", "b", "k", "1"]]


@pytest.mark.parametrize("left", ["closed", "killed"])
def test_a_store_on_a_read_only_mount_is_read_and_never_written(small_disk: Path, left: str) -> None:
    # SQLite cannot open a WAL store there ("unable to open database file": every command exited 2, the
    # status of bad input). The reading commands read it (its log too, when one was left); the writing ones
    # say the file system is read-only, in one line, exit 75 (the disk is at fault: try again later).
    db = small_disk / "s.db"
    made = subprocess.run([sys.executable, "-c", MAKE_STORE, str(db), left], cwd=Path(SRC).parent,
                          env=dict(os.environ, PYTHONPATH=f"{SRC}:{Path(SRC).parent}"), capture_output=True)
    assert made.returncode == (-9 if left == "killed" else 0), made.stderr
    assert os.path.exists(f"{db}-wal") == (left == "killed")
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    before = {p.name: p.read_bytes() for p in small_disk.iterdir()}
    for command in READERS:
        done = run_onward(*command, env={"ONWARD_DB": str(db)})
        assert done.returncode == 0, (command, done.stderr)
    status = json.loads(run_onward("status", "--json", env={"ONWARD_DB": str(db)}).stdout)
    assert (status["done"], status["pending"]) == (1, 2), status  # the commit still in the log is read
    assert run_onward("result", "a", env={"ONWARD_DB": str(db)}).stdout == b"result of a"
    for command in WRITERS:
        done = run_onward(*command, env={"ONWARD_DB": str(db)})
        assert done.returncode == 75, (command, done.stderr)
        assert done.stderr.decode() == f"onward: error: store {db}: cannot write to it: its file system is" \
                                       " read-only (EROFS)\n", command
    assert {p.name: p.read_bytes() for p in small_disk.iterdir()} == before


def test_a_full_out_disk_ends_the_run_75_and_the_next_run_writes_the_missing_files(small_disk: Path,
                                                                                   tmp_path: Path) -> None:
    """The store on a disk with room, --out on a full one: every task is done in the store, but most result
    files could not be written. The run ended "finished", exit 0, and a script reading --out after it got
    part of the results without a word; it ends 75 now (try again), and the next run, once there is room,
    writes the missing files from the store and ends 0."""
    db = tmp_path / "s.db"
    (tmp_path / "tasks.txt").write_text("".join(f"t{i}\n" for i in range(40)))
    out = small_disk / "out"
    argv = ["run", "--db", str(db), "--tasks", str(tmp_path / "tasks.txt"), "--out", str(out), "-q", "--",
            "head", "-c", "100000", "/dev/zero"]
    first = run_onward(*argv)
    err = first.stderr.decode()
    assert first.returncode == 75, err
    written = len(list(out.iterdir()))
    assert 0 < written < 40, written  # 1 MB holds some of the 40 files of 100 kB
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"onward: error: {40 - written} result files could not be written to --out (last:"
                           " [Errno 28] No space left"), err
    assert done_in_store(db) == {f"t{i}" for i in range(40)}
    subprocess.run(["umount", "-l", str(small_disk)], check=True)  # room again: the folder is on the big disk
    out.mkdir(parents=True, exist_ok=True)
    second = run_onward(*argv)
    assert second.returncode == 0, second.stderr.decode()
    assert sorted(p.name for p in out.iterdir()) == sorted(f"t{i}.txt" for i in range(40))


def test_a_disk_that_turned_read_only_on_its_own_is_unavailable_not_bad_input(tmp_path: Path) -> None:
    """ext4 with errors=remount-ro turns read-only by itself after an error: statvfs does not show it, SQLite
    opens the store read-only and says "attempt to write a readonly database", which was taken for
    configuration: exit 2, so `onward supervise` stopped for good, though the disk comes back once repaired.
    The kernel's EROFS to a write open tells: exit 75, as for a disk mounted read-only."""
    from tests.crash.test_power_cut import loop_ext4

    with loop_ext4(tmp_path, 16, "errors=remount-ro") as disk:
        db = disk.mount / "s.db"
        assert run_onward("add", "--db", str(db), "a", "b").returncode == 0
        trigger = Path("/sys/fs/ext4") / Path(disk.device).name / "trigger_fs_error"
        trigger.write_text("onward test\n")  # the error that turns it read-only, as a failing disk would
        # (/proc/mounts still says "rw" then, with "emergency_ro" beside it)
        wait_for(lambda: {"ro", "emergency_ro"} & set(next(line.split()[3].split(",") for line in open("/proc/mounts")
                                                        if line.split()[1] == str(disk.mount))), 10,
                 "the disk to turn read-only")
        for command in (["run", "--", "true"], ["add", "c"]):
            done = run_onward(command[0], "--db", str(db), *command[1:])
            err = done.stderr.decode()
            assert done.returncode == 75, err
            assert err.strip().endswith("its file system is read-only (EROFS)"), err
