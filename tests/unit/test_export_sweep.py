"""The sweep for missing result files (Settler.export_missing), against a real store on each backend and a
real folder: it writes the files of tasks done before it began, and leaves those done since to the worker
that did them, which writes each once its commit is durable."""

from __future__ import annotations

import io
import time
from pathlib import Path

from onward.log import Log
from onward.outdir import OutDir, file_name
from onward.settle import Settler
from onward.store.base import Store

from ..conftest import worker


def finish(store: Store, name: str) -> None:
    (claim,) = store.claim(worker(store), 1, 30, 3)
    assert claim.name == name
    assert store.complete(claim.task_id, claim.fence, f"result of {name}".encode(), "bytes")


def test_the_sweep_writes_what_was_done_before_it_began_and_leaves_what_is_done_since(store: Store,
                                                                                     tmp_path: Path) -> None:
    store.add(["before", "since"])
    finish(store, "before")
    with OutDir(str(tmp_path / "out")) as out:
        settler = Settler(store, Log(stream=io.StringIO()), out, 1.0, 300.0)
        settler.start_export_sweep()
        settler.export_missing(0.0)  # its first slice: the moment it began is taken, little else
        time.sleep(0.01)  # a completion stamped after that moment on any clock's resolution
        finish(store, "since")  # by another worker, say: visible, maybe not yet durable
        while settler.export_sweep_left:
            settler.export_missing(1.0)
        files = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    assert files == {file_name("before"): b"result of before"}
