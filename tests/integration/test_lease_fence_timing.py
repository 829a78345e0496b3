"""A worker that cannot renew its leases stops its tasks at the moment it must, even when that moment passes
while it is busy with the very look whose renewal failed.

The renewal is made to fail inside the worker's own store object (a real SQLite file otherwise): which look
fails, and how long it takes, must be exact here, and no outside fault lands on one look of a worker.
"""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path
from typing import Any

from onward.command_handler import CommandHandler
from onward.errors import StoreError
from onward.log import Log
from onward.proc import pid_start_time
from onward.runner import RunConfig, Runner
from onward.store.sqlite import SqliteStore

from ..conftest import wait_for


class RenewalCutOff(SqliteStore):
    """A store whose lease renewals fail once ``cut`` is set, and whose upkeep then makes the first two
    looks slow: the first ends ``slow[0]`` seconds after it began, so the next is due that long before the
    moment to stop the tasks (it was computed at the first's end from the first's start), and the second,
    slower still, ends past that moment."""

    cut = threading.Event()
    slow = (0.2, 0.5)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.looks_while_cut = 0

    def renew(self, *args: Any, **kwargs: Any) -> list[int]:
        if self.cut.is_set():
            raise StoreError("cut off from the store (test)")
        return super().renew(*args, **kwargs)

    def tidy(self) -> None:
        if self.cut.is_set():
            self.looks_while_cut += 1
            if self.looks_while_cut <= len(self.slow):
                time.sleep(self.slow[self.looks_while_cut - 1])
        super().tidy()


def test_tasks_are_stopped_at_the_fence_even_when_the_failing_look_itself_passes_it(tmp_path: Path) -> None:
    url = str(tmp_path / "store.db")
    pid_file = tmp_path / "pid"
    store = RenewalCutOff(url, create=True, job="default")
    store.add(["t"])
    config = RunConfig(heartbeat=2.0, install_signal_handlers=False)  # lease 6 s: stopped at 4 s, 2 s spare
    handler = CommandHandler(["sh", "-c", f'echo $$ > {pid_file}; exec sleep 30'], url, job=store.job)
    runner = Runner(store, handler, config, Log(stream=io.StringIO()))
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(), 10, "the command to start")
        pid = int(pid_file.read_text())
        store.cut.set()
        cut_at = time.monotonic()

        def gone_at() -> float | None:
            return time.monotonic() if pid_start_time(pid) is None else None

        stopped = float(wait_for(gone_at, 20, "the worker to stop its task", interval=0.01))  # type: ignore[arg-type]
        lease_end = runner.leases.valid_until
        fence = lease_end - runner.leases.fence_margin
        print(f"cut at {cut_at - lease_end:+.3f}s, stopped at {stopped - lease_end:+.3f}s of the lease's end")
        assert store.looks_while_cut >= 2, "the look that passes the fence did not happen"
        # Stopped one 20 ms turn after the slow look ended (0.3 s past the fence), not a heartbeat after the
        # look began (1.8 s past it, just before the lease's end).
        assert stopped < fence + 1.0, \
            f"stopped {stopped - fence:.3f}s after the fence, {stopped - lease_end:+.3f}s of the lease's end"
    finally:
        store.cut.clear()
        runner.request_stop("test over")
        thread.join(30)
        store.close()
    assert not thread.is_alive()
