"""The socket protocol: newline-delimited JSON requests and replies (docs/socket.md).

Pure encoding and validation, no I/O, so the server, the client and the tests agree on one
definition of a well-formed request and of every error code.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, Final

from pydantic_core import PydanticSerializationError, to_json, to_jsonable_python

from gpuwatch import errors as E
from gpuwatch.core import strictjson
from gpuwatch.core.strictjson import UnsafeJson, json_depth, loads

#: Where the systemd unit serves the socket (``RuntimeDirectory=gpuwatch``).
DEFAULT_SOCKET_PATH: Final = "/run/gpuwatch/gpuwatch.sock"
#: A request line longer than this is refused (and the connection closed): the longest
#: legitimate request is a few hundred bytes. ``--socket-max-request-bytes`` changes it.
MAX_LINE: Final = 64 << 10
#: JSON nested deeper than this is ``bad-request``; no request needs more than 3 levels.
MAX_DEPTH: Final = strictjson.MAX_DEPTH

#: Methods anyone allowed on the socket may call.
READ_METHODS: Final = frozenset({"probe", "snapshot", "subscribe", "plan", "holders",
                                  "config"})
#: Methods that change the host: root, or members of ``--switch-group``.
SWITCH_METHODS: Final = frozenset({"switch", "recover"})
METHODS: Final = READ_METHODS | SWITCH_METHODS

# Error codes. Strings, not JSON-RPC numbers: a shell script reads them without a table.
# Those a `GpuwatchError` can carry are defined once, in `gpuwatch.errors` (the CLI's exit
# statuses key on the same strings); the rest belong to the protocol alone.
PARSE_ERROR: Final = "parse-error"  # the line is not JSON
BAD_REQUEST: Final = "bad-request"  # JSON we refuse: too deep, NaN/Infinity, duplicate keys
REQUEST_TOO_LARGE: Final = "request-too-large"  # over MAX_LINE bytes: reply, then close
REQUEST_TIMEOUT: Final = "request-timeout"  # a partial line stalled: reply, then close
INVALID_REQUEST: Final = "invalid-request"  # JSON, but not {"id", "method", "params"}
UNKNOWN_METHOD: Final = "unknown-method"
INVALID_PARAMS: Final = E.INVALID_PARAMS  # missing, unknown or wrongly typed parameter
PERMISSION_DENIED: Final = "permission-denied"  # SO_PEERCRED says this peer may not
NOT_FOUND: Final = E.NOT_FOUND  # no such PCI function / card on this host
UNAVAILABLE: Final = "unavailable"  # this daemon cannot answer that (feature absent)
ALREADY_SUBSCRIBED: Final = "already-subscribed"
TOO_MANY_CLIENTS: Final = "too-many-clients"
SWITCH_REFUSED: Final = E.SWITCH_REFUSED  # holders named in the message; nothing written
SWITCH_FAILED: Final = E.SWITCH_FAILED
SWITCH_WEDGED: Final = E.SWITCH_WEDGED  # a kernel write hung: group poisoned until reboot/recover
GROUP_BUSY: Final = E.GROUP_BUSY  # another switch of this group is in progress
GROUP_POISONED: Final = E.GROUP_POISONED  # an earlier switch wedged: reboot or recover
REBOOT_REQUIRED: Final = E.REBOOT_REQUIRED  # recover refused: a task is stuck in the driver
NOT_ROOT: Final = E.NOT_ROOT  # the daemon itself lacks the privilege to do it
INTERNAL: Final = E.INTERNAL

ERROR_CODES: Final = frozenset({
    PARSE_ERROR, BAD_REQUEST, REQUEST_TOO_LARGE, REQUEST_TIMEOUT, INVALID_REQUEST,
    UNKNOWN_METHOD, INVALID_PARAMS,
    PERMISSION_DENIED, NOT_FOUND, UNAVAILABLE, ALREADY_SUBSCRIBED, TOO_MANY_CLIENTS,
    SWITCH_REFUSED, SWITCH_FAILED, SWITCH_WEDGED, GROUP_BUSY, GROUP_POISONED, REBOOT_REQUIRED,
    NOT_ROOT, INTERNAL,
})


class RpcError(E.CallerError):
    """A request that gets an error reply; ``code`` is one of `ERROR_CODES`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Request:
    """One decoded request. ``id`` is echoed back verbatim (any JSON value, null if absent)."""

    __slots__ = ("id", "method", "params")

    def __init__(self, id: Any, method: str, params: dict[str, Any]) -> None:
        self.id = id
        self.method = method
        self.params = params


def parse_request(line: bytes | str) -> Request:
    """A request line as a `Request`; `RpcError` (with the id when one was readable) otherwise.

    The id travels inside the error so the reply can still name the request it answers.
    """
    try:
        obj = loads(line)
    except UnsafeJson as exc:
        raise RequestError(None, BAD_REQUEST, str(exc)) from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise RequestError(None, PARSE_ERROR, f"not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise RequestError(None, INVALID_REQUEST,
                           f"a request is a JSON object, not {type(obj).__name__}")
    rid = obj.get("id")
    unknown = sorted(set(obj) - {"id", "method", "params"})
    if unknown:
        raise RequestError(rid, INVALID_REQUEST, f"unknown request field {unknown[0]!r}")
    method = obj.get("method")
    if not isinstance(method, str):
        raise RequestError(rid, INVALID_REQUEST, "request needs a string 'method'")
    params = obj.get("params")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise RequestError(rid, INVALID_PARAMS, "'params' must be a JSON object")
    if method not in METHODS:
        raise RequestError(rid, UNKNOWN_METHOD,
                           f"unknown method {method!r} (one of: {', '.join(sorted(METHODS))})")
    return Request(rid, method, params)


class RequestError(RpcError):
    """An `RpcError` raised while decoding, carrying the id read so far (None if none)."""

    def __init__(self, rid: Any, code: str, message: str) -> None:
        super().__init__(code, message)
        self.rid = rid


def encode_result(rid: Any, result: Any) -> bytes:
    """``{"id", "result"}`` + newline; pydantic answers serialised by alias (``class``).
    A non-finite float becomes ``null``: no reply ever holds ``NaN`` or ``Infinity``.

    A host's names may hold bytes that are not UTF-8 (a crafted driver's name, a process's
    ``comm``), kept as surrogate escapes, which JSON cannot carry: those answers go out with
    each such byte as U+FFFD, as the event log writes them, instead of failing every time.
    """
    reply = {"id": rid, "result": result}
    try:
        return to_json(reply, by_alias=True, inf_nan_mode="null") + b"\n"
    except PydanticSerializationError:
        from gpuwatch.core.events import scrub_surrogates

        plain = to_jsonable_python(reply, by_alias=True, inf_nan_mode="null")
        return to_json(scrub_surrogates(plain)) + b"\n"


def encode_error(rid: Any, code: str, message: str) -> bytes:
    """``{"id", "error": {"code", "message"}}`` + newline; the message is one line.
    Never raises: an id JSON cannot carry back is replaced by null."""
    one_line = " ".join(message.split())
    body = {"code": code, "message": one_line.encode("utf-8", "replace").decode("utf-8")}
    try:
        return to_json({"id": rid, "error": body}, inf_nan_mode="null") + b"\n"
    except ValueError:
        return to_json({"id": None, "error": body}) + b"\n"


def encode_request(rid: Any, method: str, params: Mapping[str, Any] | None = None) -> bytes:
    """``{"id", "method", "params"}`` + newline, for a client. A value JSON cannot carry is a
    `UsageError` before anything is sent, as the in-process call refuses it: ``NaN`` or an
    infinity sent as ``null`` would be read as an absent parameter (a switch's ``timeout``
    of NaN ran with the default 90 s), and a string with a lone surrogate (a name read with
    ``surrogateescape``) is no UTF-8."""
    request = {"id": rid, "method": method, "params": dict(params or {})}
    bad = _not_json(request)
    if bad is not None:
        raise E.UsageError(f"{method}: {bad}; nothing was sent to the daemon")
    try:
        return to_json(request) + b"\n"
    except PydanticSerializationError as exc:  # an object that is no JSON value at all
        raise E.UsageError(f"{method}: a parameter cannot be sent to the daemon: {exc}") from None


def _not_json(value: Any) -> str | None:
    """What in ``value`` (a request, a few levels deep) JSON cannot carry, or None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{value!r} is no JSON number"
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return f"{value!r} is not UTF-8 (it holds a lone surrogate)"
        return None
    if isinstance(value, Mapping):
        return next((bad for item in value.items() for bad in map(_not_json, item)
                     if bad is not None), None)
    if isinstance(value, list | tuple | set | frozenset):
        return next((bad for bad in map(_not_json, value) if bad is not None), None)
    return None


# --------------------------------------------------------------------------- parameters


class Params:
    """Typed access to a request's params; every mistake is an ``invalid-params`` error and
    a parameter nobody read is reported too, so a typo (``adr``) is not silently ignored."""

    def __init__(self, method: str, params: Mapping[str, Any]) -> None:
        self.method = method
        self._params = dict(params)
        self._read: set[str] = set()

    def _get(self, name: str) -> Any:
        self._read.add(name)
        return self._params.get(name)

    def _bad(self, name: str, want: str, value: Any) -> RpcError:
        return RpcError(INVALID_PARAMS, f"{self.method}: '{name}' must be {want}, "
                                        f"not {json.dumps(value)[:80]}")

    def opt_str(self, name: str) -> str | None:
        value = self._get(name)
        if value is None or isinstance(value, str):
            return value
        raise self._bad(name, "a string", value)

    def req_str(self, name: str) -> str:
        value = self.opt_str(name)
        if value is None:
            raise RpcError(INVALID_PARAMS, f"{self.method}: parameter '{name}' is required")
        return value

    def opt_int(self, name: str) -> int | None:
        value = self._get(name)
        if value is None or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        raise self._bad(name, "an integer", value)

    def opt_positive_float(self, name: str) -> float | None:
        """A number above 0 (a timeout: 0 would give up before trying). JSON holds no NaN
        nor Infinity (refused while decoding), and a number a double cannot hold is refused
        here, so what is returned is finite."""
        value = self._get(name)
        if value is None:
            return None
        if isinstance(value, int | float) and not isinstance(value, bool):
            if value <= 0:
                raise self._bad(name, "a positive number", value)
            try:  # an integer of 400 digits is valid JSON but no float
                return float(value)
            except OverflowError:
                raise self._bad(name, "a number a double can hold", value) from None
        raise self._bad(name, "a number", value)

    def opt_bool(self, name: str) -> bool | None:
        value = self._get(name)
        if value is None or isinstance(value, bool):
            return value
        raise self._bad(name, "true or false", value)

    def opt_str_list(self, name: str) -> list[str] | None:
        value = self._get(name)
        if value is None:
            return None
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
        raise self._bad(name, "a list of strings", value)

    def done(self) -> None:
        """Call after reading every parameter the method knows."""
        unknown = sorted(set(self._params) - self._read)
        if unknown:
            raise RpcError(INVALID_PARAMS, f"{self.method}: unknown parameter {unknown[0]!r}")


__all__ = [
    "DEFAULT_SOCKET_PATH",
    "ERROR_CODES",
    "MAX_DEPTH",
    "MAX_LINE",
    "METHODS",
    "READ_METHODS",
    "SWITCH_METHODS",
    "Params",
    "Request",
    "RequestError",
    "RpcError",
    "UnsafeJson",
    "encode_error",
    "encode_request",
    "encode_result",
    "json_depth",
    "loads",
    "parse_request",
]
