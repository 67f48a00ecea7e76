"""``gpuwatch probe ACTION`` against a daemon whose answer has the wrong shape for ACTION.

docs/socket.md: a daemon that does not speak the protocol means a direct scan. A probe's
answer is printed as it comes, so its shape is checked per action (docs/probes.md,
"Actions"): a string where a boolean belongs, escape codes, an object for a list, a function
without its fields is no answer. The fast (stdlib) path and the full command both check;
either way the command prints exactly what ``--no-daemon`` prints. A daemon that answers in
the right shape is printed as it answered, byte for byte.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import run_main
from test_cli_hostile_daemon import FakeDaemon

from gpuwatch.cli import fast
from gpuwatch.cli.fast import PROBE_SHAPES, is_probe_result
from gpuwatch.core.probes import ACTIONS
from gpuwatch.jsonout import jsonable
from gpuwatch.model import scan
from gpuwatch.service.testing import short_socket_dir
from gpuwatch.testing import SysRoot, example_gpu_host, synthetic_host
from gpuwatch.testing.machines import bmc_server_host, instinct_host, vm_guest_host
from gpuwatch.testing.modern import grace_hopper_host, iommufd_only_host, sriov_gpu_host

pytestmark = pytest.mark.timeout(300)

NV = "0000:01:00.0"

#: The command line of each action the daemon answers, on the example workstation.
LINES: dict[str, list[str]] = {
    action: ["probe", action, *(["--group", "13"] if "group" in needs else []),
             *(["--addr", NV] if "addr" in needs else []),
             *(["--mode", "vfio"] if "mode" in needs else [])]
    for action, needs in ACTIONS.items() if action not in ("memlock", "plan")
}

FUNCTION = {"addr": NV, "vendor_id": "0x10de", "device_id": "0x2204", "class": "0x0300",
            "class_label": "VGA controller", "driver": "nvidia", "iommu_group": 13}

#: For each action, answers in the protocol's envelope but not in that action's shape.
WRONG: dict[str, list[Any]] = {
    "detect-vfio": [
        "\u001b[2J", [], {"iommu_enabled": True, "iommu_kind": "intel"},
        {"iommu_enabled": "yes", "iommu_kind": "intel", "gpus": []},
        {"iommu_enabled": True, "iommu_kind": "intel", "iommufd": 1, "gpus": []},
        {"iommu_enabled": True, "iommu_kind": "intel", "gpus": [{**FUNCTION}]},
        {"iommu_enabled": True, "iommu_kind": "intel",
         "gpus": [{**FUNCTION, "iommu_group": "13", "group_members": []}]},
        {"iommu_enabled": True, "iommu_kind": "intel",
         "gpus": [{**FUNCTION, "group_members": [{**FUNCTION, "sriov": {"numvfs": 1}}]}]},
    ],
    "detect-gpu": ["true", 1, None, {}, [True]],
    "detect-amd-gpu": ["false", 0, None],
    "amd-gfx-version": [True, 10, None, ["10.3.0"]],
    "amd-gfx-target": [False, {"gfx": "gfx90a"}],
    "detect-host-devices": [
        True, [], {"gpu": True, "amd_gpu": False, "amd_gfx_version": "",
                   "amd_gfx_target": "", "devices": "/dev/nvidia0", "render_node": ""},
        {"gpu": 1, "amd_gpu": False, "amd_gfx_version": "", "amd_gfx_target": "",
         "devices": [], "render_node": ""},
    ],
    "vfio-group-accessible": ["yes", 1, None],
    "nvidia-holders": [{}, "1 nvidia-smi", [{"pid": "1", "comm": "x"}], [{"pid": 1}],
                       [{"pid": True, "comm": "x"}], [{"pid": 1, "comm": "x", "unreadable": 1}]],
    "display-driver": [None, 7, ["nvidia"]],
    "current-mode": ["\u001b[2J", "sideways", None, True],
    "group-in-mode": ["true", 0, None],
    "vfio-backend": [
        "iommufd", {"addr": NV},
        {"addr": NV, "driver": "vfio-pci", "on_vfio": True, "group_node": "/dev/vfio/13",
         "cdev_node": "", "iommufd": False, "recommended": "magic"},
    ],
    "wedge-detected": ["false", None, 0],
}

#: For each action, an answer in its shape that the direct scan of the workstation would
#: not give: printed as the daemon answered it.
RIGHT: dict[str, Any] = {
    "detect-vfio": {"iommu_enabled": True, "iommu_kind": "amd", "iommufd": True,
                    "gpus": [{**FUNCTION, "group_members": [FUNCTION]}]},
    "detect-gpu": False,
    "detect-amd-gpu": True,
    "amd-gfx-version": "11.0.0",
    "amd-gfx-target": "gfx1100",
    "detect-host-devices": {"gpu": True, "amd_gpu": True, "amd_gfx_version": "11.0.0",
                            "amd_gfx_target": "gfx1100", "devices": ["/dev/kfd"],
                            "render_node": "/dev/dri/renderD128"},
    "vfio-group-accessible": True,
    "nvidia-holders": [{"pid": 7, "comm": "Xorg"}, {"pid": 8, "comm": "x", "unreadable": True}],
    "display-driver": "nouveau",
    "current-mode": "vfio",
    "group-in-mode": True,
    "vfio-backend": {"addr": NV, "driver": "vfio-pci", "on_vfio": True, "group_node": "",
                     "cdev_node": "/dev/vfio/devices/vfio0", "iommufd": True,
                     "recommended": "iommufd"},
    "wedge-detected": True,
}


def reply(result: Any) -> bytes:
    return json.dumps({"id": 1, "result": result}).encode() + b"\n"


@pytest.fixture
def sock() -> Iterator[str]:
    with short_socket_dir() as path:
        yield f"{path}/gw.sock"


def test_every_action_the_daemon_answers_has_a_shape() -> None:
    assert set(PROBE_SHAPES) == set(LINES) == set(WRONG) == set(RIGHT)
    assert not is_probe_result("no-such-action", True)


@pytest.mark.parametrize("action", sorted(LINES))
def test_a_probe_answer_in_the_wrong_shape_means_a_direct_scan(
        host: SysRoot, sock: str, action: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    words = [*LINES[action], "--root", str(host.root)]
    direct = run_main(capsys, *words, "--no-daemon")
    assert direct[0] == 0 and direct[1].startswith(f'{{"action":"{action}","result":')
    for wrong in WRONG[action]:
        assert not is_probe_result(action, wrong), wrong
        for path in ("fast", "full"):
            with monkeypatch.context() as m:
                if path == "full":  # the full command alone (argparse, the client)
                    m.setattr(fast, "run_fast", lambda argv: None)
                with FakeDaemon(sock, reply(wrong)) as daemon:
                    got = run_main(capsys, *words, "--socket", sock)
                    asked = daemon.connections
                Path(sock).unlink()
            assert got == direct, (path, wrong)
            assert asked >= 1, (path, wrong)


@pytest.mark.parametrize("action", sorted(LINES))
def test_a_probe_answer_in_its_shape_is_printed_as_answered(
        host: SysRoot, sock: str, action: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    words = [*LINES[action], "--root", str(host.root), "--socket", sock]
    expected = json.dumps({"action": action, "result": RIGHT[action]},
                          separators=(",", ":")) + "\n"
    assert expected != run_main(capsys, *LINES[action], "--root", str(host.root),
                                "--no-daemon")[1]
    for path in ("fast", "full"):
        with monkeypatch.context() as m:
            if path == "full":
                m.setattr(fast, "run_fast", lambda argv: None)
            with FakeDaemon(sock, reply(RIGHT[action])):
                got = run_main(capsys, *words)
            Path(sock).unlink()
        assert got == (0, expected, ""), path


MACHINES: dict[str, Callable[[Path], SysRoot]] = {
    "workstation": example_gpu_host,
    "bmc-server": bmc_server_host,
    "instinct": instinct_host,
    "vm-guest": vm_guest_host,
    "grace-hopper": grace_hopper_host,
    "iommufd-only": iommufd_only_host,
    "sriov-vgpu": lambda r: sriov_gpu_host(r, vfs=2, vgpu=True),
    "synthetic": lambda r: synthetic_host(r, 8),
}


@pytest.mark.parametrize("machine", sorted(MACHINES))
def test_every_answer_the_model_gives_has_its_actions_shape(machine: str,
                                                            tmp_path: Path) -> None:
    """The check refuses no answer a real daemon gives: every action over hosts of many
    kinds, every function's address, as the daemon serialises them."""
    s = MACHINES[machine](tmp_path / "host")
    model = scan(str(s.root))
    checked = 0
    for action, needs in ACTIONS.items():
        if action not in PROBE_SHAPES:
            continue
        calls: list[dict[str, Any]] = [{}]
        if "group" in needs:
            calls = [{"group": g} for g in (-1, 0, 13, 14)]
        if "addr" in needs:
            calls = [{"addr": a, "mode": m} if "mode" in needs else {"addr": a}
                     for a in s.functions for m in ("vfio", "nvidia")]
        for params in calls:
            answer = jsonable(model.probe(action, **params))
            assert is_probe_result(action, answer), (action, params, answer)
            checked += 1
    assert checked > len(PROBE_SHAPES)
