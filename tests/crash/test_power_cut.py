"""Power cuts: the store and ``--out`` live on a loop-mounted ext4 that is shut down mid-run with
EXT4_IOC_SHUTDOWN and NOLOGFLUSH (every write not yet fsynced is dropped, as when the power goes), then
unmounted, mounted again (the ext4 journal is replayed) and the job resumed.

After every cut the test checks what a user could have seen before it:
- every task a worker reported done before the cut began (its "done task=…" line, written to a log outside
  the cut disk, and timed; see ``LoopDisk.shut_down`` for why the cut's own milliseconds are left out) is
  done in the store, with the right result;
- every result file present in ``--out`` is whole and right (never torn), and belongs to a done task;
- the store passes ``PRAGMA integrity_check``;
- no task that the store holds as done after a cut is ever executed again by a later run (executions are
  logged outside the cut disk, one file per run).
At the end the job finishes: nothing lost, every result file present and right, no temporary files left.
"""

from __future__ import annotations

import calendar
import errno
import fcntl
import json
import os
import random
import re
import shutil
import signal
import sqlite3
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from onward.outdir import file_name
from tests.conftest import onward_argv, require_tool, wait_for
from tests.reliability import record

SRC = str(Path(__file__).resolve().parents[2] / "src")
EXT4_IOC_SHUTDOWN = (2 << 30) | (4 << 16) | (ord("X") << 8) | 125  # _IOR('X', 125, __u32) = 0x8004587D
EXT4_GOING_FLAGS_NOLOGFLUSH = 2  # drop what the journal has not committed: a power cut
DONE_LINE = re.compile(rb'done task=("[^"]*") attempt=')  # task names here need no escapes
# The same line with its time (UTC, to the millisecond, cut short: the line was written in that millisecond).
TIMED_DONE_LINE = re.compile(rb'^(\S+)Z onward pid=\d+ done task=("[^"]*") attempt=', re.MULTILINE)


@dataclass
class LoopDisk:
    image: Path
    device: str
    mount: Path

    def shut_down(self) -> float:
        """Cut the power: the file system stops accepting I/O, and nothing unsynced reaches the disk.
        Returns the time (``time.time()``) just before the cut began.

        Unlike a real power cut, this one takes a few milliseconds, and an ``fdatasync`` that returns while
        it is under way may report success for data it then drops: a ten-line program that appends a
        block and ``fdatasync``s it in a loop (no onward, no SQLite) lost its last block in 2 of 60 cuts
        here, both times from an ``fdatasync`` that returned 4.6 ms after the ioctl began. A completion
        reported in that window proves nothing, so the checks hold to those reported before it began."""
        cut_at = time.time()
        fd = os.open(self.mount, os.O_RDONLY)
        try:
            fcntl.ioctl(fd, EXT4_IOC_SHUTDOWN, struct.pack("I", EXT4_GOING_FLAGS_NOLOGFLUSH))
        finally:
            os.close(fd)
        return cut_at

    def remount(self) -> None:
        # The killed worker's commands die with it (PDEATHSIG) a moment later; until then the disk is busy.
        try:
            wait_for(lambda: subprocess.run(["umount", str(self.mount)], capture_output=True).returncode == 0,
                     30, f"{self.mount} to be unmounted", interval=0.05)
        except AssertionError as e:
            raise AssertionError(f"{e}; still using it: {users_of(self.mount)}") from None
        subprocess.run(["mount", "-t", "ext4", self.device, str(self.mount)], check=True)


def users_of(mount: Path) -> str:
    if shutil.which("fuser") is None:
        return "unknown (no fuser)"
    found = subprocess.run(["fuser", "-vm", str(mount)], capture_output=True, text=True)
    return (found.stdout + found.stderr).strip()[-500:]


def loop_ext4_usable() -> str | None:
    """Why a loop-mounted ext4 cannot be made here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root to mount a loop device"
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    return None


@contextmanager
def loop_ext4(tmp_path: Path, size_mb: int, options: str = "defaults", *, image_dir: Path | None = None,
              mkfs_options: tuple[str, ...] = (), allocate: bool = False) -> Iterator[LoopDisk]:
    """A fresh ext4 on a loop device, mounted under ``tmp_path``; unmounted and detached afterwards. Its image
    is in ``image_dir`` (default ``tmp_path``), made by mkfs.ext4 with ``mkfs_options``, and with
    ``allocate`` given all its storage before the loop device is set up."""
    reason = loop_ext4_usable()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"this test {reason}")
        pytest.skip(reason)
    image = (image_dir or tmp_path) / f"disk-{uuid.uuid4().hex[:6]}.img"
    with open(image, "wb") as f:
        f.truncate(size_mb << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", *mkfs_options, str(image)], check=True)
    if allocate:
        fd = os.open(image, os.O_RDWR | os.O_CLOEXEC)
        try:
            os.posix_fallocate(fd, 0, size_mb << 20)
        finally:
            os.close(fd)
    device = subprocess.run(["losetup", "-f", "--show", str(image)], check=True, capture_output=True,
                            text=True).stdout.strip()
    mount = tmp_path / f"mnt-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    try:
        subprocess.run(["mount", "-t", "ext4", "-o", options, device, str(mount)], check=True)
        yield LoopDisk(image, device, mount)
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, capture_output=True)
        subprocess.run(["losetup", "-d", device], check=False, capture_output=True)


@pytest.fixture
def loop_disk(tmp_path: Path) -> Iterator[LoopDisk]:
    with loop_ext4(tmp_path, 64) as disk:
        yield disk


def expected_result(name: str) -> bytes:
    return f"result of {name}\n".encode() * 50  # 1.5 KB: more than one write per result file


def test_power_cuts_lose_no_reported_completion_and_redo_no_committed_task(
        loop_disk: LoopDisk, tmp_path: Path, seed: int) -> None:
    power_cut_cycles(loop_disk, tmp_path, seed, cycles=int(os.environ.get("ONWARD_POWER_CUTS", "5")),
                     n_tasks=400)


def test_power_cuts_while_the_log_syncs_slowly_lose_no_completion_reported_at_concurrency_4(
        loop_disk: LoopDisk, tmp_path: Path, seed: int) -> None:
    # Commands at concurrency 4: the loop leaves each commit's fsync to the store's sync thread and goes on
    # settling and starting commands while it runs (Runner._report_settled, pipelined). Each fdatasync starts
    # 30 ms late here, so that several commits wait for one sync, and each cut finds some committed but not
    # synced. A completion told before its sync returned is lost by such a cut: telling what a commit settled
    # as soon as its sync was asked for failed this test in 2 of 2 runs. (The Python API at concurrency 1,
    # which also leaves its syncs running, is not tested this way: the fsync of each result file in --out
    # commits the file system's journal, which writes the log's new blocks too, and hid the same mistake.)
    power_cut_cycles(loop_disk, tmp_path, seed, cycles=int(os.environ.get("ONWARD_POWER_CUTS", "5")),
                     n_tasks=300, concurrencies=(4,), slow_sync_us=30_000)


@pytest.mark.torture
def test_torture_fifty_power_cuts(loop_disk: LoopDisk, tmp_path: Path, seed: int) -> None:
    power_cut_cycles(loop_disk, tmp_path, seed, cycles=50, n_tasks=3000)


def test_power_cuts_under_the_python_api_lose_no_reported_completion_and_redo_no_committed_task(
        loop_disk: LoopDisk, tmp_path: Path, seed: int) -> None:
    # The Python API's own path: at concurrency 1 each task's thread commits and leaves the log's fsync
    # running (the store's sync thread) while it runs the next task.
    power_cut_cycles(loop_disk, tmp_path, seed, cycles=int(os.environ.get("ONWARD_POWER_CUTS", "5")),
                     n_tasks=400, api=True)


@pytest.mark.torture
def test_torture_twenty_power_cuts_under_the_python_api(loop_disk: LoopDisk, tmp_path: Path, seed: int) -> None:
    power_cut_cycles(loop_disk, tmp_path, seed, cycles=20, n_tasks=2000, api=True)


# The worker of the Python API runs: `python -c API_WORKER DB TASKS OUT CONCURRENCY EXECUTIONS`. Each task
# logs its execution outside the cut disk and returns its result (written to --out as a file, as the CLI does).
API_WORKER = """
import sys
from onward import Job
db, tasks, out, concurrency, executions = sys.argv[1:6]
job = Job(db, out=out, concurrency=int(concurrency), heartbeat=0.5)

@job.task
def handle(task, ctx):
    with open(executions, "a") as log:
        log.write(task + "\\n")
    return f"result of {task}\\n".encode() * 50

with open(tasks) as names:
    job.add(names.read().split())
job.run()
"""


def power_cut_cycles(disk: LoopDisk, tmp_path: Path, seed: int, *, cycles: int, n_tasks: int,
                     api: bool = False, concurrencies: tuple[int, ...] = (1, 4), slow_sync_us: int = 0) -> None:
    """``slow_sync_us``: every fdatasync of the worker (any thread) starts that long after it is called
    (strace), so that commits wait long for their sync and cuts fall between the two."""
    rng = random.Random(seed)
    names = [f"t{i:05d}" for i in range(n_tasks)]
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("".join(n + "\n" for n in names))
    db = disk.mount / "store" / "onward.db"
    out = disk.mount / "out"
    reported: set[str] = set()  # tasks some worker said were done
    committed_by_run: list[set[str]] = []  # done in the store after each cut
    case = (f"EXT4_IOC_SHUTDOWN NOLOGFLUSH mid-run on store and --out, {n_tasks} tasks, "
            + " or ".join(map(str, concurrencies)) + " at a time" + (", Python API" if api else ", commands")
            + (f", each fdatasync delayed {slow_sync_us // 1000} ms" if slow_sync_us else ""))
    # Counted over the whole run, for RELIABILITY.md: completions reported before the cuts and found after
    # them, and every kind of damage the checks below look for (each must stay 0).
    figures = {"cycles": 0, "reported_before_cuts": 0, "reported_while_cutting": 0, "found_after_cuts": 0,
               "lost": 0, "torn": 0,
               "wrong_results": 0, "files_of_unfinished_tasks": 0, "redone_after_commit": 0,
               "integrity_failures": 0}

    def check(run: int, ok: bool, message: str) -> None:
        if not ok:  # what went wrong is recorded as well as what held
            record("power cut", backend="sqlite", case=case, seed=seed, failed_in_run=run, **figures)
        assert ok, f"{message} after run {run} (seed {seed})"

    for run in range(cycles + 1):
        final = run == cycles
        executions = tmp_path / f"executions-{run}.log"
        log = tmp_path / f"worker-{run}.log"
        concurrency = rng.choice(concurrencies)
        cut_at: float | None = None
        # The command logs its execution outside the cut disk, then prints its result.
        script = (f"import sys; open({str(executions)!r}, 'a').write(sys.argv[1] + '\\n'); "
                  f"sys.stdout.write(('result of ' + sys.argv[1] + '\\n') * 50)")
        if api:
            argv = [sys.executable, "-c", API_WORKER, str(db), str(tasks), str(out), str(concurrency),
                    str(executions)]
        else:
            argv = onward_argv("run", "--db", str(db), "--tasks", str(tasks), "--out", str(out),
                               "--concurrency", str(concurrency), "--heartbeat", "0.5", "--",
                               sys.executable, "-c", script, "{task}")
        if slow_sync_us:
            argv = [require_tool("strace"), "-f", "-qq", "--seccomp-bpf", "-o", "/dev/null", "-e", "trace=fdatasync",
                    "-e", f"inject=fdatasync:delay_enter={slow_sync_us}", *argv]
        with open(log, "wb") as log_file:
            # Its own session: a cut kills the whole group (strace and the worker under it).
            worker = subprocess.Popen(argv, env=dict(os.environ, PYTHONPATH=SRC), stdout=subprocess.DEVNULL,
                                      stderr=log_file, start_new_session=True)
            try:
                if final:
                    assert worker.wait(timeout=600) == 0, log.read_text(errors="replace")[-2000:]
                else:
                    # Cut after a seeded number of completions of this run (some runs are cut at once).
                    target = rng.randrange(0, max(2, (n_tasks - len(reported)) // (cycles - run + 1)))
                    wait_for(lambda: worker.poll() is not None or done_lines(log) >= target, 120,
                             f"{target} completions in run {run}")
                    if worker.poll() is not None:
                        # It did every task left before this process looked (a loaded CI machine can keep
                        # it from looking for a second): no cut, this run is the last, checked as such.
                        assert worker.returncode == 0, log.read_text(errors="replace")[-2000:]
                        final = True
                    else:
                        cut_at = disk.shut_down()
                        os.killpg(worker.pid, signal.SIGKILL)  # whatever it does with its I/O errors, the power is off
                        worker.wait(timeout=60)
            finally:
                if worker.poll() is None:
                    os.killpg(worker.pid, signal.SIGKILL)
                    worker.wait()
        reported_now = reported_done(log, before=cut_at)
        reported |= reported_now
        print(f"run {run}: concurrency {concurrency}, {len(reported)} reported done so far, "
              f"{'finished' if final else 'power cut'}")
        if not final:
            disk.remount()
        store = read_store(db)
        lost = {n for n in reported if store.states.get(n) != "done"}
        wrong = [n for n, data in store.results.items() if data != expected_result(n)]
        torn, unfinished = check_out_files(out, store.states)
        again = {n for committed in committed_by_run for n in committed} & executed(executions)
        if not final:
            figures["cycles"] += 1
            figures["reported_before_cuts"] += len(reported_now)
            figures["reported_while_cutting"] += len(reported_done(log) - reported_now)
            figures["found_after_cuts"] += sum(store.states.get(n) == "done" for n in reported_now)
        figures["lost"] += len(lost)
        figures["torn"] += len(torn)
        figures["wrong_results"] += len(wrong)
        figures["files_of_unfinished_tasks"] += len(unfinished)
        figures["redone_after_commit"] += len(again)
        figures["integrity_failures"] += store.integrity != "ok"
        check(run, store.integrity == "ok", "store damaged")
        check(run, not lost, f"reported done but not done in the store: {sorted(lost)[:5]}")
        check(run, not wrong, f"wrong results in the store: {wrong[:5]}")
        check(run, not torn, f"torn result files: {torn[:5]}")
        check(run, not unfinished, f"result files of tasks not done: {unfinished[:5]}")
        check(run, not again, f"tasks done in the store after an earlier cut ran again: {sorted(again)[:5]}")
        committed_by_run.append({n for n, s in store.states.items() if s == "done"})
        if final:
            break

    final_store = read_store(db)
    unfinished_tasks = [n for n in names if final_store.states.get(n) != "done"]
    present = {p.name for p in out.iterdir()}
    stray_or_missing = sorted(present ^ {file_name(n) for n in names})
    record("power cut", backend="sqlite", case=case, seed=seed, tasks=n_tasks,
           unfinished_at_end=len(unfinished_tasks), stray_or_missing_files=len(stray_or_missing), **figures)
    assert not unfinished_tasks, f"not every task finished: {unfinished_tasks[:5]}"
    assert not stray_or_missing, f"stray or missing files in --out: {stray_or_missing[:5]}"


def done_lines(log: Path) -> int:
    try:
        return len(DONE_LINE.findall(log.read_bytes()))
    except FileNotFoundError:
        return 0


def reported_done(log: Path, before: float | None = None) -> set[str]:
    """Tasks the log reports done; with ``before``, only those whose line was written before that time."""
    if before is None:
        return {json.loads(m) for m in DONE_LINE.findall(log.read_bytes())}
    text = log.read_bytes()
    timed = TIMED_DONE_LINE.findall(text)
    assert len(timed) == len(DONE_LINE.findall(text)), "a done line without its time: the check would go blind"
    found = set()
    for stamp, name in timed:
        written = calendar.timegm(time.strptime(stamp[:19].decode(), "%Y-%m-%dT%H:%M:%S")) + float(stamp[19:] or 0)
        if written + 0.001 <= before:  # the whole millisecond it names is over before the cut began
            found.add(json.loads(name))
    return found


def executed(log: Path) -> set[str]:
    try:
        return set(log.read_text().split())
    except FileNotFoundError:
        return set()


@dataclass
class StoreView:
    integrity: str
    states: dict[str, str]
    results: dict[str, bytes]


def read_store(db: Path) -> StoreView:
    """Read the store as a plain SQLite file, the way a user's own tooling could (read-only). A cut before
    the store's creation was durable leaves no file, or an empty one: a store without tasks."""
    if not db.exists() or db.stat().st_size == 0:
        return StoreView("ok", {}, {})
    try:
        c = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    except sqlite3.OperationalError as e:
        # Seen when make torture ran beside a whole suite started on its own: EIO, on a mount marked
        # "shutdown". A mount namespace another process made meanwhile (ip netns exec, systemd-nspawn) held a
        # copy of the loop disk's mount, so the unmount left its superblock, shut down by the cut, alive, and
        # the mount again took it back (MOUNT_NAMESPACE_FILES in tests/conftest.py keeps make test's own tests
        # from doing so to each other). Say what the open met, and on what mount.
        raise AssertionError(f"cannot open {db} read-only: {e}; {why_not_opened(db)}") from None
    try:
        integrity = str(c.execute("PRAGMA integrity_check").fetchone()[0])
        states = dict(c.execute("SELECT name, state FROM tasks").fetchall())
        results = {n: bytes(r) for n, r in c.execute("SELECT name, result FROM tasks WHERE state = 'done'")}
    finally:
        c.close()
    return StoreView(integrity, states, results)


def why_not_opened(path: Path) -> str:
    """What a plain open of ``path`` meets, and the mount holding it (its options: read-only, errors)."""
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
        opened = "a plain open for reading works"
    except OSError as e:
        opened = f"a plain open for reading fails: {e}"
    mount = subprocess.run(["findmnt", "-n", "-T", str(path)], capture_output=True, text=True)
    return f"{opened}; mount: {(mount.stdout or mount.stderr).strip()}"


def check_out_files(out: Path, states: dict[str, str]) -> tuple[list[str], list[str]]:
    """The result files that are torn (not exactly the task's result) and those of tasks not done. Temporary
    files from a write the cut interrupted may be present until the next start cleans them; none may carry
    a result's name (checked at the end: none may be left)."""
    torn: list[str] = []
    unfinished: list[str] = []
    if not out.exists():
        return torn, unfinished
    by_file = {file_name(n): n for n in states}
    for path in out.iterdir():
        name = by_file.get(path.name)
        if name is None:
            continue  # a temporary file of an interrupted write
        if states[name] != "done":
            unfinished.append(path.name)
        elif path.read_bytes() != expected_result(name):
            torn.append(path.name)
    return torn, unfinished


def test_the_journal_probe_is_refused_by_an_ext4_whose_journal_aborted(tmp_path: Path) -> None:
    """The check a sync of the store's log is followed by (SqliteStore._vouch): on an ext4 that met an error
    (errors=remount-ro, trigger_fs_error) both probes raise, on a descriptor opened before; before the
    error they pass. An fdatasync that returned 0 just before such an abort may have lost its data."""
    import onward.store.sqlite as sqlite_backend
    probes = {sqlite_backend.posix_journal_probe, sqlite_backend.journal_probe}
    with loop_ext4(tmp_path, 32, "errors=remount-ro") as disk:
        log = disk.mount / "s.db-wal"
        fd = os.open(log, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.pwrite(fd, b"\x37\x7f\x06\x82" + bytes(4092), 0)
            os.fdatasync(fd)
            assert all(probe(fd) is True for probe in probes)
            Path(f"/sys/fs/ext4/{Path(disk.device).name}/trigger_fs_error").write_text("1")
            for probe in probes:
                with pytest.raises(OSError) as refused:
                    probe(fd)
                assert refused.value.errno in (errno.EROFS, errno.EIO), refused.value
        finally:
            os.close(fd)


def test_store_disk_turning_read_only_under_a_worker_stalls_it_and_loses_nothing(
        tmp_path: Path, seed: int) -> None:
    """ext4 with errors=remount-ro and an error triggered under a running worker: the store's disk turns
    read-only at once. The worker says so in throttled lines, stays up without committing anything it
    cannot (a supervisor would only restart it into the same fault), stops cleanly on SIGTERM; after the
    disk is mounted again every reported completion is there and the job finishes."""
    rng = random.Random(seed)
    names = [f"t{i:05d}" for i in range(400)]
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("".join(n + "\n" for n in names))
    log = tmp_path / "worker.log"
    script = "import sys; sys.stdout.write(('result of ' + sys.argv[1] + '\\n') * 50)"
    env = dict(os.environ, PYTHONPATH=SRC)
    with loop_ext4(tmp_path, 32, "errors=remount-ro") as disk:
        db, out = disk.mount / "store" / "onward.db", disk.mount / "out"
        argv = onward_argv("run", "--db", str(db), "--tasks", str(tasks), "--out", str(out), "--heartbeat",
                           "0.5", "--", sys.executable, "-c", script, "{task}")
        with open(log, "wb") as log_file:
            worker = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=log_file)
        try:
            target = rng.randrange(1, 100)
            wait_for(lambda: done_lines(log) >= target, 120, f"{target} completions")
            Path(f"/sys/fs/ext4/{Path(disk.device).name}/trigger_fs_error").write_text("1")
            wait_for(lambda: b"disk I/O error" in log.read_bytes() or b"read-only" in log.read_bytes(), 60,
                     "the worker to report the read-only store")
            reported_at_fault = done_lines(log)
            # Heartbeats later it is still up, and says so in a few lines, not one per retry.
            wait_for(lambda: log.read_bytes().count(b"more in the last") >= 1, 60, "a throttled repeat line")
            assert worker.poll() is None, "a read-only store must not crash the worker"
            assert done_lines(log) == reported_at_fault, "nothing can be reported done on a read-only store"
            error_lines = [line for line in log.read_bytes().splitlines()
                           if b"disk I/O error" in line or b"read-only" in line]
            assert len(error_lines) < 20, f"error lines are not throttled: {len(error_lines)}"
            worker.send_signal(signal.SIGTERM)
            assert worker.wait(timeout=60) == 0
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        assert b"Traceback" not in log.read_bytes()
        disk.remount()
        store = read_store(db)
        reported = reported_done(log)
        lost = {n for n in reported if store.states.get(n) != "done"}
        torn, unfinished = check_out_files(out, store.states)
        finish = subprocess.run(argv, env=env, capture_output=True, timeout=300)
        final = read_store(db)
        unfinished_at_end = [n for n in names if final.states.get(n) != "done"]
        record("power cut", backend="sqlite", case="store disk turned read-only under a running worker "
               "(errors=remount-ro, trigger_fs_error)", seed=seed, tasks=len(names),
               reported_before_fault=len(reported), lost=len(lost), torn=len(torn),
               files_of_unfinished_tasks=len(unfinished), integrity=store.integrity,
               exit_status_on_sigterm=worker.returncode, exit_status_after_remount=finish.returncode,
               unfinished_at_end=len(unfinished_at_end))
        assert store.integrity == "ok"
        assert not lost, f"reported done but lost: {sorted(lost)[:5]} (seed {seed})"
        assert not torn and not unfinished, (torn[:5], unfinished[:5])
        assert finish.returncode == 0, finish.stderr.decode(errors="replace")[-2000:]
        assert not unfinished_at_end, unfinished_at_end[:5]
        assert {p.name for p in out.iterdir()} == {file_name(n) for n in names}


@contextmanager
def thin_ext4(tmp_path: Path, size_mb: int = 32) -> Iterator[tuple[LoopDisk, Path]]:
    """An ext4 whose free blocks have no storage behind them yet, like a thin-provisioned volume: its image
    lives on a small tmpfs, fully allocated, and then every block ext4 holds free is punched out of it. A
    block ext4 allocates from here on (a growing file's data) needs room on the tmpfs when it is first
    written; once the tmpfs is full (``fill``), that write fails at the loop device: a real writeback
    error, while the journal and the rest of what ext4 wrote at mkfs still have their storage. The next
    ``fdatasync`` of the file reports it, once; the kernel marks the pages clean (the bytes are in memory,
    not on the disk), and ext4 leaves their blocks "unwritten" (dmesg: "failed to convert unwritten extents
    ... potential data loss"). The loop driver also takes a write the tmpfs took only in part for done (a
    short write is no error to it): a sync can then return 0 for bytes it did not keep. Yields the disk
    and the tmpfs's folder."""
    reason = loop_ext4_usable() or (None if shutil.which("dumpe2fs") else "needs dumpe2fs")
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"this test {reason}")
        pytest.skip(reason)
    backing = tmp_path / "thin"
    backing.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb + 8}m,mode=0700", "tmpfs", str(backing)],
                   check=True)
    try:
        # 4 KiB blocks, the tmpfs's pages (a hole is punched a whole page at a time); nodiscard and the
        # eager inits, so that what ext4 keeps outside its free blocks (journal, inode tables) is written now.
        with loop_ext4(tmp_path, size_mb, image_dir=backing, allocate=True, mkfs_options=(
                "-b", "4096", "-E", "nodiscard,lazy_itable_init=0,lazy_journal_init=0")) as disk:
            (disk.mount / "store").mkdir()
            subprocess.run(["sync", "-f", str(disk.mount)], check=True)  # the bitmaps on the disk, for dumpe2fs
            free = re.findall(r"Free blocks: (.*)", subprocess.run(
                ["dumpe2fs", disk.device], check=True, capture_output=True, text=True).stdout)
            fd = os.open(disk.image, os.O_RDWR | os.O_CLOEXEC)
            try:
                for ranges in free:
                    for span in filter(None, (r.strip() for r in ranges.split(","))):
                        first, _, last = span.partition("-")
                        start, end = int(first), int(last or first)
                        punch_hole(fd, start * 4096, (end - start + 1) * 4096)
            finally:
                os.close(fd)
            yield disk, backing
    finally:
        subprocess.run(["umount", "-l", str(backing)], check=False, capture_output=True)


def punch_hole(fd: int, offset: int, length: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    falloc_fl_keep_size, falloc_fl_punch_hole = 0x01, 0x02
    if libc.fallocate(fd, falloc_fl_keep_size | falloc_fl_punch_hole, ctypes.c_long(offset),
                      ctypes.c_long(length)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def stopped_on_a_lost_log(worker: subprocess.Popen[bytes], log: Path, db: Path, env: dict[str, str],
                          api: bool) -> bool:
    """Check that the worker that exited stopped on its log's lost pages, as it must: status 75 and its
    line (the Python API: StoreLogLost out of job.run()); then that ``onward status`` reads the store (its
    close must not checkpoint the log either). Returns True, for the record."""
    text = log.read_text(errors="replace")[-3000:]
    if api:
        assert worker.returncode == 1 and "onward.errors.StoreLogLost" in text, text
    else:
        assert worker.returncode == 75 and "dropped from memory" in text, text
    status = subprocess.run(onward_argv("status", "--db", str(db)), env=env, capture_output=True)
    assert status.returncode == 0, status.stderr.decode()[-2000:]
    return True


def drop_from_memory(path: Path) -> None:
    """Have the kernel drop the file's clean pages from the page cache, as memory pressure does."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def fill(folder: Path) -> Path:
    """Fill the file system of ``folder`` to the last page; returns the file to delete to make room again."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        block = bytes(1 << 16)
        while True:
            try:
                os.write(fd, block)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                if len(block) == 4096:
                    break
                block = bytes(4096)
    finally:
        os.close(fd)
    return filler


# (Python API, concurrency, worker killed during the fault, the failed pages dropped from memory): the runs
# of failed_writes_then_power_cut.
FAILED_WRITE_VARIANTS = [(False, 1, False, False), (False, 4, False, False), (True, 1, False, False),
                         (False, 1, True, False), (False, 1, False, True), (False, 4, False, True),
                         (True, 1, False, True)]
FAILED_WRITE_IDS = ["commands-1", "commands-4", "python-api-1", "commands-1-killed-in-the-fault",
                    "commands-1-pages-dropped", "commands-4-pages-dropped", "python-api-1-pages-dropped"]


@pytest.mark.parametrize(("api", "concurrency", "killed", "dropped"), FAILED_WRITE_VARIANTS, ids=FAILED_WRITE_IDS)
def test_a_failed_sync_of_the_log_is_not_papered_over_by_later_ones(
        tmp_path: Path, seed: int, api: bool, concurrency: int, killed: bool, dropped: bool) -> None:
    failed_writes_then_power_cut(tmp_path, seed, api, concurrency, killed, dropped)


@pytest.mark.torture
def test_torture_seventy_failed_writes_of_the_log_then_power_cuts(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    for round_ in range(70):
        api, concurrency, killed, dropped = FAILED_WRITE_VARIANTS[round_ % len(FAILED_WRITE_VARIANTS)]
        folder = tmp_path / f"round-{round_}"
        folder.mkdir()
        failed_writes_then_power_cut(folder, rng.randrange(2**30), api, concurrency, killed, dropped)


def failed_writes_then_power_cut(tmp_path: Path, seed: int, api: bool, concurrency: int, killed: bool,
                                 dropped: bool) -> None:
    """Writes of the store's log that fail at the disk (a thin volume out of room), then work again (room
    again): the worker's next syncs return 0, but the log's pages whose write failed were marked clean, so
    on the disk the log has a hole, and SQLite's recovery after a power cut stops there: every commit after
    it, synced or not, is gone. So no completion reported after the fault may depend on the log before the
    hole: after the power cut, every task reported done is done. ``killed``: the worker is killed during
    the fault, before it could rewrite its log, and the next worker is started once there is room again.
    ``dropped``: during the fault, the kernel drops the log's pages from memory (``posix_fadvise``
    DONTNEED on the log, the eviction memory pressure makes), the worker held still meanwhile; those whose
    write failed then read back as what the disk holds there. The worker either finds its log whole
    (nothing of the hole was dropped), rewrites it, and is killed at once; or it stops with status 75
    without checkpointing it, and ``onward status`` is run (a last connection's close must not checkpoint
    it either). Then the next worker. The store must open and pass its integrity check: before the worker
    read its log back, its rewrite copied those bytes into the database (3 of 12 runs of the two command
    variants failed). In the other variants the worker goes on after its rewrite, and ``onward status`` is
    run once it has rewritten: its close must not find itself the last connection and delete the log under
    the worker."""
    rng = random.Random(seed)
    names = [f"t{i:05d}" for i in range(3000)]
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("".join(n + "\n" for n in names))
    logs = [tmp_path / "worker.log", tmp_path / "next-worker.log"]
    stopped = False
    env = dict(os.environ, PYTHONPATH=SRC)
    with thin_ext4(tmp_path) as (disk, backing):
        db = disk.mount / "store" / "onward.db"
        if api:  # its results go to a folder off the thin disk: only the store's writes fail
            argv = [sys.executable, "-c", API_WORKER, str(db), str(tasks), str(tmp_path / "out"), str(concurrency),
                    str(tmp_path / "executions.log")]
        else:
            argv = onward_argv("run", "--db", str(db), "--tasks", str(tasks), "--concurrency", str(concurrency),
                               "--heartbeat", "0.5", "--", "true", "{task}")

        def start(log: Path) -> subprocess.Popen[bytes]:
            with open(log, "wb") as log_file:
                return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=log_file)
        log = logs[0]
        worker = start(log)
        try:
            # Early, while the log still grows (its first checkpoint is at 1,000 pages, some 200 tasks).
            before = rng.randrange(5, 60)
            wait_for(lambda: done_lines(log) >= before, 120, f"{before} completions")
            fill_at = time.time()
            filler = fill(backing)
            wait_for(lambda: b"No space left on device" in log.read_bytes()
                     or b"I/O error" in log.read_bytes(), 60, "the worker to meet the failed write")
            if killed:
                worker.kill()
                worker.wait(timeout=60)
            if dropped:
                os.kill(worker.pid, signal.SIGSTOP)
                drop_from_memory(Path(f"{db}-wal"))
            filler.unlink()
            if not killed and not dropped:
                # Once the worker rewrote its log, another process opens the store and closes it while the
                # worker goes on: it must not take itself for the last connection (the rewrite's descriptors of
                # the store's files once dropped the worker's locks with them; see onward.store.sqlite_locks).
                mark = Path(f"{db}-unsynced")
                wait_for(lambda: not mark.exists() or worker.poll() is not None, 60,
                         "the worker to rewrite its log or to stop")
                status = subprocess.run(onward_argv("status", "--db", str(db)), env=env, capture_output=True)
                assert status.returncode == 0, status.stderr
            if dropped:
                os.kill(worker.pid, signal.SIGCONT)
                mark = Path(f"{db}-unsynced")
                wait_for(lambda: not mark.exists() or worker.poll() is not None, 60,
                         "the worker to rewrite its log or to stop")
                if worker.poll() is None:
                    # Its log read back whole and rewritten: a kill -9 now leaves the database file as the
                    # rewrite wrote it, with little in the log after it.
                    worker.kill()
                    worker.wait(timeout=60)
                else:
                    stopped = stopped_on_a_lost_log(worker, log, db, env, api)
            if killed or dropped:
                log = logs[1]
                worker = start(log)
            at_fault = done_lines(log)
            after = rng.randrange(5, 40)
            wait_for(lambda: done_lines(log) >= at_fault + after or worker.poll() is not None, 120,
                     f"{after} completions after the fault")
            if log == logs[0] and worker.poll() is not None:
                # Without being made to, the kernel dropped pages of the failed write (1 round in 60 of
                # make torture): the worker found it, as in the dropped variant. The next worker rewrites the
                # log before the power cut, as in the other runs (see thin_ext4 on the loop driver's syncs).
                stopped = stopped_on_a_lost_log(worker, log, db, env, api)
                log = logs[1]
                worker = start(log)
                wait_for(lambda: done_lines(log) >= after or worker.poll() is not None, 120,
                         f"{after} completions by the next worker")
            cut_at = disk.shut_down()
            worker.kill()
            worker.wait(timeout=60)
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        disk.remount()
        reported = {n for path in logs if path.exists() for n in reported_done(path, before=cut_at)}
        # This loop device can acknowledge a sync of bytes the full tmpfs did not take (see thin_ext4): a
        # completion reported once the filling began rests on such a sync, and on the page cache's copy. Where
        # that copy is gone too (the worker found its log's pages gone: the dropped variant, or the kernel's
        # own doing), the bytes are nowhere, and no software keeps them: those are not counted as lost.
        unvouched = reported_done(logs[0]) - reported_done(logs[0], before=fill_at) if stopped else set()
        store = read_store(db)
        lost = sorted(n for n in reported - unvouched if store.states.get(n) != "done")
        gone = sorted(n for n in unvouched if store.states.get(n) != "done")
        print(f"seed {seed}: {before} done before the fault, {len(reported)} reported before the cut, "
              f"{len(lost)} lost" + (f", the worker stopped on a lost log ({len(gone)} of {len(unvouched)} reported "
                                     "after the disk filled gone with it)" if stopped else ""))
        record("power cut", backend="sqlite", case="writes of the log failing at the disk (thin volume out of room), "
               f"room again, then a power cut; concurrency {concurrency}" + (", Python API" if api else ", commands")
               + (", the worker killed during the fault" if killed else "")
               + (", the failed pages dropped from memory" if dropped else ""), seed=seed, stopped=int(stopped),
               reported_on_a_lying_sync_and_gone=len(gone),
               reported_before_cut=len(reported), lost=len(lost), integrity=store.integrity)
        assert store.integrity == "ok"
        assert not lost, f"reported done but lost: {lost[:5]} ({len(lost)} of {len(reported)}; seed {seed})"
