"""Watching a job as a user does: `onward status --watch` in a real pseudo-terminal and through a pipe, the
progress bar of `onward run` on a terminal's stderr (and never elsewhere), through the installed console
script, on real stores with real workers."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import signal
import struct
import subprocess
import termios
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import onward_argv, run_onward, wait_for

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
BAR = re.compile(r"\[[#.]+\] \d+/\d+ ")


class Terminal:
    """A pseudo-terminal ``columns`` wide whose output a thread keeps reading (a full terminal would
    block the program writing to it)."""

    def __init__(self, columns: int = 80, rows: int = 40) -> None:
        self.leader, self.follower = pty.openpty()
        fcntl.ioctl(self.follower, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        self._chunks: list[bytes] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)

    def start_reading(self) -> None:
        os.close(self.follower)  # only the child holds it now: its exit ends our reads
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.leader, 65536)
            except OSError:  # EIO: the other side closed
                return
            if not chunk:
                return
            with self._lock:
                self._chunks.append(chunk)

    @property
    def raw(self) -> str:
        with self._lock:
            return b"".join(self._chunks).decode(errors="replace")

    @property
    def text(self) -> str:
        return ANSI.sub("", self.raw).replace("\r\n", "\n")

    def close(self) -> None:
        self._reader.join(30)
        os.close(self.leader)


def terminal_env() -> dict[str, str]:
    """The environment of a program on a terminal: its size from the terminal itself, not from COLUMNS."""
    return {**{k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}, "TERM": "xterm"}


def watch_on_a_terminal(db: str, columns: int) -> tuple[Terminal, subprocess.Popen[bytes]]:
    """`onward status --watch --interval 0.2` on a terminal ``columns`` wide, its output being read."""
    term = Terminal(columns=columns)
    watch = subprocess.Popen(onward_argv("status", "--db", db, "--watch", "--interval", "0.2"),
                             stdout=term.follower, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                             env=terminal_env())
    term.start_reading()
    return term, watch


@contextmanager
def worker_holding(db: str, gate: Path, concurrency: int = 2) -> Iterator[subprocess.Popen[bytes]]:
    """A worker whose tasks run until ``gate`` exists."""
    worker = subprocess.Popen(
        onward_argv("run", "--db", db, "--concurrency", str(concurrency), "--", "sh", "-c",
                    f"while [ ! -e {gate} ]; do sleep 0.05; done"),
        env=os.environ, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        yield worker
    finally:
        gate.touch()
        worker.wait(60)


def running_count(db: str) -> int:
    import json

    r = run_onward("status", "--db", db, "--json")
    return len(json.loads(r.stdout)["tasks_running"]) if r.returncode == 0 else 0


def test_watch_redraws_in_place_on_a_terminal_and_ends_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    long_url = "https://example.com/archive/" + "x" * 150 + "/page-1"
    assert run_onward("add", "--db", db, long_url, "short-task", "later-1", "later-2").returncode == 0
    with worker_holding(db, tmp_path / "gate") as worker:
        wait_for(lambda: running_count(db) == 2, 30, "both tasks to run")
        term, watch = watch_on_a_terminal(db, columns=80)
        try:
            # Three draws of the view: the first, and two redraws in place (the cursor moved back up).
            wait_for(lambda: term.text.count("workers (1)") >= 3, 30, "the view to be redrawn")
            assert "\x1b[1A" in term.raw and "\x1b[2K" in term.raw  # redrawn over itself, not scrolled
        finally:
            watch.send_signal(signal.SIGINT)
            code = watch.wait(30)
            term.close()
        stderr = watch.stderr.read().decode() if watch.stderr else ""
        assert code == 0 and "Traceback" not in stderr and stderr == "", stderr
        screen = term.text
        last = screen[screen.rindex("onward "):]
        assert BAR.search(last) and "0/4 0.0%" in last, last
        assert "running (2)" in last and "short-task" in last and "#1" in last, last
        (url_line,) = [line for line in last.splitlines() if "example.com" in line]
        assert "…" in url_line and "/page-1" in url_line, url_line  # cut in the middle: both ends kept
        (worker_line,) = [line for line in last.splitlines() if f"pid {worker.pid} " in line]
        assert " up " in worker_line and "running 2" in worker_line and "alive" in worker_line, last
        assert all(len(line) <= 80 for line in last.splitlines()), last


def test_watch_through_a_pipe_prints_one_plain_line_per_refresh(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    assert run_onward("add", "--db", db, "a", "b", "c").returncode == 0
    watch = subprocess.Popen(onward_argv("status", "--db", db, "--watch", "--interval", "0.1"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=os.environ)
    assert watch.stdout is not None
    lines = [watch.stdout.readline().decode() for _ in range(3)]
    watch.send_signal(signal.SIGTERM)  # ends it like Ctrl-C
    rest, stderr = watch.communicate(timeout=30)
    assert watch.returncode == 0 and stderr == b"", stderr
    for line in lines:
        assert "\x1b" not in line and line.endswith("\n")
        assert re.fullmatch(r"\S+Z total 3 pending 3 running 0 waiting 0 done 0 failed 0 cancelled 0 rate 0\.0/s no worker running "
                            r"workers 0\n", line), line


def test_watch_refuses_bad_intervals_and_a_missing_store(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    assert run_onward("add", "--db", db, "a").returncode == 0
    for bad in ("0", "-1", "nan", "inf", "", "1e400", "<script>", "\udcff"):
        r = run_onward("status", "--db", db, "--watch", "--interval", bad)
        assert r.returncode == 2, (bad, r.stderr)
        assert r.stderr.decode().startswith("onward: error: ") and r.stderr.count(b"\n") == 1, r.stderr
        assert r.stdout == b""
    r = run_onward("status", "--db", db, "--interval", "2")
    assert r.returncode == 2 and b"--interval goes with --watch" in r.stderr
    missing = run_onward("status", "--db", str(tmp_path / "none" / "s.db"), "--watch")
    assert missing.returncode == 2 and missing.stderr.startswith(b"onward: error: no onward store at ")
    assert missing.stderr.count(b"\n") == 1 and not (tmp_path / "none").exists()


def test_run_draws_a_progress_bar_under_its_log_lines_on_a_terminal_only(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    tasks = [f"t{i}" for i in range(6)]
    assert run_onward("add", "--db", db, *tasks).returncode == 0
    term = Terminal(columns=80)
    worker = subprocess.Popen(onward_argv("run", "--db", db, "--", "sh", "-c", "sleep 0.3"),
                              stdout=subprocess.DEVNULL, stderr=term.follower, stdin=subprocess.DEVNULL,
                              env=terminal_env())
    term.start_reading()
    assert worker.wait(120) == 0
    term.close()
    raw = term.raw
    assert BAR.search(raw), raw
    # Every log line is written whole, the bar erased before it and drawn again under it.
    assert '\r\x1b[2K' in raw and "done task=\"t5\"" in raw
    final = ANSI.sub("", raw).replace("\r\n", "\n").rstrip("\n").split("\n")[-1].split("\r")[-1]
    assert final.startswith("[") and "6/6 100.0%" in final and "done 6" in final, final
    bars = [piece for piece in ANSI.sub("", raw).replace("\r", "\n").split("\n") if BAR.match(piece)]
    assert len(bars) > 2 and all(len(bar) < 80 for bar in bars), bars  # never wraps at the margin

    # Its stderr a pipe, or a file: one line per event, no bar, no escape sequence.
    assert run_onward("add", "--db", db, "u1", "u2").returncode == 0
    piped = run_onward("run", "--db", db, "--", "true")
    assert piped.returncode == 0 and b"done task=\"u2\"" in piped.stderr
    assert not BAR.search(piped.stderr.decode()) and b"\x1b" not in piped.stderr and b"\r" not in piped.stderr
    assert run_onward("add", "--db", db, "v1").returncode == 0
    log_file = tmp_path / "worker.log"
    with open(log_file, "wb") as f:
        subprocess.run(onward_argv("run", "--db", db, "--", "true"), stderr=f, env=os.environ, timeout=120,
                       check=True)
    written = log_file.read_text()
    assert 'done task="v1"' in written and not BAR.search(written) and "\x1b" not in written

    # On a terminal, but under a supervisor (NOTIFY_SOCKET set), whose lines share that terminal: no bar.
    assert run_onward("add", "--db", db, "w1").returncode == 0
    term = Terminal(columns=80)
    supervised = subprocess.Popen(onward_argv("run", "--db", db, "--", "true"), stdout=subprocess.DEVNULL,
                                  stderr=term.follower, stdin=subprocess.DEVNULL,
                                  env={**terminal_env(), "NOTIFY_SOCKET": str(tmp_path / "no-such-socket")})
    term.start_reading()
    assert supervised.wait(120) == 0
    term.close()
    assert 'done task="w1"' in term.text and not BAR.search(term.text), term.raw


def test_the_view_of_a_real_job_fits_80_columns_and_makes_the_readme_screenshot(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's screenshot is this view of a real job (set ONWARD_SCREENSHOTS=1 to write it again)."""
    from rich.console import Console

    from onward.status import status_dict
    from onward.store import open_store
    from onward.watch import render_view

    monkeypatch.chdir(tmp_path)
    db = "crawl/onward.db"
    pages = [f"https://archive.example.org/collections/2026/newspapers/issue-{i:04d}/page-{p}.html"
             for i in range(1, 21) for p in (1, 2)]
    assert run_onward("add", "--db", db, *pages, cwd=tmp_path).returncode == 0
    gate = tmp_path / "gate"
    # Issue 7's pages fail for good; the last three pages in the queue hang until the gate.
    script = (f'case "$0" in *issue-0007*) echo "HTTP 503 from archive.example.org" >&2; exit 1;; esac; '
              f'case "$0" in *issue-0019/page-2*|*issue-0020*) while [ ! -e {gate} ]; do sleep 0.05; done;; esac')
    worker = subprocess.Popen(
        onward_argv("run", "--db", db, "--concurrency", "3", "--max-attempts", "1",
                    "--", "sh", "-c", script, "{task}"),
        env=os.environ, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        store = open_store(db, create=False)
        try:
            def settled() -> dict[str, object] | None:
                r = status_dict(store)
                return r if r["running"] == 3 and r["failed"] == 2 and r["done"] == 35 else None
            report = wait_for(settled, 60, "35 done, 2 failed and 3 hanging")
        finally:
            store.close()
        assert isinstance(report, dict)
        console = Console(width=80, record=True, force_terminal=True, color_system="truecolor")
        console.print(render_view(report, 80))
        text = console.export_text(clear=False)
        assert all(len(line) <= 80 for line in text.splitlines()), text
        assert "37/40 92.5%" in text and "running (3)" in text and "HTTP 503" in text, text
        assert f"pid {worker.pid} " in text and "workers (1)" in text, text
        if os.environ.get("ONWARD_SCREENSHOTS") == "1":
            svg = Path(__file__).resolve().parents[2] / "docs" / "status-watch.svg"
            svg.parent.mkdir(exist_ok=True)
            console.save_svg(str(svg), title="onward status --watch")
    finally:
        gate.touch()
        worker.wait(60)


def test_a_supervised_worker_shows_its_restarts_and_their_cause(store_url: str, tmp_path: Path) -> None:
    import json

    db = store_url
    gate = tmp_path / "gate"
    assert run_onward("add", "--db", db, "a", "b").returncode == 0
    supervisor = subprocess.Popen(
        onward_argv("supervise", "--", *onward_argv("run", "--db", db, "--concurrency", "2", "--", "sh", "-c",
                                                    f"while [ ! -e {gate} ]; do sleep 0.05; done")),
        env=os.environ, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        def status() -> dict[str, object]:
            r = run_onward("status", "--db", db, "--json")
            return json.loads(r.stdout) if r.returncode == 0 else {}
        first = wait_for(lambda: status().get("running") == 2 and status(), 30, "the worker to run both tasks")
        assert isinstance(first, dict)
        (worker,) = first["workers"]
        assert worker["restarts"] == 0 and worker["last_restart"] is None
        os.kill(worker["pid"], signal.SIGKILL)

        # The supervisor journals the restart once the next worker is started, not before: on PostgreSQL
        # (importing the driver, connecting) the new worker may be running both tasks before it is written.
        def restarted() -> dict[str, object] | None:
            report = status()
            workers = [w for w in report.get("workers", []) if w["alive"]]  # type: ignore[attr-defined]
            # The two tasks run again one at a time: the worker died with both running (see the README,
            # "Crashes with several tasks running").
            return report if (report.get("running") == 1 and workers and workers[0]["pid"] != worker["pid"]
                              and workers[0]["restarts"]) else None
        report = wait_for(restarted, 60, "a new worker running a task again, its restart journaled")
        assert isinstance(report, dict)
        (alive,) = [w for w in report["workers"] if w["alive"]]
        assert alive["restarts"] == 1 and "SIGKILL" in alive["last_restart"], alive
        assert report["restarts"] == 1

        from rich.console import Console

        from onward.watch import render_view

        console = Console(width=80, record=True)
        console.print(render_view(report, 80))
        text = console.export_text()
        assert "restarts on this host 1, last: " in text and "SIGKILL" in text, text
    finally:
        gate.touch()
        supervisor.wait(60)


def test_watch_says_paused_while_the_job_is_paused(store_url: str) -> None:
    from onward.store import open_store

    db = store_url
    assert run_onward("add", "--db", db, "a").returncode == 0

    def one_line() -> str:
        watch = subprocess.Popen(onward_argv("status", "--db", db, "--watch", "--interval", "0.1"),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=os.environ)
        assert watch.stdout is not None
        line = watch.stdout.readline().decode()
        watch.send_signal(signal.SIGINT)
        watch.communicate(timeout=30)
        assert watch.returncode == 0
        return line

    assert not one_line().rstrip().endswith(" paused")
    store = open_store(db, create=False)
    try:
        assert store.set_paused(True)
    finally:
        store.close()
    assert one_line().rstrip().endswith(" workers 0 paused")


def test_the_bar_counts_cancelled_tasks_apart_from_failed_ones(tmp_path: Path) -> None:
    """Cancelled tasks are finished and no failure (README): the bar said "failed 3" for 3 cancelled and none
    failed, under the counts line saying "failed 0 cancelled 3"."""
    db = str(tmp_path / "s.db")
    assert run_onward("add", "--db", db, "a", "b", "c", "d", "e").returncode == 0
    assert run_onward("cancel", "--db", db, "a", "b", "c").returncode == 0
    term, watch = watch_on_a_terminal(db, columns=100)
    try:
        wait_for(lambda: BAR.search(term.text) is not None, 30, "the bar to be drawn")
    finally:
        watch.send_signal(signal.SIGINT)
        watch.wait(30)
        term.close()
    (bar,) = {line.strip() for line in term.text.splitlines() if BAR.search(line)}
    assert "3/5 60.0%  done 0  failed 0  cancelled 3" in bar, bar


def next_line_with(process: subprocess.Popen[bytes], needle: str, timeout: float = 20) -> str:
    """The next line ``process`` prints that holds ``needle``, waiting at most ``timeout`` seconds."""
    import select

    assert process.stdout is not None
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0 and select.select([process.stdout], [], [], left)[0], f"no line with {needle!r}"
        line = process.stdout.readline().decode()
        if needle in line:
            return line


def test_watch_and_logs_follow_notice_a_store_deleted_or_replaced_under_them(tmp_path: Path) -> None:
    """Left running beside a job, they showed the deleted file's state for ever (the watch: "paused" and 3
    tasks, while the store at that path had 5 and was not paused; logs -f: silence). The watch now says the
    store is gone while none is there, and shows the new one once it is; logs -f stops with one line."""
    db = tmp_path / "s.db"
    assert run_onward("add", "--db", str(db), "a", "b", "c").returncode == 0
    assert run_onward("pause", "--db", str(db)).returncode == 0
    watch = subprocess.Popen(onward_argv("status", "--db", str(db), "--watch", "--interval", "0.1"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=os.environ)
    logs = subprocess.Popen(onward_argv("logs", "--db", str(db), "-f"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=os.environ)
    assert watch.stdout is not None and logs.stdout is not None
    try:
        assert " total 3 " in watch.stdout.readline().decode()
        assert b"paused" in logs.stdout.readline() + logs.stdout.readline()  # the journal so far: added, paused
        for path in tmp_path.glob("s.db*"):
            path.unlink()
        line = next_line_with(watch, "store unavailable")
        assert "total 3" in line and "no onward store" in line, line  # the last report stands, and says so
        assert run_onward("add", "--db", str(db), "v", "w", "x", "y", "z").returncode == 0
        line = next_line_with(watch, " total 5 ")
        assert "store unavailable" not in line and "paused" not in line, line
        assert logs.wait(timeout=30) == 2
        err = logs.stderr.read().decode() if logs.stderr else ""
        assert err.count("\n") == 1 and "while this process was using it; stopping" in err, err
    finally:
        watch.send_signal(signal.SIGTERM)
        watch.communicate(timeout=30)
        if logs.poll() is None:
            logs.kill()
            logs.wait()
    assert watch.returncode == 0
