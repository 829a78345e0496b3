"""The PostgreSQL store's connections: where a URL points (``Target``), and the thread that turns LISTEN
notifications into bytes on a pipe (``Listener``). See postgres.py for why each is as it is."""

from __future__ import annotations

import functools
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import StoreError
from ..proc import start_thread
from ..redact import hide_secrets_in_argv, redact_one_url, scrub, url_secrets

APP_NAME = "onward"  # application_name of every connection (see events_bound in postgres.sql)
RECONNECT_BACKOFF = (0.05, 1.0)  # first and longest wait between reconnection attempts (s)
# The longest a call may be kept waiting by the network (TCP_USER_TIMEOUT) or by a row lock (lock_timeout),
# and the bound before the runner names a lease. Once it does, a quarter of the lease if shorter (see
# sqlbase.stall_ms): a worker loop stuck in a call for longer could not fence itself before its lease runs out.
STALL_CEILING_MS = 3000
CONNECT_DEFAULTS = {
    "connect_timeout": "5",
    "keepalives": "1",
    "keepalives_idle": "1",
    "keepalives_interval": "1",
    "keepalives_count": "3",
    "tcp_user_timeout": str(STALL_CEILING_MS),
    "application_name": APP_NAME,
}


def psycopg_module() -> Any:
    try:
        import psycopg
    except ImportError:
        raise StoreError("the PostgreSQL store needs psycopg: pip install 'onward[postgres]'") from None
    return psycopg



# --- calls the server never answers --------------------------------------------------------------------
@functools.cache
def watched_connection_class(pg: Any) -> Any:
    """psycopg's Connection, noting when it starts and stops waiting for the server (every statement and
    commit waits in ``wait``), for ``StallWatch``."""

    class WatchedConnection(pg.Connection):
        waiting_since: float | None = None

        def wait(self, *args: Any, **kwargs: Any) -> Any:
            self.waiting_since = time.monotonic()
            try:
                return super().wait(*args, **kwargs)
            finally:
                self.waiting_since = None

    return WatchedConnection


class StallWatch:
    """A thread that drops the connection of a call left without an answer for longer than the bound.

    TCP_USER_TIMEOUT and keepalives catch a server that is cut off, not one that is stopped (SIGSTOP, a
    paused VM or container, a host stalled in swap): its kernel still acknowledges every byte, so the
    socket looks healthy while nothing answers, and the server's own timeouts do not run either. A worker
    stuck in such a call cannot fence itself: its tasks would run on past their lease. Shutting the socket
    down makes the call fail at once; the store then reconnects in the background as after any lost
    connection, and the runner, free again, stops the tasks whose lease it cannot renew.
    """

    def __init__(self, current: Callable[[], Any], bound_seconds: Callable[[], float | None],
                 on_cut: Callable[[float], None]) -> None:
        self._current = current  # the connection in use now (or None)
        self._bound_seconds = bound_seconds  # how long a call may go unanswered now (None: no bound)
        self._on_cut = on_cut
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="onward-pg-stall-watch", daemon=True)
        start_thread(self._thread)

    def _run(self) -> None:
        while True:
            bound = self._bound_seconds()
            if self._stop.wait(bound / 4 if bound else 0.25):
                return
            conn = self._current()
            since = getattr(conn, "waiting_since", None)
            if bound is None or since is None or time.monotonic() - since <= bound:
                continue
            try:
                sock = socket.socket(fileno=os.dup(conn.pgconn.socket))
            except Exception:  # closed meanwhile: nothing to cut
                continue
            with sock:
                # Still the same wait: the socket cannot have been closed while a call waits on it.
                if conn.waiting_since == since:
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        continue
                    self._on_cut(time.monotonic() - since)

    def close(self) -> None:
        self._stop.set()


# --- wake-ups ------------------------------------------------------------------------------------------
class Listener:
    """A thread holding a LISTEN connection; each notification becomes a byte in a pipe.

    The pipe's read end never changes, so the runner can keep it in its selector while this thread
    reconnects. After every (re)connection it writes a byte too: notifications sent while it was away
    are lost, so the worker should look for work once.
    """

    def __init__(self, connect: Any, on_error: Any, listen_sql: str) -> None:
        self._connect = connect
        self._listen_sql = listen_sql
        self._on_error = on_error
        self.read_fd, self._write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._stop_r, self._stop_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="onward-pg-listen", daemon=True)
        try:
            start_thread(self._thread)
        except OSError:
            for fd in (self.read_fd, self._write_fd, self._stop_r, self._stop_w):
                os.close(fd)
            raise

    def _signal(self) -> None:
        try:
            os.write(self._write_fd, b"\0")
        except (BlockingIOError, OSError):
            pass  # full: a wake-up is already due

    def _run(self) -> None:
        delay = RECONNECT_BACKOFF[0]
        while not self._stopping.is_set():
            conn = None
            try:
                conn = self._connect()
                conn.execute(self._listen_sql)
                delay = RECONNECT_BACKOFF[0]
                self._signal()
                self._listen(conn)
            except Exception as e:  # psycopg.Error, OSError: the connection is gone; make another
                if not self._stopping.is_set():
                    self._on_error(e)
            finally:
                if conn is not None:
                    try:
                        conn.close()
                    except Exception:
                        pass
            if self._wait(delay):
                return
            delay = min(delay * 2, RECONNECT_BACKOFF[1])

    def _listen(self, conn: Any) -> None:
        pgconn = conn.pgconn
        fd = conn.fileno()
        while not self._stopping.is_set():
            ready, _, _ = select.select([fd, self._stop_r], [], [])
            if self._stop_r in ready:
                return
            pgconn.consume_input()  # raises when the server or the network went away
            got = False
            while pgconn.notifies() is not None:
                got = True
            if got:
                self._signal()
            if conn.broken or conn.closed:
                raise OSError("LISTEN connection lost")

    def _wait(self, seconds: float) -> bool:
        """Sleep, unless asked to stop (then True)."""
        ready, _, _ = select.select([self._stop_r], [], [], seconds)
        return bool(ready) or self._stopping.is_set()

    def drain(self) -> None:
        try:
            while os.read(self.read_fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        self._stopping.set()
        try:
            os.write(self._stop_w, b"\0")
        except OSError:
            pass
        # The thread may be inside a connection attempt; it is a daemon and closes what it opened.
        self._thread.join(0.5)
        if not self._thread.is_alive():
            for fd in (self._stop_r, self._stop_w):
                os.close(fd)
        os.close(self.read_fd)
        os.close(self._write_fd)


# --- where the store is --------------------------------------------------------------------------------
class Target:
    """A PostgreSQL URL as onward uses it: the connection string (with onward's defaults for what the URL
    does not set), the form fit to show, and the secrets to scrub from any text."""

    def __init__(self, url: str) -> None:
        self.pg = psycopg_module()
        self.secrets = url_secrets(url)
        hide_secrets_in_argv(self.secrets)
        self.shown = redact_one_url(url)
        try:
            given = self.pg.conninfo.conninfo_to_dict(url)
            extra = {k: v for k, v in CONNECT_DEFAULTS.items() if k not in given}
            self.conninfo = str(self.pg.conninfo.make_conninfo(url, **extra))
        except self.pg.Error as e:
            raise StoreError(f"bad PostgreSQL URL {self.shown}: {self.text(e)}") from None

    def learn_password(self, conn: Any) -> None:
        """Add the password ``conn`` used to the secrets: libpq may have taken it from ``~/.pgpass`` or a service
        file, where the URL does not show it, and a task that prints that file must not show it either."""
        password = conn.info.password
        if password and password not in self.secrets:
            self.secrets = sorted({*self.secrets, password}, key=len, reverse=True)

    def text(self, e: BaseException) -> str:
        """An error's first line, scrubbed."""
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        return scrub(lines[0] if lines else type(e).__name__, self.secrets)


def in_transaction(conn: Any) -> bool:
    """Whether a transaction is open on the connection (then it must not be retuned or compacted)."""
    return bool(conn.info.transaction_status != conn.info.transaction_status.IDLE)


def application_name(conn: Any) -> str:
    return conn.info.parameter_status("application_name") or APP_NAME
