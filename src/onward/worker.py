"""One worker, assembled in one place for ``onward run`` (commands.run_command) and the Python API
(Job.run): the runner with its systemd notifier, keep-awake marker, output folder and the store's secrets."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from .attempt import Handler
from .config import RunConfig
from .keepawake import KeepAwake
from .log import Log
from .notify import Notifier
from .redact import url_secrets
from .runner import Runner
from .settle import RunSummary
from .store.base import Store

if TYPE_CHECKING:
    from .outdir import OutDir
    from .progress import RunBar


class WorkerHandler(Handler, Protocol):
    def close(self) -> None:
        """Release what the handler holds for the whole run (threads, its heartbeat-file folder)."""


def run_worker(store: Store, handler: WorkerHandler, config: RunConfig, log: Log, *, url: str,
               out: OutDir | None = None, keep_awake: str | None = None, progress_bar: bool = False) -> RunSummary:
    """Run ``handler`` on the store's tasks until none is pending or running, or a stop signal; resumes
    where the last worker left off. ``url`` is the store's location as given: its password, in every form
    it may take, is kept out of every error a task reports (a command gets the URL as ONWARD_DB and may
    print it). ``keep_awake`` is a marker path from ``keepawake.marker_path`` (checked already). The
    handler is closed on return; ``out`` stays the caller's, who made it before writing anything. With
    ``progress_bar``, a bar is drawn under the log lines (the log's stream must be a terminal)."""
    bar: RunBar | None = None
    try:
        runner = Runner(store, handler, config, log, notifier=Notifier.from_env(),
                        keep_awake=KeepAwake(keep_awake, log) if keep_awake else None, out=out,
                        secrets=sorted({*url_secrets(url), *store.secrets}, key=len, reverse=True))
        if progress_bar:
            # Only for a terminal: a worker under a supervisor, restarted after a crash, never pays for it.
            from .progress import RunBar, run_bar_reader

            bar = RunBar(log.stream, run_bar_reader(lambda: runner.counts_seen,
                                                    lambda: (runner.summary.done, runner.summary.failed)))
            bar.start(log)
        return runner.run()
    finally:
        if bar is not None:
            bar.stop(log)
        handler.close()
