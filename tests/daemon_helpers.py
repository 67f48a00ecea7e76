"""A real ``gpuwatch watch`` daemon in a subprocess, for the attack tests: its own process,
a real unix socket, a real log file, uevents pushed through a FIFO (``--source file:``) or
the real kernel (``--source kernel``)."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from gpuwatch.service import protocol as P
from gpuwatch.watch.eventlog import read_events

REPO = Path(__file__).resolve().parent.parent


def gpuwatch_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "gpuwatch", *args]


def env() -> dict[str, str]:
    """The worktree's code for the child, never an installed copy."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("GPUWATCH_")}
    e["PYTHONPATH"] = str(REPO)
    e.pop("NOTIFY_SOCKET", None)
    return e


class Daemon:
    """``gpuwatch watch --socket`` over a fixture root; `start` returns once the log says
    ``ready`` (which, by contract, is after the socket listens)."""

    def __init__(self, root: Path, workdir: Path, sock: str, *args: str,
                 source: str = "fifo", log: Path | None = None,
                 ready_by_socket: bool = False, nofile: tuple[int, int] | None = None,
                 launcher: list[str] | None = None, root_flag: bool = True,
                 environ: dict[str, str] | None = None) -> None:
        self.root, self.workdir, self.sock = root, workdir, sock
        self.log = log if log is not None else workdir / "events.jsonl"
        #: Ready when the socket answers (a daemon on a full disk logs no `ready`).
        self.ready_by_socket = ready_by_socket
        self.fifo = workdir / "uevents.fifo"
        self.args = args
        self.source = source
        self.proc: subprocess.Popen[str] | None = None
        self._fifo: IO[str] | None = None
        self.stderr = ""
        #: RLIMIT_NOFILE (soft, hard) the daemon starts with (None: inherited).
        self.nofile = nofile
        #: What runs ``gpuwatch`` (default ``python -m gpuwatch``).
        self.launcher = launcher
        #: False: no ``--root`` (the root comes from the config file in ``args``, or ``/``).
        self.root_flag = root_flag
        #: Set in the daemon's environment over `env` (``NOTIFY_SOCKET``, ``WATCHDOG_USEC``).
        self.environ = environ or {}

    def start(self, timeout: float = 30) -> Daemon:
        spec = self.source
        if spec == "fifo":
            if not self.fifo.exists():
                os.mkfifo(self.fifo)
            spec = f"file:{self.fifo}"
        before = self.seq()
        launcher = self.launcher if self.launcher is not None else gpuwatch_cmd()
        self.proc = subprocess.Popen(
            [*launcher, "watch", *(("--root", str(self.root)) if self.root_flag else ()),
             "--source", spec, "--log",
             str(self.log), "--reconcile-interval", "0", "--socket", self.sock, *self.args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={**env(), **self.environ},
            cwd=REPO, preexec_fn=self._limits if self.nofile is not None else None)
        if self.source == "fifo":
            self._fifo = open(self.fifo, "w")  # noqa: SIM115 - closed in stop()
        deadline = time.monotonic() + timeout
        while not (self._answers() if self.ready_by_socket else
                   any(e["type"] == "ready" and e["seq"] > before for e in self.events())):
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited {self.proc.returncode}: "
                                     f"{self.proc.stderr.read() if self.proc.stderr else ''}")
            assert time.monotonic() < deadline, "daemon not ready in time"
            time.sleep(0.02)
        return self

    def _limits(self) -> None:  # in the child, before exec
        assert self.nofile is not None
        resource.setrlimit(resource.RLIMIT_NOFILE, self.nofile)

    def fds(self) -> int:
        """File descriptors the daemon holds now."""
        assert self.proc is not None
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def _answers(self) -> bool:
        try:
            return "result" in probe(self.sock)
        except OSError:
            return False

    def push(self, props: dict[str, str]) -> None:
        assert self._fifo is not None
        self._fifo.write(json.dumps(props) + "\n")
        self._fifo.flush()

    def events(self) -> list[dict[str, Any]]:
        # A log written into a FIFO or a device is not read back (readers refuse it).
        return list(read_events(self.log)) if self.log.is_file() else []

    def seq(self) -> int:
        events = self.events()
        return events[-1]["seq"] if events else 0

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            _, self.stderr = self.proc.communicate(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.communicate()
            if self._fifo is not None:
                with contextlib.suppress(BrokenPipeError):
                    self._fifo.close()
                self._fifo = None
        return self.proc.returncode

    def __enter__(self) -> Daemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def connect(path: str, timeout: float = 10) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
    except OSError:
        s.close()
        raise
    return s


class Lines:
    """Reply lines of one connection, decoded strictly (no NaN, no duplicate keys)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def line(self) -> Any:
        return P.loads(self.raw()[:-1], max_depth=64)

    def raw(self) -> bytes:
        """The next line as sent, undecoded, with its newline."""
        while b"\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError("connection closed")
            self.buf += chunk
        raw, _, self.buf = self.buf.partition(b"\n")
        return raw + b"\n"

    def eof(self) -> bool:
        """True when the daemon closes the connection (after any lines left)."""
        try:
            while True:
                chunk = self.sock.recv(65536)
                if not chunk:
                    return True
                self.buf += chunk
        except ConnectionResetError:
            return True

    def request(self, method: str, params: dict[str, Any] | None = None, rid: Any = 1) -> Any:
        self.sock.sendall(P.encode_request(rid, method, params))
        return self.line()


def probe(path: str, action: str = "detect-gpu", **params: Any) -> Any:
    with connect(path) as s:
        return Lines(s).request("probe", {"action": action, **params})
