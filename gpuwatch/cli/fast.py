"""The stdlib-only path of ``gpuwatch probe`` when a daemon answers: as quick as the interpreter.

A probe answered by the daemon needs a socket, one JSON line each way and ``json``: nothing
of pydantic, PyYAML, anyio or pyudev. This module imports none of them (a test checks
``sys.modules`` before the reply is printed) and handles only what it can answer exactly as
the full command would, byte for byte. Anything else (an option it does not know, a request
the full command would reject or answer itself, no daemon, an error reply) returns None and
the full command runs instead, so every error message and exit code stays the full one's.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
from collections.abc import Sequence
from typing import Any

from gpuwatch.core.pci import canonical_addr

#: The daemon's socket unless ``$GPUWATCH_SOCKET`` or ``--socket`` names another.
DEFAULT_SOCKET_PATH = "/run/gpuwatch/gpuwatch.sock"
#: As the full command: a daemon answers from memory in microseconds; this long is stuck.
TIMEOUT = 10.0
#: A probe reply is small; one bigger than this is not worth reading here.
MAX_REPLY = 16 << 20
#: Options of ``gpuwatch probe`` this path understands, each taking one value.
_OPTIONS = frozenset({"--group", "--addr", "--mode", "--root", "--socket"})
#: Answered by the full command itself (its own limits, a live plan), never by the daemon.
_LOCAL_ACTIONS = frozenset({"memlock", "plan"})


def parse_probe(argv: Sequence[str]) -> tuple[str, dict[str, Any], str, str | None] | None:
    """``(action, params, root, socket)`` of a plain ``probe`` command line, else None."""
    if len(argv) < 2 or argv[0] != "probe":
        return None
    action: str | None = None
    values: dict[str, str] = {}
    rest = list(argv[1:])
    while rest:
        token = rest.pop(0)
        if token.startswith("-"):
            name, eq, value = token.partition("=")
            if name not in _OPTIONS or name in values:
                return None
            if not eq:
                if not rest:
                    return None
                value = rest.pop(0)
                if value.startswith("-") and not (name == "--group" and value[1:].isdigit()):
                    return None  # argparse would take it for an option: its error, not ours
            values[name] = value
        elif action is None:
            action = token
        else:
            return None
    if action is None or action in _LOCAL_ACTIONS:
        return None
    params: dict[str, Any] = {"action": action}
    if "--group" in values:
        try:
            params["group"] = int(values["--group"])
        except ValueError:
            return None
    if "--addr" in values:
        if canonical_addr(values["--addr"]) is None:
            return None  # the full command says why, in its words
        params["addr"] = values["--addr"]
    if "--mode" in values:
        params["mode"] = values["--mode"]
    return action, params, values.get("--root", "/"), values.get("--socket")


def socket_path(root: str, explicit: str | None) -> str | None:
    """The socket to ask, by the full command's rule: an explicit one always, the default one
    only for the host root (a fixture root is never answered by the host's daemon)."""
    if explicit is not None:
        return explicit
    try:
        if os.path.realpath(root) != "/":
            return None
    except (OSError, ValueError):
        return None
    return os.environ.get("GPUWATCH_SOCKET") or DEFAULT_SOCKET_PATH


def ask(path: str, params: dict[str, Any]) -> Any:
    """The ``result`` of one ``probe`` request; raises OSError/ValueError on anything else."""
    request = json.dumps({"id": 1, "method": "probe", "params": params},
                         separators=(",", ":")).encode() + b"\n"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(TIMEOUT)
        sock.connect(path)
        sock.sendall(request)
        chunks: list[bytes] = []
        size = 0
        while True:
            chunk = sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("the daemon closed the connection")
            newline = chunk.find(b"\n")
            if newline >= 0:
                chunks.append(chunk[:newline])
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_REPLY:
                raise ValueError("reply too long")
    reply = json.loads(b"".join(chunks))
    if not isinstance(reply, dict) or reply.get("id") != 1 or "result" not in reply:
        raise ValueError("not a result")
    return reply["result"]


def run_fast(argv: Sequence[str]) -> int | None:
    """Answer ``gpuwatch probe …`` through the daemon with the stdlib; None: not here."""
    parsed = parse_probe(argv)
    if parsed is None:
        return None
    action, params, root, explicit = parsed
    if not os.path.isdir(root):
        return None
    path = socket_path(root, explicit)
    if path is None or not os.path.exists(path):
        return None
    try:
        result = ask(path, params)
    except (OSError, ValueError):
        return None  # no answer, or an error reply: the full command decides what to do
    # The full command prints pydantic_core's compact JSON: the same bytes for plain JSON.
    text = json.dumps({"action": action, "result": result}, separators=(",", ":"),
                      ensure_ascii=False)
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the flush at exit
    return 0


__all__ = ["parse_probe", "run_fast", "socket_path"]
