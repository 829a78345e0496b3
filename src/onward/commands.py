"""What ``onward run`` and ``onward add`` do, callable from Python: check everything, then change things.

Order matters for "bad input changes nothing": the command, the flags, the tasks file (every line) and the
output folder are all checked before the store is created or a single task is added.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from .command_handler import CommandHandler, check_command
from .config import DEFAULT_MAX_RESULT_BYTES, MAX_STORED_BYTES, RunConfig
from .errors import UNAVAILABLE_EXIT, OutputUnavailable, StoreMissing, UsageError
from .keepawake import marker_path
from .log import Log
from .stopsignals import stop_signals
from .store import exists as store_exists
from .store import is_postgres_url, job_name, open_store, store_url
from .store.base import Store
from .tasksfile import ImportResult, check_task_name, check_tasks_file, import_tasks_file, task_name
from .worker import run_worker

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .outdir import OutDir  # loaded only with --out


class LazyStore:
    """The store if it exists already (checked: an onward store of a known version); created only when
    something is about to be written, so input found bad before that leaves no new store behind (no file,
    no PostgreSQL schema)."""

    def __init__(self, url: str, job: str | None = None) -> None:
        self.url = store_url(url)
        self.job = job_name(job)  # a bad name is refused before anything is opened
        self.existing: Store | None = None
        if not store_exists(self.url):
            return
        try:
            self.existing = open_store(self.url, create=False, job=self.job)
        except StoreMissing:
            pass

    def get(self) -> Store:
        if self.existing is None:
            self.existing = open_store(self.url, job=self.job)
        return self.existing

    def close(self) -> None:
        if self.existing is not None:
            self.existing.close()
            self.existing = None


def add_tasks(db: str | None, tasks: list[str], tasks_file: str | None, job: str | None = None) -> ImportResult:
    store = LazyStore(store_url(db), job)
    try:
        if tasks_file:
            return import_tasks_file(store, tasks_file)
        names = [task_name(t) for t in tasks]
        for name in names:
            check_task_name(name)
        return ImportResult(added=store.get().add(names), read_from=0, skipped=False)
    finally:
        store.close()


def held_back_warning(tasks_file: str, result: ImportResult) -> str | None:
    """The warning for an unterminated last line left out of an import, if one was."""
    if result.held_back is None:
        return None
    return (f"{tasks_file}: the last line ({result.held_back!r}) has no newline and the file is still"
            " changing: it is not imported now, but at the next import once the file is still")


def run_command(config: RunConfig, log: Log, *, command: list[str], db: str | None = None,
                tasks_file: str | None = None, out_dir: str | None = None,
                max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES, keep_awake: str | None = None,
                job: str | None = None, progress_bar: bool = False) -> int:
    """``onward run``: add the tasks file's new tasks, then run ``command`` once per pending task. Returns
    the exit status (0, or 3 when some tasks failed for good). ``progress_bar``: draw one under the log
    lines (only when the log goes to a terminal)."""
    if not command or not command[0]:
        raise UsageError("no command to run: give it after --, e.g. onward run --tasks FILE -- CMD {task}")
    check_command(command)
    if max_result_bytes < 1:
        raise UsageError(f"--max-result-bytes must be at least 1 (got {max_result_bytes})")
    if max_result_bytes > MAX_STORED_BYTES:
        raise UsageError(f"--max-result-bytes must be at most {MAX_STORED_BYTES:,}, what a store takes"
                         f" (got {max_result_bytes:,})")
    marker = marker_path(keep_awake)
    url = store_url(db)
    store = LazyStore(url, job)
    out: OutDir | None = None
    try:
        try:
            with _stop_signals_end_the_setup(config.install_signal_handlers):
                # Every input is checked before anything is written: the tasks file, then the output folder.
                tasks = check_tasks_file(store.existing, tasks_file) if tasks_file else None
                if tasks is None and (store.existing is None or not sum(store.existing.counts().values())):
                    raise UsageError("no tasks: give --tasks FILE or onward add")
                if out_dir:
                    from .outdir import OutDir, owner_of

                    out = OutDir(out_dir, owner=owner_of(url, store.job, postgres=is_postgres_url(url)))
                if tasks is not None:
                    result = tasks.apply(store.get())
                    if result.added:
                        log.info(f"added {result.added} new tasks from {tasks_file}")
                    warning = held_back_warning(str(tasks_file), result)
                    if warning:
                        log.warning(warning)
        except StoppedBeforeWork as stop:
            log.info(f"worker stopped: {stop.args[0]} before its first task, while it checked or added the"
                     " tasks; what was added is kept, the rest of the tasks file is added by the next run")
            return 0
        handler = CommandHandler(command, url, max_result_bytes, job=store.job)
        summary = run_worker(store.get(), handler, config, log, url=url, out=out, keep_awake=marker,
                             progress_bar=progress_bar)
        if summary.exit_code == UNAVAILABLE_EXIT:  # the job is done, but --out lacks files: said last, exit 75
            raise OutputUnavailable(summary.unexported_line())
        return summary.exit_code
    finally:
        if out is not None:
            out.close()
        store.close()


class StoppedBeforeWork(BaseException):
    """A stop signal (SIGTERM, SIGINT, SIGHUP) came while ``onward run`` checked or added its tasks, before
    its worker took over the signals. A BaseException, like KeyboardInterrupt: what it interrupts lets it
    through, and a transaction it interrupts is rolled back (a chunk of the import is all or nothing)."""


@contextlib.contextmanager
def _stop_signals_end_the_setup(install: bool) -> Iterator[None]:
    """While ``onward run`` checks and adds its tasks (a million lines take a minute): a stop signal ends it
    there, exit 0, the import's committed chunks kept (their mark says where the next run goes on). With
    the signals' defaults, SIGTERM killed it (exit 143) and SIGHUP too, and SIGINT said "aborted" (exit 130),
    none of them recorded as the stop the README promises."""
    if not install or threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise StoppedBeforeWork(signal.Signals(signum).name)

    saved = {sig: signal.signal(sig, stop) for sig in stop_signals()}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
