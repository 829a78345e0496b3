"""The model stub the integration tests talk to: examples/stub_server.py in a subprocess on 127.0.0.1,
logging every call it gets to a file (so the count survives the kills of the workers calling it)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from examples.stub_server import read_calls  # the stub's own reader of its log

ROOT = Path(__file__).resolve().parents[2]
STUB = ROOT / "examples" / "stub_server.py"
EXAMPLES = ROOT / "examples" / "agents"


class Stub:
    def __init__(self, process: subprocess.Popen[str], url: str, log: Path) -> None:
        self.process, self.url, self.log = process, url, log

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def calls(self) -> list[dict[str, Any]]:
        return read_calls(self.log)

    def count(self) -> int:
        return len(self.calls())


def start_stub(tmp_path: Path, delay: float) -> Stub:
    log = tmp_path / "calls.jsonl"
    p = subprocess.Popen([sys.executable, str(STUB), "--port", "0", "--delay", str(delay), "--calls", str(log)],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()  # "stub model on http://127.0.0.1:PORT/v1", printed once it listens
    assert line.startswith("stub model on "), line
    return Stub(p, line.split()[-1].removesuffix("/v1"), log)


@pytest.fixture
def stub(tmp_path: Path) -> Iterator[Stub]:
    s = start_stub(tmp_path, delay=0.0)
    yield s
    s.process.terminate()
    s.process.wait(timeout=10)


@pytest.fixture
def slow_stub(tmp_path: Path) -> Iterator[Stub]:
    """A model that takes 30 ms a call, so that kills land inside calls too."""
    s = start_stub(tmp_path, delay=0.03)
    yield s
    s.process.terminate()
    s.process.wait(timeout=10)
