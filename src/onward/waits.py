"""Durable waits: what ``ctx.wait`` and ``onward send`` agree on. The checks of a wait's key and of a sent
value (JSON text, at most ``MAX_VALUE_BYTES``), and the record a wait leaves in the step journal.

A wait's record (kind ``wait`` in the task's steps, named by its key) holds ``{"value": V}`` once a value
was received, or ``{"timeout": SECONDS}`` once its deadline passed; replay returns V or raises
``WaitTimeout`` again, without waiting.

Keys beginning with ``RESERVED_PREFIX`` are onward's own: a durable sleep longer than the run's
``park_sleeps_over`` parks its task on ``SLEEP_KEY`` with the wake-up time as the wait's deadline, so that a
long sleep holds no worker slot and no lease and lets the sandbox sleep, like a wait. Nobody can send to
such a key nor wait on one, so that nothing sent from outside can end a sleep early.
"""

from __future__ import annotations

import json
import math
from typing import Any

from .config import is_number
from .errors import NotSent, UnknownTask, UsageError, WaitTimeout
from .results import json_problem
from .store.base import Store

MAX_KEY_CHARS = 200
MAX_VALUE_BYTES = 64 * 1024  # a sent value's JSON text: a decision or a small document, not a data set
RESERVED_PREFIX = "onward:"
SLEEP_KEY = RESERVED_PREFIX + "sleep"  # what a task parked in a long ctx.sleep waits for (see above)


def check_key(key: object) -> str:
    """A wait's key: 1 to MAX_KEY_CHARS printable characters, not beginning with RESERVED_PREFIX.
    ``UsageError`` otherwise (one line)."""
    if not isinstance(key, str) or not key:
        raise UsageError("a wait's key must be a non-empty string")
    if len(key) > MAX_KEY_CHARS:
        raise UsageError(f"a wait's key is at most {MAX_KEY_CHARS} characters (got {len(key)})")
    if not key.isprintable():
        raise UsageError(f"a wait's key must be printable text (got {key!r})")
    if key.startswith(RESERVED_PREFIX):
        raise UsageError(f"keys beginning with {RESERVED_PREFIX!r} are onward's own (a long ctx.sleep waits on"
                         f" {SLEEP_KEY!r}); choose another key (got {key!r})")
    return key


# The longest a wait's timeout or a durable sleep may be. Far beyond any real wait (no timeout at all is
# None), and it keeps the deadline a date: a timeout of 1e300 s was taken, and the worker then crashed
# (OverflowError) writing the parked task's deadline into its log.
MAX_WAIT_SECONDS = 366 * 24 * 3600


def check_timeout(timeout: object) -> float | None:
    """A wait's timeout (``ctx.wait(key, timeout=...)``): None, or a finite number of seconds above 0 and
    at most ``MAX_WAIT_SECONDS``. ``UsageError`` otherwise (one line)."""
    if timeout is None:
        return None
    seconds = _seconds("a wait's timeout", timeout, or_none=True)
    if not seconds > 0:
        raise UsageError(f"a wait's timeout must be a finite number of seconds above 0, or None (got {timeout!r:.60})")
    return float(seconds)


def check_sleep(seconds: object) -> float:
    """A durable sleep's duration (``ctx.sleep``): a finite number of seconds, 0 or more, at most
    ``MAX_WAIT_SECONDS``. ``UsageError`` otherwise (one line), before anything is recorded: NaN or infinity
    made a deadline that could not be stored, and the task failed saying a step's value was not JSON."""
    duration = _seconds("a sleep's duration", seconds)
    if duration < 0:
        raise UsageError(f"a sleep's duration cannot be negative (got {seconds!r:.60})")
    return float(duration)


def _seconds(what: str, value: object, or_none: bool = False) -> int | float:
    """``value`` if it is a number, not NaN nor infinite, and at most MAX_WAIT_SECONDS; ``UsageError``
    naming ``what`` otherwise. Left as it came (the callers check its lower bound before making it a
    float: an int too big for one would raise OverflowError there)."""
    if not is_number(value):  # True seconds is a slip, as everywhere else onward takes a number
        takes = "a number of seconds" + (" or None" if or_none else "")
        raise UsageError(f"{what} must be {takes}, not {type(value).__name__}: {value!r:.60}")
    if isinstance(value, float) and not math.isfinite(value):
        raise UsageError(f"{what} must be a finite number of seconds (got {value!r})")
    if value > MAX_WAIT_SECONDS:
        raise UsageError(f"{what} must be at most {MAX_WAIT_SECONDS:,} seconds (366 days) (got {value!r:.60})")
    return value


def value_text(value: Any) -> str:
    """The JSON text sent for ``value`` (``Job.send``): compact, no NaN or infinity, at most MAX_VALUE_BYTES,
    and read back equal (``results.json_problem``: no object key that is not a string)."""
    problem = json_problem(value)
    if problem is not None:
        raise UsageError(f"the value to send is not JSON: {problem}")
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise UsageError(f"the value to send is not JSON: {e}") from None
    except RecursionError:
        raise UsageError("the value to send is nested too deeply") from None
    return _capped(text)


def parse_value_text(text: str) -> str:
    """Check JSON text given on the command line or to the dashboard; the compact text to store."""
    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    def one_of_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        value: dict[str, Any] = {}
        for name, item in pairs:
            if name in value:  # json.loads would keep the last of the two, without a word
                raise ValueError(f"the name {name!r} appears twice in one object")
            value[name] = item
        return value
    try:
        value = json.loads(text, parse_constant=refuse, object_pairs_hook=one_of_each)
    except ValueError as e:  # JSONDecodeError is one
        raise UsageError(f"the value is not valid JSON: {str(e).splitlines()[0]}") from None
    except RecursionError:  # the decoder recurses once per level of nesting
        raise UsageError("the value is nested too deeply") from None
    return value_text(value)


def _capped(text: str) -> str:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_VALUE_BYTES:
        raise UsageError(f"the value is {size} bytes of JSON; at most {MAX_VALUE_BYTES} can be sent")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError("the value holds text that is not valid Unicode (a lone surrogate)") from None
    return text


def received_payload(value_json: str) -> bytes:
    return ('{"value":' + value_json + "}").encode()


def timeout_payload(seconds: float | None) -> bytes:
    return json.dumps({"timeout": seconds}).encode()


def outcome(key: str, payload: bytes) -> Any:
    """What a wait returns for its record: the value, or ``WaitTimeout`` raised."""
    record = json.loads(payload)
    if "value" in record:
        return record["value"]
    raise WaitTimeout(f"no value for {key!r} arrived in time")


def send(store: Store, task: str, key: str, text: str) -> str:
    """Send the JSON ``text`` (checked: ``value_text`` or ``parse_value_text``) to ``task``'s wait on
    ``key``: ``"delivered"`` (it waited: runnable again) or ``"stored"`` (kept until it waits). Raises
    ``UnknownTask`` or ``NotSent`` (one line each) when nothing was stored."""
    check_key(key)
    outcome = store.send(task, key, text)
    if outcome == "unknown":
        raise UnknownTask(f"no task {task!r} in {store.url}; nothing was sent")
    if outcome == "already sent":
        raise NotSent(f"task {task!r} has a value for {key!r} it did not receive yet; nothing was sent"
                      " (a value is never replaced)")
    if outcome.startswith("already "):
        raise NotSent(f"task {task!r} is {outcome.removeprefix('already ')}: it waits for nothing; nothing was sent")
    return outcome
