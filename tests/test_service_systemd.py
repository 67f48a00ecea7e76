"""Running as a systemd service: the notify protocol on a real datagram socket, the watchdog,
``gpuwatch watch`` as the unit runs it, and the unit file itself."""

from __future__ import annotations

import configparser
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.service import protocol as P
from gpuwatch.service.notify import Notifier, sd_notify, watchdog_interval
from gpuwatch.service.testing import short_socket_dir
from gpuwatch.testing import SysRoot

REPO = Path(__file__).resolve().parent.parent
UNIT = REPO / "contrib/systemd/gpuwatch.service"


@pytest.fixture
def sockdir() -> Iterator[str]:
    with short_socket_dir() as path:
        yield path


@pytest.fixture
def notify_socket(sockdir: str) -> Iterator[tuple[socket.socket, str]]:
    """What systemd holds: an AF_UNIX datagram socket that the service writes states to."""
    path = f"{sockdir}/notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    yield sock, path
    sock.close()


def receive(sock: socket.socket, timeout: float = 10) -> str:
    sock.settimeout(timeout)
    return sock.recv(4096).decode()


def test_sd_notify_sends_one_datagram(notify_socket: tuple[socket.socket, str]) -> None:
    sock, path = notify_socket
    assert sd_notify("READY=1\nSTATUS=scanned", {"NOTIFY_SOCKET": path})
    assert receive(sock) == "READY=1\nSTATUS=scanned"
    notifier = Notifier({"NOTIFY_SOCKET": path})
    assert notifier.enabled and notifier.stopping()
    assert receive(sock) == "STOPPING=1"


def test_sd_notify_abstract_namespace() -> None:
    name = f"gpuwatch-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    try:
        assert sd_notify("READY=1", {"NOTIFY_SOCKET": "@" + name})
        assert receive(sock) == "READY=1"
    finally:
        sock.close()


def test_sd_notify_without_systemd_is_a_quiet_noop(sockdir: str) -> None:
    assert sd_notify("READY=1", {}) is False
    assert not Notifier({}).ready()
    assert sd_notify("READY=1", {"NOTIFY_SOCKET": f"{sockdir}/nobody"}) is False  # logged only


def test_watchdog_interval() -> None:
    me = str(os.getpid())
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": me}) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval({}) is None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_watch_is_ready_after_the_scan_with_the_socket_up_and_pings_the_watchdog(
    host: SysRoot, tmp_path: Path, sockdir: str, notify_socket: tuple[socket.socket, str]
) -> None:
    notify, notify_path = notify_socket
    fifo, log, api = tmp_path / "uevents", tmp_path / "events.jsonl", f"{sockdir}/gw.sock"
    os.mkfifo(fifo)
    port = free_port()
    env = {**os.environ, "NOTIFY_SOCKET": notify_path, "WATCHDOG_USEC": "200000"}
    env.pop("WATCHDOG_PID", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpuwatch",
            "watch",
            "--root",
            str(host.root),
            "--source",
            f"file:{fifo}",
            "--log",
            str(log),
            "--reconcile-interval",
            "0",
            "--socket",
            api,
            "--metrics",
            f"127.0.0.1:{port}",
            "--nfd-features",
            str(tmp_path / "features.d") + "/",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    try:
        with open(fifo, "w"):
            ready = receive(notify, timeout=30)
            # READY comes after the initial scan (the ready event is logged) and once the
            # socket listens: a client connecting right now is answered, no retry needed.
            assert ready.startswith("READY=1\nSTATUS=watching 7 PCI functions, 2 GPU(s)"), ready
            assert '"type":"ready"' in log.read_text()
            with socket.socket(socket.AF_UNIX) as c:
                c.settimeout(5)
                c.connect(api)
                c.sendall(
                    P.encode_request(1, "probe", {"action": "current-mode", "addr": "0000:01:00.0"})
                )
                assert json.loads(c.makefile("rb").readline()) == {"id": 1, "result": "nvidia"}
            pings = [receive(notify, timeout=5) for _ in range(3)]  # every 0.1 s
            assert pings == ["WATCHDOG=1"] * 3
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                assert "gpuwatch_pci_functions 7.0" in r.read().decode()
            deadline = time.monotonic() + 10
            while not (tmp_path / "features.d/gpuwatch").exists():
                assert time.monotonic() < deadline
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            states = []
            while "STOPPING=1" not in states:
                states.append(receive(notify, timeout=5))
            _, stderr = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr
    assert not os.path.exists(api)  # the socket file is removed on the way out


# --------------------------------------------------------------------------- the unit file


def unit() -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(UNIT.read_text())
    return parser


def test_unit_is_a_notify_service_with_watchdog_and_directories() -> None:
    service = unit()["Service"]
    assert service["Type"] == "notify"
    assert service["WatchdogSec"] == "30s"
    assert service["RuntimeDirectory"] == "gpuwatch"
    assert service["StateDirectory"] == "gpuwatch"
    assert service["LogsDirectory"] == "gpuwatch"
    exec_start = " ".join(service["ExecStart"].replace("\\\n", " ").split())
    assert exec_start == (
        "/usr/bin/gpuwatch watch --socket /run/gpuwatch/gpuwatch.sock "
        "--log /var/log/gpuwatch/events.jsonl"
    )
    assert P.DEFAULT_SOCKET_PATH in exec_start


def test_unit_restarts_what_may_bind_later_but_not_a_bad_configuration() -> None:
    from gpuwatch.errors import EXIT_RETRY, EXIT_USAGE

    service = unit()["Service"]
    assert service["Restart"] == "on-failure"
    assert service["RestartPreventExitStatus"].split() == [str(EXIT_USAGE)]
    assert str(EXIT_RETRY) not in service.get("SuccessExitStatus", "").split()
    for doc in ("service.md", "socket.md"):  # the table of exit codes is documented
        text = (REPO / "docs" / doc).read_text()
        assert f"| {EXIT_RETRY} |" in text and f"| {EXIT_USAGE} |" in text, doc


def test_unit_hardening_leaves_sysfs_modules_and_devices_usable() -> None:
    service = unit()["Service"]
    assert service["ProtectKernelTunables"] == "no"  # "yes" would make /sys read-only
    assert service["ProtectKernelModules"] == "no"  # "yes" would forbid modprobe
    assert service["PrivateDevices"] == "no"
    assert "ProtectClock" not in service  # implies a device allow-list
    assert "ProtectProc" not in service or service["ProtectProc"] == "default"
    caps = set(service["CapabilityBoundingSet"].split())
    assert {"CAP_SYS_MODULE", "CAP_SYS_ADMIN", "CAP_SYS_PTRACE", "CAP_NET_ADMIN"} <= caps
    assert "AF_NETLINK" in service["RestrictAddressFamilies"]
    # Every hardening choice is explained in the file, next to it.
    text = UNIT.read_text()
    for key in (
        "ProtectKernelTunables",
        "ProtectKernelModules",
        "PrivateDevices",
        "ProtectClock",
        "CapabilityBoundingSet",
        "RestrictAddressFamilies",
        "ReadWritePaths",
    ):
        before = text[: text.index(key)].rstrip().splitlines()[-1]
        assert before.lstrip().startswith("#"), key


def test_unit_lets_the_documented_nfd_default_be_written() -> None:
    from gpuwatch.service.nfd import NFD_FEATURES_DIR

    writable = [p.lstrip("-") for p in unit()["Service"]["ReadWritePaths"].split()]
    assert NFD_FEATURES_DIR in writable  # ProtectSystem=strict makes the rest of /etc read-only
    docs = (REPO / "docs" / "service.md").read_text()
    assert f"gpuwatch watch --socket --nfd-features {NFD_FEATURES_DIR}/" in docs
    for path in writable:
        assert path in docs, path  # the docs name every writable path the unit grants


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    copy = tmp_path / "gpuwatch.service"  # verify wants ExecStart to exist: point it at true
    copy.write_text(
        UNIT.read_text().replace("/usr/bin/gpuwatch", shutil.which("true") or "/bin/true")
    )
    proc = subprocess.run(
        ["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=60
    )
    complaints = [
        line for line in (proc.stdout + proc.stderr).splitlines() if "gpuwatch.service" in line
    ]
    assert proc.returncode == 0 and complaints == [], proc.stderr


def test_the_unit_may_write_where_a_switch_puts_the_cdi_spec() -> None:
    from gpuwatch.core.plan import CDI_OUTPUT
    from gpuwatch.service.install import CDI_DIR

    writable = [p.lstrip("-") for p in unit()["Service"]["ReadWritePaths"].split()]
    assert "/" + os.path.dirname(CDI_OUTPUT) == CDI_DIR and CDI_DIR in writable
