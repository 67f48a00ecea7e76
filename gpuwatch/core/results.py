"""The typed answers of the probe contract (see docs/probes.md).

Built once when the model changes and then handed out as is: they are frozen, so a
caller can keep one without it changing under them, and a cached probe costs a lookup.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

#: A function's health as its error-recovery and DRM wedge uevents left it.
Health = Literal["ok", "recovering", "failed", "wedged"]
HEALTH_STATES: tuple[Health, ...] = ("ok", "recovering", "failed", "wedged")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, serialize_by_alias=True, validate_by_name=True)


class Sriov(_Frozen):
    """A physical function's SR-IOV state: ``vfs`` from its ``virtfnN`` links, in N order."""

    totalvfs: int
    numvfs: int
    vfs: tuple[str, ...]


class Vgpu(_Frozen):
    """An NVIDIA vGPU-capable VF: its current vGPU type (0 = none) and the creatable ones."""

    type: int
    creatable: tuple[int, ...]


class PciFunction(_Frozen):
    """One PCI function as the probe contract spells it."""

    addr: str
    vendor_id: str
    device_id: str
    class_: str = Field(alias="class")
    class_label: str
    driver: str
    iommu_group: int
    vfio_dev: str = ""
    vfio_cdev: str = ""
    sriov: Sriov | None = None
    physfn: str = ""
    vgpu: Vgpu | None = None
    health: Health = "ok"


class GpuInfo(PciFunction):
    """A display-class function with every function of its IOMMU group (itself alone if none)."""

    group_members: tuple[PciFunction, ...]


class DetectVfioResult(_Frozen):
    iommu_enabled: bool
    iommu_kind: str
    #: ``/dev/iommu`` exists: VMMs can use iommufd with the functions' VFIO cdevs.
    iommufd: bool = False
    gpus: tuple[GpuInfo, ...]


class VfioBackend(_Frozen):
    """How a VMM should open one function through VFIO (the ``vfio-backend`` probe)."""

    addr: str
    driver: str
    on_vfio: bool
    group_node: str
    cdev_node: str
    iommufd: bool
    recommended: Literal["iommufd", "group", "none"]


class HostDevicesResult(_Frozen):
    gpu: bool
    amd_gpu: bool
    amd_gfx_version: str
    amd_gfx_target: str
    devices: tuple[str, ...]
    render_node: str


class MemlockResult(_Frozen):
    """RLIMIT_MEMLOCK in bytes; ``None`` is unlimited."""

    soft: int | None
    hard: int | None


class Holder(_Frozen):
    """A process holding a GPU device node open (the ``nvidia-holders`` probe);
    ``unreadable`` when its open files could not be read in time (stuck in the kernel): it
    may hold one, so it counts as a holder."""

    pid: int
    comm: str
    unreadable: bool = False

    @model_serializer(mode="wrap")
    def _spelling(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if isinstance(data, dict) and not self.unreadable:
            data.pop("unreadable", None)  # {"pid", "comm"}, as before
        return data


class Holding(Holder):
    """A process that keeps a device node of the group open, so the switch must not unbind;
    an ``unreadable`` one is spelled ``{"pid", "comm", "unreadable": true}``."""

    node: str = ""

    @model_serializer(mode="wrap")
    def _spelling(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if isinstance(data, dict):
            data.pop("node" if self.unreadable else "unreadable", None)
        return data
