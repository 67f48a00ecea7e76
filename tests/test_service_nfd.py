"""The node-feature-discovery features file: labels, atomic rewrites only when they change."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import anyio
import pytest

from gpuwatch.hostfs.scan import read_cdi
from gpuwatch.service.nfd import (
    NfdDirectoryLocked,
    NfdFeatureFile,
    feature_labels,
    render,
    resolve_path,
)
from gpuwatch.sources.memory import MemorySource
from gpuwatch.testing import SysRoot, machines, modern
from gpuwatch.watch.watcher import Watcher, open_watcher

NV, NV_AUDIO, NIC = "0000:01:00.0", "0000:01:00.1", "0000:02:00.0"


def parse(path: Path) -> tuple[dict[str, str], list[str]]:
    labels, directives = {}, []
    for line in path.read_text().splitlines():
        if line.startswith("# +"):
            directives.append(line[3:])
        elif line and not line.startswith("#"):
            name, _, value = line.partition("=")
            labels[name] = value
    return labels, directives


def identity(path: Path) -> tuple[int, int, str]:
    st = path.stat()
    return st.st_ino, st.st_mtime_ns, path.read_text()


async def bind(w: Watcher, source: MemorySource, host: SysRoot, addr: str, driver: str) -> None:
    before = w.seq
    host.bind(addr, driver)
    source.push(host.uevent_props("bind", addr))
    with anyio.fail_after(5):
        while w.seq < before + 1:
            await anyio.sleep(0.005)


async def quiet(nfd: NfdFeatureFile, moment: float = 0.2) -> None:
    """Give the writer task time to act on whatever it was woken for."""
    await anyio.sleep(moment)


async def test_rewritten_on_a_change_and_only_then(host: SysRoot, tmp_path: Path) -> None:
    features = tmp_path / "features.d"
    source = MemorySource()
    async with (
        open_watcher(host.root, source, reconcile_interval=0, cdi_poll_interval=0) as w,
        anyio.create_task_group() as tg,
    ):
        nfd = NfdFeatureFile(str(features) + "/", expiry=3600, min_interval=0.05)
        nfd.attach(w)
        tg.start_soon(nfd.run)
        path = features / "gpuwatch"
        with anyio.fail_after(5):
            while nfd.writes < 1:  # counted once the rename is done, not when it appears
                await anyio.sleep(0.01)
        labels, directives = parse(path)
        assert labels == {
            "gpuwatch.amd.gpu": "false",
            "gpuwatch.gpu.count": "2",
            "gpuwatch.gpu.intel.count": "1",
            "gpuwatch.gpu.nvidia.count": "1",
            "gpuwatch.gpu.unhealthy.count": "0",
            "gpuwatch.gpu.vfio.count": "0",
            "gpuwatch.iommu": "true",
            "gpuwatch.iommu.kind": "intel",
            "gpuwatch.nvidia.cdi": "true",
        }
        assert len(directives) == 1 and directives[0].startswith("expiry-time=")
        first = identity(path)
        assert nfd.writes == 1

        # The audio function alone to vfio-pci: detect-vfio changes, but the group is mixed,
        # so no label does. The file is left alone: same inode, same mtime.
        await bind(w, source, host, NV_AUDIO, "vfio-pci")
        await quiet(nfd)
        host.unbind(NIC)  # a NIC: not a GPU, no label depends on it
        source.push(host.uevent_props("unbind", NIC))
        await quiet(nfd)
        assert identity(path) == first and nfd.writes == 1

        # Now the whole group is on vfio-pci: one label changes, the file is replaced.
        await bind(w, source, host, NV, "vfio-pci")
        with anyio.fail_after(5):
            while nfd.writes < 2:
                await anyio.sleep(0.01)
        second = identity(path)
        assert second[0] != first[0]  # a new inode: written aside, then renamed over
        assert parse(path)[0]["gpuwatch.gpu.vfio.count"] == "1"
        # No display function is left on nvidia: no usable NVIDIA GPU, whatever CDI says.
        assert parse(path)[0]["gpuwatch.nvidia.cdi"] == "false"
        assert not [p for p in features.iterdir() if p.name != "gpuwatch"]  # no temp file left

        await bind(w, source, host, NV, "nvidia")
        with anyio.fail_after(5):
            while nfd.writes < 3:
                await anyio.sleep(0.01)
        assert parse(path)[0]["gpuwatch.nvidia.cdi"] == "true"
        # The CDI spec goes away: detect-gpu flips, so does gpuwatch.nvidia.cdi.
        host.remove_cdi_spec("etc")
        w.apply([read_cdi(w.paths)])  # what the watcher's CDI poll does
        with anyio.fail_after(5):
            while nfd.writes < 4:
                await anyio.sleep(0.01)
        assert parse(path)[0]["gpuwatch.nvidia.cdi"] == "false"
        tg.cancel_scope.cancel()
    nfd.detach()


async def test_expiry_is_refreshed_before_it_lapses(host: SysRoot, tmp_path: Path) -> None:
    now = [1_000_000.0]
    async with open_watcher(
        host.root, MemorySource(), reconcile_interval=0, cdi_poll_interval=0
    ) as w:
        nfd = NfdFeatureFile(tmp_path / "gpuwatch", expiry=600, clock=lambda: now[0])
        nfd.attach(w)
        assert await nfd.update(force=True)
        assert parse(tmp_path / "gpuwatch")[1] == ["expiry-time=1970-01-12T13:56:40Z"]
        now[0] += 200
        assert not await nfd.update()  # nothing changed, the expiry is far enough away
        now[0] += 150  # past half the expiry: refresh, with a later expiry
        assert await nfd.update()
        assert parse(tmp_path / "gpuwatch")[1] == ["expiry-time=1970-01-12T14:02:30Z"]
        nfd.detach()
    never = NfdFeatureFile(tmp_path / "never", expiry=0)
    assert "expiry" not in render({"a": "b"}, None) and never.expiry == 0


@pytest.mark.parametrize(
    ("gpus", "expected"),
    [
        ([], {"gpuwatch.gpu.count": "0", "gpuwatch.gpu.vfio.count": "0",
              "gpuwatch.gpu.unhealthy.count": "0"}),
        (
            [
                ("0x1002", [("0x0300", "vfio-pci"), ("0x0403", "vfio-pci")]),
                ("0x1002", [("0x0300", "amdgpu")]),
                ("0x1af4", [("0x0300", "virtio-pci")]),
            ],
            {
                "gpuwatch.gpu.count": "3",
                "gpuwatch.gpu.vfio.count": "1",
                "gpuwatch.gpu.unhealthy.count": "0",
                "gpuwatch.gpu.amd.count": "2",
                "gpuwatch.gpu.0x1af4.count": "1",
            },
        ),
    ],
)
def test_feature_labels(
    gpus: list[tuple[str, list[tuple[str, str]]]], expected: dict[str, str]
) -> None:
    def fn(vendor: str, klass: str, driver: str, i: int) -> dict[str, Any]:
        return {
            "addr": f"0000:0{i}:00.0",
            "vendor_id": vendor,
            "device_id": "0x1",
            "class": klass,
            "class_label": "",
            "driver": driver,
            "iommu_group": i,
        }

    detect_vfio = {
        "iommu_enabled": False,
        "iommu_kind": "",
        "gpus": [
            {
                **fn(vendor, *members[0], i),
                "group_members": [fn(vendor, k, d, i) for k, d in members],
            }
            for i, (vendor, members) in enumerate(gpus)
        ],
    }
    labels = feature_labels(
        detect_vfio,
        False,
        bool(gpus),
        "11.0.0" if gpus else "",
        lambda vid: {"0x1002": "AMD"}.get(vid, vid),
    )
    assert {k: v for k, v in labels.items() if k.startswith("gpuwatch.gpu.")} == expected
    assert labels["gpuwatch.iommu"] == "false" and "gpuwatch.iommu.kind" not in labels
    assert labels.get("gpuwatch.amd.gfx") == ("11.0.0" if gpus else None)
    assert list(labels) == sorted(labels)


def test_resolve_path(tmp_path: Path) -> None:
    assert resolve_path(tmp_path) == os.path.join(tmp_path, "gpuwatch")
    assert resolve_path(f"{tmp_path}/missing/") == f"{tmp_path}/missing/gpuwatch"
    assert resolve_path(tmp_path / "custom") == str(tmp_path / "custom")
    # NFD's directory named without its slash, before it exists: still a directory, never
    # a file of ours by that name (which would block NFD's own directory).
    nfd = tmp_path / "node-feature-discovery" / "features.d"
    assert resolve_path(nfd) == str(nfd / "gpuwatch")
    nfd.parent.mkdir()
    nfd.write_text("a=b\n")  # someone's file by that name: written over, as any named file
    assert resolve_path(nfd) == str(nfd)


async def test_an_unwritable_directory_backs_off_logs_once_and_counts(
    host: SysRoot, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from prometheus_client import generate_latest

    from gpuwatch.service import nfd as nfd_module
    from gpuwatch.service.metrics import Metrics

    blocker = tmp_path / "features.d"
    blocker.write_text("a file where the directory should be")  # ENOTDIR/EEXIST, even for root
    async with open_watcher(host.root, MemorySource(), reconcile_interval=0,
                            cdi_poll_interval=0) as w:
        nfd = NfdFeatureFile(str(blocker) + "/", expiry=3600)
        nfd.attach(w)
        metrics = Metrics()
        metrics.track_nfd(nfd)
        backoffs = []
        for _ in range(9):
            assert await nfd.update() is False
            backoffs.append(nfd._backoff)
        assert backoffs == [1, 2, 4, 8, 16, 32, 60, 60, 60]  # at most one try a minute
        assert nfd.failures == 9
        warnings = [r for r in caplog.records if "cannot write NFD" in r.getMessage()]
        assert len(warnings) == 1  # said once, not per try
        text = generate_latest(metrics.registry).decode()
        assert "gpuwatch_nfd_write_failures_total 9.0" in text
        # The directory becomes writable: the next try writes and the backoff resets.
        blocker.unlink()
        assert await nfd.update() is True
        assert nfd._backoff == 0 and (blocker / nfd_module.NFD_FILE_NAME).is_file()
        nfd.detach()


# Kubernetes' rules for a label's name (after NFD's prefix) and value.
LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")


def hostile_vendors_host(root: Path) -> SysRoot:
    """Display functions whose ``vendor`` files are garbled (a hostile or broken tree)."""
    s = SysRoot(root)
    for i, vendor in enumerate(("0x" + "a" * 70, "vfio", "Unhealthy", "é€", "-0x10de-")):
        s.add_function(f"0000:0{i + 1}:00.0", vendor=vendor, device="0x1234",
                       klass="0x030000", driver="vfio-pci", iommu_group=i + 1)
    return s


BUILDERS = {name: fn for module in (machines, modern) for name, fn in vars(module).items()
            if callable(fn) and not name.startswith("_")
            and name.endswith(("_host", "_guest", "desktop"))}


@pytest.mark.parametrize("layout", ["symlink", "capture"])
@pytest.mark.parametrize("kind", [*sorted(BUILDERS), "hostile_vendors_host"])
async def test_labels_are_valid_kubernetes_labels_on_every_kind_of_host(
    kind: str, layout: str, tmp_path: Path
) -> None:
    """Every host and guest the fixtures know, as the kernel lays it out and as a capture
    tool copies it (links flattened into folders): the same valid labels."""
    build = BUILDERS.get(kind, hostile_vendors_host)
    tree = build(tmp_path / "host")
    if layout == "capture":
        tree.capture()
    nfd = NfdFeatureFile(tmp_path / "features.d/")
    async with open_watcher(tree.root, MemorySource()) as w:
        nfd.attach(w)
        labels = nfd.labels()
        gpus = len(w.probe("detect-vfio").gpus)
    for name, value in labels.items():
        assert LABEL_NAME.fullmatch(name), name
        assert LABEL_VALUE.fullmatch(value), (name, value)
    per_vendor = [int(v) for k, v in labels.items()
                  if k.startswith("gpuwatch.gpu.") and k.count(".") == 3
                  and k not in ("gpuwatch.gpu.vfio.count", "gpuwatch.gpu.unhealthy.count")]
    assert sum(per_vendor) == int(labels["gpuwatch.gpu.count"]) == gpus
    if kind == "hostile_vendors_host":  # no vendor lands on another label
        assert labels["gpuwatch.gpu.vfio.count"] == "5"
        assert labels["gpuwatch.gpu.vendor-vfio.count"] == "1"
        assert labels["gpuwatch.gpu.vendor-unhealthy.count"] == "1"


async def test_a_no_iommu_vfio_host_is_labelled_without_an_iommu(tmp_path: Path) -> None:
    """VFIO's no-IOMMU mode makes groups (so detect-vfio's ``iommu_enabled`` is true), but no
    VM can be given a device there: the label follows `status`, which says disabled."""
    tree = machines.vfio_noiommu_host(tmp_path / "host")
    nfd = NfdFeatureFile(tmp_path / "features.d/")
    async with open_watcher(tree.root, MemorySource()) as w:
        nfd.attach(w)
        assert w.probe("detect-vfio").iommu_enabled  # the probe's own rule stands
        assert nfd.labels()["gpuwatch.iommu"] == "false"
    # A real group beside the no-IOMMU one: an IOMMU isolates that one.
    (tree.root / "sys/kernel/iommu_groups/7/devices").mkdir(parents=True)
    async with open_watcher(tree.root, MemorySource()) as w:
        nfd.attach(w)
        assert nfd.labels()["gpuwatch.iommu"] == "true"


def stamp_of(path: Path) -> float:
    """The file's ``# +expiry-time`` as a POSIX time."""
    from datetime import UTC, datetime

    (directive,) = parse(path)[1]
    text = directive.removeprefix("expiry-time=")
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


async def wait_writes(nfd: NfdFeatureFile, count: int) -> None:
    with anyio.fail_after(10):
        while nfd.writes < count:
            await anyio.sleep(0.01)


@pytest.mark.timeout(60)
async def test_a_wall_clock_step_is_seen_at_the_next_look_not_half_an_expiry_later(
    host: SysRoot, tmp_path: Path
) -> None:
    """NTP steps the clock at boot (the unit runs before kubelet): the refresh was timed on
    the monotonic clock from the wall clock before the step, so the file's expiry stayed in
    the past for up to half the expiry. The writer now looks at the wall clock every
    ``recheck`` (60 s at most) and refreshes a stamp the step made stale, either way."""
    now = [1_000_000.0]
    path = tmp_path / "gpuwatch"
    async with (
        open_watcher(host.root, MemorySource(), reconcile_interval=0, cdi_poll_interval=0) as w,
        anyio.create_task_group() as tg,
    ):
        nfd = NfdFeatureFile(path, expiry=3600, clock=lambda: now[0], recheck=0.02,
                             min_interval=0.01)
        nfd.attach(w)
        tg.start_soon(nfd.run)
        await wait_writes(nfd, 1)
        assert stamp_of(path) == 1_000_000 + 3600
        await anyio.sleep(0.2)  # many looks at a clock that did not move: nothing written
        assert nfd.writes == 1
        now[0] += 2 * 3600  # stepped forward past the expiry: the labels would be dropped
        await wait_writes(nfd, 2)
        assert stamp_of(path) == now[0] + 3600
        now[0] -= 24 * 3600  # stepped back: the stamp would keep dead labels a day too long
        await wait_writes(nfd, 3)
        assert stamp_of(path) == now[0] + 3600
        tg.cancel_scope.cancel()
    nfd.detach()


@pytest.mark.timeout(60)
async def test_a_tiny_expiry_is_rounded_up_and_never_spins(host: SysRoot, tmp_path: Path) -> None:
    """An expiry of a millisecond once wrote files already expired (the stamp truncated to
    the second), in a loop that fsynced without pause. The stamp is rounded up, and two
    writes are at least ``min_interval`` apart, whatever the clock says."""
    assert "expiry-time=1970-01-12T13:46:41Z" in render({}, 1_000_000.2)
    ticks = [1_000_000.5]

    def clock() -> float:  # half the expiry passes between any two looks: always due
        ticks[0] += 1.0
        return ticks[0]

    path = tmp_path / "gpuwatch"
    async with (
        open_watcher(host.root, MemorySource(), reconcile_interval=0, cdi_poll_interval=0) as w,
        anyio.create_task_group() as tg,
    ):
        nfd = NfdFeatureFile(path, expiry=0.001, clock=clock, min_interval=0.1)
        nfd.attach(w)
        started = anyio.current_time()
        tg.start_soon(nfd.run)
        await anyio.sleep(0.5)
        tg.cancel_scope.cancel()
    elapsed = anyio.current_time() - started
    # A slow machine writes fewer times, never more: one now, then one per min_interval.
    assert 1 <= nfd.writes <= elapsed / 0.1 + 2, (nfd.writes, elapsed)
    assert stamp_of(path) >= ticks[0] - 3  # the last write's stamp was not in its past
    nfd.detach()


def test_one_writer_per_features_directory(tmp_path: Path) -> None:
    """Two daemons on one node (the systemd unit and the DaemonSet) once overwrote each
    other's file unseen. The writer holds the directory's flock (no lock file: NFD would read
    it as features); a second one is refused, naming the directory and the holder."""
    features = tmp_path / "features.d"
    first = NfdFeatureFile(str(features) + "/")
    second = NfdFeatureFile(features / "gpuwatch")
    assert first.lock() and first.lock()  # taken once, held
    with pytest.raises(NfdDirectoryLocked) as refused:
        second.lock()
    message = str(refused.value)
    assert str(features) in message and f"pid {os.getpid()}" in message
    assert list(features.iterdir()) == []  # nothing NFD could read was made
    first.close()
    assert second.lock()
    second.close()


async def test_a_writer_without_the_lock_never_writes(host: SysRoot, tmp_path: Path) -> None:
    """A directory missing at start (``lock`` then says False, no refusal) is locked before
    the first write; held by another writer by then, the write is a failed one."""
    features = tmp_path / "features.d"
    late = NfdFeatureFile(str(features) + "/")
    features.write_text("not yet a directory")
    assert late.lock() is False
    features.unlink()
    holder = NfdFeatureFile(str(features) + "/")
    assert holder.lock()
    async with open_watcher(host.root, MemorySource(), reconcile_interval=0,
                            cdi_poll_interval=0) as w:
        late.attach(w)
        assert await late.update(force=True) is False
        assert late.failures == 1 and list(features.iterdir()) == []
        holder.close()
        assert await late.update(force=True) is True
        late.detach()
    late.close()


@pytest.mark.timeout(90)
def test_a_second_daemon_on_a_features_directory_exits_2_naming_the_holder(
    host: SysRoot, tmp_path: Path
) -> None:
    import fcntl
    import subprocess
    import sys

    features = tmp_path / "features.d"
    features.mkdir()
    events = tmp_path / "uevents.jsonl"
    events.write_text("")
    command = [sys.executable, "-m", "gpuwatch", "watch", "--root", str(host.root),
               "--source", f"file:{events}", "--log", str(tmp_path / "log.jsonl"),
               "--reconcile-interval", "0", "--nfd-features", f"{features}/"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWATCH_")}
    fd = os.open(features, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another writer, as far as the daemon can tell
        proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
    finally:
        os.close(fd)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert f"{features}" in proc.stderr and f"pid {os.getpid()}" in proc.stderr
    assert list(features.iterdir()) == []
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr  # the holder gone: it runs


async def test_a_features_directory_made_again_is_locked_again_before_a_write(
    host: SysRoot, tmp_path: Path
) -> None:
    """The directory removed and made again (a package reinstall, a hostPath recreated), or a
    link to another put in its place: the flock held was on a directory no one writes any
    more, so a second daemon could take the new one's and both wrote one file, the last
    winning. The writer now checks that the directory it holds is the one at the path before
    each write, and takes the new one's lock first: held by another, no write."""
    import shutil

    features = tmp_path / "features.d"
    first = NfdFeatureFile(str(features) + "/")
    assert first.lock()
    async with open_watcher(host.root, MemorySource(), reconcile_interval=0,
                            cdi_poll_interval=0) as w:
        first.attach(w)
        assert await first.update(force=True) is True
        shutil.rmtree(features)
        features.mkdir()
        second = NfdFeatureFile(str(features) + "/")
        assert second.lock()  # nothing held it: the first writer's lock is on the old one
        assert await first.update(force=True) is False  # refused, as any locked directory
        assert first.failures == 1 and list(features.iterdir()) == []
        second.close()
        assert await first.update(force=True) is True  # and the new one is held now
        third = NfdFeatureFile(features / "gpuwatch")
        with pytest.raises(NfdDirectoryLocked):
            third.lock()
        # A link to another directory in its place: that one is locked before a write.
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        shutil.rmtree(features)
        features.symlink_to(elsewhere)
        fd = os.open(elsewhere, os.O_RDONLY | os.O_DIRECTORY)
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX)
            assert await first.update(force=True) is False
            assert list(elsewhere.iterdir()) == []
        finally:
            os.close(fd)
        assert await first.update(force=True) is True
        assert (elsewhere / "gpuwatch").is_file()
        first.detach()
    first.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("expiry", [3600.0, 0.0])
async def test_a_features_file_removed_or_replaced_is_written_again_at_the_next_look(
    host: SysRoot, tmp_path: Path, expiry: float
) -> None:
    """The file deleted, or the directory made again empty: NFD drops the node's labels at
    its next read, and the writer, which wrote only on a change or half an expiry later (never
    with no expiry), left the node without them for up to half an hour. It now sees the file
    is not the one it wrote at its next look at the clock and writes it again."""
    import shutil

    features = tmp_path / "features.d"
    path = features / "gpuwatch"
    async with (
        open_watcher(host.root, MemorySource(), reconcile_interval=0, cdi_poll_interval=0) as w,
        anyio.create_task_group() as tg,
    ):
        nfd = NfdFeatureFile(str(features) + "/", expiry=expiry, recheck=0.05,
                             min_interval=0.01)
        nfd.attach(w)
        assert nfd.lock()
        tg.start_soon(nfd.run)
        await wait_writes(nfd, 1)
        labels = parse(path)[0]
        await anyio.sleep(0.3)  # many looks at a file that is still ours: nothing written
        assert nfd.writes == 1
        path.unlink()
        await wait_writes(nfd, 2)
        assert parse(path)[0] == labels
        path.write_text("gpuwatch.gpu.count=7\n")  # written over in place by someone else
        await wait_writes(nfd, 3)
        assert parse(path)[0] == labels
        shutil.rmtree(features)
        features.mkdir()
        await wait_writes(nfd, 4)
        assert parse(path)[0] == labels
        await anyio.sleep(0.3)
        assert nfd.writes == 4
        tg.cancel_scope.cancel()
    nfd.detach()
    nfd.close()


async def test_after_a_failed_write_the_next_one_is_made_whatever_the_labels(
    host: SysRoot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that failed after its rename (the directory's fsync) left the new labels in
    the file, but the writer still held the old ones as written: labels changing back were
    then not written, and the file kept the wrong ones until half an expiry later."""
    from gpuwatch.hostfs import files

    source = MemorySource()
    path = tmp_path / "gpuwatch"
    async with open_watcher(host.root, source, reconcile_interval=0, cdi_poll_interval=0) as w:
        nfd = NfdFeatureFile(path, expiry=3600)
        nfd.attach(w)
        assert await nfd.update(force=True) is True
        assert parse(path)[0]["gpuwatch.gpu.vfio.count"] == "0"
        real_fsync = os.fsync

        def fsync(fd: int) -> None:
            import stat

            if stat.S_ISDIR(os.fstat(fd).st_mode):
                raise OSError(5, "Input/output error")
            real_fsync(fd)

        monkeypatch.setattr(files.os, "fsync", fsync)
        await bind(w, source, host, NV, "vfio-pci")
        await bind(w, source, host, NV_AUDIO, "vfio-pci")
        assert await nfd.update() is False  # failed: the directory's fsync
        assert parse(path)[0]["gpuwatch.gpu.vfio.count"] == "1"  # but renamed in
        monkeypatch.setattr(files.os, "fsync", real_fsync)
        await bind(w, source, host, NV, "nvidia")  # back to what was last written well
        assert await nfd.update() is True
        assert parse(path)[0]["gpuwatch.gpu.vfio.count"] == "0"
        nfd.detach()
