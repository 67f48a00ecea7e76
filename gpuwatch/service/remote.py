"""The parts of `HostModel` that ``status`` and ``list`` read, answered by the daemon.

Lets the operator reports (gpuwatch/report.py) run unchanged on the daemon's in-memory model:
one ``detect-vfio`` probe carries every GPU with its group, and access to ``/dev/vfio/N`` is
asked of the daemon, which answers for the caller (the socket peer), as a local scan would.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from gpuwatch.core.modes import variant_keys
from gpuwatch.core.results import DetectVfioResult, PciFunction
from gpuwatch.core.tables import Tables
from gpuwatch.hostfs.files import tree_dir
from gpuwatch.service.client import Client

if TYPE_CHECKING:
    from gpuwatch.hostfs.bootvga import HostConsole


class _RemoteState:
    def __init__(self, vfio: DetectVfioResult, tables: Tables) -> None:
        self._members = {gpu.addr: gpu.group_members for gpu in vfio.gpus}
        #: The config file's vfio-pci variants, as a scan's state holds them: a group on
        #: one is in ``vfio`` mode whether the daemon or a direct scan answers.
        self.vfio_variants = variant_keys(tables.vfio_variant_drivers)

    def group_members(self, addr: str) -> tuple[PciFunction, ...]:
        return self._members[addr]


class RemoteModel:
    """Duck-typed stand-in for `HostModel` in `build_status` and `passthrough_gpus`."""

    def __init__(self, client: Client, tables: Tables, root: str = "/") -> None:
        self._client = client
        self.tables = tables
        self.root = root
        self._vfio = DetectVfioResult.model_validate(client.probe("detect-vfio"))
        self.state = _RemoteState(self._vfio, tables)
        self._console: HostConsole | None = None

    def probe(self, action: str, **params: Any) -> Any:
        if action == "detect-vfio" and not params:
            return self._vfio
        return self._client.probe(action, **params)

    def vfio_group_accessible(self, group: int | None) -> bool:
        if group is None or group < 0:
            return False
        return bool(self._client.probe("vfio-group-accessible", group=group))

    def kept_for_host(self, addr: str) -> str:
        """The same rule as the model's; ``boot_vga`` and the framebuffer devices are in no
        probe answer, so they are read from sysfs here (once per report, not once per GPU,
        and not at all on a host of two displays or more in different groups:
        `console_unread`), as `module_loaded` reads modules."""
        from gpuwatch.core.hostkeep import kept_for_host_reason
        from gpuwatch.hostfs.bootvga import console_unread
        from gpuwatch.hostfs.scan import read_console

        if self._console is None:
            gpus = [(g.addr, g.physfn, g.class_) for g in self._vfio.gpus]
            groups = {g.addr: g.iommu_group for g in self._vfio.gpus}
            self._console = (console_unread(gpus, groups)
                             or read_console(self.root, gpus, groups))
        console = self._console
        return kept_for_host_reason(self.state.group_members(addr),
                                    console_drivers=self.tables.host_console_drivers,
                                    console_devices=self.tables.host_console_devices,
                                    boot_vga=console.boot_vga, host_displays=console.displays,
                                    framebuffers=console.framebuffers)

    def module_loaded(self, name: str) -> bool:
        # Module state is not in any probe answer; sysfs says it directly and cheaply.
        return os.path.isdir(os.path.join(tree_dir(self.root, "sys"), "module", name))


__all__ = ["RemoteModel"]
