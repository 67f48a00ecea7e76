"""The typed answers of the probe contract (see docs/probes.md).

Built once when the model changes and then handed out as is: they are frozen, so a
caller can keep one without it changing under them, and a cached probe costs a lookup.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, serialize_by_alias=True, validate_by_name=True)


class PciFunction(_Frozen):
    """One PCI function as the probe contract spells it."""

    addr: str
    vendor_id: str
    device_id: str
    class_: str = Field(alias="class")
    class_label: str
    driver: str
    iommu_group: int


class GpuInfo(PciFunction):
    """A display-class function with every function of its IOMMU group (itself alone if none)."""

    group_members: tuple[PciFunction, ...]


class DetectVfioResult(_Frozen):
    iommu_enabled: bool
    iommu_kind: str
    gpus: tuple[GpuInfo, ...]


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
    """A process holding a GPU device node open."""

    pid: int
    comm: str
