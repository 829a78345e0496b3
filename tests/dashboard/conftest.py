"""Fixtures of the dashboard tests: the real server, started as the installed console script on a free
port, and a real job (``onward run``) working on the same store."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import onward_argv, run_onward

# A task's command: sleeps a little, then succeeds, except that
# - "blocker" runs until the file DIR/release exists (it keeps the worker alive while a test looks on),
# - a task whose name starts with "flaky" or "<" fails while DIR/broken exists, naming itself on stderr.
WORK_PY = """\
import os, sys, time
task, folder = sys.argv[1], sys.argv[2]
if task == "blocker":
    for _ in range(1200):
        if os.path.exists(os.path.join(folder, "release")):
            break
        time.sleep(0.1)
time.sleep(0.15)
if task.startswith(("flaky", "<")) and os.path.exists(os.path.join(folder, "broken")):
    sys.stderr.write("broken: " + task + " <script>alert(2)</script>\\n")
    sys.exit(1)
print("result of " + task)
"""


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Served:
    """A running ``onward dashboard``: its base URL (ends with "/") and its process."""

    url: str
    process: subprocess.Popen[bytes]
    token: str | None = None

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
                token: str | None = None) -> Answer:
        """One HTTP request; ``token`` defaults to the server's own (pass "" for none)."""
        all_headers = dict(headers or {})
        token = self.token if token is None else token
        if token:
            all_headers.setdefault("Authorization", f"Bearer {token}")
        req = urllib.request.Request(self.url + path.lstrip("/"), data=body, method=method, headers=all_headers)
        try:
            with urllib.request.urlopen(req, timeout=30) as response:
                return Answer(response.status, dict(response.headers), response.read())
        except urllib.error.HTTPError as e:
            return Answer(e.code, dict(e.headers), e.read())

    def get(self, path: str, **kw: Any) -> Answer:
        return self.request("GET", path, **kw)

    def post(self, path: str, value: object, **kw: Any) -> Answer:
        headers = {"Content-Type": "application/json", **kw.pop("headers", {})}
        return self.request("POST", path, body=json.dumps(value).encode(), headers=headers, **kw)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=30)


def start_dashboard(db: str, *args: str, env: dict[str, str] | None = None) -> Served:
    """``onward dashboard --db DB --port 0 ARGS…``, once it printed the URL it listens on."""
    full_env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    full_env.pop("ONWARD_DASHBOARD_TOKEN", None)
    full_env.update(env or {})
    process = subprocess.Popen(onward_argv("dashboard", "--db", db, "--port", "0", *args), env=full_env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines: queue.Queue[bytes] = queue.Queue()
    stdout = process.stdout
    assert stdout is not None
    threading.Thread(target=lambda: lines.put(stdout.readline()), daemon=True).start()
    try:
        first = lines.get(timeout=30).decode()
    except queue.Empty:
        process.kill()
        raise AssertionError("the dashboard printed no URL within 30 s") from None
    if not first.startswith("onward dashboard: http://"):
        process.kill()
        raise AssertionError(f"unexpected first line {first!r}; stderr: {process.communicate()[1]!r}")
    token = None
    if "--token" in args:
        token = args[args.index("--token") + 1]
    elif env and env.get("ONWARD_DASHBOARD_TOKEN"):
        token = env["ONWARD_DASHBOARD_TOKEN"]
    return Served(first.split()[2], process, token)


@pytest.fixture
def dashboard() -> Iterator[Any]:
    """A factory of dashboards, each stopped with SIGTERM at the end; each must exit 0."""
    started: list[Served] = []

    def start(db: str, *args: str, env: dict[str, str] | None = None) -> Served:
        served = start_dashboard(db, *args, env=env)
        started.append(served)
        return served

    yield start
    for served in started:
        code = served.stop()
        assert code == 0, served.process.communicate()[1]


@dataclass
class Job:
    """A store with tasks and a worker (``onward run``) on it, and the folder its tasks look at."""

    db: str
    folder: Path
    worker: subprocess.Popen[bytes] | None = None

    def run(self, *extra: str) -> subprocess.Popen[bytes]:
        self.worker = subprocess.Popen(
            onward_argv("run", "--db", self.db, "--heartbeat", "0.5", *extra, "--",
                        sys.executable, str(self.folder / "work.py"), "{task}", str(self.folder)),
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")},
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        return self.worker

    def finish(self) -> None:
        """Let the blocker end and stop the worker."""
        (self.folder / "release").touch()
        if self.worker is not None and self.worker.poll() is None:
            self.worker.send_signal(signal.SIGTERM)
            self.worker.wait(timeout=60)


def make_job(tmp_path: Path, tasks: list[str]) -> Job:
    folder = tmp_path / "job"
    folder.mkdir()
    (folder / "work.py").write_text(WORK_PY)
    db = str(tmp_path / "store" / "onward.db")
    tasks_file = folder / "tasks.txt"
    tasks_file.write_text("".join(t + "\n" for t in tasks))
    added = run_onward("add", "--db", db, "--tasks", str(tasks_file))
    assert added.returncode == 0, added.stderr
    return Job(db, folder)


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Any]:
    jobs: list[Job] = []

    def make(tasks: list[str]) -> Job:
        made = make_job(tmp_path, tasks)
        jobs.append(made)
        return made

    yield make
    for made in jobs:
        made.finish()


def status_of(db: str) -> dict[str, Any]:
    shown = run_onward("status", "--db", db, "--json")
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)
