"""The stdlib-only path of ``gpuwatch status`` and ``gpuwatch list``: from the daemon when one
answers, else from one direct scan (`Local`, the answers of `gpuwatch.cli.direct`).

The full commands build their reports on the daemon's ``detect-vfio`` answer with pydantic
models; here the same reports are built as plain dicts, in the models' field order, and
rendered by the same text functions (`gpuwatch.core.reporttext`), so the output is byte for
byte the full command's. A config file is never read here (that takes PyYAML). Of the tables,
the PCI class labels come in the daemon's answers; the vendor names, the host's console
drivers and devices and the vfio-pci variants are applied here, as the full command applies
its own tables to the daemon's answers: with no config file in force, the embedded tables
(pre-compiled as JSON next to the YAML); with one, the tables the daemon built from that very
file, taken from its ``config`` answer only when that proves the file is the one the daemon
read and checked, unchanged (`gpuwatch.cli.fast.ask_proven`). Anything else (another file, an
edit since, no daemon with a file in force, anything not plain) runs the full command.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from typing import Any

from gpuwatch.cli.common import EXIT_OK
from gpuwatch.cli.fast import (
    ROOT_ENV,
    _split,
    ask,
    ask_many,
    ask_proven,
    compact,
    daemon_socket,
    gives_root,
    is_probe_result,
    reader_may_leave,
)
from gpuwatch.core.health import health_advice
from gpuwatch.core.hostkeep import kept_for_host_reason
from gpuwatch.core.modes import (
    group_mode,
    host_bystanders,
    stays_with_host,
    variant_keys,
    vfio_variant,
)
from gpuwatch.core.reporttext import (
    MANAGED_VALUES,
    hostdev_xml,
    iommu_isolates,
    iommu_status,
    list_managed,
    managed_note,
    memlock_verdict,
    render_list,
    render_status,
    vf_ready,
)
from gpuwatch.core.tabledata import KEYED_TABLES, TABLE_KEYS, TableData, table_data
from gpuwatch.errors import GpuwatchError
from gpuwatch.hostfs.bootvga import HostConsole, console_unread, listed_console
from gpuwatch.hostfs.files import TreePlaces, tree_dir
from gpuwatch.hostfs.hostkind import read_host_kind
from gpuwatch.hostfs.noiommu import IommuGroups, read_iommu_groups, read_iommu_off, vfio_open


class Fn:
    """A PCI function of a probe answer with the attribute names the shared rules read."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data
        self.addr: str = data["addr"]
        self.driver: str = data["driver"]
        self.class_: str = data["class"]
        self.vendor_id: str = data.get("vendor_id", "")
        self.device_id: str = data.get("device_id", "")
        self.vfio_dev: Any = data.get("vfio_dev")
        self.health: str = data.get("health", "ok")
        vgpu = data.get("vgpu")
        self.vgpu = None if vgpu is None else _Vgpu(vgpu)


class _Vgpu:
    def __init__(self, data: dict[str, Any]) -> None:
        self.type: Any = data.get("type")


def embedded_tables() -> dict[str, Any]:
    """The embedded tables from their pre-compiled JSON form (tested to equal the YAML):
    read beside the package's own files, as it is installed, without `importlib.resources`
    (which brings pathlib, zipfile and tempfile: more than the rest of a cold `status`);
    through it only where the package is no folder (imported from a zip)."""
    import gpuwatch

    text = None
    if gpuwatch.__file__:
        try:
            with open(os.path.join(os.path.dirname(gpuwatch.__file__), "data", "tables.json"),
                      encoding="utf-8") as f:
                text = f.read()
        except OSError:
            pass
    if text is None:
        from importlib import resources

        text = resources.files("gpuwatch").joinpath("data/tables.json").read_text("utf-8")
    tables: dict[str, Any] = json.loads(text)
    return tables


def served_tables(served: dict[str, Any] | None) -> TableData:
    """The tables a report applies: the embedded ones with no config file in force
    (``served`` None), else those in the daemon's ``config`` answer, built from the very
    file in force (`ask_proven`). ValueError for an answer without them in the shape the
    reports read (a daemon older than them): the full command reads the file itself."""
    if served is None:
        return table_data(embedded_tables())
    raw = served.get("tables")
    if not (isinstance(raw, dict)
            and all(isinstance(raw.get(key), dict)
                    and all(isinstance(k, str) and isinstance(v, str)
                            for k, v in raw[key].items())
                    for key in TABLE_KEYS if key in KEYED_TABLES)
            and all(isinstance(raw.get(key), list)
                    and all(isinstance(item, str) for item in raw[key])
                    for key in TABLE_KEYS if key not in KEYED_TABLES)):
        raise ValueError("no tables in the daemon's config answer")
    return table_data(raw)


def _plain(argv: list[str], command: str, options: frozenset[str]
           ) -> tuple[dict[str, str], str, str | None] | None:
    if not argv or argv[0] != command:
        return None
    split = _split(argv[1:], options, frozenset({"--json"}))
    if split is None or split[0]:
        return None
    values = split[1]
    if "--root" not in values and ROOT_ENV in os.environ:
        return None  # the full command reads it (and refuses a blank one)
    return values, values.get("--root", "/"), values.get("--socket")


def parse_status(argv: list[str]) -> tuple[bool, str, str | None] | None:
    """``(as_json, root, socket)`` of a plain ``status`` command line, else None."""
    plain = _plain(argv, "status", frozenset({"--root", "--socket"}))
    return None if plain is None else ("--json" in plain[0], plain[1], plain[2])


def parse_list(argv: list[str]) -> tuple[bool, str, str, str | None] | None:
    """``(as_json, managed, root, socket)`` of a plain ``list`` command line, else None."""
    plain = _plain(argv, "list", frozenset({"--root", "--socket", "--managed"}))
    if plain is None or plain[0].get("--managed", "yes") not in MANAGED_VALUES:
        return None
    return "--json" in plain[0], plain[0].get("--managed", "yes"), plain[1], plain[2]


def _checked(action: str, result: Any) -> Any:
    """``result`` when it has the shape of ``action``'s answer; else ValueError (the full
    command runs, which scans directly: a daemon's "yes" is no ``true``)."""
    if not is_probe_result(action, result):
        raise ValueError(f"not a {action} answer")
    return result


#: No ``detect-gpu`` answer yet (``null`` is an answer: a wrong one).
_UNASKED: Any = object()


class Remote:
    """What the reports read of the daemon's model, through stdlib requests."""

    def __init__(self, path: str, root: str, vfio: Any, tables: TableData | None = None,
                 usable: Any = _UNASKED) -> None:
        self.path, self.root = path, root
        #: The daemon's ``detect-gpu`` answer when it came with ``detect-vfio`` (`status`
        #: asks both at once: one connection less), else asked when first needed.
        self._usable = usable
        #: The embedded tables unless given (`served_tables`).
        self.tables = tables if tables is not None else table_data(embedded_tables())
        #: As the full command's model holds them (`HostState.vfio_variants`).
        self.variants = variant_keys(self.tables.vfio_variant_drivers)
        self.vfio: dict[str, Any] = _checked("detect-vfio", vfio)
        self.gpus: list[dict[str, Any]] = vfio["gpus"]
        self._console: HostConsole | None = None
        self._accessible: dict[int, bool] | None = None

    def members(self, gpu: dict[str, Any]) -> list[Fn]:
        return [Fn(m) for m in gpu["group_members"]]

    def vendor(self, gpu: dict[str, Any]) -> str:
        vendor: str = self.tables.gpu_vendors.get(gpu["vendor_id"],
                                                  gpu["vendor_id"] or "unknown")
        return vendor

    def accessible(self, group: int) -> bool:
        if group < 0:
            return False
        if self._accessible is None:  # every GPU's group in one pipelined exchange
            groups = sorted({g["iommu_group"] for g in self.gpus if g["iommu_group"] >= 0}
                            | {group})
            answers = ask_many(self.path, [
                ("probe", {"action": "vfio-group-accessible", "group": g}) for g in groups])
            self._accessible = {g: _checked("vfio-group-accessible", a)
                                for g, a in zip(groups, answers, strict=True)}
        if group not in self._accessible:
            self._accessible[group] = _checked("vfio-group-accessible", ask(
                self.path, "probe", {"action": "vfio-group-accessible", "group": group}))
        return self._accessible[group]

    def nvidia_usable(self) -> bool:
        if self._usable is _UNASKED:
            self._usable = ask(self.path, "probe", {"action": "detect-gpu"})
        usable: bool = _checked("detect-gpu", self._usable)
        return usable

    def kept_for_host(self, gpu: dict[str, Any]) -> str:
        if self._console is None:  # once per report, not once per GPU
            gpus = [(g["addr"], g["physfn"], g["class"]) for g in self.gpus]
            groups = {g["addr"]: g["iommu_group"] for g in self.gpus}
            console = console_unread(gpus, groups) or listed_console(self.root, gpus, groups)
            if console is None:  # a tree without the bus listing: the scan's walk finds them
                from gpuwatch.hostfs.scan import read_console

                console = read_console(self.root, gpus, groups)
            self._console = console
        return kept_for_host_reason(self.members(gpu),  # type: ignore[arg-type]
                                    console_drivers=self.tables.host_console_drivers,
                                    console_devices=self.tables.host_console_devices,
                                    boot_vga=self._console.boot_vga,
                                    host_displays=self._console.displays,
                                    framebuffers=self._console.framebuffers)


class Local(Remote):
    """The same reports on one direct scan, for a root no daemon answers for: the answers
    of `FreshHost` (`gpuwatch.cli.direct`), no pydantic."""

    def __init__(self, root: str) -> None:
        from gpuwatch.cli.direct import fresh_host  # the scan's modules: only without a daemon

        self.host = fresh_host(root)
        super().__init__("", root, self.host.detect_vfio())

    def accessible(self, group: int) -> bool:
        return group >= 0 and bool(self.host.answer("vfio-group-accessible", group=group))

    def nvidia_usable(self) -> bool:
        return self.host.detect_gpu()


def _memlock() -> dict[str, Any]:
    def clean(value: int) -> int | None:
        return None if value == resource.RLIM_INFINITY else value

    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    verdict, hint = memlock_verdict(clean(soft))
    return {"soft": clean(soft), "hard": clean(hard), "verdict": verdict, "hint": hint}


def status_report(remote: Remote) -> dict[str, Any]:
    """`gpuwatch.report.build_status` on the daemon's model, as the dict its JSON is."""
    gpus: list[dict[str, Any]] = []
    functions: dict[str, dict[str, Any]] = {}
    groups = read_iommu_groups(remote.root)
    places = TreePlaces(remote.root)
    for gpu in remote.gpus:
        members = remote.members(gpu)
        group: int = gpu["iommu_group"]
        noiommu = group in groups.noiommu
        kept = remote.kept_for_host(gpu)
        node = groups.node(group)
        accessible = not noiommu and remote.accessible(group)
        opens, opens_ok = vfio_open(remote.root, node, bool(remote.vfio.get("iommufd")),
                                    [m.get("vfio_cdev", "") for m in gpu["group_members"]],
                                    accessible, places)
        gpus.append({
            "addr": gpu["addr"], "vendor": remote.vendor(gpu), "vendor_id": gpu["vendor_id"],
            "device_id": gpu["device_id"], "class_label": gpu["class_label"],
            "driver": gpu["driver"], "iommu_group": group,
            "mode": group_mode(members, remote.variants),
            "vfio_variant": vfio_variant(members, remote.variants),
            "vfio_node": node,
            "vfio_accessible": accessible,
            "iommufd": bool(remote.vfio.get("iommufd")),
            "vfio_open": opens,
            "vfio_open_accessible": opens_ok,
            "members": [{"addr": m["addr"], "class_label": m["class_label"],
                         "vendor_id": m["vendor_id"], "device_id": m["device_id"],
                         "driver": m["driver"], "health": m.get("health", "ok"),
                         "vfio_cdev": m.get("vfio_cdev", "")}
                        for m in gpu["group_members"]],
            "kept_for_host": bool(kept), "reason": kept,
        })
        functions.update((m["addr"], m) for m in gpu["group_members"])
    vfio = remote.vfio
    return {
        "iommu": iommu_status(vfio["iommu_enabled"], vfio["iommu_kind"], groups.noiommu,
                              groups.real, groups.emulated, read_iommu_off(remote.root),
                              read_host_kind(remote.root)),
        "vfio_pci_loaded": os.path.isdir(os.path.join(tree_dir(remote.root, "sys"),
                                                    "module/vfio_pci")),
        "nvidia_usable": remote.nvidia_usable(),
        "memlock": _memlock(),
        "gpus": gpus,
        "unhealthy": [
            {"addr": addr, "class_label": fn["class_label"], "driver": fn["driver"],
             "health": fn.get("health", "ok"),
             "advice": health_advice(fn.get("health", "ok"), addr, fn["driver"], ())}
            for addr, fn in sorted(functions.items()) if fn.get("health", "ok") != "ok"
        ],
    }


def list_report(remote: Remote, managed: str,
                groups: IommuGroups | None = None) -> list[dict[str, Any]]:
    """`gpuwatch.report.passthrough_gpus` on the daemon's model, as the dicts of its JSON."""
    out: list[dict[str, Any]] = []
    noiommu = (groups if groups is not None else read_iommu_groups(remote.root)).noiommu
    for gpu in remote.gpus:
        if gpu["iommu_group"] < 0 or gpu["iommu_group"] in noiommu:
            continue
        if gpu.get("physfn") and not vf_ready(Fn(gpu), remote.variants):  # type: ignore[arg-type]
            continue
        kept = remote.kept_for_host(gpu)
        members = [m for m in gpu["group_members"]
                   if not stays_with_host(Fn(m))]
        with_vfs = [(m["addr"], m["sriov"]["numvfs"]) for m in members
                    if m.get("sriov") and m["sriov"]["numvfs"] > 0]
        vgpu_type = int((gpu.get("vgpu") or {}).get("type", 0))
        blocks = list_managed(managed, vgpu_type)
        out.append({
            "addr": gpu["addr"], "vendor": remote.vendor(gpu), "vendor_id": gpu["vendor_id"],
            "device_id": gpu["device_id"], "iommu_group": gpu["iommu_group"],
            "managed": blocks, "physfn": gpu.get("physfn", ""),
            "note": "" if kept else managed_note(
                blocks, gpu["addr"], gpu["vendor_id"], with_vfs,
                [(m["addr"], m.get("health", "ok"),
                  health_advice(m.get("health", "ok"), m["addr"], m["driver"], ()))
                 for m in gpu["group_members"] if m.get("health", "ok") != "ok"],
                [(m.addr, m.driver)
                 for m in host_bystanders(remote.members(gpu), remote.variants)],
                vgpu_type),
            "functions": [{"addr": m["addr"], "class_label": m["class_label"],
                           "driver": m["driver"],
                           "hostdev_xml": None if kept else hostdev_xml(m["addr"], blocks)}
                          for m in members],
            "kept_for_host": bool(kept), "reason": kept,
        })
    return out




def run_report(argv: list[str]) -> int | None:
    """``gpuwatch status|list`` through the daemon with the stdlib; None: the full command."""
    status = parse_status(argv)
    listing = parse_list(argv) if status is None else None
    if status is not None:
        as_json, root, explicit = status
    elif listing is not None:
        as_json, root, explicit = listing[0], listing[2], listing[3]
    else:
        return None
    path = daemon_socket(root, explicit)
    if path is None:
        from gpuwatch.cli.direct import direct_settings_plain

        if not (os.path.isdir(root) and direct_settings_plain()):
            return None  # (a config file in force: the full command reads it)
    try:
        if path is not None:
            calls = [("probe", {"action": "detect-vfio"})]
            if status is not None:  # its NVIDIA line: on the same connection
                calls.append(("probe", {"action": "detect-gpu"}))
            proven = ask_proven(path, calls, root, gives_root(argv), explicit)
            if proven is None:
                return None  # a config file the daemon did not read as it is now
            root, served, (vfio, *usable) = proven
            remote = Remote(path, root, vfio, served_tables(served), *usable)
        else:
            remote = Local(root)
        if status is not None:
            report = status_report(remote)
            text = compact(report) if as_json else render_status(report)
        else:
            assert listing is not None
            groups = read_iommu_groups(remote.root)  # once for the list and its header
            gpus = list_report(remote, listing[1], groups)
            text = compact(gpus) if as_json else render_list(gpus, iommu_isolates(
                bool(remote.vfio["iommu_enabled"]), groups.noiommu, groups.real,
                groups.emulated))
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError,
            GpuwatchError):
        return None  # no answer, an error reply or an unexpected one: the full command
    with reader_may_leave():
        print(text)
        sys.stdout.flush()
    return EXIT_OK


__all__ = ["Local", "Remote", "embedded_tables", "list_report", "parse_list", "parse_status",
           "run_report", "served_tables", "status_report"]
