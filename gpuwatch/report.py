"""Operator reports from the model: passthrough readiness (`status`), libvirt blocks (`list`).

Pure functions of a `HostModel` and a memlock reading, so both commands (and the daemon
later) say exactly the same thing and tests need no terminal.
"""

from __future__ import annotations

from pydantic import BaseModel

from gpuwatch.core.health import health_advice
from gpuwatch.core.modes import group_mode, host_bystanders, stays_with_host, vfio_variant
from gpuwatch.core.reporttext import (
    hostdev_xml,
    iommu_isolates,
    iommu_status,
    list_managed,
    managed_note,
    memlock_verdict,
    vf_ready,
)
from gpuwatch.core.reporttext import render_list as render_list_json
from gpuwatch.core.reporttext import render_status as render_status_json
from gpuwatch.core.results import MemlockResult, PciFunction
from gpuwatch.hostfs.files import TreePlaces
from gpuwatch.hostfs.hostkind import read_host_kind
from gpuwatch.hostfs.noiommu import IommuGroups, read_iommu_groups, read_iommu_off, vfio_open
from gpuwatch.model import HostModel


class IommuReport(BaseModel):
    enabled: bool
    kind: str
    hint: str


class MemlockReport(BaseModel):
    soft: int | None
    hard: int | None
    verdict: str  # "unlimited" | "enough" | "too low"
    hint: str


class MemberReport(BaseModel):
    addr: str
    class_label: str
    vendor_id: str
    device_id: str
    driver: str
    health: str = "ok"
    #: The function's VFIO device cdev (``/dev/vfio/devices/vfioN``), ``""`` when none.
    vfio_cdev: str = ""


class HealthReport(BaseModel):
    """A function that is not ok, and what to do about it."""

    addr: str
    class_label: str
    driver: str
    health: str
    advice: str


class GpuReport(BaseModel):
    addr: str
    vendor: str
    vendor_id: str
    device_id: str
    class_label: str
    driver: str
    iommu_group: int
    mode: str
    #: The vfio-pci variant the group is bound to (``nvgrace_gpu_vfio_pci``), ``""`` if none.
    vfio_variant: str = ""
    vfio_node: str
    vfio_accessible: bool
    #: ``/dev/iommu`` exists (iommufd).
    iommufd: bool = False
    #: What a VM manager opens to pass the group through now: ``[vfio_node]`` when it
    #: exists, else (an iommufd-only kernel) ``/dev/iommu`` and each function's cdev, else
    #: nothing.
    vfio_open: list[str] = []
    #: This process may open every node of ``vfio_open`` read/write.
    vfio_open_accessible: bool = False
    members: list[MemberReport]
    #: The host's own console or management group (`gpuwatch.core.hostkeep`), and why.
    kept_for_host: bool = False
    reason: str = ""


class StatusReport(BaseModel):
    iommu: IommuReport
    vfio_pci_loaded: bool
    #: detect-gpu: nvidia loaded, CDI reachable and a display function bound to nvidia.
    nvidia_usable: bool
    memlock: MemlockReport
    gpus: list[GpuReport]
    #: Every function whose health is not ok (error recovery, DRM wedge), with advice.
    unhealthy: list[HealthReport] = []


def memlock_report(limit: MemlockResult) -> MemlockReport:
    verdict, hint = memlock_verdict(limit.soft)
    return MemlockReport(soft=limit.soft, hard=limit.hard, verdict=verdict, hint=hint)


def unhealthy_functions(model: HostModel) -> list[HealthReport]:
    """Functions that are not ok: every one the model holds, or (a daemon's model seen
    through its probes) those of the GPU groups."""
    state = model.state
    functions: dict[str, PciFunction] = dict(getattr(state, "functions", {}))
    if not functions:
        for gpu in model.probe("detect-vfio").gpus:
            functions.update((m.addr, m) for m in gpu.group_members)
    recovery = getattr(state, "wedge_recovery", {})
    return [
        HealthReport(addr=fn.addr, class_label=fn.class_label, driver=fn.driver,
                     health=fn.health,
                     advice=health_advice(fn.health, fn.addr, fn.driver, recovery.get(fn.addr, ())))
        for addr, fn in sorted(functions.items()) if fn.health != "ok"
    ]


def build_status(model: HostModel, limit: MemlockResult) -> StatusReport:
    state = model.state
    variants: frozenset[str] = getattr(state, "vfio_variants", frozenset())
    vfio = model.probe("detect-vfio")
    groups = read_iommu_groups(model.root)
    places = TreePlaces(model.root)
    gpus: list[GpuReport] = []
    for gpu in vfio.gpus:
        members = state.group_members(gpu.addr)
        group = gpu.iommu_group
        noiommu = group in groups.noiommu
        node = groups.node(group)
        accessible = not noiommu and model.vfio_group_accessible(group)
        opens, opens_ok = vfio_open(model.root, node, vfio.iommufd,
                                    [m.vfio_cdev for m in members], accessible, places)
        gpus.append(
            GpuReport(
                addr=gpu.addr,
                vendor=model.tables.gpu_vendors.get(gpu.vendor_id, gpu.vendor_id or "unknown"),
                vendor_id=gpu.vendor_id,
                device_id=gpu.device_id,
                class_label=gpu.class_label,
                driver=gpu.driver,
                iommu_group=group,
                mode=group_mode(members, variants),
                vfio_variant=vfio_variant(members, variants),
                # A VFIO no-IOMMU group's node is /dev/vfio/noiommu-N: no VM opens it.
                vfio_node=node,
                vfio_accessible=accessible,
                iommufd=vfio.iommufd,
                vfio_open=opens,
                vfio_open_accessible=opens_ok,
                kept_for_host=bool(kept := model.kept_for_host(gpu.addr)),
                reason=kept,
                members=[
                    MemberReport(
                        addr=m.addr,
                        class_label=m.class_label,
                        vendor_id=m.vendor_id,
                        device_id=m.device_id,
                        driver=m.driver,
                        health=m.health,
                        vfio_cdev=m.vfio_cdev,
                    )
                    for m in members
                ],
            )
        )
    return StatusReport(
        iommu=IommuReport(**iommu_status(vfio.iommu_enabled, vfio.iommu_kind,
                                         groups.noiommu, groups.real, groups.emulated,
                                         read_iommu_off(model.root),
                                         read_host_kind(model.root))),
        vfio_pci_loaded=model.module_loaded("vfio_pci"),
        nvidia_usable=bool(model.probe("detect-gpu")),
        memlock=memlock_report(limit),
        gpus=gpus,
        unhealthy=unhealthy_functions(model),
    )


def render_status(report: StatusReport) -> str:
    return render_status_json(report.model_dump())


# --------------------------------------------------------------------------- list


class HostdevFunction(BaseModel):
    addr: str
    class_label: str
    driver: str
    #: None for a group kept for the host: it gets no block to paste.
    hostdev_xml: str | None


class PassthroughGpu(BaseModel):
    addr: str
    vendor: str
    vendor_id: str
    device_id: str
    iommu_group: int
    managed: str  # "yes" | "no": the blocks' libvirt managed attribute
    #: A virtual function's PF (SR-IOV): each ready VF is offered on its own.
    physfn: str = ""
    note: str  # what that attribute means for who detaches the group (and its holder checks)
    functions: list[HostdevFunction]
    #: The host's own console or management group (`gpuwatch.core.hostkeep`): not offered.
    kept_for_host: bool = False
    reason: str = ""


def passthrough_gpus(model: HostModel, managed: str = "yes",
                     groups: IommuGroups | None = None) -> list[PassthroughGpu]:
    """GPUs in an IOMMU group; every function of the group must go to the guest, but those
    that stay with the host (`stays_with_host`: bridges, whatever pcieport drives).

    Bridges share groups with endpoints on some boards but stay with the host (pcieport).
    A VFIO no-IOMMU group is no IOMMU group to a VM (no VMM opens one): not offered.
    ``groups``: the host's groups when the caller has read them already.
    """
    out: list[PassthroughGpu] = []
    variants: frozenset[str] = getattr(model.state, "vfio_variants", frozenset())
    noiommu = (groups if groups is not None else read_iommu_groups(model.root)).noiommu
    recovery = getattr(model.state, "wedge_recovery", {})
    for gpu in model.probe("detect-vfio").gpus:
        if gpu.iommu_group < 0 or gpu.iommu_group in noiommu:
            continue
        if gpu.physfn and not vf_ready(gpu, variants):
            continue
        members: list[PciFunction] = [m for m in gpu.group_members
                                      if not stays_with_host(m)]
        kept = model.kept_for_host(gpu.addr)
        vgpu_type = gpu.vgpu.type if gpu.vgpu is not None else 0
        blocks = list_managed(managed, vgpu_type)
        out.append(
            PassthroughGpu(
                addr=gpu.addr,
                vendor=model.tables.gpu_vendors.get(gpu.vendor_id, gpu.vendor_id or "unknown"),
                vendor_id=gpu.vendor_id,
                device_id=gpu.device_id,
                iommu_group=gpu.iommu_group,
                managed=blocks,
                physfn=gpu.physfn,
                note="" if kept else managed_note(
                    blocks, gpu.addr, gpu.vendor_id,
                    [(m.addr, m.sriov.numvfs) for m in members
                     if m.sriov is not None and m.sriov.numvfs > 0],
                    # Every function's health, a bridge's too: no hostdev line, but a
                    # failed port leaves the group unusable all the same.
                    [(m.addr, m.health, health_advice(m.health, m.addr, m.driver,
                                                      recovery.get(m.addr, ())))
                     for m in gpu.group_members if m.health != "ok"],
                    [(m.addr, m.driver) for m in host_bystanders(gpu.group_members, variants)],
                    vgpu_type),
                kept_for_host=bool(kept),
                reason=kept,
                functions=[
                    HostdevFunction(
                        addr=m.addr,
                        class_label=m.class_label,
                        driver=m.driver,
                        hostdev_xml=None if kept else hostdev_xml(m.addr, blocks),
                    )
                    for m in members
                ],
            )
        )
    return out


def iommu_enabled(model: HostModel, groups: IommuGroups | None = None) -> bool:
    """Whether an IOMMU isolates anything: `status`'s ``iommu.enabled`` (detect-vfio's answer,
    except on a host whose only groups are VFIO no-IOMMU groups)."""
    vfio = model.probe("detect-vfio")
    if groups is None:
        groups = read_iommu_groups(model.root)
    return iommu_isolates(vfio.iommu_enabled, groups.noiommu, groups.real, groups.emulated)


def render_list(gpus: list[PassthroughGpu], iommu_enabled: bool) -> str:
    return render_list_json([g.model_dump() for g in gpus], iommu_enabled)
