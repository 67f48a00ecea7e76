"""More kinds of real host (HGX with NVSwitches, Optimus laptop, Intel Flex with SR-IOV VFs,
AMD APU beside a dGPU, VFIO no-IOMMU), each answering the same as captured by the tools that
copy sysfs: links followed into folders (``cp -rL``, ``tar -h``), and GNU tar's NUL padding
of every attribute."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from cli_helpers import run_main as cli

import gpuwatch
from gpuwatch.jsonout import jsonable
from gpuwatch.testing import SysRoot, example_gpu_host
from gpuwatch.testing.machines import (
    amd_apu_dgpu_host,
    bmc_server_host,
    hgx_h100_host,
    hybrid_laptop_host,
    instinct_host,
    intel_flex_sriov_host,
    turing_desktop_host,
    vfio_noiommu_host,
)
from gpuwatch.testing.modern import grace_hopper_host, sriov_gpu_host

PROBES = ("detect-vfio", "detect-gpu", "detect-amd-gpu", "amd-gfx-version", "amd-gfx-target",
          "detect-host-devices")

MACHINES: dict[str, Callable[[Path], SysRoot]] = {
    "example": example_gpu_host,
    "bmc": bmc_server_host,
    "turing": turing_desktop_host,
    "instinct": instinct_host,
    "grace-hopper": grace_hopper_host,
    "sriov": lambda r: sriov_gpu_host(r, vfs=2),
    "hgx": lambda r: hgx_h100_host(r, gpus=2),
    "laptop": hybrid_laptop_host,
    "flex": lambda r: intel_flex_sriov_host(r, vfs=2),
    "apu": amd_apu_dgpu_host,
    "noiommu": vfio_noiommu_host,
}


def answers(root: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    """Every probe, and per GPU the per-address probes and the plan, and `status` and
    `list` as JSON: what a captured tree must answer as its host did."""
    model = gpuwatch.scan(root)
    got: dict[str, object] = {a: jsonable(model.probe(a)) for a in PROBES}
    for gpu in model.probe("detect-vfio").gpus:
        for action in ("display-driver", "current-mode", "vfio-backend"):
            got[f"{action} {gpu.addr}"] = jsonable(model.probe(action, addr=gpu.addr))
        for mode in ("vfio", "nvidia"):
            got[f"in {mode} {gpu.addr}"] = model.probe("group-in-mode", addr=gpu.addr, mode=mode)
            got[f"plan {mode} {gpu.addr}"] = cli(capsys, "probe", "plan", "--mode", mode,
                                                 "--addr", gpu.addr, "--root", str(root))
    for command in ("status", "list"):
        code, out, err = cli(capsys, command, "--json", "--no-daemon", "--root", str(root))
        assert (code, err) == (0, ""), command
        got[command] = json.loads(out)
    return got


@pytest.mark.parametrize("kind", sorted(MACHINES))
def test_tar_capture_answers_like_the_host(tmp_path: Path, kind: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """``tar -chf`` of a host's sysfs: links followed into folders, and every attribute
    padded with NULs to the 4096 bytes sysfs reports as its size."""
    live = MACHINES[kind](tmp_path / "live")
    captured = MACHINES[kind](tmp_path / "captured")
    captured.capture()
    captured.pad_like_tar()
    vendor = captured.root / "sys/bus/pci/devices" / live.functions[-1] / "vendor"
    data = vendor.read_bytes()
    assert len(data) == 4096 and data.endswith(b"\0\0") and data.rstrip(b"\0").endswith(b"\n")
    assert answers(captured.root, capsys) == answers(live.root, capsys)
