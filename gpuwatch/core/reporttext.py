"""The text of the operator reports (``status``, ``list``) and their pure rules, on the
reports' plain JSON form: shared by `gpuwatch.report` (pydantic models, dumped) and the
stdlib-only CLI path, so both print the same bytes. No pydantic here, by design."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any

from gpuwatch.core.health import UNSWITCHABLE
from gpuwatch.core.hostkind import HYPERVISOR_NAMES, NO_VIOMMU, UNKNOWN_HOST, HostKind
from gpuwatch.core.modes import BRIDGE_CLASSES, on_vfio
from gpuwatch.core.text import terminal_safe

if TYPE_CHECKING:
    from gpuwatch.core.results import PciFunction

#: Enough locked memory to pin a 16 GiB guest: vfio pins all guest RAM.
MEMLOCK_ENOUGH = 16 * 1024**3
#: The node VFIO gives a no-IOMMU group N: ``/dev/vfio/noiommu-N`` (`status`'s ``vfio_node``).
NOIOMMU_NODE = "/dev/vfio/noiommu-"
#: The iommufd character device a VMM binds VFIO device cdevs to (``vfio-backend``'s).
IOMMU_NODE = "/dev/iommu"


def vfio_open_nodes(vfio_node: str, node_present: bool, iommufd: bool,
                    cdevs: Iterable[str]) -> list[str]:
    """What a VM manager opens to pass a group through now (`status`'s ``vfio_open``): the
    group node when it exists; else, on a kernel with iommufd and the VFIO device cdevs only
    (no ``/dev/vfio/N``), ``/dev/iommu`` and each function's cdev; else nothing. A no-IOMMU
    group's node is for no VM."""
    if not vfio_node or vfio_node.startswith(NOIOMMU_NODE):
        return []
    if node_present:
        return [vfio_node]
    nodes = [c for c in cdevs if c]
    return [IOMMU_NODE, *nodes] if iommufd and nodes else []


def iommu_off_param(cmdline: str) -> str:
    """The ``iommu=`` parameter of the kernel command line that turns the IOMMU off, as
    spelt there (``iommu=off``, ``iommu=pt,off``), else ``""``. On x86 an ``off`` in its
    comma list sets ``no_iommu``, and then neither the Intel nor the AMD IOMMU driver
    starts, whatever ``intel_iommu=on`` or ``amd_iommu=on`` ask."""
    for token in cmdline.split():
        if token.startswith("iommu=") and any(
                option.startswith("off") for option in token[len("iommu="):].split(",")):
            return token
    return ""


#: What x86 needs for VFIO: the firmware's VT-d/AMD-Vi and the kernel's driver asked for.
X86_IOMMU_NEEDS = "intel_iommu=on or amd_iommu=on, and VT-d/AMD-Vi in the firmware"


def _viommu_devices(arch: str) -> str:
    """How QEMU and libvirt give a guest of ``arch`` a virtual IOMMU."""
    if arch == "arm64":
        return ("QEMU: -machine virt,iommu=smmuv3 or -device virtio-iommu-pci; libvirt: "
                "<iommu model='smmuv3'/> or <iommu model='virtio'/>")
    return ("QEMU: -device intel-iommu,intremap=on,caching-mode=on on a q35 machine, with "
            "intel_iommu=on on this guest's command line, or -device virtio-iommu-pci; "
            "libvirt: <iommu model='intel'/> or <iommu model='virtio'/>")


def no_iommu_advice(kind: str, host: HostKind) -> str:
    """What turns an IOMMU on for a host that is no x86 bare-metal one (``""`` for those,
    or when nothing says: the firmware's VT-d/AMD-Vi and ``intel_iommu=on`` are theirs). A
    guest has only what its hypervisor gives it: a virtual IOMMU, which no setting inside
    it creates (and a VM started inside it also needs nested virtualisation); an arm64
    host has its SMMU, which the firmware must describe and route the PCIe root complexes
    through (no ``intel_iommu=``/``amd_iommu=`` there). ``kind``: the IOMMU's
    (``detect-vfio``'s ``iommu_kind``; ``arm``: an SMMU is registered)."""
    if host.hypervisor:
        name = HYPERVISOR_NAMES.get(host.hypervisor, host.hypervisor)
        if host.hypervisor in NO_VIOMMU:
            return (f"this is a {name} virtual machine, whose hypervisor gives it no virtual "
                    "IOMMU: no device can be passed through from inside it; use the GPU in "
                    "this VM directly, or pass it through on a host with an IOMMU")
        viommu = _viommu_devices(host.arch if kind != "arm" else "arm64")
        if host.hypervisor == "rust-vmm":
            give = ("Cloud Hypervisor gives one to each device it is started with iommu=on "
                    "(--device path=<the sysfs path>,iommu=on: a virtio-iommu), Firecracker none")
        elif host.hypervisor == "kvm":
            give = f"give it one on the host ({viommu}) and restart it"
        else:
            give = (f"give it one if its hypervisor can ({viommu}) and restart it; Hyper-V "
                    "and cloud VMs get none")
        return (f"this is a virtual machine ({name}) without a virtual IOMMU: {give}; a VM "
                "started inside this one also needs nested virtualisation on the host")
    if kind == "arm":
        return ("an SMMU is registered but no device is in an IOMMU group: the firmware must "
                "route the PCIe root complexes through it (ACPI IORT, or the device tree's "
                "iommu-map), then reboot")
    if host.arch == "arm64":
        return ("no SMMU is registered: enable it in the firmware (ACPI IORT, or the device "
                "tree) and use a kernel with its driver (arm-smmu-v3 or arm-smmu), then "
                "reboot; intel_iommu= and amd_iommu= do not apply on arm64")
    return ""


def iommu_needs(kind: str, host: HostKind) -> str:
    """What vfio-pci needs, said where a switch is refused for the lack of an IOMMU: the
    IOMMU, and how to have one (`no_iommu_advice`, or on x86 `X86_IOMMU_NEEDS`)."""
    advice = no_iommu_advice(kind, host)
    return f"the IOMMU: {advice}" if advice else f"the IOMMU ({X86_IOMMU_NEEDS})"


def iommu_hint(enabled: bool, kind: str, off: str = "", host: HostKind = UNKNOWN_HOST) -> str:
    """How to enable the IOMMU (``""`` when it is on). ``off``: the command line's own
    `iommu_off_param`, which no firmware setting overrides: removing it comes first (x86's
    parameter: an arm64 kernel reads no ``iommu=``). ``host``: the machine's kind, whose
    advice differs from x86 bare metal's (`no_iommu_advice`)."""
    if enabled:
        return ""
    arm = kind == "arm" or host.arch == "arm64"
    advice = no_iommu_advice(kind, host)
    if off and not arm:
        said = (f"the kernel command line has {off}, which keeps the IOMMU off whatever "
                "intel_iommu=/amd_iommu= ask: remove it (iommu=pt, not off, for a "
                "passthrough host), then reboot")
        return f"{said}; {advice}" if host.hypervisor else said
    asked = {"intel": "intel_iommu=on", "amd": "amd_iommu=on"}.get(kind, "")
    if advice:
        return f"{asked} is asked for but no IOMMU group exists: {advice}" if asked else advice
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


def iommu_isolates(enabled: bool, noiommu: Collection[int] = (), real: bool = False,
                   emulated: Collection[int] = ()) -> bool:
    """Whether an IOMMU isolates anything: detect-vfio's ``iommu_enabled`` (groups exist),
    except where the only groups are VFIO's own, no-IOMMU (``noiommu``) or mediated devices'
    (``emulated``) (``real``: another group exists)."""
    return enabled and (real or not (noiommu or emulated))


def iommu_status(enabled: bool, kind: str, noiommu: Collection[int] = (),
                 real: bool = False, emulated: Collection[int] = (),
                 off: str = "", host: HostKind = UNKNOWN_HOST) -> dict[str, Any]:
    """``status``'s ``iommu`` entry: ``{enabled, kind, hint}``.

    ``enabled`` is detect-vfio's ``iommu_enabled`` (IOMMU groups exist), except on a host
    whose only groups are VFIO's own (``noiommu``, ``emulated``; ``real``: another group
    exists): there is no IOMMU there, and the operator is told so rather than "enabled". Only
    no-IOMMU groups are named: a mediated device's group is safe for its VM. ``off``: the
    command line's `iommu_off_param`; ``host``: the machine's kind (`iommu_hint`)."""
    on = iommu_isolates(enabled, noiommu, real, emulated)
    hint = iommu_hint(on, kind, off, host)
    if noiommu:
        said = (f"IOMMU group(s) {', '.join(str(g) for g in sorted(noiommu))}: VFIO no-IOMMU "
                "mode (vfio.enable_unsafe_noiommu_mode), no DMA isolation: for userspace "
                "drivers, never for a VM")
        hint = f"{said}; {hint}" if hint else said
    return {"enabled": on, "kind": kind, "hint": hint}


def memlock_verdict(soft: int | None) -> tuple[str, str]:
    """``(verdict, hint)`` of a soft RLIMIT_MEMLOCK (None: unlimited)."""
    if soft is None:
        return "unlimited", ""
    if soft >= MEMLOCK_ENOUGH:
        return "enough", "enough for a 16 GiB guest; raise it for larger ones"
    return "too low", (
        "vfio pins all guest memory: raise RLIMIT_MEMLOCK (LimitMEMLOCK=infinity in the "
        "systemd unit, `ulimit -l unlimited`, or memlock in /etc/security/limits.conf)"
    )


def addr_width(addrs: Iterable[str]) -> int:
    """The width of a block's address column: its widest address. A VMD domain's functions
    (``10000:01:00.0``) are a character wider than the usual ``0000:…`` ones, and may share
    a group with them (the VMD controller's own): padding every row to the widest keeps the
    columns after the address in line."""
    return max((len(a) for a in addrs), default=0)


def _fmt_bytes(value: int | None) -> str:
    if value is None:
        return "unlimited"
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if value >= size:
            return f"{value / size:g} {unit}"
    return f"{value} B"


def _nvidia_line(report: dict[str, Any]) -> str:
    """Why NVIDIA is (not) usable, naming what is missing where the report tells: a GPU on
    nvidia proves the module loaded, so only CDI can be lacking (a real host with the
    driver up and no container toolkit installed)."""
    if report["nvidia_usable"]:
        return "usable (nvidia loaded, CDI reachable, a GPU on nvidia)"
    if any(gpu["driver"] == "nvidia" for gpu in report["gpus"]):
        return ("not usable: a GPU is on nvidia, but there is no CDI spec "
                "(/etc/cdi/nvidia.yaml, /var/run/cdi/nvidia.yaml) and no nvidia-ctk on PATH "
                "to make one (install the NVIDIA Container Toolkit, then gpuwatch ensure-cdi)")
    return "not usable (needs nvidia loaded, a CDI spec or nvidia-ctk, and a GPU on nvidia)"


def render_status(report: dict[str, Any]) -> str:
    """``gpuwatch status``'s text of a status report in its JSON form."""
    io = report["iommu"]
    lines = [
        f"IOMMU:    {'enabled' if io['enabled'] else 'disabled'}"
        + (f" ({io['kind']})" if io["kind"] else ""),
    ]
    if io["hint"]:
        lines.append(f"          -> {io['hint']}")
    lines.append(
        f"vfio-pci: {'loaded' if report['vfio_pci_loaded'] else 'not loaded (modprobe vfio-pci)'}"
    )
    lines.append("NVIDIA:   " + _nvidia_line(report))
    ml = report["memlock"]
    lines.append(f"memlock:  {_fmt_bytes(ml['soft'])} (hard {_fmt_bytes(ml['hard'])}): "
                 f"{ml['verdict']}")
    if ml["hint"] and ml["verdict"] == "too low":
        lines.append(f"          -> {ml['hint']}")
    if not report["gpus"]:
        lines.append("GPUs:     none found")
    for gpu in report["gpus"]:
        group = (f"group {gpu['iommu_group']}" if gpu["iommu_group"] >= 0
                 else "no IOMMU group")
        noiommu = gpu["vfio_node"].startswith(NOIOMMU_NODE)
        if noiommu:
            group += " (VFIO no-IOMMU)"
        lines.append("")
        variant = f" ({gpu['vfio_variant']})" if gpu["vfio_variant"] else ""
        lines.append(
            f"GPU {gpu['addr']}  {_card(gpu['vendor'], gpu['device_id'])} "
            f"({gpu['class_label']})  {group}  mode: {gpu['mode']}{variant}"
        )
        if gpu["kept_for_host"]:
            lines.append(f"  kept for the host: {gpu['reason']}")
        width = addr_width(m["addr"] for m in gpu["members"])
        for m in gpu["members"]:
            lines.append(
                f"  {m['addr']:<{width}}  {m['class_label']:<20} "
                f"{_ids(m['vendor_id'], m['device_id'])}  "
                f"driver: {m['driver'] or '(none)'}"
                + (f"  health: {m['health']}" if m["health"] != "ok" else "")
            )
        opens = gpu.get("vfio_open", [])
        if noiommu:
            lines.append(f"  {gpu['vfio_node']}: VFIO no-IOMMU group: no DMA isolation, not "
                         "for a VM")
        elif opens[:1] == [IOMMU_NODE]:
            # An iommufd-only kernel: no group node; a VMM opens each function's cdev.
            cdevs = ", ".join(f"{m['vfio_cdev']} ({m['addr']})" for m in gpu["members"]
                              if m.get("vfio_cdev"))
            access = ("read/write ok" if gpu["vfio_open_accessible"]
                      else "not accessible (no permission)")
            lines.append(f"  {gpu['vfio_node']}: absent (iommufd only): a VM opens "
                         f"{IOMMU_NODE} and {cdevs}: {access}")
        elif gpu["vfio_node"]:
            access = (
                "read/write ok"
                if gpu["vfio_accessible"]
                else "not accessible (absent or no permission)"
            )
            lines.append(f"  {gpu['vfio_node']}: {access}")
    if report["unhealthy"]:
        lines.append("")
        lines.append("Not healthy:")
        width = addr_width(bad["addr"] for bad in report["unhealthy"])
        for bad in report["unhealthy"]:
            lines.append(f"  {bad['addr']:<{width}}  {bad['class_label']}  {bad['health']}")
            lines.append(f"          -> {bad['advice']}")
    return terminal_safe("\n".join(lines))


# --------------------------------------------------------------------------- list

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
#: An NVIDIA vGPU VF with a type chosen (vendor-specific VFIO: nvidia itself registers the
#: VF's VFIO device): libvirt must leave it on nvidia, whatever ``--managed`` asks.
VGPU_NOTE = (
    "managed='no' whatever --managed says: {addr} is an NVIDIA vGPU VF (vGPU type {type}) "
    "that stays on nvidia, whose VFIO device the VM opens; libvirt must not detach it "
    "(managed='yes' would bind vfio-pci to it and take the vGPU away)"
)
#: How an NVIDIA group goes back to the host; other vendors' host drivers are not a mode.
_BACK_TO_HOST = {
    "0x10de": ", and back after it stops with `gpuwatch mode nvidia --addr {addr}`",
}


def managed_note(managed: str, addr: str, vendor_id: str,
                 with_vfs: Iterable[tuple[str, int]] = (),
                 unhealthy: Iterable[tuple[str, str, str]] = (),
                 bystanders: Iterable[tuple[str, str]] = (),
                 vgpu_type: int = 0) -> str:
    """What the blocks' managed attribute means for who detaches the group; for each member
    that is an SR-IOV physical function with virtual functions enabled (address, count), that
    detaching it takes them away (`gpuwatch mode` refuses it); and for each member that is not
    healthy (address, health, advice from `gpuwatch.core.health.health_advice`), that it
    needs its recovery before a guest can use it (`gpuwatch mode` refuses a wedged or failed
    one); and for each member that is no part of the card but on a host driver (address,
    driver: a NIC behind the same PCIe switch without ACS), that the guest takes it from the
    host (`gpuwatch mode` refuses to without --force). ``vgpu_type``: the GPU is an NVIDIA
    vGPU VF with that type chosen (`list_managed`), whose blocks are managed='no'."""
    if vgpu_type:
        note = VGPU_NOTE.format(addr=addr, type=vgpu_type)
    else:
        note = MANAGED_NOTES[managed].format(
            addr=addr, back=_BACK_TO_HOST.get(vendor_id, "").format(addr=addr))
    for pf, numvfs in with_vfs:
        note += (f"; {pf} has {numvfs} SR-IOV virtual function(s) enabled: taking its driver "
                 "away removes them under whatever uses them (`gpuwatch mode` refuses to), "
                 "so disable them first")
    for member, health, advice in unhealthy:
        note += f"; {member} is not healthy ({advice})"
        if health in UNSWITCHABLE:
            note += (": recover it before a guest takes it (`gpuwatch mode` refuses to switch "
                     "it until then)")
    for member, driver in bystanders:
        note += (f"; {member} (on {driver}) shares the IOMMU group but is no part of the "
                 "card: passing the group through takes it from the host (`gpuwatch mode` "
                 "refuses to without --force)")
    return note


def list_managed(managed: str, vgpu_type: int) -> str:
    """The managed attribute of a GPU's blocks: ``--managed``'s, but ``no`` for an NVIDIA vGPU
    VF with a type chosen (``vgpu_type`` ≠ 0). With NVIDIA's vendor-specific VFIO (the vGPU
    manager since Linux 6.8, no mdev) the VF stays on nvidia, which registers its VFIO
    device; managed='yes' has libvirt unbind it from nvidia and bind vfio-pci, and the vGPU
    written to ``nvidia/current_vgpu_type`` goes with the driver."""
    return "no" if vgpu_type else managed


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


def _card(vendor: str, device_id: str) -> str:
    """A GPU's vendor and device id as a heading names them; a capture that copied only some
    of a function's files leaves the id empty, and the heading then shows no gap for it."""
    return f"{vendor} {device_id}" if device_id else vendor


def _ids(vendor_id: str, device_id: str) -> str:
    """``vendor:device`` of a member line, or ``unknown`` when a capture kept neither file
    (not a bare ``:``)."""
    return f"{vendor_id}:{device_id}" if vendor_id or device_id else "unknown"


def render_list(gpus: list[dict[str, Any]], iommu_enabled: bool) -> str:
    """``gpuwatch list``'s text of the passthrough GPUs in their JSON form."""
    offered = [g for g in gpus if not g["kept_for_host"]]
    kept = [g for g in gpus if g["kept_for_host"]]
    blocks: list[str] = []
    if not offered:
        why = "" if iommu_enabled else " (the IOMMU is off: see `gpuwatch status`)"
        blocks.append(f"no passthrough-capable GPU{why}")
    if kept:
        # Its own section, before the blocks, so that copying the blocks never takes it along.
        blocks.append("kept for the host (not offered for passthrough):")
        for gpu in kept:
            blocks.append(f"  GPU {gpu['addr']} {_card(gpu['vendor'], gpu['device_id'])}, "
                          f"IOMMU group {gpu['iommu_group']}: {gpu['reason']}")
    #: The first GPU to give a group's blocks, by the blocks (a group's, whichever GPU of it).
    given: dict[tuple[str, ...], str] = {}
    for gpu in offered:
        # The note is prose, not an XML comment: it names flags, and "--" may not appear
        # inside one. The blocks and their comments below stay valid XML to paste.
        blocks.append(f"note: {gpu['note']}")
        vf = f" (SR-IOV VF of {gpu['physfn']})" if gpu["physfn"] else ""
        card = f"GPU {gpu['addr']}{vf} {_card(gpu['vendor'], gpu['device_id'])}"
        xml = tuple(f["hostdev_xml"] for f in gpu["functions"] if f["hostdev_xml"] is not None)
        first = given.get(xml) if xml else None
        if first is not None:
            # Two GPUs of one group (no ACS between them): its blocks once, or a domain
            # pasted from both sets names each function twice, which libvirt refuses.
            blocks.append(_xml_comment(
                f"{card}, IOMMU group {gpu['iommu_group']}: its functions are in the blocks "
                f"of GPU {first} above (one group, one VM)"))
            continue
        given[xml] = gpu["addr"]
        shared = [g["addr"] for g in offered if g is not gpu
                  and g["iommu_group"] == gpu["iommu_group"]
                  and tuple(f["hostdev_xml"] for f in g["functions"]
                            if f["hostdev_xml"] is not None) == xml]
        with_ = f" with GPU {', '.join(shared)}" if shared else ""
        blocks.append(_xml_comment(
            f"{card}, IOMMU group {gpu['iommu_group']}{with_}: pass every function below "
            "together"))
        blocks.extend(xml)
    return terminal_safe("\n".join(blocks))


def _xml_comment(text: str) -> str:
    """``text`` as an XML comment that pastes into a domain: a vendor name from the tables
    or an id read from the host may hold ``--``, which no XML comment may (libvirt's parser
    refuses the whole document), so each hyphen followed by another gets a space."""
    return f"<!-- {re.sub(r'-(?=-)', '- ', text)} -->"


__all__ = ["BRIDGE_CLASSES", "MANAGED_NOTES", "MANAGED_VALUES", "MEMLOCK_ENOUGH",
           "X86_IOMMU_NEEDS", "addr_width", "hostdev_xml", "iommu_hint", "iommu_isolates",
           "iommu_needs", "iommu_off_param", "iommu_status", "list_managed", "managed_note",
           "memlock_verdict", "no_iommu_advice", "render_list", "render_status", "vf_ready"]
