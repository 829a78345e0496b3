"""``onward dashboard``: serve the page and the JSON API of one job's store until SIGINT or SIGTERM."""

from __future__ import annotations

import signal
import threading
from types import FrameType

import click

from ..cli_types import db_option, job_option
from ..errors import UsageError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..store.base import Store

DEFAULT_PORT = 8765
MAX_TOKEN = 512


@click.command(name="dashboard")
@db_option
@job_option
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; any but a loopback one needs --token.")
@click.option("--port", default=DEFAULT_PORT, show_default=True, type=click.IntRange(0, 65535),
              help="Port to listen on (0: any free port; the URL printed says which).")
@click.option("--token", envvar="ONWARD_DASHBOARD_TOKEN", default=None, metavar="TOKEN",
              help="Every request must carry 'Authorization: Bearer TOKEN' (env ONWARD_DASHBOARD_TOKEN).")
@click.option("--origin", "origins", multiple=True, metavar="ORIGIN",
              help="Public origin the page is served from, as https://HOST[:PORT] (behind a proxy); repeatable."
                   " Actions are then accepted from exactly these.")
def dashboard_command(db: str | None, job: str, host: str, port: int, token: str | None,
                      origins: tuple[str, ...]) -> None:
    """Serve a live page of the job (and its JSON API) on http://127.0.0.1:8765/ until Ctrl-C."""
    from ..redact import hide_secrets_in_argv
    from ..store import open_store
    from .server import Dashboard, make_server

    if token is not None:
        _check_token(token)
        hide_secrets_in_argv([token])
    public = _public_origins(origins)
    loopback = _is_loopback(host)
    if not loopback and token is None:
        raise UsageError(f"listening on {host} (not a loopback address) needs a token: give --token or"
                         " ONWARD_DASHBOARD_TOKEN")
    def open_handle() -> Store:
        return open_store(db, create=False, job=job)

    store = open_handle()
    # Each action on a connection of its own (see Dashboard): reads never wait behind one.
    board = Dashboard(store, token, host, loopback, public, open_handle)
    try:
        threading.Thread(target=board.idle_between_requests, name="onward-dashboard-idle", daemon=True).start()
        try:
            server = make_server(board, host, port)
        except OSError as e:
            raise UsageError(f"cannot listen on {host} port {port}: {e.strerror or e}") from None

        stops: list[int] = []

        def stop(signum: int, frame: FrameType | None) -> None:
            # Once: a second signal arriving inside the first one's Event.set() (`timeout` sends SIGTERM to the
            # process, then to its group, microseconds apart) ran this again there, and waited for good on the
            # lock the first one held: the dashboard never exited, and answered nothing.
            if stops:
                return
            stops.append(signum)
            board.stopping.set()
            # shutdown() waits for serve_forever() to return, which runs in this very thread: ask from another.
            threading.Thread(target=server.shutdown, daemon=True).start()

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        # Said once the handlers are in place: a stop sent as soon as the address is read ends it with exit 0.
        bound_port = server.server_address[1]
        shown_host = f"[{host}]" if ":" in host else host
        click.echo(f"onward dashboard: http://{shown_host}:{bound_port}/" +
                   ("  (open it as /?token=TOKEN)" if token else ""))
        try:
            server.serve_forever(poll_interval=0.2)
        finally:
            server.server_close()
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # on the way out: no handler runs inside the set() below
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        board.stopping.set()
        with board.lock:  # not in the middle of the idle thread's turn
            store.close()
    click.echo("onward dashboard: stopped", err=True)


def _check_token(token: str) -> None:
    """A token travels in an HTTP header: printable ASCII without spaces, and short enough for one."""
    if not token:
        raise UsageError("the token is empty")
    if len(token) > MAX_TOKEN or not token.isascii() or not token.isprintable() or any(c.isspace() for c in token):
        raise UsageError(f"the token must be 1 to {MAX_TOKEN} printable ASCII characters without spaces")


def _public_origins(values: tuple[str, ...]) -> frozenset[str]:
    """The origins given with --origin, normalised as a browser writes its Origin header; any value that is
    not exactly an http(s) origin is refused rather than guessed at (a path, a user, another scheme)."""
    from .server import normalise_origin

    origins = set()
    for value in values:
        try:
            origins.add(normalise_origin(value))
        except ValueError as e:
            raise UsageError(f"--origin {value!r}: {e}") from None
    return frozenset(origins)


def _is_loopback(host: str) -> bool:
    """Whether ``host`` names only loopback addresses; a name that does not resolve is bad input."""
    from .server import is_loopback

    if not host or "\x00" in host:
        raise UsageError("--host is empty")
    try:
        return is_loopback(host)
    except (OSError, UnicodeError) as e:
        raise UsageError(f"cannot use host {host!r}: {getattr(e, 'strerror', None) or e}") from None
