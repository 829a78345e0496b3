"""`onward run` speaks sd_notify to whatever listens on $NOTIFY_SOCKET: the test binds its own socket."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import onward_argv, run_onward, wait_for

SRC = str(Path(__file__).resolve().parents[2] / "src")


def listen(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + address[1:] if address.startswith("@") else address)
    sock.setblocking(False)
    return sock


def drain(sock: socket.socket, into: list[str]) -> list[str]:
    while True:
        try:
            into.append(sock.recv(4096).decode())
        except BlockingIOError:
            return into


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_ready_status_watchdog_stopping(tmp_path: Path, abstract: bool) -> None:
    address = f"@onward-test-{uuid.uuid4().hex}" if abstract else str(tmp_path / "notify.sock")
    sock = listen(address)
    db = str(tmp_path / "s.db")
    run_onward("add", "--db", db, "a", "b")
    gate = tmp_path / "gate"
    worker = subprocess.Popen(
        onward_argv("run", "--db", db, "--heartbeat", "0.2", "--", "sh", "-c",
                    f"while [ ! -e {gate} ]; do sleep 0.02; done"),
        env=dict(os.environ, PYTHONPATH=SRC, NOTIFY_SOCKET=address, WATCHDOG_USEC="400000"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    messages: list[str] = []
    try:
        wait_for(lambda: any(m.startswith("READY=1") for m in drain(sock, messages)), 20, "READY=1")
        ready = next(m for m in messages if m.startswith("READY=1"))
        assert f"MAINPID={worker.pid}" in ready
        wait_for(lambda: sum(m == "WATCHDOG=1" for m in drain(sock, messages)) >= 3, 20, "watchdog pings")
        status = [m for m in drain(sock, messages) if m.startswith("STATUS=")]
        assert status and "0/2 done" in status[-1] and "1 running" in status[-1]
        worker.send_signal(signal.SIGTERM)
        gate.touch()
        worker.wait(timeout=20)
        assert "STOPPING=1" in drain(sock, messages)
        # the task's own environment does not carry the socket: a task cannot pose as the worker
    finally:
        if worker.poll() is None:
            worker.kill()
        sock.close()


def test_tasks_do_not_inherit_the_notify_socket(tmp_path: Path) -> None:
    address = str(tmp_path / "notify.sock")
    sock = listen(address)
    db = str(tmp_path / "s.db")
    run_onward("add", "--db", db, "t")
    r = subprocess.run(onward_argv("run", "--db", db, "--", "sh", "-c", 'echo "[${NOTIFY_SOCKET:-none}]"'),
                       env=dict(os.environ, PYTHONPATH=SRC, NOTIFY_SOCKET=address), capture_output=True, timeout=60)
    assert r.returncode == 0
    assert run_onward("result", "--db", db, "t").stdout == b"[none]\n"
    sock.close()


def test_no_socket_no_messages(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    run_onward("add", "--db", db, "t")
    started = time.monotonic()
    r = run_onward("run", "--db", db, "--", "true", env={"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")})
    assert r.returncode == 0, r.stderr  # a supervisor that went away never stops the work
    assert time.monotonic() - started < 30


def test_a_short_watchdog_is_fed_whatever_the_heartbeat(tmp_path: Path) -> None:
    # WATCHDOG_USEC of 1 s with --heartbeat 30 and a task that blocks: the loop must still wake (and send
    # WATCHDOG=1) at least twice a watchdog period, or systemd / onward supervise kills a healthy worker.
    address = str(tmp_path / "notify.sock")
    sock = listen(address)
    db = str(tmp_path / "s.db")
    run_onward("add", "--db", db, "a")
    gate = tmp_path / "gate"
    worker = subprocess.Popen(
        onward_argv("run", "--db", db, "--heartbeat", "30", "--grace", "1", "--", "sh", "-c",
                    f"while [ ! -e {gate} ]; do sleep 0.02; done"),
        env=dict(os.environ, PYTHONPATH=SRC, NOTIFY_SOCKET=address, WATCHDOG_USEC="1000000"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    messages: list[str] = []
    try:
        wait_for(lambda: any(m.startswith("READY=1") for m in drain(sock, messages)), 20, "READY=1")
        after_ready = len(messages)
        wait_for(lambda: sum(m == "WATCHDOG=1" for m in drain(sock, messages)[after_ready:]) >= 6, 10,
                 "WATCHDOG=1 every quarter second or so while the task runs")
    finally:
        gate.touch()
        worker.wait(timeout=20)
        sock.close()


def test_a_supervisor_that_does_not_read_never_blocks_the_sender_and_loses_no_ready(tmp_path: Path) -> None:
    # Nobody reads the socket (a supervisor SIGSTOPped alone): its queue fills. Heartbeats and statuses that
    # find it full are dropped; READY=1, progress and STOPPING=1 wait, and go first, in order, once it drains.
    from onward.notify import PROGRESS_FIELD, Notifier

    sock = listen(str(tmp_path / "notify.sock"))
    notifier = Notifier(str(tmp_path / "notify.sock"), watchdog_usec=1)

    def sender() -> None:
        for _ in range(100):
            notifier.send("WATCHDOG=1")
        notifier.ready()
        notifier.progress()
        notifier.status("late")
        notifier.stopping()

    thread = threading.Thread(target=sender, daemon=True)
    thread.start()
    thread.join(5)
    blocked = thread.is_alive()
    messages: list[str] = []
    while thread.is_alive():  # let a blocked sender go, so that the test ends
        drain(sock, messages)
        thread.join(0.05)
    assert not blocked, "a send blocked on the full queue"
    queued = drain(sock, [])
    assert queued and all(m == "WATCHDOG=1" for m in queued), queued
    notifier.watchdog()  # the next turn of the loop: what was kept goes first, in order
    sent = drain(sock, [])
    assert [m.split("\n")[0] for m in sent[:3]] == ["READY=1", f"{PROGRESS_FIELD}=1", "STOPPING=1"], sent
    notifier.close()
    sock.close()
