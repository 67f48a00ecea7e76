"""A Kubernetes node-feature-discovery local feature file, kept current by the watcher.

NFD's ``local`` source reads every file in ``features.d/`` and turns each ``name=value``
line into a node label (prefixed ``feature.node.kubernetes.io/``). Writing that file is all
it takes for a scheduler to see this host's GPUs and their modes: no poller, no API access.

The file is rewritten (atomically: temporary file, fsync, rename) only when a label changes,
plus once per half ``expiry`` so that the ``# +expiry-time`` directive never lapses while the
daemon runs; if the daemon dies, NFD drops the labels at that time.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import anyio
from pydantic import BaseModel

from gpuwatch.core.modes import group_mode
from gpuwatch.core.reporttext import iommu_isolates
from gpuwatch.hostfs.files import write_atomic
from gpuwatch.hostfs.noiommu import IommuGroups, read_iommu_groups

if TYPE_CHECKING:
    from gpuwatch.watch.watcher import Watcher

_log = logging.getLogger("gpuwatch.service")

#: The file name inside ``features.d/`` when a directory is given.
NFD_FILE_NAME = "gpuwatch"
#: NFD's usual features directory on a node.
NFD_FEATURES_DIR = "/etc/kubernetes/node-feature-discovery/features.d"
DEFAULT_EXPIRY = 3600.0
#: After a failed write: wait 1 s, doubling, until at most one attempt a minute.
RETRY_FIRST = 1.0
RETRY_MAX = 60.0
#: The probe answers the labels are made of: a change to any other one cannot alter them.
LABEL_PROBES = frozenset({"detect-vfio", "detect-gpu", "detect-amd-gpu", "amd-gfx-version",
                          "amd-gfx-target"})

_SLUG_RE = re.compile(r"[^a-z0-9]+")
#: A label's name (after NFD's ``feature.node.kubernetes.io/``) is at most 63 characters:
#: ``gpuwatch.gpu.`` + vendor + ``.count`` leaves this much for the vendor.
_VENDOR_MAX = 63 - len("gpuwatch.gpu.") - len(".count")
#: Vendor segments that would land on another label (``gpuwatch.gpu.vfio.count``).
_TAKEN = frozenset({"vfio", "unhealthy"})


def _slug(name: str) -> str:
    """A vendor name as a label-name segment: ``NVIDIA`` → ``nvidia``, ``Red Hat`` → ``red-hat``.

    Cut to fit Kubernetes' 63-character label names: a config's long vendor name or a
    garbled ``vendor`` file must not make NFD drop the label (or the node update)."""
    slug = _SLUG_RE.sub("-", name.lower()).strip("-")[:_VENDOR_MAX].rstrip("-") or "unknown"
    return f"vendor-{slug}" if slug in _TAKEN else slug


def _flag(value: bool) -> str:
    return "true" if value else "false"


def _get(obj: Any, name: str) -> Any:
    return obj[name] if isinstance(obj, Mapping) else getattr(obj, name)


def feature_labels(
    detect_vfio: Any,
    detect_gpu: bool,
    detect_amd_gpu: bool,
    amd_gfx_version: str,
    vendor_name: Callable[[str], str],
    amd_gfx_target: str = "",
    vfio_variants: frozenset[str] = frozenset(),
    iommu_on: bool | None = None,
) -> dict[str, str]:
    """The labels of one host, from probe answers only (pure: the tests feed it plain data).

    ``iommu_on``, when given, is `status`'s ``iommu.enabled``: false on a host whose only IOMMU
    groups are VFIO no-IOMMU groups, where detect-vfio's ``iommu_enabled`` (groups exist) is
    true but no VM can be given a device. A scheduler placing passthrough VMs reads this label.
    """
    iommu = bool(_get(detect_vfio, "iommu_enabled")) if iommu_on is None else iommu_on
    labels = {
        "gpuwatch.iommu": _flag(iommu),
        "gpuwatch.nvidia.cdi": _flag(detect_gpu),
        "gpuwatch.amd.gpu": _flag(detect_amd_gpu),
    }
    kind = _get(detect_vfio, "iommu_kind")
    if kind:
        labels["gpuwatch.iommu.kind"] = str(kind)
    if amd_gfx_version:
        labels["gpuwatch.amd.gfx"] = amd_gfx_version
    if amd_gfx_target:
        labels["gpuwatch.amd.gfx-target"] = amd_gfx_target
    vendors: Counter[str] = Counter()
    vfio = unhealthy = 0
    gpus = list(_get(detect_vfio, "gpus"))
    for gpu in gpus:
        vendors[_slug(vendor_name(str(_get(gpu, "vendor_id"))))] += 1
        members = _get(gpu, "group_members")
        if members and group_mode(_as_functions(members), vfio_variants) == "vfio":
            vfio += 1
        # Answers from before health existed (an older daemon's JSON) count as healthy.
        health = gpu.get("health", "ok") if isinstance(gpu, Mapping) else gpu.health
        if health != "ok":
            unhealthy += 1
    for vendor, count in vendors.items():
        labels[f"gpuwatch.gpu.{vendor}.count"] = str(count)
    labels["gpuwatch.gpu.count"] = str(len(gpus))
    labels["gpuwatch.gpu.vfio.count"] = str(vfio)
    labels["gpuwatch.gpu.unhealthy.count"] = str(unhealthy)
    return dict(sorted(labels.items()))


def _as_functions(members: Any) -> list[Any]:
    from gpuwatch.core.results import PciFunction

    return [m if isinstance(m, PciFunction) else PciFunction.model_validate(m) for m in members]


def render(labels: Mapping[str, str], expires: float | None) -> str:
    """The file's text: a header, the expiry directive (NFD >= 0.14 honours it), the labels."""
    lines = ["# Written by gpuwatch; rewritten on every change, do not edit."]
    if expires is not None:
        stamp = datetime.fromtimestamp(expires, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        lines.append(f"# +expiry-time={stamp}")
    lines.extend(f"{name}={value}" for name, value in labels.items())
    return "\n".join(lines) + "\n"


def resolve_path(path: str | os.PathLike[str]) -> str:
    """A directory (``features.d/``) gets the file name ``gpuwatch`` inside it."""
    text = os.fspath(path)
    if text.endswith("/") or os.path.isdir(text):
        return os.path.join(text, NFD_FILE_NAME)
    return text


def write_atomically(path: str, text: str) -> None:
    """Temporary file in the same directory, fsync, rename: NFD never reads half a file."""
    os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
    write_atomic(path, text, 0o644, sync_dir=True)


class NfdFeatureFile:
    """Keeps one features file in step with a watcher. ``attach`` then run ``run`` as a task."""

    def __init__(self, path: str | os.PathLike[str], *, expiry: float = DEFAULT_EXPIRY,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = resolve_path(path)
        self.expiry = expiry
        self._clock = clock
        self._watcher: Watcher | None = None
        self._labels: dict[str, str] | None = None
        self._written_at = 0.0
        self._dirty = True
        self._wake: anyio.Event | None = None  # made in `run`: an Event needs a running loop
        self.writes = 0
        #: Failed writes (each retry counts): ``gpuwatch_nfd_write_failures_total``.
        self.failures = 0
        self._backoff = 0.0  # seconds to wait before the next try; 0 while writes succeed

    def attach(self, watcher: Watcher) -> None:
        self._watcher = watcher
        watcher.listeners.append(self.on_event)

    def detach(self) -> None:
        if self._watcher is not None and self.on_event in self._watcher.listeners:
            self._watcher.listeners.remove(self.on_event)

    def on_event(self, event: BaseModel) -> None:
        """Watcher listener: only mark and wake; the writer task does the I/O."""
        etype = getattr(event, "type", "")
        if etype in ("ready", "device-error", "gpu-wedged") or (
                etype == "probe-changed" and getattr(event, "action", "") in LABEL_PROBES):
            self._dirty = True
            if self._wake is not None:
                self._wake.set()

    def labels(self, groups: IommuGroups | None = None) -> dict[str, str]:
        """The labels now; ``groups``: the IOMMU groups' names as read (`update` reads them
        in a worker thread), else read here when groups exist."""
        w = self._watcher
        assert w is not None, "attach a watcher first"
        gpu_vendors = w.tables.gpu_vendors
        return feature_labels(
            w.probe("detect-vfio"), bool(w.probe("detect-gpu")), bool(w.probe("detect-amd-gpu")),
            str(w.probe("amd-gfx-version")), lambda vid: gpu_vendors.get(vid, vid or "unknown"),
            str(w.probe("amd-gfx-target")) if w.probe("detect-amd-gpu") else "",
            w.model.state.vfio_variants,
            self._iommu_on(w, groups),
        )

    @staticmethod
    def _iommu_on(w: Watcher, groups: IommuGroups | None) -> bool:
        """`status`'s answer (`iommu_isolates`); the group names matter only where groups
        exist at all."""
        if not w.probe("detect-vfio").iommu_enabled:
            return False
        if groups is None:
            groups = read_iommu_groups(w.model.root)
        return iommu_isolates(True, groups.noiommu, groups.real, groups.emulated)

    async def update(self, *, force: bool = False) -> bool:
        """Write if the labels changed (or ``force``, or the expiry needs refreshing)."""
        self._dirty = False
        w = self._watcher
        assert w is not None, "attach a watcher first"
        groups = None
        if w.probe("detect-vfio").iommu_enabled:  # sysfs reads: off the event loop
            groups = await anyio.to_thread.run_sync(read_iommu_groups, w.model.root)
        labels = self.labels(groups)
        now = self._clock()
        refresh_due = self.expiry > 0 and now >= self._written_at + self.expiry / 2
        if not force and labels == self._labels and not refresh_due:
            self._backoff = 0.0
            return False
        expires = now + self.expiry if self.expiry > 0 else None
        text = render(labels, expires)
        try:
            await anyio.to_thread.run_sync(write_atomically, self.path, text)
        except OSError as exc:
            # Said once per outage, not per try: a read-only directory stays read-only.
            if self._backoff == 0:
                _log.warning("cannot write NFD features file %s: %s; retrying at most once "
                             "a minute", self.path, exc)
            self.failures += 1
            self._dirty = True
            self._backoff = min(max(self._backoff * 2, RETRY_FIRST), RETRY_MAX)
            return False
        if self._backoff:
            _log.warning("NFD features file %s written again", self.path)
        self._backoff = 0.0
        self._labels = labels
        self._written_at = now
        self.writes += 1
        return True

    async def run(self) -> None:
        """Write now, then on every change and before the expiry lapses."""
        self._wake = anyio.Event()
        await self.update(force=True)
        while True:
            if self._backoff:
                await anyio.sleep(self._backoff)  # changes meanwhile are picked up after
            elif not self._dirty:
                wait = None
                if self.expiry > 0:
                    wait = max(self._written_at + self.expiry / 2 - self._clock(), 0.0)
                with anyio.move_on_after(wait):
                    await self._wake.wait()
                self._wake = anyio.Event()
            await self.update()


__all__ = [
    "DEFAULT_EXPIRY",
    "NFD_FEATURES_DIR",
    "NFD_FILE_NAME",
    "NfdFeatureFile",
    "feature_labels",
    "render",
    "resolve_path",
    "write_atomically",
]
