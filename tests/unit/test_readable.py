"""The worker loop's wait on its descriptors (``onward.readable``), against real pipes, a real pidfd and a real
signal: what the loop relies on from it, as it relied on it from ``selectors``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from onward.readable import ReadableFds


@pytest.fixture
def fds() -> Iterator[ReadableFds]:
    watch = ReadableFds()
    yield watch
    watch.close()


def pipe() -> tuple[int, int]:
    return os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)


def test_only_readable_descriptors_are_returned_with_their_callbacks(fds: ReadableFds) -> None:
    (r1, w1), (r2, w2) = pipe(), pipe()
    calls: list[str] = []
    fds.register(r1, lambda: calls.append("one"))
    fds.register(r2, lambda: calls.append("two"))
    assert fds.wait(0) == []
    os.write(w2, b"x")
    ready = fds.wait(1.0)
    assert len(ready) == 1
    ready[0]()
    assert calls == ["two"]
    # A pipe whose writer closed is readable (end of file): its callback's read finds out.
    os.close(w1)
    ready = fds.wait(1.0)
    for callback in ready:
        callback()
    assert sorted(calls) == ["one", "two", "two"]  # r2 still holds its byte: level-triggered
    for fd in (r1, r2, w2):
        os.close(fd)


def test_registering_a_descriptor_twice_is_refused_and_keeps_the_first_callback(fds: ReadableFds) -> None:
    r, w = pipe()
    calls: list[str] = []
    fds.register(r, lambda: calls.append("first"))
    with pytest.raises(KeyError):
        fds.register(r, lambda: calls.append("second"))
    os.write(w, b"x")
    for callback in fds.wait(1.0):
        callback()
    assert calls == ["first"]
    os.close(r)
    os.close(w)


def test_an_unregistered_descriptor_is_not_returned_and_unregistering_a_closed_one_is_quiet(fds: ReadableFds) -> None:
    (r1, w1), (r2, w2) = pipe(), pipe()
    fds.register(r1, lambda: None)
    fds.register(r2, lambda: None)
    os.write(w1, b"x")
    os.write(w2, b"x")
    fds.unregister(r1)
    assert len(fds.wait(1.0)) == 1
    # Closed before it was unregistered (the kernel dropped it from the epoll set): only forgotten here.
    os.close(r2)
    fds.unregister(r2)
    assert fds.wait(0) == []
    with pytest.raises(KeyError):
        fds.unregister(r2)
    # Its number, taken by a new pipe, can be registered again.
    r3, w3 = pipe()
    fds.register(r3, lambda: None)
    os.write(w3, b"x")
    assert len(fds.wait(1.0)) == 1
    for fd in (r1, w1, w2, r3, w3):
        os.close(fd)


def test_a_pidfd_is_readable_once_its_process_exits(fds: ReadableFds) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    pidfd = os.pidfd_open(child.pid)
    exited: list[bool] = []
    fds.register(pidfd, lambda: exited.append(True))
    try:
        assert fds.wait(0) == []
        assert child.stdin is not None
        child.stdin.close()  # the child reads end of file and exits
        deadline = time.monotonic() + 30
        while not exited and time.monotonic() < deadline:
            for callback in fds.wait(deadline - time.monotonic()):
                callback()
        assert exited
    finally:
        child.wait()
        fds.unregister(pidfd)
        os.close(pidfd)


def test_a_wait_is_never_shorter_than_asked(fds: ReadableFds) -> None:
    # epoll counts whole milliseconds: 1.5 ms must not become 1 ms (the loop would turn early, and again).
    for timeout in (0.0015, 0.0101):
        started = time.monotonic()
        assert fds.wait(timeout) == []
        assert time.monotonic() - started >= timeout


def test_a_signal_handled_during_the_wait_does_not_raise(fds: ReadableFds) -> None:
    r, w = pipe()
    fds.register(r, lambda: None)
    handled: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: handled.append(signum))
    try:
        timer = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGUSR1))
        timer.start()
        deadline = time.monotonic() + 30
        while not handled and time.monotonic() < deadline:
            assert fds.wait(0.5) == []  # nothing became readable: the signal only ends or shortens a wait
        timer.join()
        assert handled == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)
        os.close(r)
        os.close(w)
