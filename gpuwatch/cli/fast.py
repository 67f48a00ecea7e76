"""The stdlib-only path of ``gpuwatch probe|holders|plan`` when a daemon answers.

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
import stat
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from gpuwatch.cli.common import EXIT_FAILURE, EXIT_OK, fail, to_stderr
from gpuwatch.core.ndjson import TOO_LONG, LineFramer
from gpuwatch.core.pci import canonical_addr, card_in_group
from gpuwatch.core.strictjson import loads as strict_loads
from gpuwatch.core.text import terminal_safe

#: The daemon's socket unless ``$GPUWATCH_SOCKET`` or ``--socket`` names another.
DEFAULT_SOCKET_PATH = "/run/gpuwatch/gpuwatch.sock"
#: As the full command: a daemon answers from memory in microseconds; this long is stuck.
TIMEOUT = 10.0
#: A probe reply is small; one bigger than this is not worth reading here.
MAX_REPLY = 16 << 20
#: Replies echo a request's id inside their envelope: the client's bound
#: (`gpuwatch.service.client.REPLY_MAX_DEPTH`).
REPLY_MAX_DEPTH = 64
#: Sockets whose daemon did not answer within `TIMEOUT` during this command: the full
#: command does not wait on them a second time (docs/socket.md: a daemon that does not
#: answer within 10 s means a direct scan, not two waits of 10 s). `main` clears it.
UNANSWERED: set[str] = set()
#: Options of ``gpuwatch probe`` this path understands, each taking one value.
_OPTIONS = frozenset({"--group", "--addr", "--mode", "--root", "--socket"})
#: ... and of ``gpuwatch holders`` (plus the ``--json`` flag).
_HOLDERS_OPTIONS = frozenset({"--addr", "--root", "--socket"})
#: ... and of ``gpuwatch plan MODE`` (plus ``--json`` and ``--force``).
_PLAN_OPTIONS = _HOLDERS_OPTIONS
_MODES = ("vfio", "nvidia")
#: The card ``holders`` and ``plan`` look at without ``--addr`` (``core.plan.NVIDIA_VENDOR``).
DEFAULT_VENDOR = "0x10de"
#: Answered by the full command itself (its own limits, a live plan), never by the daemon.
_LOCAL_ACTIONS = frozenset({"memlock", "plan"})
#: The daemon's root (`gpuwatch.settings`): set, it is the full command's to read and check.
ROOT_ENV = "GPUWATCH_ROOT"
#: The config file (`gpuwatch.settings.config_file_path`): ``$GPUWATCH_CONFIG``, else the
#: default one when it exists.
CONFIG_ENV = "GPUWATCH_CONFIG"
DEFAULT_CONFIG_PATH = "/etc/gpuwatch/config.yaml"


def _split(
    argv: Sequence[str], options: frozenset[str], flags: frozenset[str] = frozenset()
) -> tuple[list[str], dict[str, str]] | None:
    """Positionals and ``{option: value}`` (a flag's value is ``""``), argparse's way for the
    plain spellings only; None for anything else (abbreviations, repeats, ``--``, help)."""
    positionals: list[str] = []
    values: dict[str, str] = {}
    rest = list(argv)
    while rest:
        token = rest.pop(0)
        if not token.startswith("-"):
            positionals.append(token)
            continue
        name, eq, value = token.partition("=")
        if name in values or (name not in options and name not in flags):
            return None
        if name in flags:
            if eq:
                return None
            values[name] = ""
            continue
        if not eq:
            if not rest:
                return None
            value = rest.pop(0)
            if value.startswith("-") and not (name == "--group" and value[1:].isdigit()):
                return None  # argparse would take it for an option: its error, not ours
        values[name] = value
    return positionals, values


def parse_probe(argv: Sequence[str]) -> tuple[str, dict[str, Any], str, str | None] | None:
    """``(action, params, root, socket)`` of a plain ``probe`` command line, else None."""
    if len(argv) < 2 or argv[0] != "probe":
        return None
    split = _split(argv[1:], _OPTIONS)
    if split is None or len(split[0]) != 1:
        return None
    (action,), values = split
    if action in _LOCAL_ACTIONS:
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


def parse_holders(argv: Sequence[str]) -> tuple[dict[str, Any], bool, str, str | None] | None:
    """``(params, as_json, root, socket)`` of a plain ``holders`` command line, else None."""
    if not argv or argv[0] != "holders":
        return None
    split = _split(argv[1:], _HOLDERS_OPTIONS, frozenset({"--json"}))
    if split is None or split[0]:
        return None
    values = split[1]
    params: dict[str, Any] = {"vendor": DEFAULT_VENDOR}
    if "--addr" in values:
        addr = canonical_addr(values["--addr"])
        if addr is None:
            return None
        params = {"addr": addr}
    return params, "--json" in values, values.get("--root", "/"), values.get("--socket")


_PLAN_KEYS = frozenset({"addr", "group", "from_mode", "to_mode", "example", "members",
                        "refused", "steps", "notes"})


def _str(value: Any) -> bool:
    return isinstance(value, str)


def _each(values: Any, ok: Callable[[Any], bool]) -> bool:
    """A JSON array (or, from a direct scan's plain values, a tuple) of ``ok`` items."""
    return isinstance(values, (list, tuple)) and all(ok(v) for v in values)


def is_holders_report(report: Any) -> bool:
    """Whether a daemon's ``holders`` answer has the shape `print_holders` reads: anything
    else is no answer (the direct scan runs), never a traceback half-way through printing."""
    return (isinstance(report, dict) and _str(report.get("addr"))
            and isinstance(report.get("group"), int) and _str(report.get("note"))
            and _each(report.get("holders"), lambda h: isinstance(h, dict)
                      and isinstance(h.get("pid"), int) and _str(h.get("comm"))
                      and _str(h.get("node", ""))))


def _is_step(step: Any) -> bool:
    if not isinstance(step, dict):
        return False
    if step.get("kind") == "write":
        return _str(step.get("value")) and _str(step.get("path"))
    if step.get("kind") == "command":
        return _each(step.get("argv"), _str)
    return _str(step.get("path"))


def is_plan(plan: Any) -> bool:
    """Whether a daemon's ``plan`` answer has the shape `render_plan` and `print_plan` read."""
    if not (isinstance(plan, dict) and plan.keys() >= _PLAN_KEYS):
        return False
    refused = plan["refused"]
    return (_str(plan["addr"]) and isinstance(plan["group"], int) and _str(plan["from_mode"])
            and _str(plan["to_mode"]) and isinstance(plan["example"], bool)
            and _each(plan["members"], lambda m: isinstance(m, dict) and _str(m.get("addr"))
                      and _str(m.get("target")) and _str(m.get("alias", "")))
            and (refused is None or (isinstance(refused, dict) and _str(refused.get("reason"))))
            and _each(plan["steps"], _is_step) and _each(plan["notes"], _str))


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bool(value: Any) -> bool:
    return isinstance(value, bool)


def _fields(value: Any, shape: Mapping[str, Callable[[Any], bool]],
            optional: Mapping[str, Callable[[Any], bool]] | None = None) -> bool:
    """A JSON object with every field of ``shape``, each ``ok``, and the ``optional`` ones
    ``ok`` where present (an older daemon left them out; a newer one may add fields)."""
    # Loops, not ``all`` over generators: a report's answer holds hundreds of functions.
    if not isinstance(value, dict):
        return False
    for k, ok in shape.items():
        if k not in value or not ok(value[k]):
            return False
    return all(k not in value or ok(value[k]) for k, ok in (optional or {}).items())


def _or_null(ok: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or ok(v)


_FUNCTION = {"addr": _str, "vendor_id": _str, "device_id": _str, "class": _str,
             "class_label": _str, "driver": _str, "iommu_group": _int}
_FUNCTION_LATER = {  # fields with a default: a daemon of an older gpuwatch may lack them
    "vfio_dev": _str, "vfio_cdev": _str, "physfn": _str, "health": _str,
    "sriov": _or_null(lambda s: _fields(s, {"totalvfs": _int, "numvfs": _int,
                                            "vfs": lambda v: _each(v, _str)})),
    "vgpu": _or_null(lambda g: _fields(g, {"type": _int,
                                           "creatable": lambda v: _each(v, _int)})),
}


def _is_function(fn: Any) -> bool:
    return _fields(fn, _FUNCTION, _FUNCTION_LATER)


def _is_gpu(gpu: Any) -> bool:
    return _is_function(gpu) and _each(gpu.get("group_members"), _is_function)


#: What each probe action the daemon answers returns (docs/probes.md, "Actions"): an answer
#: in any other shape is no answer, so the direct scan runs instead of printing it.
PROBE_SHAPES: dict[str, Callable[[Any], bool]] = {
    "detect-vfio": lambda r: _fields(r, {"iommu_enabled": _bool, "iommu_kind": _str,
                                         "gpus": lambda g: _each(g, _is_gpu)},
                                     {"iommufd": _bool}),
    "detect-gpu": _bool,
    "detect-amd-gpu": _bool,
    "amd-gfx-version": _str,
    "amd-gfx-target": _str,
    "detect-host-devices": lambda r: _fields(r, {
        "gpu": _bool, "amd_gpu": _bool, "amd_gfx_version": _str, "amd_gfx_target": _str,
        "devices": lambda d: _each(d, _str), "render_node": _str}),
    "vfio-group-accessible": _bool,
    "nvidia-holders": lambda r: _each(r, lambda h: _fields(h, {"pid": _int, "comm": _str},
                                                            {"unreadable": _bool})),
    "display-driver": _str,
    "current-mode": lambda r: r in _MODES,
    "group-in-mode": _bool,
    "vfio-backend": lambda r: _fields(r, {
        "addr": _str, "driver": _str, "on_vfio": _bool, "group_node": _str,
        "cdev_node": _str, "iommufd": _bool,
        "recommended": lambda v: v in ("iommufd", "group", "none")}),
    "wedge-detected": _bool,
}


def is_probe_result(action: str, result: Any) -> bool:
    """Whether a daemon's answer to ``probe ACTION`` has the shape docs/probes.md gives that
    action: a foreign or hostile socket's answer in another shape (a string where a boolean
    belongs, escape codes, an object for a list) is never printed as the answer."""
    shape = PROBE_SHAPES.get(action)
    return shape is not None and shape(result)


def parse_plan(argv: Sequence[str]) -> tuple[dict[str, Any], bool, str, str | None] | None:
    """``(params, as_json, root, socket)`` of a plain ``plan MODE`` command line, else None
    (no mode: the full command picks one from the host; ``--vendor``/``--vfio-driver``: it
    validates them first)."""
    if not argv or argv[0] != "plan":
        return None
    split = _split(argv[1:], _PLAN_OPTIONS, frozenset({"--json", "--force"}))
    if split is None or len(split[0]) != 1 or split[0][0] not in _MODES:
        return None
    (mode,), values = split
    params: dict[str, Any] = {"mode": mode, "vendor": DEFAULT_VENDOR}
    if "--addr" in values:
        addr = canonical_addr(values["--addr"])
        if addr is None:
            return None
        params = {"mode": mode, "addr": addr}
    if "--force" in values:
        params["force"] = True
    return params, "--json" in values, values.get("--root", "/"), values.get("--socket")


def describe_step(step: dict[str, Any]) -> str:
    if step["kind"] == "write":
        return f"write {step['value']!r} to {step['path']}"
    if step["kind"] == "command":
        import shlex

        return "run " + shlex.join(step["argv"])
    return f"mkdir -p {step['path']}"


def render_plan(plan: dict[str, Any]) -> str:
    """Text of a plan in its JSON form, so a plan from the daemon reads the same as ours."""
    lines = [f"plan: {card_in_group(plan['addr'], plan['group'])} {plan['from_mode']} -> "
             f"{plan['to_mode']}" + (" [example card]" if plan["example"] else "")]
    for member in plan["members"]:
        alias = member.get("alias", "")
        lines.append(f"  {member['addr']}: {member['target']}"
                     + (f" (modules.alias {alias})" if alias else ""))
    if plan["refused"] is not None:
        lines.append(f"refused: {plan['refused']['reason']}")
    elif not plan["steps"]:
        lines.append("no steps: nothing to write")
    for i, step in enumerate(plan["steps"], 1):
        lines.append(f"  {i}. {describe_step(step)}")
    return "\n".join(lines)


def print_plan(plan: dict[str, Any], as_json: bool, dumps: Callable[[Any], str]) -> int:
    """``gpuwatch plan``'s output and exit code, for the full command and this path alike.
    A reader that leaves (``| grep -q``, ``| true``) takes none of the verdict with it: a
    plan that would be refused still says so on stderr and exits 1."""
    with reader_may_leave():
        print(dumps(plan) if as_json else terminal_safe(render_plan(plan)))
        sys.stdout.flush()
    for note in plan["notes"]:
        to_stderr(f"gpuwatch: note: {note}")
    if plan["refused"] is not None:
        return fail(f"the switch would be refused: {plan['refused']['reason']}", EXIT_FAILURE)
    return EXIT_OK


def print_holders(report: dict[str, Any], as_json: bool, dumps: Callable[[Any], str]) -> None:
    """``gpuwatch holders``'s output, for the full command and this path alike."""
    if as_json:
        print(dumps(report))
    else:
        holders = report["holders"]
        if not holders:
            print(f"no process holds a node of {card_in_group(report['addr'], report['group'])}")
        for h in holders:
            node = h.get("node") or ("(its open files could not be read: it may hold one)"
                                     if h.get("unreadable") else "")
            # Each field escaped alone: a tab in a name cannot shift the columns either.
            print("\t".join(terminal_safe(str(v), keep="") for v in (h["pid"], h["comm"], node)))
    if report["note"]:
        to_stderr(f"gpuwatch: note: {report['note']}")


#: `json.dumps` with these arguments, made once: ``dumps`` makes a new encoder on each call
#: with any but its defaults, and a report asks the daemon a hundred things.
_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def compact(value: Any) -> str:
    """pydantic_core's compact JSON for plain JSON values: what the full command prints."""
    return _COMPACT.encode(value)


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


def ask(path: str, method: str, params: dict[str, Any]) -> Any:
    """The ``result`` of one request; raises OSError/ValueError on anything else."""
    return ask_many(path, [(method, params)])[0]


def ask_many(path: str, calls: Sequence[tuple[str, dict[str, Any]]]) -> list[Any]:
    """The ``result`` of each request, pipelined on one connection (the daemon answers a
    connection's requests in order): a report that needs a hundred answers pays one connect
    and a few round trips, not a hundred. Raises OSError/ValueError on anything else."""
    payload = b"".join(
        compact({"id": i, "method": method, "params": params}).encode() + b"\n"
        for i, (method, params) in enumerate(calls, 1))
    import socket  # here: without a daemon to ask, a command never needs it

    # One deadline for the whole answer, not one per read: a daemon that trickles a byte
    # now and then must not hold the command for ever.
    deadline = time.monotonic() + TIMEOUT
    lines: list[bytes] = []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(TIMEOUT)
            sock.connect(path)
            sock.settimeout(max(deadline - time.monotonic(), 0.001))  # the same one deadline
            sock.sendall(payload)
            framer = LineFramer(MAX_REPLY)
            while len(lines) < len(calls):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no answer from {path} within {TIMEOUT:g} s")
                sock.settimeout(left)
                chunk = sock.recv(1 << 16)
                if not chunk:
                    raise ConnectionError("the daemon closed the connection")
                lines.extend(framer.feed(chunk))
    except TimeoutError:
        UNANSWERED.add(path)
        raise
    results: list[Any] = []
    for i, line in enumerate(lines[:len(calls)], 1):
        if line is TOO_LONG:
            raise ValueError("reply too long")
        # Strict, as the client decodes: NaN, a duplicate key, a lone surrogate or nesting
        # past the bound is no answer (and no traceback, no invalid JSON printed).
        reply = strict_loads(line, max_depth=REPLY_MAX_DEPTH)
        if not isinstance(reply, dict) or reply.get("id") != i or "result" not in reply:
            raise ValueError("not a result")
        results.append(reply["result"])
    return results


def config_in_force() -> str | None:
    """The config file the full command reads (`gpuwatch.settings.config_file_path` without
    ``--config``, which this path never takes): ``$GPUWATCH_CONFIG``, else the default one
    when it exists."""
    return os.environ.get(CONFIG_ENV) or (
        DEFAULT_CONFIG_PATH if os.path.isfile(DEFAULT_CONFIG_PATH) else None)


def config_identity(path: str) -> list[int] | None:
    """`gpuwatch.settings.file_identity` of the file at ``path``, as JSON carries it, taken
    as the full command's loader opens it (links followed, a regular file checked before the
    open, read access): None where the full command could not read it (it says why)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except (OSError, ValueError):
        return None
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    finally:
        os.close(fd)
    if not stat.S_ISREG(st.st_mode):
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def served_root(served: Any, identity: list[int]) -> tuple[bool, str | None]:
    """What a daemon's ``config`` answer proves of the config file in force: whether it is
    the very file the daemon read and checked at start, unchanged since (its identity; the
    file is then valid: the daemon refuses to start on one a command would refuse), and if
    so the root that file gives a command without ``--root``: the daemon's, where it took it
    from the file, or ``/`` where the file names none (``root_from`` ``default``). A root
    the daemon took from a flag or its environment says nothing of the file's: None."""
    if not (isinstance(served, dict) and served.get("identity") == identity
            and _str(served.get("root"))):
        return False, None
    root: str = served["root"]
    return True, root if served.get("root_from") in ("file", "default") else None


def gives_root(argv: Sequence[str]) -> bool:
    """``--root`` on the command line: the command's root, whatever a config file names."""
    return any(word == "--root" or word.startswith("--root=") for word in argv)


def ask_proven(path: str, calls: Sequence[tuple[str, dict[str, Any]]], root: str,
               root_given: bool, explicit: str | None
               ) -> tuple[str, dict[str, Any] | None, list[Any]] | None:
    """`ask_many` ``calls`` of the daemon at ``path`` (asked for ``root``, through the
    socket ``explicit`` or the default one) for a command whose config file in force, if
    any, is not read here (that takes PyYAML). With one, the daemon's ``config`` is asked
    first on the same connection, and the answers count only when it is this very file,
    unchanged (`served_root`: the file is valid), and, without ``--root`` (``root_given``),
    its root is known from the daemon's and leads to the socket just asked (the full
    command's rule: the file's root is the command's). Returns the root the answers are for,
    the daemon's ``config`` answer (None without a file: nothing of it is the command's) and
    the answers; None: the full command's, which reads the file and refuses a bad one.
    Raises OSError/ValueError as `ask_many` does."""
    config = config_in_force()
    if config is None:
        return root, None, ask_many(path, calls)
    identity = config_identity(config)
    if identity is None:
        return None  # no regular file there: the full command says so
    # An older daemon answers ``config`` with unknown-method: no answer (ValueError).
    served, *answers = ask_many(path, [("config", {}), *calls])
    same, file_root = served_root(served, identity)
    if not same:
        return None  # not the file the daemon checked: the full command reads it
    if root_given:
        return root, served, answers
    if file_root is None or daemon_socket(file_root, explicit) != path:
        return None
    return file_root, served, answers


def run_fast(argv: Sequence[str]) -> int | None:
    """Answer ``gpuwatch probe|holders …`` through the daemon with the stdlib; None: not here.

    A config file in force is never read here (that takes PyYAML): the daemon is asked, on
    the same connection, which file it read and checked at start (``config``). Only when it
    is this very file, unchanged, is the answer printed: the file is valid, and its root is
    known. Anything else (another file, an edit since, a daemon without that method) is the
    full command's, which reads the file and refuses a bad one (docs/service.md)."""
    root_given = gives_root(argv)
    if ROOT_ENV in os.environ and not root_given:
        return None  # the host it names may not be the one the default socket's daemon watches
    probe = parse_probe(argv)
    holders = parse_holders(argv) if probe is None else None
    plan = parse_plan(argv) if probe is None and holders is None else None
    if probe is not None:
        method, params, root, explicit = "probe", probe[1], probe[2], probe[3]
    elif holders is not None:
        method, params, root, explicit = "holders", holders[0], holders[2], holders[3]
    elif plan is not None:
        method, params, root, explicit = "plan", plan[0], plan[2], plan[3]
    else:
        return None
    path = daemon_socket(root, explicit)
    if path is None:
        return None
    try:
        proven = ask_proven(path, [(method, params)], root, root_given, explicit)
        if proven is None:
            return None
        result = proven[2][0]
        if not (is_holders_report(result) if holders is not None
                else is_plan(result) if plan is not None
                else is_probe_result(params["action"], result)):
            return None
    except (OSError, ValueError):
        return None  # no answer, or an error reply: the full command decides what to do
    code = EXIT_OK
    with reader_may_leave():
        if probe is not None:
            print(compact({"action": probe[0], "result": result}))
        elif holders is not None:
            print_holders(result, holders[1], compact)
        elif plan is not None:
            code = print_plan(result, plan[1], compact)
        sys.stdout.flush()
    return code


def daemon_socket(root: str, explicit: str | None) -> str | None:
    """The daemon's socket for ``root`` when one exists there and has not already failed to
    answer in time; None sends the command the full way (which also reports a root that is
    not a folder)."""
    if not os.path.isdir(root):
        return None
    path = socket_path(root, explicit)
    return path if path is not None and os.path.exists(path) and path not in UNANSWERED \
        else None


@contextlib.contextmanager
def reader_may_leave() -> Iterator[None]:
    """A reader that closes the pipe early (``| head``) is no error: print nothing more."""
    try:
        yield
    except BrokenPipeError:
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the flush at exit


__all__ = ["PROBE_SHAPES", "UNANSWERED", "ask_proven", "compact", "config_identity",
           "config_in_force", "daemon_socket", "gives_root", "is_holders_report",
           "is_plan", "is_probe_result",
           "parse_holders", "parse_plan",
           "parse_probe", "print_holders", "print_plan", "reader_may_leave", "render_plan",
           "run_fast", "served_root", "socket_path"]
