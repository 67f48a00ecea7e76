"""A Kubernetes node-feature-discovery local feature file, kept current by the watcher.

NFD's ``local`` source reads every file in ``features.d/`` and turns each ``name=value``
line into a node label (prefixed ``feature.node.kubernetes.io/``). Writing that file is all
it takes for a scheduler to see this host's GPUs and their modes: no poller, no API access.

The file is rewritten (atomically: temporary file, fsync, rename) only when a label changes,
plus once per half ``expiry`` so that the ``# +expiry-time`` directive never lapses while the
daemon runs; if the daemon dies, NFD drops the labels at that time. The writer looks at the wall
clock at least once a minute, so a clock stepped forward (NTP at boot) or back is caught, and
at the file and its directory then too, so a file removed or replaced (the directory made
again) is written again. It holds an exclusive flock on the features directory for life,
taken again on the directory at the path when that is another one, so that two daemons on
one node (the systemd unit and the DaemonSet) cannot overwrite each other's file unseen.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import math
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
from gpuwatch.errors import SERVICE, HostError
from gpuwatch.hostfs.files import flock_holder, write_atomic
from gpuwatch.hostfs.noiommu import IommuGroups, read_iommu_groups
from gpuwatch.settings import MIN_NFD_EXPIRY

if TYPE_CHECKING:
    from gpuwatch.watch.watcher import Watcher

_log = logging.getLogger("gpuwatch.service")

#: The file name inside ``features.d/`` when a directory is given.
NFD_FILE_NAME = "gpuwatch"
#: NFD's local feature directory: a path by this name not made yet is taken as it.
NFD_DIRECTORY_NAME = "features.d"
#: NFD's usual features directory on a node.
NFD_FEATURES_DIR = "/etc/kubernetes/node-feature-discovery/features.d"
DEFAULT_EXPIRY = 3600.0
#: After a failed write: wait 1 s, doubling, until at most one attempt a minute.
RETRY_FIRST = 1.0
RETRY_MAX = 60.0
#: The writer re-reads the wall clock at least this often (a quarter of the expiry when that
#: is shorter): a clock stepped forward by NTP would otherwise leave the expiry in the past
#: until the next timed refresh, computed from the clock before the step.
RECHECK_MAX = 60.0
#: At least this long between two writes, whatever asks for them: the loop can never spin
#: (a tiny expiry from a library caller, a clock gone wrong), and a burst of changes is
#: written once. NFD itself reads ``features.d`` about once a minute.
MIN_WRITE_INTERVAL = 1.0
#: The least non-zero ``nfd_expiry`` the settings accept: NFD re-reads ``features.d`` about
#: every 60 s, so a shorter expiry could lapse between two of its reads of a live file.
MIN_EXPIRY = MIN_NFD_EXPIRY
#: The probe answers the labels are made of: a change to any other one cannot alter them.
LABEL_PROBES = frozenset({"detect-vfio", "detect-gpu", "detect-amd-gpu", "amd-gfx-version",
                          "amd-gfx-target"})

_SLUG_RE = re.compile(r"[^a-z0-9]+")
#: A label's name (after NFD's ``feature.node.kubernetes.io/``) is at most 63 characters:
#: ``gpuwatch.gpu.`` + vendor + ``.count`` leaves this much for the vendor.
_VENDOR_MAX = 63 - len("gpuwatch.gpu.") - len(".count")
#: Vendor segments that would land on another label (``gpuwatch.gpu.vfio.count``).
_TAKEN = frozenset({"vfio", "unhealthy"})


class NfdDirectoryLocked(HostError):
    """Another process writes this features directory (it holds its flock): two writers
    would overwrite each other's file, the last one winning, so the second one stops."""

    code = SERVICE


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
    """The file's text: a header, the expiry directive (NFD >= 0.14 honours it), the labels.

    The stamp is rounded up to the second: truncated, it would be up to a second earlier than
    asked, already past when the expiry is short."""
    lines = ["# Written by gpuwatch; rewritten on every change, do not edit."]
    if expires is not None:
        stamp = datetime.fromtimestamp(math.ceil(expires), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        lines.append(f"# +expiry-time={stamp}")
    lines.extend(f"{name}={value}" for name, value in labels.items())
    return "\n".join(lines) + "\n"


def resolve_path(path: str | os.PathLike[str]) -> str:
    """A directory (``features.d/``) gets the file name ``gpuwatch`` inside it. So does a
    path named ``features.d`` that does not exist yet, slash or not: that is NFD's directory
    (made at the first write), and a file of ours by that name would block it."""
    text = os.fspath(path)
    if (text.endswith("/") or os.path.isdir(text)
            or (os.path.basename(text) == NFD_DIRECTORY_NAME and not os.path.lexists(text))):
        return os.path.join(text, NFD_FILE_NAME)
    return text


def write_atomically(path: str, text: str) -> None:
    """Temporary file in the same directory, fsync, rename: NFD never reads half a file."""
    os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
    write_atomic(path, text, 0o644, sync_dir=True)


def lock_directory(directory: str) -> int:
    """The features directory opened and flocked exclusively (no waiting): its descriptor.

    The directory itself, not a lock file: NFD reads every file in ``features.d`` as
    features. Raises `NfdDirectoryLocked` naming the holder's pid when another process holds
    it, OSError when the directory cannot be made or opened."""
    os.makedirs(directory, mode=0o755, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        who = flock_holder(fd) if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else ""
        os.close(fd)
        if not who:
            raise
        raise NfdDirectoryLocked(
            f"NFD features directory {directory} is written by {who} (it holds the "
            "directory's lock); one features directory has one gpuwatch writer") from None
    return fd


def _identity(path: str) -> tuple[int, ...] | None:
    """What is at ``path`` (links followed), None for nothing: device and inode, and size
    and mtime, which a write in place changes."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class NfdFeatureFile:
    """Keeps one features file in step with a watcher. ``attach`` then run ``run`` as a task."""

    def __init__(self, path: str | os.PathLike[str], *, expiry: float = DEFAULT_EXPIRY,
                 clock: Callable[[], float] = time.time, recheck: float = RECHECK_MAX,
                 min_interval: float = MIN_WRITE_INTERVAL) -> None:
        self.path = resolve_path(path)
        self.directory = os.path.dirname(self.path) or "."
        self.expiry = expiry
        self._clock = clock
        #: Seconds between looks at the wall clock; writes at least ``min_interval`` apart.
        self.recheck = min(recheck, expiry / 4) if expiry > 0 else recheck
        self.min_interval = min_interval
        self._dir_fd: int | None = None  # the features directory, flocked (`lock`)
        #: `_identity` of the file as last renamed in: another one there, or none, or this
        #: one written over, is not what we wrote (`_replaced`).
        self._file_id: tuple[int, ...] | None = None
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

    def lock(self) -> bool:
        """Take the features directory's flock for the writer's life (`close` drops it).

        Raises `NfdDirectoryLocked` when another writer holds it: the daemon refuses to
        start. A directory that cannot be made or opened yet is no refusal (as a failed
        write is none): False, and every write tries again first, writing only once held."""
        if self._dir_fd is not None:
            return True
        try:
            self._dir_fd = lock_directory(self.directory)
        except OSError:
            return False
        return True

    def close(self) -> None:
        """Drop the directory's flock: another writer may take over."""
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None

    def _write(self, text: str) -> None:
        """Lock (when not yet held), then write: never a write without the lock. A directory
        at the path that is not the one held (removed and made again, a link put in its place)
        is locked first: the lock held is on a directory no other writer would look at."""
        if self._dir_fd is not None and not self._holds_directory():
            self.close()
        if self._dir_fd is None:
            self._dir_fd = lock_directory(self.directory)
        write_atomically(self.path, text)
        self._file_id = _identity(self.path)

    def _holds_directory(self) -> bool:
        """The directory at the path is the one whose flock is held."""
        assert self._dir_fd is not None
        held = os.fstat(self._dir_fd)
        now = _identity(self.directory)
        return now is not None and now[:2] == (held.st_dev, held.st_ino)

    def _replaced(self) -> bool:
        """The file at the path is not the one last written (removed, replaced, its directory
        made again), or the directory is not the one locked: NFD would read no labels of ours,
        or another's, until the next change or refresh. False before the first write."""
        if self._file_id is None:
            return False
        return (_identity(self.path) != self._file_id
                or (self._dir_fd is not None and not self._holds_directory()))

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
        refresh_due = self.expiry > 0 and self._refresh_due(now)
        if not force and labels == self._labels and not refresh_due:
            self._backoff = 0.0
            return False
        expires = now + self.expiry if self.expiry > 0 else None
        text = render(labels, expires)
        try:
            await anyio.to_thread.run_sync(self._write, text)
        except (OSError, NfdDirectoryLocked) as exc:
            # Said once per outage, not per try: a read-only directory stays read-only.
            if self._backoff == 0:
                _log.warning("cannot write NFD features file %s: %s; retrying at most once "
                             "a minute", self.path, exc)
            self.failures += 1
            self._dirty = True
            # What the file holds now is not known (a rename done, then the directory's
            # fsync failed): the next write is made whatever the labels are then.
            self._labels = None
            self._backoff = min(max(self._backoff * 2, RETRY_FIRST), RETRY_MAX)
            return False
        if self._backoff:
            _log.warning("NFD features file %s written again", self.path)
        self._backoff = 0.0
        self._labels = labels
        self._written_at = now
        self.writes += 1
        return True

    def _refresh_due(self, now: float) -> bool:
        """Half the expiry gone by the wall clock, or the clock stepped back past the last
        write (the file's expiry would then be further away than ``expiry``)."""
        return now >= self._written_at + self.expiry / 2 or now < self._written_at

    async def run(self) -> None:
        """Write now, then on every change and before the expiry lapses.

        The wait for the refresh is never longer than ``recheck``: it is measured on the
        monotonic clock, and only a fresh look at the wall clock sees a step. Each look also
        checks that the file is still the one written (`_replaced`), with no expiry too. Two
        writes are at least ``min_interval`` apart, so no clock, no expiry and no file
        replaced again and again can make this loop spin."""
        self._wake = anyio.Event()
        await self.update(force=True)
        last_write = anyio.current_time()
        while True:
            if self._backoff:
                await anyio.sleep(self._backoff)  # changes meanwhile are picked up after
            elif not self._dirty:
                wait = self.recheck
                if self.expiry > 0:
                    due = self._written_at + self.expiry / 2 - self._clock()
                    wait = min(max(due, 0.0), self.recheck)
                with anyio.move_on_after(wait):
                    await self._wake.wait()
                self._wake = anyio.Event()
                if not self._dirty and not (
                        self.expiry > 0 and self._refresh_due(self._clock())):
                    if not await anyio.to_thread.run_sync(self._replaced):
                        continue  # a look at the clock and the file only: nothing to write
                    self._labels = None  # not in the file any more: written again
            gap = last_write + self.min_interval - anyio.current_time()
            if gap > 0:
                await anyio.sleep(gap)  # changes meanwhile are written together
            writes = self.writes
            await self.update()
            if self.writes != writes:
                last_write = anyio.current_time()


__all__ = [
    "DEFAULT_EXPIRY",
    "MIN_EXPIRY",
    "NFD_FEATURES_DIR",
    "NFD_FILE_NAME",
    "NfdDirectoryLocked",
    "NfdFeatureFile",
    "feature_labels",
    "lock_directory",
    "render",
    "resolve_path",
    "write_atomically",
]
