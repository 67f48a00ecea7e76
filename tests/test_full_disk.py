"""A real daemon whose log's disk fills up (a real tmpfs, really full): the model, the socket
and the metrics go on, subscribers hear `log-degraded`, the metric says so, and when space
returns the log resumes with a `log-gap` record naming exactly the seqs it misses."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_helpers import Daemon, Lines, connect, probe

from gpuwatch.service.testing import short_socket_dir
from gpuwatch.testing import SysRoot
from gpuwatch.watch.eventlog import read_events

NV_AUDIO = "0000:01:00.1"

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount") is None,
                                reason="needs root to mount a small tmpfs")


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A 512 KiB tmpfs: small enough to fill in a moment."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount tmpfs here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def sockdir() -> Iterator[str]:
    with short_socket_dir() as path:
        yield path


def fill(disk: Path) -> Path:
    """Take every free byte (as root, past the reserve: tmpfs has none)."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (65536, 4096, 512, 1):  # down to the last byte
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def toggle(d: Daemon, host: SysRoot, n: int) -> None:
    """Rebind the audio function (vfio-pci <-> snd_hda_intel): one driver-changed each."""
    driver = "vfio-pci" if n % 2 == 0 else "snd_hda_intel"
    host.bind(NV_AUDIO, driver)
    d.push(host.uevent_props("bind", NV_AUDIO))


def events_until(lines: Lines, etype: str) -> list[dict[str, object]]:
    got = []
    while True:
        event = lines.line()
        got.append(event)
        if event.get("type") == etype:
            return got


def test_a_full_disk_degrades_the_log_not_the_daemon(
    host: SysRoot, tmp_path: Path, disk: Path, sockdir: str
) -> None:
    port = free_port()
    log = disk / "events.jsonl"
    with Daemon(host.root, tmp_path, f"{sockdir}/gw.sock", "--metrics", f"127.0.0.1:{port}",
                log=log) as d, connect(d.sock) as sub:
        lines = Lines(sub)
        assert "result" in lines.request("subscribe")
        assert metric(port, "gpuwatch_log_degraded") == 0
        filler = fill(disk)
        # The log's last page may still have room: events go on until a write fails.
        got: list[dict[str, object]] = []
        for n in range(2000):
            toggle(d, host, n)
            got += events_until(lines, "driver-changed")
            sub.settimeout(0.05)
            try:
                got += events_until(lines, "log-degraded")
                break
            except TimeoutError:
                pass
            finally:
                sub.settimeout(10)
        degraded = got[-1]
        assert degraded.get("type") == "log-degraded", got[-3:]
        assert degraded["path"] == str(log) and "ENOSPC" in str(degraded["error"])
        assert metric(port, "gpuwatch_log_degraded") == 1
        assert metric(port, "gpuwatch_log_write_failures_total") >= 1
        # The daemon serves on: probes answer, events flow to subscribers.
        assert probe(d.sock)["result"] is True
        toggle(d, host, n + 1)
        assert events_until(lines, "driver-changed")[-1]["new"] == (
            "snd_hda_intel" if n % 2 == 0 else "vfio-pci")
        missing_to = degraded["seq"]
        # Space returns; after the backoff (1 s, then 2 s) the next event resumes the log.
        filler.unlink()
        deadline = time.monotonic() + 30
        n += 2
        while not any(e["type"] == "log-gap" for e in read_events(log)):
            assert time.monotonic() < deadline, "the log did not resume"
            time.sleep(1.1)
            toggle(d, host, n)
            n += 1
        assert metric(port, "gpuwatch_log_degraded") == 0
    on_disk = list(read_events(log))
    seqs = [e["seq"] for e in on_disk]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    gap = next(e for e in on_disk if e["type"] == "log-gap")
    before = [e for e in on_disk if e["seq"] < gap["first_seq"]]
    assert before and before[-1]["seq"] == gap["first_seq"] - 1  # nothing lost silently
    assert gap["first_seq"] <= int(missing_to) <= gap["last_seq"] == gap["seq"]
    after = [e for e in on_disk if e["seq"] > gap["seq"]]
    assert after and after[0]["seq"] == gap["last_seq"] + 1
    assert on_disk[-1]["type"] == "stopped"
    # No line was torn or fused by the failed writes.
    assert all(line.count('"seq"') == 1 for line in log.read_text().splitlines())


def test_a_daemon_starts_and_serves_on_a_full_disk(
    host: SysRoot, tmp_path: Path, disk: Path, sockdir: str
) -> None:
    port = free_port()
    log = disk / "events.jsonl"
    log.write_text("")  # an existing (empty) log, as after a logrotate
    fill(disk)
    with Daemon(host.root, tmp_path, f"{sockdir}/gw.sock", "--metrics", f"127.0.0.1:{port}",
                log=log, ready_by_socket=True) as d:
        assert probe(d.sock, "current-mode", addr="0000:01:00.0")["result"] == "nvidia"
        assert metric(port, "gpuwatch_log_degraded") == 1
    assert d.proc is not None and d.proc.returncode == 0, d.stderr
    assert list(read_events(log)) == []  # nothing could be written, nothing half-written
