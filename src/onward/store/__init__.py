"""Durable task stores: the ``Store`` contract (base.py), the logic the SQL backends share (sqlbase.py) and
one module per backend.

``store_url`` says which forms a store location may take (every other form is refused, so that a typo never
becomes a file of that name). ``open_store``, ``list_jobs``, ``exists`` and ``upgrade`` are the only doors to
a backend: nothing outside this package imports one.
"""

from __future__ import annotations

import os

# What is imported here stays small (no `re`, no error types, no contract classes until they are needed):
# `onward status` on a plain store loads this package and little else (see onward.status.print_plain_status).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

    from .base import JobRow, Store
    from .postgres import PostgresStore

DEFAULT_DB = ".onward/onward.db"
DEFAULT_JOB = "default"
# A job name: short, plain, the same on every shell and in every log line (it is also shown in the systemd
# unit and the dashboard's URLs): letters, digits, '.', '_' and '-', starting with a letter or a digit.
JOB_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
JOB_NAME_RULE = "1 to 64 letters, digits, '.', '_' or '-', starting with a letter or a digit"

# "name:" at the start of a location, as in "mysql://…" or "file:x.db" (no slash before the colon).
_SCHEME = r"([A-Za-z][A-Za-z0-9+.-]*):"
POSTGRES_SCHEMES = ("postgresql", "postgres")
ACCEPTED_FORMS = "a file path, sqlite:///relative/path, sqlite:////absolute/path or postgresql://…"


def store_url(explicit: str | None = None) -> str:
    """The store location: the explicit value, else $ONWARD_DB, else the default file; in one of the
    accepted forms, with its scheme in lower case. Raises ``StoreError`` for any other form.

    Accepted: a plain path (one that starts with a scheme-like ``name:`` is taken for a URL: write
    ``./name:…`` for such a file), ``sqlite:///relative`` and ``sqlite:////absolute``, ``postgresql://`` and
    ``postgres://``; schemes in any case. Refused: every other scheme (``mysql://``, ``https://``), and
    SQLite's own ``file:`` URIs, which SQLite would resolve to another file than the one named."""
    url = explicit or os.environ.get("ONWARD_DB") or DEFAULT_DB
    if url.endswith("/") and not url.lower().startswith(tuple(f"{scheme}:" for scheme in POSTGRES_SCHEMES)):
        from ..errors import StoreError

        # A folder's name: refused here, before run or add created the folders above it (and the output
        # folder) and then failed to create the store itself.
        raise StoreError(f"store location {url} ends with '/', which names a folder: give a file")
    if ":" not in url:
        return url  # a plain path: no scheme to look at (and `re` not even loaded)
    if url in (":memory:", "sqlite:///:memory:"):
        from ..errors import StoreError

        # SQLite would open a database in memory, gone with the process, and leave a file of that name.
        raise StoreError(f"{url} is a database in memory, which keeps nothing: give a file"
                         " (write ./:memory: for a file of that name)")
    import re

    match = re.match(_SCHEME, url)
    if match is None:
        return url
    scheme, rest = match.group(1).lower(), url[match.end():]
    if scheme in POSTGRES_SCHEMES and rest.startswith("//"):
        return f"{scheme}:{rest}"
    if scheme == "sqlite" and rest.startswith("///") and len(rest) > 3:
        return f"sqlite:{rest}"
    from ..errors import StoreError  # imported here, not at the top: start-up of `onward status`

    # Only the scheme is shown: the rest may hold a password.
    raise StoreError(f"unsupported store location {match.group(0)}…: give {ACCEPTED_FORMS}"
                     f" (write ./{match.group(1)}:… for a file whose name starts like that)")


def is_postgres_url(url: str) -> bool:
    """Whether a location returned by ``store_url`` names a PostgreSQL database."""
    return url.startswith(tuple(f"{scheme}://" for scheme in POSTGRES_SCHEMES))


def job_name(explicit: str | None = None) -> str:
    """The job a command works on: the explicit name, else $ONWARD_JOB, else ``default``. Raises
    ``UsageError`` (one line, the name shown escaped) for a name that breaks ``JOB_NAME_RULE``."""
    name = explicit if explicit is not None else os.environ.get("ONWARD_JOB") or DEFAULT_JOB
    if name == DEFAULT_JOB:
        return name  # keeps the rule (and spares loading `re`)
    import re

    if re.fullmatch(JOB_NAME, name) is None:
        from ..errors import UsageError  # imported here, not at the top: start-up of `onward status`

        shown = ascii(name[:80] + ("…" if len(name) > 80 else ""))
        raise UsageError(f"bad job name {shown}: give {JOB_NAME_RULE}")
    return name


def open_store(url: str | None = None, *, create: bool = True, job: str | None = None) -> Store:
    """Open (and, with ``create``, initialise) the store at ``url``, as the view of one job (``job_name``:
    ``job``, else $ONWARD_JOB, else ``default``); with ``create`` the job is created if it is new. Raises
    ``UsageError`` for a bad job name (before touching anything), a ``StoreError`` subclass otherwise:
    ``StoreMissing`` when there is no store there, or no such job in it, and ``create`` is false."""
    job = job_name(job)
    url = store_url(url)
    if is_postgres_url(url):
        from .postgres import PostgresStore

        ahead = _take_ahead(url, job)
        if ahead is not None:
            return ahead
        return PostgresStore(url, create=create, job=job)
    from .sqlite import SqliteStore

    return SqliteStore(url, create=create, job=job)


def list_jobs(url: str | None = None) -> list[JobRow]:
    """Every job of the store at ``url`` (``onward jobs``), read through a handle of no job: a store holds
    the job ``default`` only once a run or an add made it (or when it was upgraded from before named jobs).
    Raises what ``open_store(create=False)`` raises, ``StoreMissing`` where there is no store."""
    from .sqlbase import NO_JOB

    url = store_url(url)
    store: Store
    if is_postgres_url(url):
        from .postgres import PostgresStore

        store = PostgresStore(url, create=False, job=NO_JOB)
    else:
        from .sqlite import SqliteStore

        store = SqliteStore(url, create=False, job=NO_JOB)
    try:
        return store.jobs()
    finally:
        store.close()


# A store opened by this process ahead of need (open_ahead): its location, its job, the store.
_ahead: tuple[str, str, PostgresStore] | None = None


def open_ahead(url: str | None, job: str | None) -> None:
    """Open the store at ``url`` for ``job`` ahead of need, if it is on PostgreSQL, for the next
    ``open_store`` of the same location and job to take: what a worker restarted by ``onward supervise``
    does while the restart delay runs (``onward.entry``), so that connecting to the server is done by the
    time it may start. It is opened as ``open_store(create=False)`` opens it, with its LISTEN connection:
    nothing is created and nothing written. Raises what ``open_store`` raises."""
    global _ahead
    job = job_name(job)
    url = store_url(url)
    if not is_postgres_url(url):
        return  # a SQLite file opens in a millisecond
    from .postgres import PostgresStore

    store = PostgresStore(url, create=False, job=job)
    store.wakeup_fd()
    if _ahead is not None:
        _ahead[2].close()
    _ahead = (url, job, store)


def _take_ahead(url: str, job: str) -> PostgresStore | None:
    """The store opened ahead, if it is the one asked for and its connection survived the wait (else it is
    closed, and the caller opens one as usual)."""
    global _ahead
    if _ahead is None:
        return None
    (ahead_url, ahead_job, store), _ahead = _ahead, None
    if (ahead_url, ahead_job) == (url, job) and store.connection_intact():
        return store
    store.close()
    return None


def load_backend(postgres: bool) -> None:
    """Load a backend's code, and its driver, ahead of their first use, as a worker waiting at its start
    gate does (``onward.entry``). Raises ``StoreError`` where PostgreSQL's driver is not installed."""
    import importlib

    importlib.import_module(f"{__name__}.{'postgres' if postgres else 'sqlite'}")
    if postgres:
        from .pgconn import psycopg_module

        psycopg_module()  # psycopg itself is otherwise loaded at the first connection


def exists(url: str) -> bool:
    """Whether there may be a store at ``url`` (as ``store_url`` returns it), for ``open_store(url,
    create=False)`` to open: False for a SQLite file that is missing or empty (a store whose creation was
    cut short, which opening would initialise); True for a PostgreSQL database, where only a connection
    can tell (``open_store`` raises ``StoreMissing`` then)."""
    if is_postgres_url(url):
        return True
    from . import sqlite

    return sqlite.exists(url)


def upgrade(url: str) -> tuple[str, int, int]:
    """``onward db upgrade``: create the store at ``url`` (as ``store_url`` returns it), or bring its schema
    to this onward's version. Returns the store's printable location (no password) and its schema versions
    before (0: there was no store) and after. Refuses a newer store (``SchemaTooNew``)."""
    if is_postgres_url(url):
        from ..redact import redact_url
        from . import postgres

        before, after = postgres.upgrade(url)
        return redact_url(url), before, after
    from . import sqlite

    before, after = sqlite.upgrade(url)
    return sqlite.path_from_url(url), before, after


def absolute_location(url: str) -> str:
    """``url`` (as ``store_url`` returns it) usable from any folder: a SQLite store's path made absolute, a
    PostgreSQL URL as it is."""
    if is_postgres_url(url):
        return url
    from .sqlite import path_from_url

    return os.path.abspath(path_from_url(url))


def cancel_all_or_nothing(store: Store, names: Sequence[str]) -> dict[str, str]:
    """``Store.cancel`` of ``names``, or of none of them: a name not in the job raises ``UnknownTask``, naming it,
    and cancels nothing, not even the names that exist, so that a typo among many names is not half applied
    (``onward cancel`` and ``Job.cancel``). Tasks are never removed, so a name checked here is there still."""
    unknown = [name for name in dict.fromkeys(names) if store.task_id(name) is None]
    if unknown:
        from ..errors import UnknownTask

        more = f" (and {len(unknown) - 1} more unknown)" if len(unknown) > 1 else ""
        raise UnknownTask(f"no task {unknown[0]!r} in {store.url}{more}; nothing was cancelled")
    return store.cancel(list(names))


def __getattr__(name: str) -> object:
    # ``Store`` (the contract) loads on first use: see the note on imports above.
    if name == "Store":
        from .base import Store

        return Store
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Store", "open_store", "list_jobs", "exists", "upgrade", "store_url", "job_name", "DEFAULT_DB", "DEFAULT_JOB",
           "is_postgres_url"]
