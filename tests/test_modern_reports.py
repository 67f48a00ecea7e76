"""Issue 15 in the operator's views: status (variant, health advice), list (SR-IOV VFs),
metrics (gpuwatch_function_health) and the NFD unhealthy-GPU count."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest
from cli_helpers import run_cli
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import gpuwatch
from gpuwatch.core.results import MemlockResult
from gpuwatch.report import build_status, passthrough_gpus, render_status
from gpuwatch.service.metrics import Metrics
from gpuwatch.service.nfd import NfdFeatureFile
from gpuwatch.testing import SysRoot, example_gpu_host
from gpuwatch.testing.modern import (
    GH_ADDR,
    SRIOV_PF,
    VGPU_TYPES,
    grace_hopper_host,
    iommufd_only_host,
    sriov_gpu_host,
)
from tests.test_watcher import harness_for

NV = "0000:01:00.0"
CARD1 = "/devices/pci0000:00/0000:00:01.0/0000:01:00.0/drm/card1"
UNLIMITED = MemlockResult(soft=None, hard=None)


def test_status_names_the_variant(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    grace_hopper_host(tmp_path)
    report = build_status(gpuwatch.scan(tmp_path), UNLIMITED)
    gpu = report.gpus[0]
    assert (gpu.mode, gpu.vfio_variant) == ("vfio", "nvgrace_gpu_vfio_pci")
    assert "mode: vfio (nvgrace_gpu_vfio_pci)" in render_status(report)
    code, out, _ = anyio.run(run_cli, capsys, "status", "--json", "--root", str(tmp_path),
                             "--no-daemon")
    assert code == 0 and json.loads(out)["gpus"][0]["vfio_variant"] == "nvgrace_gpu_vfio_pci"


async def test_status_shows_unhealthy_functions_with_what_to_do(tmp_path: Path) -> None:
    host = example_gpu_host(tmp_path)
    async with harness_for(host) as h:
        await h.send("change", CARD1, expect=2, WEDGED="rebind,bus-reset")
        await h.send("change", "0000:02:00.0", expect=1, ERROR_EVENT="FAILED_RECOVERY")
        report = build_status(h.watcher.model, UNLIMITED)
    bad = {b.addr: b for b in report.unhealthy}
    assert set(bad) == {NV, "0000:02:00.0"}  # the NIC too: every function, not only GPUs
    assert bad[NV].health == "wedged"
    assert "rebind its driver" in bad[NV].advice and "/reset" in bad[NV].advice
    assert "recovery failed" in bad["0000:02:00.0"].advice
    text = render_status(report)
    assert "Not healthy:" in text and "health: wedged" in text


def test_list_offers_each_ready_vf(tmp_path: Path) -> None:
    host = sriov_gpu_host(tmp_path, vfs=3, vgpu=True)
    host.set_vgpu("0000:41:00.5", 1156, VGPU_TYPES)  # a vGPU type chosen: ready
    host.unbind("0000:41:00.6")  # unbound: libvirt can take it
    offered = {g.addr: g for g in passthrough_gpus(gpuwatch.scan(tmp_path))}
    assert "0000:41:00.4" not in offered  # on nvidia with no vGPU type: the host's
    assert offered["0000:41:00.5"].physfn == SRIOV_PF
    assert [f.addr for f in offered["0000:41:00.6"].functions] == ["0000:41:00.6"]
    assert SRIOV_PF in offered


@pytest.mark.parametrize("managed", ["yes", "no"])
def test_a_vgpu_vf_is_offered_managed_no_whatever_is_asked(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], managed: str) -> None:
    """NVIDIA's vendor-specific VFIO (the vGPU manager since Linux 6.8, no mdev): the VF whose
    ``nvidia/current_vgpu_type`` holds a type stays on nvidia, which registers its VFIO device.
    managed='yes' has libvirt unbind it from nvidia and bind vfio-pci (taking the vGPU with
    the driver); `gpuwatch mode vfio` is no step of its either. Its blocks are managed='no'
    and its note says why; the other GPUs keep what was asked."""
    vf, other = "0000:41:00.5", "0000:41:00.6"
    host = sriov_gpu_host(tmp_path, vfs=3, vgpu=True)
    host.set_vgpu(vf, 1156, VGPU_TYPES)
    host.unbind(other)  # unbound: libvirt binds it
    offered = {g.addr: g for g in passthrough_gpus(gpuwatch.scan(tmp_path), managed)}
    assert offered[vf].managed == "no"
    assert offered[vf].functions[0].hostdev_xml is not None
    assert "managed='no'" in offered[vf].functions[0].hostdev_xml
    assert offered[vf].note.startswith(
        f"managed='no' whatever --managed says: {vf} is an NVIDIA vGPU VF (vGPU type 1156) "
        "that stays on nvidia")
    assert "gpuwatch mode vfio" not in offered[vf].note
    assert (offered[other].managed, offered[SRIOV_PF].managed) == (managed, managed)
    code, out, _ = anyio.run(run_cli, capsys, "list", "--json", "--managed", managed,
                             "--root", str(tmp_path), "--no-daemon")
    listed = {g["addr"]: g for g in json.loads(out)}
    assert code == 0 and listed[vf]["managed"] == "no" and listed[other]["managed"] == managed
    assert listed[vf]["note"] == offered[vf].note


def test_list_text_marks_vfs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    host = sriov_gpu_host(tmp_path, vfs=1)
    host.bind("0000:41:00.4", "vfio-pci")
    code, out, _ = anyio.run(run_cli, capsys, "list", "--root", str(tmp_path), "--no-daemon")
    assert code == 0
    assert f"GPU 0000:41:00.4 (SR-IOV VF of {SRIOV_PF})" in out
    assert "function='0x4'" in out


@pytest.mark.parametrize("vfs", [0, 2])
def test_list_warns_that_detaching_a_pf_takes_its_vfs(tmp_path: Path, vfs: int) -> None:
    """libvirt's managed='yes' detaches the PF from its driver, which disables SR-IOV: the
    note says so wherever VFs are enabled (and only there)."""
    sriov_gpu_host(tmp_path, vfs=vfs)
    offered = {g.addr: g for g in passthrough_gpus(gpuwatch.scan(tmp_path))}
    warning = (f"; {SRIOV_PF} has 2 SR-IOV virtual function(s) enabled: taking its driver away "
               "removes them under whatever uses them (`gpuwatch mode` refuses to), so disable "
               "them first")
    assert offered[SRIOV_PF].note.endswith(warning) == bool(vfs)
    assert "virtual function" not in offered[SRIOV_PF].note or vfs


def metric(registry: Any, name: str) -> dict[tuple[str, str], float]:
    text = generate_latest(registry).decode()
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out[(sample.labels["addr"], sample.labels["state"])] = sample.value
    return out


async def test_function_health_metric(tmp_path: Path) -> None:
    host = example_gpu_host(tmp_path)
    async with harness_for(host) as h:
        metrics = Metrics()
        metrics.attach(h.watcher)
        health = metric(metrics.registry, "gpuwatch_function_health")
        assert health[(NV, "ok")] == 1 and health[(NV, "wedged")] == 0
        assert len(health) == 4 * len(host.functions)
        await h.send("change", NV, expect=2, ERROR_EVENT="BEGIN_RECOVERY")
        health = metric(metrics.registry, "gpuwatch_function_health")
        assert (health[(NV, "recovering")], health[(NV, "ok")]) == (1, 0)
        await h.send("change", CARD1, expect=2, WEDGED="unknown")
        assert metric(metrics.registry, "gpuwatch_function_health")[(NV, "wedged")] == 1
        host.remove_function("0000:02:00.0")
        await h.send("remove", "0000:02:00.0", expect=1)
        assert ("0000:02:00.0", "ok") not in metric(metrics.registry,
                                                     "gpuwatch_function_health")
        metrics.close()


async def test_nfd_counts_unhealthy_gpus(tmp_path: Path) -> None:
    host = example_gpu_host(tmp_path)
    features = tmp_path / "features.d"
    async with harness_for(host) as h, anyio.create_task_group() as tg:
        nfd = NfdFeatureFile(str(features) + "/", expiry=3600)
        nfd.attach(h.watcher)
        tg.start_soon(nfd.run)
        path = features / "gpuwatch"

        async def label() -> str:
            with anyio.fail_after(5):
                while not path.exists():
                    await anyio.sleep(0.01)
            return dict(line.split("=", 1) for line in path.read_text().splitlines()
                        if line and not line.startswith("#"))["gpuwatch.gpu.unhealthy.count"]

        assert await label() == "0"
        await h.send("change", CARD1, expect=2, WEDGED="rebind")
        with anyio.fail_after(5):
            while await label() != "1":
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()


def test_status_through_a_remote_model_uses_gpu_members(empty_host: SysRoot) -> None:
    """A daemon's model seen through detect-vfio: health travels in the function objects."""
    from gpuwatch.report import unhealthy_functions

    class Remote:
        def __init__(self, vfio: Any) -> None:
            self.state = object()
            self._vfio = vfio

        def probe(self, action: str) -> Any:
            return self._vfio

    empty_host.add_function(NV, driver="nvidia", iommu_group=1)
    vfio = gpuwatch.scan(empty_host.root).probe("detect-vfio")
    gpu = vfio.gpus[0]
    wedged = gpu.model_copy(update={"group_members": (
        gpu.group_members[0].model_copy(update={"health": "wedged"}),)})
    bad = unhealthy_functions(Remote(vfio.model_copy(update={"gpus": (wedged,)})))  # type: ignore[arg-type]
    assert [(b.addr, b.health) for b in bad] == [(NV, "wedged")]
    assert "gpu-wedged event" in bad[0].advice


def test_gh_vfio_backend_in_status_json(tmp_path: Path) -> None:
    grace_hopper_host(tmp_path)
    assert gpuwatch.scan(tmp_path).probe("vfio-backend", addr=GH_ADDR).recommended == "iommufd"


async def test_list_warns_that_an_unhealthy_gpu_needs_its_recovery(tmp_path: Path) -> None:
    """A wedged GPU is still listed (libvirt's managed='yes' rebinds it, which is one of its
    recoveries), but its note says it is not healthy and what to do, as status does; the
    stdlib report path, on the same answer, writes the same note."""
    from gpuwatch.cli.fast_report import Remote, list_report
    from gpuwatch.jsonout import dumps

    host = example_gpu_host(tmp_path)
    async with harness_for(host) as h:
        await h.send("change", CARD1, expect=2, WEDGED="rebind")
        model = h.watcher.model
        full = {g.addr: g for g in passthrough_gpus(model)}
        vfio = json.loads(dumps(model.probe("detect-vfio")))
    note = full[NV].note
    assert f"; {NV} is not healthy (the driver declared the GPU wedged: rebind its driver" in note
    assert "`gpuwatch mode` refuses to switch it" in note
    assert len(full) > 1 and all("not healthy" not in g.note for a, g in full.items() if a != NV)
    fast = {g["addr"]: g for g in list_report(Remote("", str(host.root), vfio), "yes")}
    # Without the wedge's methods (in no probe answer) the advice is the generic one.
    assert f"{NV} is not healthy (the driver declared the GPU wedged: the recovery methods" in (
        fast[NV]["note"])


def test_status_on_an_iommufd_only_kernel_names_the_cdevs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No /dev/vfio/13 (a kernel without the VFIO group interface): status names what a VM
    manager opens instead, /dev/iommu and each function's cdev, the ones vfio-backend
    recommends, rather than calling the group node absent and stopping there."""
    iommufd_only_host(tmp_path)
    model = gpuwatch.scan(tmp_path)
    gpu = next(g for g in build_status(model, UNLIMITED).gpus if g.addr == NV)
    assert (gpu.vfio_node, gpu.vfio_accessible, gpu.iommufd) == ("/dev/vfio/13", False, True)
    cdevs = [model.probe("vfio-backend", addr=m.addr).cdev_node for m in gpu.members]
    assert cdevs == ["/dev/vfio/devices/vfio0", "/dev/vfio/devices/vfio1"]
    assert [m.vfio_cdev for m in gpu.members] == cdevs
    assert gpu.vfio_open == ["/dev/iommu", *cdevs] and gpu.vfio_open_accessible
    code, out, _ = anyio.run(run_cli, capsys, "status", "--root", str(tmp_path), "--no-daemon")
    assert code == 0
    assert ("  /dev/vfio/13: absent (iommufd only): a VM opens /dev/iommu and "
            "/dev/vfio/devices/vfio0 (0000:01:00.0), /dev/vfio/devices/vfio1 (0000:01:00.1): "
            "read/write ok") in out.splitlines()
    assert "/dev/vfio/13: not accessible" not in out


def test_status_with_the_group_node_opens_the_group(tmp_path: Path) -> None:
    """Where the group node exists (beside the cdevs, or alone), it is what status names, as
    before; a group not on VFIO has nothing to open."""
    host = iommufd_only_host(tmp_path)
    host.add_vfio_group(13)
    gpus = {g.addr: g for g in build_status(gpuwatch.scan(tmp_path), UNLIMITED).gpus}
    assert gpus[NV].vfio_open == ["/dev/vfio/13"]
    assert gpus[NV].vfio_open_accessible == gpus[NV].vfio_accessible
    assert gpus["0000:00:02.0"].vfio_open == [] and not gpus["0000:00:02.0"].vfio_open_accessible
    assert "/dev/vfio/13: read/write ok" in render_status(build_status(gpuwatch.scan(tmp_path),
                                                                       UNLIMITED))
