"""`gpuwatch mode` interrupted by SIGTERM or SIGINT, as a real process on a fixture root.

The child is ``python -m gpuwatch mode vfio --root FIXTURE --log LOG`` with the simulated
kernel (saved by the test, loaded through the test-only ``GPUWATCH_TESTING_SIMKERNEL``), each
step slowed down so that the signal can land before the switch, between its steps, or while
it waits for the kernel's bind events. Whatever the moment, the log and the tree must show:
every ``switch-started`` ended by ``switch-failed`` ("interrupted") or ``switch-completed``,
and the group wholly in one mode, the one it started from after an interruption.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import pytest
from daemon_helpers import P, connect, env, gpuwatch_cmd

import gpuwatch
from gpuwatch.testing import SysRoot
from gpuwatch.testing.simkernel import SIMKERNEL_ENV, SimKernel, save_for_subprocess
from gpuwatch.watch.eventlog import read_events

NV, AUDIO = "0000:01:00.0", "0000:01:00.1"
BEFORE = {NV: "nvidia", AUDIO: "snd_hda_intel"}
AFTER = {NV: "vfio-pci", AUDIO: "vfio-pci"}


def driver(host: SysRoot, addr: str) -> str:
    link = host.root / "sys/bus/pci/devices" / addr / "driver"
    try:  # one read: the simulated kernel may unbind between a check and a read
        return os.path.basename(os.readlink(link))
    except FileNotFoundError:
        return ""


def drivers(host: SysRoot) -> dict[str, str]:
    """The group's drivers as a fresh scan of the tree sees them."""
    model = gpuwatch.scan(host.root)
    return {f.addr: f.driver for f in model.functions() if f.addr in (NV, AUDIO)}


# When to send the signal: a condition on the log and the tree, polled every few ms.
Moment = Callable[[SysRoot, Path], bool]


def watcher_up(host: SysRoot, log: Path) -> bool:
    """The command's own watcher has opened its log: before (or at) the switch's start."""
    return Path(f"{log}.lock").exists()


def nvidia_unloaded(host: SysRoot, log: Path) -> bool:
    """Mid-switch: the card has left nvidia (module unloaded) and is not on vfio-pci yet."""
    return driver(host, NV) == "" and watcher_up(host, log)


def half_bound(host: SysRoot, log: Path) -> bool:
    """Mid-switch: the display function is on vfio-pci, its audio function is not."""
    return driver(host, NV) == "vfio-pci" and driver(host, AUDIO) != "vfio-pci"


def waiting_for_events(host: SysRoot, log: Path) -> bool:
    """Every step done, bind events lost: the switch waits for the model to see the binds."""
    return driver(host, NV) == "vfio-pci" and driver(host, AUDIO) == "vfio-pci"


MOMENTS: dict[str, tuple[Moment, dict[str, Any]]] = {
    "watcher-up": (watcher_up, {}),
    "nvidia-unloaded": (nvidia_unloaded, {}),
    "half-bound": (half_bound, {}),
    "waiting-for-events": (waiting_for_events, {"lose_bind_events": True}),
}


def run_interrupted(host: SysRoot, tmp_path: Path, moment: Moment, sig: int,
                    **knobs: Any) -> tuple[int, str, str, list[dict[str, Any]]]:
    sim = SimKernel(host)
    sim.step_delay = 0.25
    for name, value in knobs.items():
        setattr(sim, name, value)
    saved = tmp_path / "simkernel.pickle"
    save_for_subprocess(sim, saved)
    log = tmp_path / "events.jsonl"
    proc = subprocess.Popen(
        gpuwatch_cmd("mode", "vfio", "--addr", NV, "--root", str(host.root), "--log", str(log),
                     "--timeout", "60", "--json"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**env(), SIMKERNEL_ENV: str(saved)})
    try:
        deadline = time.monotonic() + 60
        while not moment(host, log):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the moment never came"
            time.sleep(0.002)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out, err, list(read_events(log)) if log.exists() else []


def check_every_start_ends(events: list[dict[str, Any]]) -> str | None:
    """The outcome of the one switch in the log (None: none started), after checking that
    its `switch-started` has exactly one end, after it."""
    kinds = [e["type"] for e in events]
    starts = [i for i, k in enumerate(kinds) if k == "switch-started"]
    ends = [i for i, k in enumerate(kinds) if k in ("switch-completed", "switch-failed")]
    assert len(starts) <= 1 and len(ends) == len(starts), kinds
    if not starts:
        return None
    assert starts[0] < ends[0], kinds
    end = events[ends[0]]
    if end["type"] == "switch-failed":
        assert (end["error"], end["wedged"], end["addr"]) == ("interrupted", False, NV), end
        return "interrupted"
    return "completed"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
@pytest.mark.parametrize("moment", list(MOMENTS))
def test_an_interrupted_switch_ends_and_leaves_the_group_whole(
    host: SysRoot, tmp_path: Path, moment: str, sig: int
) -> None:
    when, knobs = MOMENTS[moment]
    code, out, err, events = run_interrupted(host, tmp_path, when, sig, **knobs)
    assert "Traceback" not in err, err
    assert not events or events[0]["type"] == "ready"  # the signal may beat the first scan
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    outcome = check_every_start_ends(events)
    now = drivers(host)
    if outcome == "completed":  # the signal came after the switch had finished
        assert code == 0 and json.loads(out)["to_mode"] == "vfio", (code, err)
        assert now == AFTER
    else:
        # Interrupted (exit 1, one line naming the interruption after the signal's own), or
        # stopped before the switch began (exit 128 + the signal): the group as it was.
        assert code in (1, 128 + sig), (code, err)
        assert now == BEFORE, (now, events[-3:])
        assert err.splitlines()[-1].startswith("gpuwatch: "), err
        if outcome == "interrupted":
            assert code == 1 and "interrupted" in err
        else:  # no switch-started: none had begun, whatever the watcher was doing
            assert code == 128 + sig and "no switch was under way" in err, (code, err)
        if moment != "watcher-up":  # past the first step: the switch had begun
            assert outcome == "interrupted", [e["type"] for e in events]
            failed = next(e for e in events if e["type"] == "switch-failed")
            # What the switch changed was put back, step by step: nvidia loaded again,
            # the card bound to it again.
            assert "run modprobe nvidia" in failed["restored"], failed
            assert any("drivers_probe" in step for step in failed["restored"]), failed
    # The model the log tells of ends where the tree is: the last driver seen per function.
    seen = dict(BEFORE)
    for e in events:
        if e["type"] == "driver-changed" and e["addr"] in seen:
            seen[e["addr"]] = e["new"]
    if moment != "waiting-for-events":  # there the bind events were lost on purpose
        assert seen == now, (seen, now)


@pytest.mark.timeout(120)
def test_after_an_interruption_the_same_switch_runs_to_completion(
    host: SysRoot, tmp_path: Path
) -> None:
    """Nothing is left behind that blocks a retry: no lock, no poison, a whole group."""
    code, _, _, events = run_interrupted(host, tmp_path, half_bound, signal.SIGTERM)
    assert code == 1 and check_every_start_ends(events) == "interrupted"
    log = tmp_path / "events.jsonl"
    proc = subprocess.run(
        gpuwatch_cmd("mode", "vfio", "--addr", NV, "--root", str(host.root), "--log", str(log),
                     "--timeout", "60", "--json"),
        capture_output=True, text=True, timeout=90,
        env={**env(), SIMKERNEL_ENV: str(tmp_path / "simkernel.pickle")})
    assert proc.returncode == 0, proc.stderr
    assert drivers(host) == AFTER
    kinds = [e["type"] for e in read_events(log)]
    assert kinds.count("switch-started") == 2 and kinds[-1] == "switch-completed", kinds


@pytest.mark.parametrize("spoil", ["world-writable", "symlink", "fifo"])
def test_the_testing_hook_refuses_a_file_it_cannot_trust(
        host: SysRoot, tmp_path: Path, spoil: str) -> None:
    """The test-only variable unpickles nothing that another user could have planted or edited:
    a shared-writable file, a symlink or a FIFO is one config error line and exit 2, no switch."""
    saved = tmp_path / "simkernel.pickle"
    save_for_subprocess(SimKernel(host), saved)
    assert saved.stat().st_mode & 0o777 == 0o600
    if spoil == "world-writable":
        saved.chmod(0o666)
        target = saved
    elif spoil == "symlink":
        target = tmp_path / "link.pickle"
        target.symlink_to(saved)
    else:
        target = tmp_path / "fifo.pickle"
        os.mkfifo(target)
    proc = subprocess.run(
        gpuwatch_cmd("mode", "vfio", "--addr", NV, "--root", str(host.root), "--timeout", "5"),
        capture_output=True, text=True, timeout=60,
        env={**env(), SIMKERNEL_ENV: str(target)})
    assert proc.returncode == 2, proc.stderr
    assert SIMKERNEL_ENV in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert "Traceback" not in proc.stderr
    assert drivers(host) == BEFORE  # nothing was switched


def test_the_simulated_kernel_is_never_saved_for_the_real_root() -> None:
    sim = SimKernel.__new__(SimKernel)
    sim.root = "/"
    sim._source = None
    with pytest.raises(ValueError, match="fixture root"):
        save_for_subprocess(sim, "/nonexistent/never-written")


def sim_daemon(host: SysRoot, saved: Path, log: Path, sock: str,
               fifo: Path) -> tuple[subprocess.Popen[str], IO[str]]:
    """``watch --socket`` of the tree under the simulated kernel saved at ``saved``, its
    uevents from the FIFO ``fifo`` (made here), and that FIFO's writer end, which the caller
    keeps open until the end (the daemon's source ends when it closes)."""
    os.mkfifo(fifo)
    proc = subprocess.Popen(
        gpuwatch_cmd("watch", "--root", str(host.root), "--source", f"file:{fifo}",
                     "--log", str(log), "--reconcile-interval", "0", "--socket", sock),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**env(), SIMKERNEL_ENV: str(saved)})
    return proc, open(fifo, "w")


@pytest.mark.timeout(180)
def test_a_daemon_stopped_mid_switch_logs_the_switch_end_before_stopped(
        host: SysRoot, tmp_path: Path) -> None:
    """SIGTERM to ``watch --socket`` while a socket client's switch is half way: the switch
    ends (completed, or put back with ``switch-failed``) and ``stopped`` is still the last
    record of the run, so a reader that stops at ``stopped`` misses nothing."""
    sim = SimKernel(host)
    sim.step_delay = 0.25
    saved = tmp_path / "simkernel.pickle"
    save_for_subprocess(sim, saved)
    log, sock = tmp_path / "events.jsonl", str(tmp_path / "gw.sock")
    proc, writer = sim_daemon(host, saved, log, sock, tmp_path / "ue")
    try:
        deadline = time.monotonic() + 60
        while not any(e["type"] == "ready" for e in read_events(log)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr
            time.sleep(0.02)
        client = connect(sock, timeout=60)
        client.sendall(P.encode_request(1, "switch", {"addr": NV, "mode": "vfio"}))
        while not half_bound(host, log):
            assert proc.poll() is None and time.monotonic() < deadline, "no half-bound moment"
            time.sleep(0.002)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
        client.close()
    finally:
        writer.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    events = list(read_events(log))
    types = [e["type"] for e in events]
    assert types[-1] == "stopped", types
    assert types.count("stopped") == 1
    outcome = check_every_start_ends(events)
    # A socket switch runs to its end (docs/socket.md), or is put back: either way its end is
    # logged before `stopped`, and the group is wholly in one mode.
    assert outcome in ("completed", "interrupted"), outcome
    end = "switch-completed" if outcome == "completed" else "switch-failed"
    assert types.index(end) < types.index("stopped")
    assert drivers(host) == (AFTER if outcome == "completed" else BEFORE)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
@pytest.mark.parametrize("command", ["mode", "recover"])
def test_a_signal_during_the_holder_scan_stops_with_nothing_begun(
        host: SysRoot, tmp_path: Path, sig: int, command: str) -> None:
    """The watcher is up and the switch is reading the host (its holder scan): nothing has
    been written and no `switch-started` published, so the command says so and exits
    128 + the signal, as docs/switch.md's table says; not 1 ("interrupted") as if a switch
    had been under way."""
    sim = SimKernel(host)
    sim.facts_delay = 3.0
    sim.facts_marker = str(tmp_path / "scanning")
    saved = tmp_path / "simkernel.pickle"
    save_for_subprocess(sim, saved)
    log = tmp_path / "events.jsonl"
    argv = ["mode", "vfio"] if command == "mode" else ["recover"]
    proc = subprocess.Popen(
        gpuwatch_cmd(*argv, "--addr", NV, "--root", str(host.root), "--log", str(log),
                     "--timeout", "60"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**env(), SIMKERNEL_ENV: str(saved)})
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "scanning").exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the holder scan never began"
            time.sleep(0.005)
        proc.send_signal(sig)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + sig, (proc.returncode, err)
    assert err.strip() == (  # one line, the only one
        f"gpuwatch: {signal.Signals(sig).name}: stopped; no switch was under way"), err
    assert "Traceback" not in err
    kinds = [e["type"] for e in read_events(log)]
    assert not any(k.startswith("switch-") for k in kinds), kinds
    assert drivers(host) == BEFORE  # recover too: the card stayed on nvidia

