"""A switch asked of a tree a capture tool copied (every ``sys/bus/pci/devices`` entry a folder,
its links flattened): reading it is fine, writing to it is no switch. Every write would land
in the copy, never in a device, and the switch would then wait for binds that cannot come and
blame "another driver". It is refused before anything is written, naming the entry, with a
`switch-refused` event and the CLI's exit 1 in one line.

Fixture roots only: the real seam (`RealHostOps`) writes into the fixture's files, and runs
no command on a root that is not a mounted sysfs.
"""

from __future__ import annotations

import pickle
import subprocess
from pathlib import Path

import pytest
from daemon_helpers import env, gpuwatch_cmd

from gpuwatch.errors import SwitchRefused
from gpuwatch.host import open_host
from gpuwatch.sources.memory import MemorySource
from gpuwatch.switch.hostops import RealHostOps
from gpuwatch.testing import SysRoot
from gpuwatch.testing.simkernel import SIMKERNEL_ENV, SimKernel, save_for_subprocess
from tests.test_switch_engine import NV, add_second_card, of_type


def snapshot(host: SysRoot) -> dict[str, bytes]:
    """Every file a switch could write to, with what it holds now."""
    found = {}
    for pattern in ("sys/bus/pci/devices/*/driver_override", "sys/bus/pci/drivers/*/unbind",
                    "sys/bus/pci/drivers/*/bind", "sys/bus/pci/drivers_probe"):
        for path in sorted(host.root.glob(pattern)):
            found[str(path)] = path.read_bytes()
    return found


@pytest.mark.timeout(60)
async def test_a_switch_of_a_captured_tree_is_refused_before_any_write(host: SysRoot) -> None:
    """Two GPUs (so the plan is writes alone: unbind from nvidia, override, probe): before
    the fix the writes landed in the copy and the switch failed saying another driver took
    the card. Now: refused, nothing written, no `switch-started`."""
    add_second_card(host)
    host.capture()
    before = snapshot(host)
    assert before
    async with open_host(host.root, source=MemorySource(), ops=RealHostOps(host.root),
                         geteuid=lambda: 0, reconcile_interval=0, cdi_poll_interval=0,
                         tree_check_after=0.2) as w:
        events: list[object] = []
        w.listeners.append(events.append)
        with pytest.raises(SwitchRefused, match=rf"devices/{NV} is a folder, not the kernel's "
                                                "link.*copy of a host's sysfs"):
            await w.switch(NV, "vfio", timeout=5)
        assert of_type(events, "switch-started") == []
        assert len(of_type(events, "switch-refused")) == 1
        with pytest.raises(SwitchRefused, match="copy of a host's sysfs"):
            await w.recover(NV, timeout=5)
    assert snapshot(host) == before


@pytest.mark.timeout(60)
def test_mode_on_a_captured_tree_is_one_line_and_exit_1(host: SysRoot, tmp_path: Path) -> None:
    """The CLI's view: exit 1, one line naming the copy, and the simulated kernel was told
    nothing."""
    add_second_card(host)
    host.capture()
    saved = tmp_path / "simkernel.pickle"
    save_for_subprocess(SimKernel(host), saved)
    proc = subprocess.run(gpuwatch_cmd("mode", "vfio", "--addr", NV, "--root", str(host.root)),
                          capture_output=True, text=True, timeout=60,
                          env={**env(), SIMKERNEL_ENV: str(saved)})
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "copy of a host's sysfs" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    with open(saved, "rb") as fh:
        assert pickle.load(fh)["sim"].record == []  # saved back at exit: nothing asked of it


def every_file(host: SysRoot) -> dict[str, bytes]:
    """Each regular file under ``sys`` with its bytes: an rsync-like copy holds no
    ``driver_override`` or ``bind`` to snapshot, and a write would make one."""
    return {str(p): p.read_bytes() for p in sorted((host.root / "sys").rglob("*"))
            if p.is_file() and not p.is_symlink()}


@pytest.mark.timeout(60)
async def test_a_switch_of_an_rsync_copy_is_refused_before_any_write(host: SysRoot) -> None:
    """``rsync -a`` keeps the links (no bus entry is a folder) and drops the text attributes:
    the scan reads the GPU from ``config``, but a function with no ``vendor`` is no live
    device. Refused, nothing written (before: the switch ran its writes into the copy)."""
    add_second_card(host)
    host.add_config()
    host.drop_like_rsync()
    before = every_file(host)
    async with open_host(host.root, source=MemorySource(), ops=RealHostOps(host.root),
                         geteuid=lambda: 0, reconcile_interval=0, cdi_poll_interval=0,
                         tree_check_after=0.2) as w:
        assert w.model.function(NV).vendor_id == "0x10de"
        events: list[object] = []
        w.listeners.append(events.append)
        with pytest.raises(SwitchRefused, match=rf"devices/{NV} has no vendor attribute.*"
                                                "copy of a host's sysfs"):
            await w.switch(NV, "vfio", timeout=5)
        assert of_type(events, "switch-started") == []
        with pytest.raises(SwitchRefused, match="copy of a host's sysfs"):
            await w.recover(NV, timeout=5)
    assert every_file(host) == before
