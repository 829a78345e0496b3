"""The format of a durable step's record: its kinds, the serializers of its values, the frame around the
payload, how an exception is kept, and the names and keys derived from a task's records. Pure functions
of bytes and records: no store, no runner.

A record's ``data`` is ``b"<serializer> <seconds> <attempt> <fence>\\n"`` followed by the payload: the
serializer's name (checked on replay), the seconds the body took (the time a replay saves), and the attempt
and fence that recorded it (``onward status`` counts records of earlier claims as replayed).
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .errors import OnwardError, StoreError, UsageError
from .log import one_line
from .results import json_bytes
from .store.base import StepRecord

# Record kinds (StepRecord.kind).
VALUE, ERROR, CHECKPOINT, SLEEP, WAIT = "value", "error", "checkpoint", "sleep", "wait"
# How a drift message names each kind, when a call and the record in its place share a name.
KIND_WORDS = {VALUE: "a step", ERROR: "a step", CHECKPOINT: "a checkpoint", SLEEP: "a durable sleep",
              WAIT: "a wait"}


class StepError(OnwardError):
    """A recorded step error replayed when its original exception could not be rebuilt: carries its type
    name and message."""


# --- serializers ------------------------------------------------------------------------------------------
class Serializer(Protocol):
    """Turns step values into bytes and back. ``name`` is written with every record and checked on replay."""

    name: str

    def dumps(self, value: Any) -> bytes: ...

    def loads(self, data: bytes) -> Any: ...


class JsonSerializer:
    name = "json"

    def dumps(self, value: Any) -> bytes:
        try:
            return json_bytes(value, separators=(",", ":"))
        except ValueError as e:
            raise UsageError(f"a step returned a value that is not JSON ({e}); pass serializer=onward.steps.PICKLE"
                             " or your own to @step") from None

    def loads(self, data: bytes) -> Any:
        return json.loads(data)


class ModelCallSerializer(JsonSerializer):
    """JSON for what a model's server sent (a durable model call, a stream's chunks, an agent framework's
    model and tool calls), with a NaN or an infinity in it written as JavaScript's tokens, which ``json.loads``
    reads back as they were: a logprob of -Infinity is an answer Python's json and the SDKs take, and refused
    it failed every attempt after paying for its call. A step of the user's still refuses them (``JSON``).
    Named as ``JSON`` is: a record of either is read alike."""

    def dumps(self, value: Any) -> bytes:
        try:
            return json_bytes(value, separators=(",", ":"), allow_nan=True)
        except ValueError as e:
            raise UsageError(f"a model call's answer could not be recorded ({e})") from None


class PickleSerializer:
    """Any picklable value. Only load stores you trust: unpickling runs code named by the data."""

    name = "pickle"

    def dumps(self, value: Any) -> bytes:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)

    def loads(self, data: bytes) -> Any:
        return pickle.loads(data)


JSON: Serializer = JsonSerializer()
MODEL_CALL_JSON: Serializer = ModelCallSerializer()
PICKLE: Serializer = PickleSerializer()


# --- records ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Frame:
    """A record's data, unpacked."""

    serializer: str
    seconds: float
    attempt: int
    fence: int
    payload: bytes


def frame(serializer: str, seconds: float, attempt: int, fence: int, payload: bytes) -> bytes:
    return b"%s %.6f %d %d\n" % (serializer.encode(), seconds, attempt, fence) + payload


def unframe(data: bytes) -> Frame:
    head, sep, payload = data.partition(b"\n")
    parts = head.split(b" ")
    if not sep or len(parts) != 4:
        raise StoreError("a step record is not in onward's format (written by something else?)")
    return Frame(parts[0].decode(), float(parts[1]), int(parts[2]), int(parts[3]), payload)


def ordinals(records: Sequence[StepRecord]) -> list[str]:
    """``name#n`` for each record: the n-th call of that name."""
    seen: dict[str, int] = {}
    out = []
    for r in records:
        seen[r.name] = seen.get(r.name, 0) + 1
        out.append(f"{r.name}#{seen[r.name]}")
    return out


def summarize(records: Sequence[StepRecord], fence: int | None) -> dict[str, Any]:
    """For status: how many steps a task has recorded, how many of them came from earlier claims than
    ``fence`` (replayed, or about to be, by the current attempt), and the time those took originally."""
    replayed, saved = 0, 0.0
    for r in records:
        try:
            f = unframe(r.data)
        except (StoreError, ValueError):
            continue
        if fence is not None and f.fence < fence:
            replayed += 1
            if r.kind == VALUE:
                saved += f.seconds
    return {"recorded": len(records), "replayed": replayed, "saved_seconds": round(saved, 3)}


def idempotency_key(task: str, name: str, index: int) -> str:
    """Stable for (task, step name, call index); different for any other step."""
    digest = hashlib.sha256(f"{task}\0{name}\0{index}".encode("utf-8", "surrogatepass")).hexdigest()
    return "onward-" + digest[:32]


# Header values that are credentials. An HTTP client's exception carries the request it failed on, headers
# and all (anthropic's and httpx's do): pickled as it is, the API key would be stored in the step's record.
SECRET_HEADERS = frozenset({"authorization", "proxy-authorization", "x-api-key", "api-key", "x-goog-api-key",
                            "cookie", "set-cookie", "x-amz-security-token"})
# ... and any other header, or query parameter, named with one of these words (split at "-" and "_"): the
# gateways' and proxies' own credentials (Helicone-Auth, Ocp-Apim-Subscription-Key, cf-aig-authorization,
# x-portkey-api-key), a ?key= in the URL. Not "tokens": x-ratelimit-remaining-tokens is no secret, and a task
# may read it on replay.
SECRET_WORDS = frozenset({"auth", "authorization", "key", "apikey", "token", "secret", "cookie", "password",
                          "passwd", "pwd", "signature", "sig", "session", "credential", "credentials"})
NOT_SECRET_WORDS = frozenset({"idempotency"})  # onward's own Idempotency-Key, derived from the task anyway
REDACTED = "[redacted]"


def secret_name(name: str) -> bool:
    """Whether a header or query parameter of this name holds a credential (``SECRET_HEADERS``, ``SECRET_WORDS``)."""
    name = name.lower()
    if name in SECRET_HEADERS:
        return True
    words = set(name.replace("_", "-").split("-"))
    return bool(words & SECRET_WORDS) and not words & NOT_SECRET_WORDS


def redacted_url(url: str) -> str:
    """``url`` with the password of its user part, and the value of every query parameter named as a credential,
    replaced by ``REDACTED``."""
    from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}{':' + REDACTED if colon else ''}@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(secret_name(key) for key, _ in pairs):
            query = urlencode([(key, REDACTED if secret_name(key) else value) for key, value in pairs])
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
HTTPX_MODULES = frozenset({"httpx", "httpx2"})  # the OpenAI and Anthropic SDKs' HTTP client, by either name


# An error record's serializer. Since onward drops an error record when the attempt fails with its error
# (``StepLog.end_failed``), its records carry these names; records named the legacy way ("pickle", "json")
# were written by earlier versions, which left that record in place and dropped a trailing one at the next
# load: ``StepLog.load`` still does that for them, so that a task in flight across an upgrade runs on as it
# would have.
ERROR_PICKLE, ERROR_JSON = "error-pickle", "error-json"
LEGACY_ERROR_PICKLE, LEGACY_ERROR_JSON = "pickle", "json"


def is_legacy_error(f: Frame) -> bool:
    return f.serializer in (LEGACY_ERROR_PICKLE, LEGACY_ERROR_JSON)


def recordable(e: BaseException) -> bool:
    """An exception a step's record keeps (and a replay raises again): not onward's own (cancellation,
    fencing, drift), nor what is no error of the step's (KeyboardInterrupt, SystemExit, a task's
    cancellation)."""
    return isinstance(e, Exception) and not isinstance(e, OnwardError)


def encode_error(e: BaseException) -> tuple[str, bytes]:
    """An exception as a step's record, so that a replay raises it again and a task that caught it takes
    the same path. Pickled, with every credential header of an HTTP request or response it holds replaced
    by ``REDACTED``. An exception that pickles but cannot be rebuilt that way (its ``__init__`` takes other
    arguments than its ``args``: every error of the OpenAI SDK) is rebuilt without calling its ``__init__``:
    its class, ``args`` and attributes. Only when neither round trip works, its type's name and message
    (replayed as ``StepError``)."""
    for rebuild in (False, True):
        try:
            out = io.BytesIO()
            _ErrorPickler(out, rebuild).dump(e)
            data = out.getvalue()
            if isinstance(_load_error(data), type(e)):  # as a replay will load it
                return ERROR_PICKLE, data
        except Exception:
            continue
    return ERROR_JSON, json.dumps({"type": f"{type(e).__module__}.{type(e).__qualname__}",
                               "message": str(e)}).encode()


class _ErrorPickler(pickle.Pickler):
    def __init__(self, out: io.BytesIO, rebuild: bool) -> None:
        super().__init__(out, protocol=pickle.HIGHEST_PROTOCOL)
        self.rebuild = rebuild
        self._causes_kept: set[int] = set()  # the exceptions whose __cause__ is pickled already (see below)

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, BaseException) and obj.__cause__ is not None and id(obj) not in self._causes_kept:
            # `raise X from Y`: pickling an exception keeps its args and attributes, not the Y a task may look
            # at (an SDK's error raised from the HTTP client's): a replay gave __cause__ None. Kept as a call
            # that sets it on the exception pickled the usual way (this method, once more, for it).
            self._causes_kept.add(id(obj))
            return _caused, (obj, obj.__cause__)
        kind = type(obj)
        package = kind.__module__.split(".")[0]
        if kind.__name__ == "Headers" and package in HTTPX_MODULES:
            return kind, ([(name, REDACTED if secret_name(name) else value) for name, value in obj.multi_items()],)
        if kind.__name__ == "URL" and package in HTTPX_MODULES:
            return kind, (redacted_url(str(obj)),)
        if kind.__name__ == "CaseInsensitiveDict" and package == "requests":
            return kind, ({name: REDACTED if secret_name(name) else value for name, value in obj.items()},)
        if self.rebuild and isinstance(obj, BaseException):
            return _rebuilt_exception, (kind, obj.args, dict(getattr(obj, "__dict__", {})))
        if isinstance(obj, type) and issubclass(obj, BaseException) and obj.__module__ != "builtins":
            return _exception_class, (obj.__module__, obj.__qualname__, _base_names(obj))
        return NotImplemented


def _base_names(kind: type[BaseException]) -> tuple[tuple[str, str], ...]:
    """The exception classes ``kind`` derives from, nearest first, down to the first built-in one (which
    every process has): where a replay looks when ``kind``'s own module is not imported (``_exception_class``)."""
    names = []
    for base in kind.__mro__[1:]:
        if issubclass(base, BaseException):
            names.append((base.__module__, base.__qualname__))
            if base.__module__ == "builtins":
                break
    return tuple(names)


# The stand-ins made by _exception_class, one per class named: a replay that meets the same record twice
# raises one class both times.
_STAND_INS: dict[tuple[str, str, type], type] = {}


def _exception_class(module: str, qualname: str, bases: tuple[tuple[str, str], ...]) -> type[BaseException]:
    """The exception class an error record names, as ``find_class`` finds it. When its module is not
    imported (the step imported it in its body, which a replay does not run), a stand-in of the same name
    and module, derived from the nearest of its bases that is found: a task that caught the error by a base
    (``except ValueError``) or looked at its name takes the same path as on the first run, with its
    ``args`` and attributes. (Catching it by its own class needs its module, which the task's code then
    imported itself.) Nothing is imported either way."""
    try:
        return _ErrorUnpickler.exception_class(module, qualname)
    except pickle.UnpicklingError:
        if not (isinstance(module, str) and isinstance(qualname, str) and isinstance(bases, tuple)):
            raise
        for base_module, base_qualname in bases:
            try:
                base = _ErrorUnpickler.exception_class(str(base_module), str(base_qualname))
            except pickle.UnpicklingError:
                continue
            key = (module, qualname, base)
            if key not in _STAND_INS:
                _STAND_INS[key] = type(qualname.rpartition(".")[2], (base,),
                                       {"__module__": module, "__qualname__": qualname})
            return _STAND_INS[key]
        raise


def _rebuilt_exception(kind: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    """An exception of class ``kind`` with these ``args`` and attributes, made without its ``__init__``
    (``encode_error``)."""
    if not (isinstance(kind, type) and issubclass(kind, BaseException)):
        raise pickle.UnpicklingError(f"{kind!r} is not an exception class")
    e = kind.__new__(kind, *args)
    e.args = args
    e.__dict__.update(state)
    return e


def _caused(e: BaseException, cause: BaseException) -> BaseException:
    """``e`` raised from ``cause`` (``_ErrorPickler``), as its first run had it."""
    if not (isinstance(e, BaseException) and isinstance(cause, BaseException)):
        raise pickle.UnpicklingError("an error's cause is not an exception")
    e.__cause__ = cause  # (which sets __suppress_context__, as `raise e from cause` does)
    return e


# What an error record may name besides exception classes (see _ErrorUnpickler).
_ERROR_RECORD_GLOBALS = frozenset({
    ("copyreg", "_reconstructor"), ("copyreg", "__newobj__"), ("copyreg", "__newobj_ex__"),
    ("builtins", "object"), ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "bytearray"),
    ("builtins", "complex"), ("builtins", "slice"), ("builtins", "range"),
    ("collections", "OrderedDict"), ("collections", "deque"),
    ("datetime", "datetime"), ("datetime", "date"), ("datetime", "time"), ("datetime", "timedelta"),
    ("datetime", "timezone"), ("decimal", "Decimal"), ("uuid", "UUID"),
    ("onward.step_records", "_rebuilt_exception"), ("onward.step_records", "_exception_class"),
    ("onward.step_records", "_caused"),
})
_HTTP_PACKAGES = HTTPX_MODULES | {"requests", "urllib3"}  # the requests and responses errors carry


class _ErrorUnpickler(pickle.Unpickler):
    """Loads an error record naming only what an exception needs: exception classes, the HTTP clients'
    request and response classes, and a few plain value types (``_ERROR_RECORD_GLOBALS``); each from a
    module this process has imported already (the task's code imported it before it could raise it), so
    that loading imports nothing. A record is a step's, in a store others may write to (a PostgreSQL
    database's other users): unrestricted, a planted record would run any code it names in every worker
    that resumes the task. A user's values are another matter: ``serializer=PICKLE`` is their explicit
    choice, documented as for trusted stores only."""

    def find_class(self, module: str, name: str) -> Any:
        found = _loaded(module, name)
        if found is not None and ((module, name) in _ERROR_RECORD_GLOBALS or (
                isinstance(found, type) and (issubclass(found, BaseException)
                                             or module.split(".")[0] in _HTTP_PACKAGES))):
            return found
        raise pickle.UnpicklingError(f"an error record may not name {module}.{name}")

    @staticmethod
    def exception_class(module: str, name: str) -> type[BaseException]:
        """An exception class ``find_class`` would load, or ``UnpicklingError``."""
        found = _loaded(module, name) if isinstance(module, str) and isinstance(name, str) else None
        if isinstance(found, type) and issubclass(found, BaseException):
            return found
        raise pickle.UnpicklingError(f"an error record may not name {module}.{name}")


def _loaded(module: str, qualname: str) -> Any:
    """What ``qualname`` names in ``module`` if that module is imported already (never importing it)."""
    loaded = sys.modules.get(module)
    return _named_in(loaded, qualname) if loaded is not None else None


def _named_in(module: Any, qualname: str) -> Any:
    """What ``qualname`` names in ``module``: a module's attribute, or a class nested in a class there (its
    qualified name has dots: Django's ``Model.DoesNotExist``, an API client's ``Api.RateLimited``), read
    from each class's own namespace, so that no descriptor or ``__getattr__`` runs. None when nothing is
    found so."""
    first, *nested = qualname.split(".")
    found = getattr(module, first, None)
    for part in nested:
        if not isinstance(found, type):
            return None
        found = vars(found).get(part)
    return found


def _load_error(data: bytes) -> Any:
    return _ErrorUnpickler(io.BytesIO(data)).load()


def decode_error(f: Frame) -> BaseException:
    if f.serializer in (ERROR_PICKLE, LEGACY_ERROR_PICKLE):
        try:
            e = _load_error(f.payload)
            if isinstance(e, BaseException):
                return e
            why = f"it holds a {type(e).__name__}, not an exception"
        except Exception as error:
            why = one_line(str(error), 200)
        return StepError(f"a recorded step error could not be rebuilt: {why}")
    info = json.loads(f.payload)
    return StepError(f"{info['type']}: {info['message']}")

