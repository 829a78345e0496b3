"""The dashboard's HTTP server: the stdlib's threading server, the page's files, the JSON API and a stream
of status updates (server-sent events), with the security rules of the README's Dashboard section.

Rules every request goes through, in this order (``Handler._guard``):

1. The Host header names this server (binds on a loopback address only): a page of another site that
   resolves its own name to 127.0.0.1 (DNS rebinding) gets nothing.
2. With a token, every API, event-stream and metrics request carries ``Authorization: Bearer TOKEN``,
   compared in constant time. The page's own files (HTML, script, style: the same bytes as in the
   package, no data) are served without it, so that a reload of a page whose address no longer holds
   ``?token=`` still starts; the page keeps the token in sessionStorage and sends it with every call.
3. A state change is a POST with ``Content-Type: application/json`` and a JSON body of at most
   ``MAX_BODY`` bytes; a POST whose ``Origin`` is present and is not this server's own is refused. Those
   two stop another site's form or script from changing anything (a cross-site form cannot send that
   content type; a cross-site fetch that can carries its Origin). A GET never changes anything.
   "This server's own" is ``http://`` + the Host header, unless ``--origin`` names the public origins the
   page is served from (behind an HTTPS proxy the browser's Origin is the proxy's, never ``http://`` +
   Host): then exactly those, and their host names pass rule 1 too. ``X-Forwarded-*`` is never read: any
   client can send it, so it cannot vouch for anything.

The token never reaches a log: requests are not logged by the line (the query string of the page's
first load holds it), only failures, by method and path.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import re
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from ..errors import StoreError, StoreGone
from ..store.base import Store
from . import api

MAX_BODY = 1 << 20
DRAIN_LIMIT = 16 << 20  # a larger refused body is not even read: the connection is closed at once
IDLE_EVERY = 1.0  # seconds between two calls of Store.idle (Dashboard.idle_between_requests)
EVENT_INTERVAL = 1.0  # seconds between two looks at the store for the event stream
KEEPALIVE_INTERVAL = 15.0  # a comment line this often keeps proxies and the browser from closing the stream

# The page's files: name in the URL -> (file in static/, content type). Nothing else is ever read from disk.
STATIC = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/static/app.css": ("app.css", "text/css; charset=utf-8"),
    "/static/favicon.svg": ("favicon.svg", "image/svg+xml"),
}

# Everything the page loads comes from this server; no frame may embed it; nothing inline runs.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self'; style-src 'self'; script-src 'self';"
                               " connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
DEFAULT_PORTS = {"http": 80, "https": 443}
_HOST_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?", re.ASCII)
# Up to the next parameter or space: a token may hold quotes (any printable ASCII but a space), and stopping
# at them showed the rest of it in the stdlib's quote of a malformed request line.
_TOKEN_IN_QUERY = re.compile(r"([?&]token=)[^&\s]*", re.IGNORECASE)


def _nothing(store: Store) -> None:
    pass


class Dashboard:
    """What every request thread shares: the store, the token and the server's own names.

    A store handle is not thread-safe (one SQLite connection or one PostgreSQL connection, used from one
    thread at a time), and the threading server runs each connection in a thread of its own. So a handle is
    shared under a lock: each request holds it for its few store calls (each bounded, under 0.3 s on a
    million tasks), and the event streams take it once per tick, not for their whole life. A handle per
    request would pay a connection and a schema check on every call instead, and one per thread would open
    one for every connection, the long-lived event streams included.

    An action (a POST: retry, cancel, send, pause) runs on a handle of its own, opened for it and closed
    after it, under a lock of its own (``act``): it waits for the store's write lock when another process
    holds it (an import of a million tasks, a worker stalled in its commit), up to the store's bound (30 s
    on SQLite), and on the one shared handle every page, event stream and scrape waited behind it. Reads
    never wait for the write lock (SQLite's WAL, PostgreSQL's snapshots), so they go on answering. Not kept
    open between actions: a SQLite reader must be able to let go of the log's index with no other
    connection of its process open (``Store.idle``), and actions are rare. Without ``open_actions`` (a
    test's store), the actions share the readers' handle and lock.
    """

    def __init__(self, store: Store, token: str | None, host: str, loopback: bool,
                 origins: frozenset[str] = frozenset(), open_actions: Callable[[], Store] | None = None) -> None:
        self.store = store
        self.token = token.encode() if token else None
        self.host = host
        self.loopback = loopback
        self.origins = origins  # normalised by ``normalise_origin``; empty: the page's own, http:// + Host
        # The names of those origins: a proxy that passes the browser's Host on (Caddy does by default)
        # sends one of them, and the operator, who chose them, owns their DNS (no rebinding through them).
        self.origin_hosts = frozenset(_origin_host(origin) for origin in origins)
        self.lock = threading.Lock()
        self._open_actions = open_actions
        self.actions_lock = threading.Lock()  # one action at a time (see act)
        self.stopping = threading.Event()

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(store, *args)`` on the readers' handle."""
        with self.lock:
            return fn(self._still_there(self.store), *args)

    def act(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(store, *args)`` for an action that changes the store, on a handle of its own."""
        if self._open_actions is None:
            return self.call(fn, *args)
        with self.actions_lock:
            self.call(_nothing)  # a store deleted or replaced is said as for a read, before any open
            actions = self._open_actions()
            try:
                # The store the page reads, not one made at its path since: the readers' handle finds its
                # file still there after this one opened the file there.
                self.call(_nothing)
                return fn(self._still_there(actions), *args)
            finally:
                actions.close()

    @staticmethod
    def _still_there(store: Store) -> Store:
        # SQLite reads and writes the file it opened even after it was deleted, or another store was made
        # at its path: the page would show the dead store as live, and a pause would go into it with a 200.
        # One stat (a query on PostgreSQL) per request says so instead (503).
        try:
            store.check_still_there()
        except StoreGone:
            raise StoreGone("the store was deleted or replaced since this dashboard opened it: nothing"
                            " was read or changed; start the dashboard again for the store there now") from None
        return store

    def idle_between_requests(self) -> None:
        """On a thread of its own until ``stopping``: ``Store.idle`` every second, under the lock, whether or
        not a page is open (the dashboard's connection must not keep a suspect SQLite log's index alive)."""
        while not self.stopping.wait(IDLE_EVERY):
            with self.lock:
                try:
                    self.store.idle()
                except StoreError:
                    pass  # the next request is answered 503 with the error, as for any store that fails
                except MemoryError:
                    # Passing (the requests meet it too, each answered 500): this thread must outlive it, or
                    # no later look lets go of a suspect log's index for as long as the dashboard runs.
                    pass


class Handler(BaseHTTPRequestHandler):
    server_version = "onward-dashboard"
    protocol_version = "HTTP/1.1"  # keep-alive: the page makes many small calls
    # The version assumed until the request line says one: the stdlib's HTTP/0.9 answers a malformed line
    # (and a two-word one, "GET /") with a bare body, without a status line or any header, the security
    # headers included. Assumed to be 1.0, every answer has both.
    default_request_version = "HTTP/1.0"
    timeout = 60  # an idle kept-alive connection is closed after this (its thread ends)
    dashboard: Dashboard  # set on the subclass made by ``make_server``

    # --- routing ---------------------------------------------------------------------------------------
    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        self._body_left_unread()
        path, query = self._target()
        if path is None or not self._guard(path):
            return
        if path in STATIC:
            self._static(*STATIC[path])
        elif path == "/api/status":
            self._api(api.status)
        elif path == "/api/tasks":
            self._api(api.tasks, self._query(query))
        elif path.startswith("/api/tasks/"):
            name = self._name(path[len("/api/tasks/"):])
            if name is not None:
                self._api(api.task_detail, name)
        elif path == "/api/activity":
            self._api(api.activity, self._query(query))
        elif path == "/api/events":
            self._events()
        elif path == "/metrics":
            self._metrics()
        else:
            self._error(HTTPStatus.NOT_FOUND, "no such page")

    def do_POST(self) -> None:  # noqa: N802
        # The body is read before any check: a refusal that left it unread would have the connection closed
        # under a client still sending it, which may then see a reset instead of the answer.
        raw = self._read_body()
        path, _ = self._target()
        if path is None or not self._guard(path):
            return
        actions: dict[str, Callable[[Store, object], dict[str, Any]]] = {
            "/api/retry": api.retry,
            "/api/cancel": api.cancel,
            "/api/send": api.send,
            "/api/pause": lambda store, body: api.pause(store, body, True),
            "/api/resume": lambda store, body: api.pause(store, body, False),
        }
        if path not in actions:
            self._error(HTTPStatus.NOT_FOUND, "no such action")
        elif not self._same_origin():
            self._error(HTTPStatus.FORBIDDEN, "cross-origin request refused")
        elif self.headers.get_content_type() != "application/json" or "Content-Type" not in self.headers:
            self._error(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, "send Content-Type: application/json")
        elif raw is None:
            self._error(HTTPStatus.BAD_REQUEST, f"send a body of at most {MAX_BODY} bytes, with a Content-Length")
        else:
            try:
                body = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
            except (UnicodeDecodeError, ValueError, RecursionError):
                self._error(HTTPStatus.BAD_REQUEST, "the body is not valid JSON")
                return
            self._api(actions[path], body, acting=True)

    def _not_allowed(self) -> None:
        self._body_left_unread()
        self._error(HTTPStatus.METHOD_NOT_ALLOWED, "only GET and POST")

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed  # noqa: N815 (HEAD: the stdlib's 501)

    # --- checks ----------------------------------------------------------------------------------------
    def _target(self) -> tuple[str | None, str]:
        parts = urlsplit(self.path)
        if not parts.path.startswith("/"):
            self._error(HTTPStatus.BAD_REQUEST, "bad request target")
            return None, ""
        return parts.path, parts.query

    def _guard(self, path: str) -> bool:
        """The Host and token rules (see the module's docstring); answers the request when it fails."""
        board = self.dashboard
        host = _host_name(self.headers.get("Host", ""))
        if board.loopback and host not in LOOPBACK_NAMES | {board.host} and host.lower() not in board.origin_hosts:
            self._error(HTTPStatus.FORBIDDEN, "unknown Host: open the dashboard by the address it printed")
            return False
        if board.token is None or path in STATIC:
            return True
        given = self.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("utf-8", "replace"),
                                                             board.token):
            return True
        self._error(HTTPStatus.UNAUTHORIZED, "this dashboard needs its token (Authorization: Bearer TOKEN)",
                    extra_headers={"WWW-Authenticate": 'Bearer realm="onward"'})
        return False

    def _same_origin(self) -> bool:
        origin = self.headers.get("Origin")
        if origin is None:
            return True  # not a browser's cross-site request (curl, scripts); the token rules still hold
        if not self.dashboard.origins:
            return origin == f"http://{self.headers.get('Host', '')}"
        try:
            return normalise_origin(origin) in self.dashboard.origins
        except ValueError:
            return False  # "null" (a sandboxed frame, a file: page), or anything else that names no origin

    def _body_left_unread(self) -> None:
        """A request whose body is not read (a GET's, a refused method's) ends its connection with the answer:
        kept alive, the server read that body as the next request, which got past the Host, Origin and
        method checks of the one that carried it (a PUT refused with 405, then a POST /api/pause it held
        run)."""
        length = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding") is not None or (length is not None and length.strip() != "0") \
                or len(self.headers.get_all("Content-Length") or ()) > 1:
            self._read_body()  # read (up to DRAIN_LIMIT) and dropped, so that the close is no reset
            self.close_connection = True

    def _read_body(self) -> bytes | None:
        """The request's body, or None when it has no Content-Length or is larger than ``MAX_BODY``. A body
        up to ``DRAIN_LIMIT`` is read even then (and dropped), so that the refusal reaches the client; the
        connection is not reused after a refusal of that kind."""
        length_text = self.headers.get("Content-Length", "")
        # Content-Length given twice: which one a proxy in front went by cannot be known, and the rest of the
        # body would be read as the next request (RFC 9112: refused, the connection closed).
        if self.headers.get("Transfer-Encoding") or not length_text.isascii() or not length_text.isdigit() \
                or len(self.headers.get_all("Content-Length") or ()) > 1:
            self.close_connection = True
            return None
        length = int(length_text)
        if length <= MAX_BODY:
            return self.rfile.read(length)
        self.close_connection = True
        left = length if length <= DRAIN_LIMIT else 0
        while left > 0:
            chunk = self.rfile.read(min(left, 1 << 16))
            if not chunk:
                break
            left -= len(chunk)
        return None

    def _query(self, query: str) -> dict[str, str] | None:
        try:
            pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=False, errors="strict",
                              max_num_fields=20)
        except (UnicodeDecodeError, ValueError):
            return None
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            return None
        return dict(pairs)

    def _name(self, quoted: str) -> str | None:
        try:
            return unquote(quoted, errors="strict")
        except UnicodeDecodeError:
            self._error(HTTPStatus.NOT_FOUND, "no such task")
            return None

    # --- answers ---------------------------------------------------------------------------------------
    def _api(self, fn: Callable[..., Any], *args: Any, acting: bool = False) -> None:
        if any(a is None for a in args):
            self._error(HTTPStatus.BAD_REQUEST, "bad query string (not UTF-8, or a parameter given twice)")
            return
        answered, answer = self._call(fn, *args, acting=acting)
        if answered:
            self._send(HTTPStatus.OK, _json_bytes(answer), "application/json")

    def _call(self, fn: Callable[..., Any], *args: Any, acting: bool = False) -> tuple[bool, Any]:
        """``fn(store, *args)`` under its handle's lock (the actions' handle if ``acting``): (True, its value),
        or (False, None) once the error was answered: the API's refusals as they are, a store that cannot be
        used as 503, a bug as 500."""
        try:
            return True, (self.dashboard.act if acting else self.dashboard.call)(fn, *args)
        except api.ApiError as e:
            self._error(e.status, str(e))
        except StoreError as e:
            self._error(HTTPStatus.SERVICE_UNAVAILABLE, str(e))
        except Exception:  # a bug: said in one line to the client, in full on the server's stderr
            self.log_error("%s %s failed:\n%s", self.command, urlsplit(self.path).path, traceback.format_exc())
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error (see the dashboard's stderr)")
        return False, None

    def _static(self, filename: str, content_type: str) -> None:
        data = resources.files(__package__).joinpath("static").joinpath(filename).read_bytes()
        self._send(HTTPStatus.OK, data, content_type)

    def _metrics(self) -> None:
        from ..metrics import metrics_text  # loaded on the first scrape: prometheus-client is not small

        answered, text = self._call(metrics_text)
        if answered:
            self._send(HTTPStatus.OK, text, "text/plain; version=0.0.4; charset=utf-8")

    def _events(self) -> None:
        """``GET /api/events``: a server-sent event ``status`` (the object of ``/api/status``) at once and
        whenever it changes, looked at every second; a comment line in between keeps the stream open."""
        board = self.dashboard
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Connection", "close")  # no length: the stream ends when either side closes
        self.send_header("X-Accel-Buffering", "no")
        self.end_headers()
        self.close_connection = True
        last = b""
        quiet_since = time.monotonic()
        try:
            while not board.stopping.is_set():
                try:
                    data = _json_bytes(board.call(api.status))
                    event = b"event: status\ndata: " + data + b"\n\n" if data != last else b""
                    last = data
                except StoreError as e:
                    event = b"event: trouble\ndata: " + _json_bytes({"error": str(e)}) + b"\n\n"
                except Exception:  # a bug: on stderr once, and the stream ends (the page tries again later)
                    self.log_error("%s failed:\n%s", urlsplit(self.path).path, traceback.format_exc())
                    return
                if event:
                    self.wfile.write(event)
                    quiet_since = time.monotonic()
                elif time.monotonic() - quiet_since > KEEPALIVE_INTERVAL:
                    self.wfile.write(b": still here\n\n")
                    quiet_since = time.monotonic()
                self.wfile.flush()
                board.stopping.wait(EVENT_INTERVAL)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass  # the page went away

    def _error(self, status: int, message: str, extra_headers: dict[str, str] | None = None) -> None:
        self._send(status, _json_bytes({"error": message}), "application/json", extra_headers)

    def _send(self, status: int, body: bytes, content_type: str,
              extra_headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (extra_headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":  # the stdlib's 501 to a HEAD: the length is said, the body is not sent
            self.wfile.write(body)

    def send_response(self, code: int, message: str | None = None) -> None:
        # Every answer starts here (the API's, the page's files, the event stream, the stdlib's refusals
        # through send_error below): the security headers are sent in this one place, whatever the path.
        super().send_response(code, message)
        for key, value in SECURITY_HEADERS.items():
            self.send_header(key, value)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The stdlib's own refusals, before any of ours could run: a bad request line (400), one too long
        (414), a header too long or too many (431), a method with no ``do_`` here such as HEAD (501), HTTP/2
        (505). Answered like the dashboard's own errors, as JSON, instead of the stdlib's HTML page."""
        text = message or HTTPStatus(code).phrase
        self.log_error("code %d, message %s", code, text)  # as the stdlib did: what was refused, and why
        self.close_connection = True  # the rest of the request was not read: the connection cannot go on
        self._error(code, text)

    def version_string(self) -> str:
        return self.server_version

    # --- logging: failures only, and never the query string (the page's first load holds the token) ----
    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        # Only the server's own failures: not a store that is down (503, said to the client), nor a method
        # or an HTTP version the client should not have used (501, 505). The method and path are the
        # client's bytes: escaped, so that no request writes control sequences to the operator's terminal.
        if isinstance(code, int) and code >= 500 and code not in _CLIENTS_OWN_5XX:
            path = getattr(self, "path", None)  # unset when the request line could not be read
            where = urlsplit(path).path if path is not None else "(request not read)"
            self.log_error("%s %s answered %d", _printable(getattr(self, "command", None) or "-"),
                           _printable(where), code)

    def log_error(self, format: str, *args: Any) -> None:  # noqa: A002 (the stdlib's name)
        # The stdlib quotes a malformed request line whole: a token in its query string is blanked here.
        text = _TOKEN_IN_QUERY.sub(r"\1***", (format % args).rstrip("\n"))
        token = self.dashboard.token
        if token:  # wherever else the client put it, as it is or percent-encoded
            for shown in {token.decode(), quote(token.decode(), safe="")}:
                text = text.replace(shown, "***")
        sys.stderr.write("onward dashboard: " + text + "\n")


def make_server(board: Dashboard, host: str, port: int) -> ThreadingHTTPServer:
    """A server bound to ``host``:``port`` (0: any free port), not yet serving. Raises ``OSError``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET

    class Server(ThreadingHTTPServer):
        address_family = family
        daemon_threads = True  # event streams never end by themselves: they must not hold the exit
        # The listen backlog: connections the kernel completes before the server accepts them. The
        # stdlib's 5 let a burst overflow it (a page's calls, a scraper, a script retrying 400 tasks at
        # once): the kernel then drops the handshakes beyond it, and those clients waited for seconds,
        # got no answer at all or a reset. The kernel caps it at net.core.somaxconn (4096 since Linux 5.4).
        request_queue_size = 1024

        def handle_error(self, request: Any, client_address: Any) -> None:
            # A client that went away mid-request (a tab closed, a scrape timed out, a reset): its
            # business, not a failure of ours. Anything else is one, and keeps the stdlib's traceback.
            if isinstance(sys.exc_info()[1], ConnectionError):
                return
            super().handle_error(request, client_address)

    handler = type("BoundHandler", (Handler,), {"dashboard": board})
    return Server((host, port), handler)


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback one (``localhost``, 127.0.0.0/8, ``::1``).
    Raises ``OSError`` (``socket.gaierror``) or ``UnicodeError`` for a name that does not resolve."""
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return bool(infos) and all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)


def normalise_origin(value: str) -> str:
    """``value`` as the one serialisation a browser sends in ``Origin``: ``scheme://host[:port]``, scheme and
    host in lowercase, IPv6 in its short form, no default port (80 for http, 443 for https); a single
    trailing ``/`` (as an address bar shows it) is dropped. Raises ``ValueError`` saying what is wrong for
    anything else: another scheme, a user, a path, a query, a fragment, a bad port or host, and any
    character that is not printable ASCII (a browser sends an international name in its ``xn--`` form)."""
    if not value.isascii() or not value.isprintable() or " " in value:
        raise ValueError("only printable ASCII without spaces (an international name in its xn-- form)")
    scheme, sep, rest = value.partition("://")
    scheme = scheme.lower()
    if not sep:
        raise ValueError("no scheme: write it as https://HOST or https://HOST:PORT")
    if scheme not in DEFAULT_PORTS:
        raise ValueError("the scheme must be http or https")
    rest = rest.removesuffix("/")
    if any(c in rest for c in "/?#@\\"):
        raise ValueError("an origin is scheme://host[:port] only: no user, path, query or fragment")
    if rest.startswith("["):  # an IPv6 address, always in brackets (its colons would read as a port)
        inner, bracket, after = rest[1:].partition("]")
        if not bracket or (after and not after.startswith(":")):
            raise ValueError("an IPv6 address is written in brackets: http://[::1]:8765")
        try:
            address = ipaddress.IPv6Address(inner)
        except ValueError:
            address = None
        if address is None or address.scope_id:  # a zone (fe80::1%eth0) is never part of an origin
            raise ValueError(f"{inner!r} is not an IPv6 address")
        host = f"[{address.compressed}]"
        port_text = after[1:] if after else None
    else:
        name, colon, port_after = rest.partition(":")
        host, port_text = name.lower(), (port_after if colon else None)
        labels = host.split(".")
        if not host or len(host) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
            raise ValueError("the host must be a name (letters, digits, '-', '.') or an IP address")
        if labels[-1].isdigit():  # what a browser reads as an IPv4 address, and then sends as a dotted quad
            try:
                host = str(ipaddress.IPv4Address(host))
            except ValueError:
                raise ValueError(f"{host!r} is not an IPv4 address") from None
    if port_text is None:
        return f"{scheme}://{host}"
    if not (port_text.isdigit() and len(port_text) <= 5 and 1 <= int(port_text) <= 65535):
        raise ValueError("the port must be a number from 1 to 65535")
    port = int(port_text)
    return f"{scheme}://{host}" if port == DEFAULT_PORTS[scheme] else f"{scheme}://{host}:{port}"


def _origin_host(origin: str) -> str:
    """The host of a normalised origin, as ``_host_name`` reads it from a Host header (IPv6 unbracketed)."""
    return _host_name(origin.partition("://")[2])


def _host_name(host_header: str) -> str:
    """The name in a Host header, without its port: ``[::1]:8765`` -> ``::1``."""
    if host_header.startswith("["):
        return host_header[1:].partition("]")[0]
    return host_header.rpartition(":")[0] if host_header.count(":") == 1 else host_header


_CLIENTS_OWN_5XX = frozenset({HTTPStatus.SERVICE_UNAVAILABLE, HTTPStatus.NOT_IMPLEMENTED,
                              HTTPStatus.HTTP_VERSION_NOT_SUPPORTED})


def _printable(text: str) -> str:
    """``text`` with every character that is not printable (ESC, BEL, newlines) written as an escape."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def _json_bytes(value: object) -> bytes:
    # ASCII only: a stored text that is not valid UTF-8 (lone surrogates) still makes valid JSON.
    return json.dumps(value, ensure_ascii=True, allow_nan=False).encode()


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")
