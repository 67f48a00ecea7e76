"""Find the shell and Python examples in README.md, docs/ and contrib/, and run them against a
fixture root.

The convention (README.md, "Development"): an HTML comment on the line right before a code
fence says how its example runs; without one, a ``sh``/``bash``/``shell`` or ``python`` block
runs as it is, and must succeed.

    <!-- doc-test: WORD [WORD …] (optional reason) -->

- ``host``: needs a real GPU host, a cluster, or changes the host (installs, systemctl,
  groupadd, switching a real GPU). Not run; its ``gpuwatch`` command lines are still parsed
  by the real argument parser, so a renamed flag still fails.
- ``daemon``: a gpuwatch daemon serves the fixture host at ``/run/gpuwatch/gpuwatch.sock``
  (its event log ``/var/log/gpuwatch/events.jsonl``), switching through a simulated kernel,
  while a NIC's driver keeps changing (a steady stream of events).
- ``each-line``: every command line runs on its own (a block of independent commands).
- ``until-stopped``: the example runs until stopped (a watcher, a follower, a subscriber):
  it passes if it is still running, with no error on stderr, after a few seconds (or has
  finished with exit 0); then it is stopped with SIGTERM.

Every run happens in a fresh temporary folder holding the fixture host (``SysRoot``'s example
workstation: NVIDIA 0000:01:00.0 + HDMI audio, Intel iGPU, NIC). The host paths gpuwatch uses
(``/run/gpuwatch``, ``/var/log/gpuwatch``, ``/etc/gpuwatch``, NFD's ``features.d``, …) are
moved into that folder in the example's text, ``gpuwatch`` on ``PATH`` adds ``--root`` for the
fixture to every command that takes one (and refuses ``--root /``), ``sudo`` just runs its
command, and Python examples see ``root="/"`` as the fixture and get uevents from a simulated
kernel. Nothing touches the real host.
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
PAGES = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
         *sorted((REPO / "contrib").rglob("*.md")))
MARKERS = frozenset({"host", "daemon", "each-line", "until-stopped"})
SHELL = frozenset({"sh", "bash", "shell"})
PYTHON = frozenset({"python", "py", "python3"})
#: Host paths moved into the run's folder, longest first.
HOST_PATHS = (
    "/etc/kubernetes/node-feature-discovery",
    "/etc/systemd/system",
    "/etc/udev/rules.d",
    "/var/log/gpuwatch",
    "/var/lib/gpuwatch",
    "/run/gpuwatch",
    "/etc/gpuwatch",
)
#: Seconds an until-stopped example must stay up.
UNTIL_STOPPED_WAIT = 3.0
#: Bound of one example that should finish.
FINISH_TIMEOUT = 90.0

_MARKER_RE = re.compile(r"^<!--\s*doc-test:\s*([a-z\- ]+?)\s*(?:\((.*)\))?\s*-->\s*$")
_FENCE_RE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```\s*$", re.S | re.M)


@dataclass(frozen=True)
class Example:
    page: Path
    line: int
    lang: str  # "sh" or "python"
    code: str
    markers: frozenset[str] = field(default_factory=frozenset)
    reason: str = ""

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


class BadMarker(ValueError):
    pass


def collect(pages: tuple[Path, ...] = PAGES) -> list[Example]:
    out: list[Example] = []
    for page in pages:
        text = page.read_text()
        for match in _FENCE_RE.finditer(text):
            lang = match.group(1).lower()
            kind = "sh" if lang in SHELL else "python" if lang in PYTHON else None
            line = text.count("\n", 0, match.start()) + 1
            before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            markers: frozenset[str] = frozenset()
            reason = ""
            if "doc-test" in before:
                m = _MARKER_RE.match(before.strip())
                if m is None:
                    raise BadMarker(f"{page.name}:{line}: cannot read {before.strip()!r}")
                markers = frozenset(m.group(1).split())
                reason = m.group(2) or ""
                unknown = markers - MARKERS
                if unknown:
                    raise BadMarker(f"{page.name}:{line}: unknown doc-test word(s) "
                                    f"{sorted(unknown)} (known: {sorted(MARKERS)})")
            if kind is None:
                continue
            out.append(Example(page, line, kind, match.group(2), markers, reason))
    return out


# --------------------------------------------------------------------------- python text


def gpuwatch_names(code: str, where: str) -> list[str]:
    """The ``gpuwatch.NAME`` attributes a Python example uses, in order. The example must
    compile (top-level ``await`` and ``async with`` allowed: a snippet of a coroutine's body
    is how a host example shows a call); a syntax error raises."""
    tree = compile(code, where, "exec",
                   flags=ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    return [node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "gpuwatch"]


# --------------------------------------------------------------------------- shell text


def logical_lines(code: str) -> list[str]:
    """Command lines: continuations (``\\``, a trailing ``&&``, ``||`` or ``|``) joined,
    blank and comment-only lines dropped."""
    out: list[str] = []
    pending = ""
    for raw in code.splitlines():
        line = pending + raw
        stripped = line.rstrip()
        if stripped.endswith("\\"):
            pending = stripped[:-1] + " "
            continue
        if re.search(r"(&&|\|\||\|)\s*$", stripped):
            pending = stripped + " "
            continue
        pending = ""
        if stripped.strip() and not stripped.strip().startswith("#"):
            out.append(stripped)
    if pending.strip():
        out.append(pending)
    return out


_OPERATORS = {"&&", "||", ";", "|", "&", "(", ")", "{", "}", "$(", "`"}


def gpuwatch_commands(code: str) -> list[list[str]]:
    """Every ``gpuwatch …`` argument list in the shell text (after sudo, up to an operator
    or a redirection)."""
    found: list[list[str]] = []
    for line in logical_lines(code):
        lexer = shlex.shlex(line, posix=True, punctuation_chars="();&|<>")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        try:
            tokens = list(lexer)
        except ValueError:
            continue
        command: list[str] = []
        for tok in [*tokens, ";"]:
            if tok in _OPERATORS or set(tok) <= set("();&|"):
                _take(command, found)
                command = []
            else:
                command.append(tok)
    return found


def _take(command: list[str], found: list[list[str]]) -> None:
    words = list(command)
    while words and (words[0] == "sudo" or re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0])):
        words.pop(0)
    if not words or not (words[0] == "gpuwatch" or words[0].endswith("/gpuwatch")):
        return
    args: list[str] = []
    for word in words[1:]:
        if set(word) <= set("<>") or word.startswith((">", "<", "2>")):
            break
        args.append(word)
    found.append(args)


# --------------------------------------------------------------------------- running


@dataclass
class Place:
    """Where one example runs: its folder, the fixture root, the moved host paths."""

    folder: Path
    root: Path
    socket: str
    log: str
    bin: Path = field(init=False)

    def __post_init__(self) -> None:
        self.bin = self.folder / "bin"
        self.bin.mkdir(parents=True, exist_ok=True)
        (self.folder / "work").mkdir(exist_ok=True)
        for host_path in HOST_PATHS:
            self.moved(host_path).mkdir(parents=True, exist_ok=True)
        shims = {
            "gpuwatch": f'exec "{sys.executable}" "{TESTS / "doc_shim.py"}" "$@"',
            "sudo": 'exec "$@"',
            "python3": f'exec "{sys.executable}" "$@"',
            "python": f'exec "{sys.executable}" "$@"',
        }
        for name, body in shims.items():
            path = self.bin / name
            path.write_text(f"#!/bin/sh\n{body}\n")
            path.chmod(0o755)

    def moved(self, host_path: str) -> Path:
        return self.folder / host_path.lstrip("/")

    def rewrite(self, code: str) -> str:
        for host_path in HOST_PATHS:
            code = re.sub(re.escape(host_path) + r"(?=[/\s'\"]|$)", str(self.moved(host_path)),
                          code)
        return code

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("GPUWATCH_") and k != "PYTEST_CURRENT_TEST"}
        env.update(
            PATH=f"{self.bin}:{env.get('PATH', '/usr/bin:/bin')}",
            PYTHONPATH=str(REPO) + (os.pathsep + env["PYTHONPATH"] if "PYTHONPATH" in env
                                    else ""),
            GPUWATCH_SOCKET=self.socket,
            GPUWATCH_DOC_ROOT=str(self.root),
            GPUWATCH_DOC_SOCKET=self.socket,
            GPUWATCH_DOC_ETC=str(self.moved("/etc/gpuwatch")),
        )
        return env


@dataclass
class Outcome:
    code: int | None  # None: still running when stopped (until-stopped)
    stdout: str
    stderr: str
    script: str


def run_script(place: Place, example: Example, script: str, *, until_stopped: bool) -> Outcome:
    """Run one shell script or Python program (blocking: call it from a worker thread)."""
    if example.lang == "python":
        program = place.folder / "work" / "example.py"
        program.write_text(script)
        argv = [sys.executable, str(TESTS / "doc_python.py"), str(program)]
    else:
        argv = ["bash", "-c", "set -e -o pipefail\n" + script]
    proc = subprocess.Popen(argv, cwd=place.folder / "work", env=place.env(),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=UNTIL_STOPPED_WAIT if until_stopped
                                    else FINISH_TIMEOUT)
        return Outcome(proc.returncode, out, err, script)
    except subprocess.TimeoutExpired:
        _stop(proc)
        out, err = proc.communicate(timeout=30)
        if until_stopped:
            return Outcome(None, out, err, script)
        return Outcome(-1, out, err + f"\n(did not finish in {FINISH_TIMEOUT:g} s)", script)
    finally:
        if proc.poll() is None:
            _stop(proc, signal.SIGKILL)


def _stop(proc: subprocess.Popen[str], sig: int = signal.SIGTERM) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=\S*")


def scripts(example: Example, place: Place) -> list[str]:
    """What to run: the whole block, or (each-line) each command line, with the block's
    plain variable assignments (``S=/run/…``) in front of every later line."""
    code = place.rewrite(example.code)
    if example.lang != "sh" or "each-line" not in example.markers:
        return [code]
    prelude: list[str] = []
    out: list[str] = []
    for line in logical_lines(code):
        if _ASSIGNMENT.fullmatch(line.strip()):
            prelude.append(line.strip())
        else:
            out.append("\n".join([*prelude, line]))
    return out


def failure(outcome: Outcome, *, until_stopped: bool) -> str | None:
    """Why this run failed, or None."""
    if until_stopped and outcome.code is None:
        if re.search(r"Traceback|[Ee]rror", outcome.stderr):
            return f"an error while running:\n{outcome.stderr}"
        return None
    if outcome.code != 0:
        return (f"exit {outcome.code}\n--- stdout\n{outcome.stdout}\n--- stderr\n"
                f"{outcome.stderr}")
    return None
