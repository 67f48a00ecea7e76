"""Operator reports from the model: passthrough readiness (`status`), libvirt blocks (`list`).

Pure functions of a `HostModel` and a memlock reading, so both commands (and the daemon
later) say exactly the same thing and tests need no terminal.
"""

from __future__ import annotations

from pydantic import BaseModel

from gpuwatch.core.health import health_advice
from gpuwatch.core.modes import group_mode, on_vfio, vfio_variant
from gpuwatch.core.results import MemlockResult, PciFunction
from gpuwatch.model import HostModel

#: Enough locked memory to pin a 16 GiB guest: vfio pins all guest RAM.
MEMLOCK_ENOUGH = 16 * 1024**3
BRIDGE_CLASS = "0x0604"


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


def iommu_hint(enabled: bool, kind: str) -> str:
    if enabled:
        return ""
    if kind == "intel":
        return "intel_iommu=on is asked for but no IOMMU group exists: enable VT-d in the firmware"
    if kind == "amd":
        return (
            "amd_iommu=on is asked for but no IOMMU group exists: enable AMD-Vi/IOMMU in the "
            "firmware"
        )
    return (
        "enable VT-d/AMD-Vi in the firmware and add intel_iommu=on iommu=pt (Intel) or "
        "amd_iommu=on iommu=pt (AMD) to the kernel command line, then reboot"
    )


def memlock_report(limit: MemlockResult) -> MemlockReport:
    if limit.soft is None:
        return MemlockReport(soft=None, hard=limit.hard, verdict="unlimited", hint="")
    if limit.soft >= MEMLOCK_ENOUGH:
        return MemlockReport(
            soft=limit.soft,
            hard=limit.hard,
            verdict="enough",
            hint="enough for a 16 GiB guest; raise it for larger ones",
        )
    return MemlockReport(
        soft=limit.soft,
        hard=limit.hard,
        verdict="too low",
        hint=(
            "vfio pins all guest memory: raise RLIMIT_MEMLOCK (LimitMEMLOCK=infinity in the "
            "systemd unit, `ulimit -l unlimited`, or memlock in /etc/security/limits.conf)"
        ),
    )


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
    gpus: list[GpuReport] = []
    for gpu in vfio.gpus:
        members = state.group_members(gpu.addr)
        group = gpu.iommu_group
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
                vfio_node=f"/dev/vfio/{group}" if group >= 0 else "",
                vfio_accessible=model.vfio_group_accessible(group),
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
                    )
                    for m in members
                ],
            )
        )
    return StatusReport(
        iommu=IommuReport(
            enabled=vfio.iommu_enabled,
            kind=vfio.iommu_kind,
            hint=iommu_hint(vfio.iommu_enabled, vfio.iommu_kind),
        ),
        vfio_pci_loaded=model.module_loaded("vfio_pci"),
        nvidia_usable=bool(model.probe("detect-gpu")),
        memlock=memlock_report(limit),
        gpus=gpus,
        unhealthy=unhealthy_functions(model),
    )


def _fmt_bytes(value: int | None) -> str:
    if value is None:
        return "unlimited"
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if value >= size:
            return f"{value / size:g} {unit}"
    return f"{value} B"


def render_status(report: StatusReport) -> str:
    io = report.iommu
    lines = [
        f"IOMMU:    {'enabled' if io.enabled else 'disabled'}"
        + (f" ({io.kind})" if io.kind else ""),
    ]
    if io.hint:
        lines.append(f"          -> {io.hint}")
    lines.append(
        f"vfio-pci: {'loaded' if report.vfio_pci_loaded else 'not loaded (modprobe vfio-pci)'}"
    )
    lines.append("NVIDIA:   " + ("usable (nvidia loaded, CDI reachable, a GPU on nvidia)"
                                 if report.nvidia_usable else
                                 "not usable (needs nvidia loaded, a CDI spec or nvidia-ctk, "
                                 "and a GPU on nvidia)"))
    ml = report.memlock
    lines.append(f"memlock:  {_fmt_bytes(ml.soft)} (hard {_fmt_bytes(ml.hard)}): {ml.verdict}")
    if ml.hint and ml.verdict == "too low":
        lines.append(f"          -> {ml.hint}")
    if not report.gpus:
        lines.append("GPUs:     none found")
    for gpu in report.gpus:
        group = f"group {gpu.iommu_group}" if gpu.iommu_group >= 0 else "no IOMMU group"
        lines.append("")
        variant = f" ({gpu.vfio_variant})" if gpu.vfio_variant else ""
        lines.append(
            f"GPU {gpu.addr}  {gpu.vendor} {gpu.device_id} ({gpu.class_label})  {group}  "
            f"mode: {gpu.mode}{variant}"
        )
        if gpu.kept_for_host:
            lines.append(f"  kept for the host: {gpu.reason}")
        for m in gpu.members:
            lines.append(
                f"  {m.addr}  {m.class_label:<20} {m.vendor_id}:{m.device_id}  "
                f"driver: {m.driver or '(none)'}"
                + (f"  health: {m.health}" if m.health != "ok" else "")
            )
        if gpu.vfio_node:
            access = (
                "read/write ok"
                if gpu.vfio_accessible
                else "not accessible (absent or no permission)"
            )
            lines.append(f"  {gpu.vfio_node}: {access}")
    if report.unhealthy:
        lines.append("")
        lines.append("Not healthy:")
        for bad in report.unhealthy:
            lines.append(f"  {bad.addr}  {bad.class_label}  {bad.health}")
            lines.append(f"          -> {bad.advice}")
    return "\n".join(lines)


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


#: The two values of libvirt's ``managed`` attribute that ``gpuwatch list --managed`` offers.
MANAGED_VALUES = ("yes", "no")

#: Said with every block set, because the choice decides who checks that nothing holds the GPU.
MANAGED_NOTES = {
    "yes": (
        "managed='yes': libvirt itself detaches these functions from their host driver and "
        "binds vfio-pci when the VM starts, without gpuwatch's holder checks (a process still "
        "using the GPU is cut off); for hosts that switch with `gpuwatch mode`, use "
        "`gpuwatch list --managed no`"
    ),
    "no": (
        "managed='no': libvirt leaves the drivers alone; switch the group to vfio-pci before "
        "the VM starts with `gpuwatch mode vfio --addr {addr}` (which checks holders){back}"
    ),
}
#: How an NVIDIA group goes back to the host; other vendors' host drivers are not a mode.
_BACK_TO_HOST = {
    "0x10de": ", and back after it stops with `gpuwatch mode nvidia --addr {addr}`",
}


def hostdev_xml(addr: str, managed: str = "yes") -> str:
    """libvirt's ``<hostdev>`` for one function. managed='yes' lets libvirt bind vfio-pci
    itself; managed='no' expects the group on vfio-pci already (``gpuwatch mode vfio``)."""
    if managed not in MANAGED_VALUES:
        raise ValueError(f"managed must be yes or no, not {managed!r}")
    domain, bus, rest = addr.split(":")
    slot, function = rest.split(".")
    return (
        f"<hostdev mode='subsystem' type='pci' managed='{managed}'>\n"
        "  <source>\n"
        f"    <address domain='0x{domain}' bus='0x{bus}' slot='0x{slot}' "
        f"function='0x{function}'/>\n"
        "  </source>\n"
        "</hostdev>"
    )


def vf_ready(fn: PciFunction, variants: frozenset[str] = frozenset()) -> bool:
    """An SR-IOV VF a guest can take now: healthy, and on VFIO, unbound (libvirt binds it), or
    an NVIDIA vGPU VF with a vGPU type chosen. A VF on a host driver is in use by the host."""
    if fn.health != "ok":
        return False
    if on_vfio(fn, variants) or not fn.driver:
        return True
    return fn.vgpu is not None and fn.vgpu.type != 0


def passthrough_gpus(model: HostModel, managed: str = "yes") -> list[PassthroughGpu]:
    """GPUs in an IOMMU group; every non-bridge function of the group must go to the guest.

    Bridges share groups with endpoints on some boards but stay with the host (pcieport).
    """
    out: list[PassthroughGpu] = []
    variants: frozenset[str] = getattr(model.state, "vfio_variants", frozenset())
    for gpu in model.probe("detect-vfio").gpus:
        if gpu.iommu_group < 0:
            continue
        if gpu.physfn and not vf_ready(gpu, variants):
            continue
        members: list[PciFunction] = [m for m in gpu.group_members if m.class_ != BRIDGE_CLASS]
        kept = model.kept_for_host(gpu.addr)
        out.append(
            PassthroughGpu(
                addr=gpu.addr,
                vendor=model.tables.gpu_vendors.get(gpu.vendor_id, gpu.vendor_id or "unknown"),
                vendor_id=gpu.vendor_id,
                device_id=gpu.device_id,
                iommu_group=gpu.iommu_group,
                managed=managed,
                physfn=gpu.physfn,
                note="" if kept else MANAGED_NOTES[managed].format(
                    addr=gpu.addr,
                    back=_BACK_TO_HOST.get(gpu.vendor_id, "").format(addr=gpu.addr)),
                kept_for_host=bool(kept),
                reason=kept,
                functions=[
                    HostdevFunction(
                        addr=m.addr,
                        class_label=m.class_label,
                        driver=m.driver,
                        hostdev_xml=None if kept else hostdev_xml(m.addr, managed),
                    )
                    for m in members
                ],
            )
        )
    return out


def render_list(gpus: list[PassthroughGpu], iommu_enabled: bool) -> str:
    offered = [g for g in gpus if not g.kept_for_host]
    kept = [g for g in gpus if g.kept_for_host]
    blocks: list[str] = []
    if not offered:
        why = "" if iommu_enabled else " (the IOMMU is off: see `gpuwatch status`)"
        blocks.append(f"no passthrough-capable GPU{why}")
    if kept:
        # Its own section, before the blocks, so that copying the blocks never takes it along.
        blocks.append("kept for the host (not offered for passthrough):")
        for gpu in kept:
            blocks.append(f"  GPU {gpu.addr} {gpu.vendor} {gpu.device_id}, IOMMU group "
                          f"{gpu.iommu_group}: {gpu.reason}")
    for gpu in offered:
        # The note is prose, not an XML comment: it names flags, and "--" may not appear
        # inside one. The blocks and their comments below stay valid XML to paste.
        blocks.append(f"note: {gpu.note}")
        vf = f" (SR-IOV VF of {gpu.physfn})" if gpu.physfn else ""
        blocks.append(
            f"<!-- GPU {gpu.addr}{vf} {gpu.vendor} {gpu.device_id}, IOMMU group "
            f"{gpu.iommu_group}: pass every function below together -->"
        )
        blocks.extend(f.hostdev_xml for f in gpu.functions if f.hostdev_xml is not None)
    return "\n".join(blocks)

