"""A switch whose process is killed with SIGKILL half-way, then `recover` or the next switch.

SIGKILL runs nothing: no roll-back, no override cleared, no ``switch-failed``. The child is a
real ``python -m gpuwatch mode`` (or ``watch --socket`` daemon) on a fixture root with the
simulated kernel, stopped for ever right after one chosen write or command (``pause_on``) and
killed there. What must hold afterwards: the next watcher or switch says the earlier switch
ended (``switch-failed``, ``abandoned``, after its ``switch-started`` in the same log), and
`recover` (or the next switch) leaves the group wholly in one mode with no function pinned
to a driver by a ``driver_override`` vfio mode never leaves.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from daemon_helpers import P, connect, env, gpuwatch_cmd
from test_switch_interrupt import AFTER, AUDIO, BEFORE, NV, drivers, sim_daemon

from gpuwatch.testing import SysRoot
from gpuwatch.testing.simkernel import SIMKERNEL_ENV, SimKernel, save_for_subprocess
from gpuwatch.watch.eventlog import read_events

OVR = "/sys/bus/pci/devices/{}/driver_override"
PROBE = "/sys/bus/pci/drivers_probe"

#: Where a switch to vfio from nvidia (the example host) is killed: right after...
TO_VFIO: dict[str, tuple[str, ...]] = {
    "nvidia-unloaded": ("command", "modprobe", "-r", "nvidia"),
    "display-override": ("write", OVR.format(NV), "vfio-pci"),
    "display-bound": ("write", PROBE, NV),
    "audio-unbound": ("write", "/sys/bus/pci/drivers/snd_hda_intel/unbind", AUDIO),
    "audio-bound": ("write", PROBE, AUDIO),  # all on vfio-pci, the audio still pinned
}
#: ... and a switch to nvidia from vfio.
TO_NVIDIA: dict[str, tuple[str, ...]] = {
    "nvidia-loaded": ("command", "modprobe", "nvidia"),
    "display-unbound": ("write", "/sys/bus/pci/drivers/vfio-pci/unbind", NV),
    "display-override": ("write", OVR.format(NV), "nvidia"),
    "display-bound": ("write", PROBE, NV),
    "audio-bound": ("write", PROBE, AUDIO),
}


def overrides(host: SysRoot) -> dict[str, str]:
    """Each function's driver_override as the kernel shows it ("" for none)."""
    out = {}
    for addr in (NV, AUDIO):
        path = host.root / "sys/bus/pci/devices" / addr / "driver_override"
        text = path.read_text().strip() if path.exists() else ""
        out[addr] = "" if text == "(null)" else text
    return out


def gw(host: SysRoot, tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        gpuwatch_cmd(*argv, "--addr", NV, "--root", str(host.root), "--log",
                     str(tmp_path / "events.jsonl"), "--timeout", "30", "--json"),
        capture_output=True, text=True, timeout=90,
        env={**env(), SIMKERNEL_ENV: str(tmp_path / "simkernel.pickle")})


def wait_for(path: Path, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the step never came"
        time.sleep(0.005)


def killed_at(host: SysRoot, tmp_path: Path, mode: str, step: tuple[str, ...],
              sim: SimKernel | None = None) -> None:
    """Run ``gpuwatch mode MODE`` to the end of ``step``, then SIGKILL it."""
    saved = tmp_path / "simkernel.pickle"
    if sim is not None:
        save_for_subprocess(sim, saved)
    with open(saved, "rb") as fh:
        import pickle

        data = pickle.load(fh)
    data["sim"].pause_on = step
    data["sim"].pause_marker = str(tmp_path / "paused")
    with open(saved, "wb") as fh:
        pickle.dump(data, fh)
    proc = subprocess.Popen(
        gpuwatch_cmd("mode", mode, "--addr", NV, "--root", str(host.root), "--log",
                     str(tmp_path / "events.jsonl"), "--timeout", "30", "--no-daemon"),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**env(), SIMKERNEL_ENV: str(saved)})
    try:
        wait_for(tmp_path / "paused", proc)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    (tmp_path / "paused").unlink()


def ends(events: list[dict[str, Any]]) -> list[str]:
    """Each switch-started's end, in order, checking every one has exactly one after it."""
    out, open_ = [], 0
    for e in events:
        if e["type"] == "switch-started":
            assert open_ == 0, [x["type"] for x in events]
            open_ = 1
        elif e["type"] in ("switch-completed", "switch-failed") and open_:
            open_ = 0
            out.append(e["error"].split(":")[0] if e["type"] == "switch-failed" else "completed")
    assert open_ == 0, [x["type"] for x in events]
    return out


def to_vfio_first(host: SysRoot, tmp_path: Path) -> None:
    save_for_subprocess(SimKernel(host), tmp_path / "simkernel.pickle")
    done = gw(host, tmp_path, "mode", "vfio")
    assert done.returncode == 0, done.stderr
    assert drivers(host) == AFTER and overrides(host) == {NV: "", AUDIO: ""}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("then", ["recover", "mode"])
@pytest.mark.parametrize("step", list(TO_VFIO))
def test_sigkill_mid_switch_to_vfio(host: SysRoot, tmp_path: Path, step: str,
                                    then: str) -> None:
    killed_at(host, tmp_path, "vfio", TO_VFIO[step], SimKernel(host))
    assert drivers(host) != BEFORE  # the kill left the group changed
    after = gw(host, tmp_path, *(["recover"] if then == "recover" else ["mode", "vfio"]))
    assert after.returncode == 0, after.stderr
    # Whole, on vfio-pci, and pinned by nothing: vfio mode leaves no override.
    assert drivers(host) == AFTER
    assert overrides(host) == {NV: "", AUDIO: ""}, step
    events = list(read_events(tmp_path / "events.jsonl"))
    assert ends(events) == ["abandoned", "completed"], [e["type"] for e in events]
    abandoned = next(e for e in events if e["type"] == "switch-failed")
    assert (abandoned["to_mode"], abandoned["wedged"], abandoned["group"]) == ("vfio", False, 13)
    # And the next switch goes back as from a switch that completed.
    back = gw(host, tmp_path, "mode", "nvidia")
    assert back.returncode == 0, back.stderr
    assert drivers(host) == BEFORE
    assert overrides(host) == {NV: "nvidia", AUDIO: "snd_hda_intel"}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("step", list(TO_NVIDIA))
def test_sigkill_mid_switch_to_nvidia_then_recover(host: SysRoot, tmp_path: Path,
                                                   step: str) -> None:
    to_vfio_first(host, tmp_path)
    killed_at(host, tmp_path, "nvidia", TO_NVIDIA[step])
    after = gw(host, tmp_path, "recover")
    assert after.returncode == 0, after.stderr
    assert drivers(host) == AFTER
    assert overrides(host) == {NV: "", AUDIO: ""}, step
    events = list(read_events(tmp_path / "events.jsonl"))
    assert ends(events) == ["completed", "abandoned", "completed"], [e["type"] for e in events]
    again = gw(host, tmp_path, "mode", "nvidia")
    assert again.returncode == 0, again.stderr
    assert drivers(host) == BEFORE


@pytest.mark.timeout(120)
def test_in_mode_after_a_kill_is_no_answer_until_the_pin_is_cleared(
        host: SysRoot, tmp_path: Path) -> None:
    """Killed after the audio function's bind, before its override was cleared: the group
    reads as vfio, but the audio function is pinned. `plan vfio` shows the clearing write;
    `mode vfio` (root) makes it and says so."""
    killed_at(host, tmp_path, "vfio", TO_VFIO["audio-bound"], SimKernel(host))
    assert drivers(host) == AFTER and overrides(host)[AUDIO] == "vfio-pci"
    plan = subprocess.run(
        gpuwatch_cmd("plan", "vfio", "--addr", NV, "--root", str(host.root), "--json"),
        capture_output=True, text=True, timeout=60, env=env())
    assert plan.returncode == 0, plan.stderr
    steps = json.loads(plan.stdout)["steps"]
    # Both functions the killed switch may have pinned: the switch never reads an override
    # (the read takes the device lock), it clears each one blindly.
    assert [(s.get("path"), s.get("value")) for s in steps] == [
        (OVR.format(NV), "\n"), (OVR.format(AUDIO), "\n")], steps
    done = gw(host, tmp_path, "mode", "vfio")
    assert done.returncode == 0, done.stderr
    assert overrides(host) == {NV: "", AUDIO: ""}
    assert any("killed" in n for n in json.loads(done.stdout)["notes"]), done.stdout


@pytest.mark.timeout(180)
def test_a_daemon_killed_mid_switch_is_reported_by_the_next_daemon(
        host: SysRoot, tmp_path: Path) -> None:
    """SIGKILL to ``watch --socket`` while its socket client's switch is half way: the next
    daemon on the same log publishes the end of that switch after its ``ready``, and writes
    nothing to the host for it; `recover` then brings the group whole."""
    sim = SimKernel(host)
    sim.pause_on = TO_VFIO["display-bound"]
    sim.pause_marker = str(tmp_path / "paused")
    saved = tmp_path / "simkernel.pickle"
    save_for_subprocess(sim, saved)
    log, sock = tmp_path / "events.jsonl", str(tmp_path / "gw.sock")

    def daemon() -> subprocess.Popen[str]:
        proc, writer = sim_daemon(host, saved, log, sock, tmp_path / f"ue{time.monotonic_ns()}")
        proc.fifo = writer  # type: ignore[attr-defined]
        return proc

    def readies() -> int:
        return sum(e["type"] == "ready" for e in read_events(log)) if log.exists() else 0

    first = daemon()
    try:
        deadline = time.monotonic() + 60
        while readies() < 1:
            assert first.poll() is None and time.monotonic() < deadline, first.stderr
            time.sleep(0.02)
        client = connect(sock, timeout=60)
        client.sendall(P.encode_request(1, "switch", {"addr": NV, "mode": "vfio"}))
        wait_for(tmp_path / "paused", first)
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=30)
        client.close()
    finally:
        first.fifo.close()  # type: ignore[attr-defined]
        if first.poll() is None:
            first.kill()
            first.communicate()
    with open(saved, "rb") as fh:
        import pickle

        writes = len(pickle.load(fh)["sim"].record)
    os.unlink(sock)
    second = daemon()
    try:
        deadline = time.monotonic() + 60
        while readies() < 2 or not any(e["type"] == "switch-failed" for e in read_events(log)):
            assert second.poll() is None and time.monotonic() < deadline, list(read_events(log))
            time.sleep(0.02)
        second.send_signal(signal.SIGTERM)
        second.communicate(timeout=60)
    finally:
        second.fifo.close()  # type: ignore[attr-defined]
        if second.poll() is None:
            second.kill()
            second.communicate()
    events = list(read_events(log))
    types = [e["type"] for e in events]
    assert ends(events) == ["abandoned"], types
    # Its end comes in the second run, after that run's ready.
    assert types.index("switch-failed") > [i for i, t in enumerate(types) if t == "ready"][1]
    failed = events[types.index("switch-failed")]
    assert failed["error"].startswith("abandoned: "), failed
    assert f"{NV} on vfio-pci" in failed["restored"][0], failed
    with open(saved, "rb") as fh:
        assert len(pickle.load(fh)["sim"].record) == writes  # the start-up wrote nothing
    assert overrides(host)[NV] == "vfio-pci"  # as the killed switch left it...
    rec = gw(host, tmp_path, "recover")
    assert rec.returncode == 0, rec.stderr
    assert drivers(host) == AFTER and overrides(host) == {NV: "", AUDIO: ""}
    # ... and reported once only: the recover's own run does not say it again.
    assert ends(list(read_events(log))) == ["abandoned", "completed"]
