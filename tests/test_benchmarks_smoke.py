"""The benchmark harness end to end at tiny sizes: nothing is timed, only what it reports.

The full run belongs to ``python benchmarks/run.py``; this keeps its pieces working (the JSON
keys and shapes of issue 5, a storm that loses nothing, a model that matches a fresh scan)
in a few seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio
import pytest

import gpuwatch
from gpuwatch.hostfs.scan import fs_type
from gpuwatch.sources.memory import MemorySource
from gpuwatch.testing import SysRoot, example_gpu_host
from gpuwatch.watch.watcher import open_watcher

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `pytest` run from elsewhere: the benchmarks live in the checkout
    sys.path.insert(0, str(REPO))

from benchmarks import run as run_script  # noqa: E402
from benchmarks.harness import (  # noqa: E402
    KEYS,
    PROBE_ACTIONS,
    Settings,
    format_table,
    run_storm,
    synthetic,
)

TINY = Settings(
    sizes=(16, 48),
    probe_n=48,
    storm_n=48,
    storm_events=500,
    storm_runs=1,
    scan_reps={16: 1, 48: 1},
    probe_rounds=1,
    cached_batches=1,
    cached_loops=10,
    event_samples=8,
    event_warmup=2,
    kernel_samples=3,
    peer_reps=2,
    peer_cached_loops=5,
    ratio_toggles=10,
    ratio_kernel_rounds=2,
    ratio_cli_reps=1,
    ratio_trips=5,
    ratio_fanout_events=64,
    ratio_fanout_pairs=1,
    ratio_replay_mib=2,
    ratio_replay_probes=20,
    ratio_replay_rounds=1,
)


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value >= 0


def test_run_writes_every_figure_under_the_issues_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(run_script, "QUICK", TINY)
    out = tmp_path / "figures.json"
    assert run_script.main(["--quick", "--json", str(out)]) == 0
    r = json.loads(out.read_text())

    assert list(r) == list(KEYS)
    for key in ("probe_cached_ns", "probe_fresh_ns", "probe_speedup"):
        assert list(r[key]) == list(PROBE_ACTIONS)
        assert all(is_number(v) for v in r[key].values()), r[key]
    sizes = [str(n) for n in TINY.sizes]
    assert list(r["scan_ms"]) == sizes and all(is_number(v) for v in r["scan_ms"].values())
    assert list(r["event_apply_us"]) == sizes
    for figure in r["event_apply_us"].values():
        assert set(figure) == {"p50", "p99"} and figure["p50"] <= figure["p99"]
    assert list(r["rss_mb"]) == sizes and all(v > 0 for v in r["rss_mb"].values())
    assert is_number(r["storm_events_per_s"]) and r["storm_events_per_s"] > 0
    assert r["storm_lost"] == {"expected": 500, "produced": 500, "lost": 0,
                               "model_equals_fresh_scan": True}
    kernel = r["kernel_latency_us"]
    assert kernel is None or (set(kernel) == {"p50", "p99"} and kernel["p50"] <= kernel["p99"])
    peer = r["peer"]
    assert peer is None or (set(peer) == {"pyudev", "fresh", "cached"}
                            and all(is_number(v) for v in peer.values()))

    ratios = r["ratios"]
    assert set(ratios) == {"probe_vs_empty_call", "gpu_toggle_log_on", "kernel_vs_floor",
                           "cli_and_socket", "fanout", "backlog", "burst", "storm_vs_reader",
                           "replay"}
    assert list(ratios["probe_vs_empty_call"]) == list(PROBE_ACTIONS)
    assert all(is_number(v) for v in ratios["probe_vs_empty_call"].values())
    for key in ("gpu_toggle_log_on", "fanout", "storm_vs_reader"):
        assert is_number(ratios[key]["ratio"]), ratios[key]
    assert ratios["storm_vs_reader"]["lost"] == 0
    assert is_number(ratios["storm_vs_reader"]["per_line_ratio"])
    assert ratios["storm_vs_reader"]["per_line_reader_per_s"] > 0  # its lines were all counted
    assert ratios["burst"] == {"events": 48, "lag_notices": 0}
    cli = ratios["cli_and_socket"]
    assert all(is_number(cli[k]) for k in ("cli_daemon_ratio", "cli_direct_ratio",
                                           "request_ratio"))
    replay = ratios["replay"]
    assert replay["log_mib"] == 2 and replay["log_files"] > 1 and replay["replay_complete"]
    assert all(is_number(replay[k]) for k in ("idle_p99_us", "busy_p99_us", "fast_reader_p99_us",
                                              "slow_reader_p99_us", "ratio", "fast_vs_busy",
                                              "fast_ratio", "stop_after_hangup_s"))
    backlog = ratios["backlog"]
    assert backlog["answered_ms"] > 0 and backlog["backlog_ms"] > 0

    table = capsys.readouterr().out
    assert "storm lost" in table and "0 of 500" in table
    assert "100 socket subscribers" in table and "MiB log replay" in table
    assert format_table(r).count("\n") > 20


def test_storm_expects_one_driver_change_per_uevent_even_when_chunks_exceed_the_host() -> None:
    # 7 functions, chunks of 64 uevents at most: every function toggles many times per chunk
    # unless the writer holds each toggle until the last one of that function is logged.
    with synthetic(7) as host:
        first = run_storm(host, 100)
        second = run_storm(host, 101)  # starts from where the first left the tree
    for storm in (first, second):
        assert storm.seen == storm.produced == storm.events
        assert storm.model_equals_fresh_scan


# --------------------------------------------------------------------------- the shortcuts
# A bind/unbind re-reads only the driver and IOMMU group links when the function's directory is
# the inode read in full before (gpuwatch.hostfs.scan.read_function_known). These pin down
# that the shortcut never serves a stale identity.

NIC = "0000:02:00.0"


def fixture_parents(tmp_path: Path) -> list[Path]:
    """The test's temp dir (a disk filesystem, which reuses inode numbers) and tmpfs."""
    parents = [tmp_path]
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        parents.append(Path(tempfile.mkdtemp(prefix="gpuwatch-smoke-", dir=shm)))
    return parents


async def _events_after(host: SysRoot, change: Any, action: str, count: int) -> list[Any]:
    """Unbind the NIC (its first, full read), then ``change`` the tree, send ``action``."""
    source = MemorySource()
    async with open_watcher(host.root, source, reconcile_interval=0, cdi_poll_interval=0) as w, \
            w.subscribe() as sub:
        host.unbind(NIC)
        source.push(host.uevent_props("unbind", NIC))
        with anyio.fail_after(5):
            assert (await sub.receive()).type == "driver-changed"
        change()
        source.push(host.uevent_props(action, NIC))
        got: list[Any] = []
        with anyio.fail_after(5):
            while len(got) < count:
                got.append(await sub.receive())
        return got


@pytest.mark.parametrize("where", ["tmp", "tmpfs"])
def test_a_card_swapped_behind_a_bind_is_seen_as_the_swap(tmp_path: Path, where: str) -> None:
    parents = fixture_parents(tmp_path)
    if where == "tmpfs" and len(parents) < 2:
        pytest.skip("no writable /dev/shm")
    parent = parents[0] if where == "tmp" else parents[1]
    try:
        host = example_gpu_host(parent / "host")

        def swap() -> None:  # a new card in the slot: a new directory, maybe the old inode
            host.remove_function(NIC)
            host.add_function(NIC, vendor="0x15b3", device="0x1017", klass="0x020000",
                              driver="mlx5_core", parent="0000:00:1c.0", iommu_group=14)

        got = anyio.run(_events_after, host, swap, "bind", 2)
    finally:
        for extra in parents[1:]:
            shutil.rmtree(extra, ignore_errors=True)
    assert [e.type for e in got] == ["device-removed", "device-added"]
    assert (got[0].device.vendor_id, got[1].device.vendor_id) == ("0x8086", "0x15b3")
    assert got[1].device.driver == "mlx5_core"


def test_a_change_uevent_still_reads_everything(tmp_path: Path) -> None:
    host = example_gpu_host(tmp_path / "host")
    got = anyio.run(_events_after, host, lambda: host.set_attr(NIC, "class", "0x010802\n"),
                    "change", 2)
    assert [e.type for e in got] == ["device-removed", "device-added"]
    assert got[1].device.class_ == "0x0108"
    model = gpuwatch.scan(host.root)
    assert next(f for f in model.functions() if f.addr == NIC).class_ == "0x0108"


def test_fs_type_names_the_mount_a_path_is_on() -> None:
    if not Path("/proc/self/mountinfo").exists():
        pytest.skip("no /proc/self/mountinfo")
    assert fs_type("/proc/self") == "proc"
    assert fs_type("/") != ""


@pytest.mark.timeout(120)
def test_the_soak_runs_small_and_holds_its_invariants(tmp_path: Path) -> None:
    """The soak's checks on a small run: gapless rotated log, every subscriber complete."""
    from benchmarks import soak

    out = tmp_path / "soak.json"
    assert soak.main(["--uevents", "3000", "--subscribers", "4", "--log-max-bytes", "20000",
                      "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["log_gapless"] and result["log_files"] > 1
    assert result["subscribers_complete"] == 4 and result["subscriber_gaps"] == 0
    assert result["events"] >= 600 and result["last_type"] == "stopped"
    assert result["subscribers_silent_loss"] == 0
    # Each saw every event after its subscription (all but `ready`, and `stopped` may race
    # its hang-up); flips the writer could not keep apart under load are fewer events for all.
    assert result["subscriber_events_seen"] >= 4 * (result["events"] - 2)


@pytest.mark.timeout(120)
def test_the_soak_counts_the_lagged_notices_of_stalled_subscribers(tmp_path: Path) -> None:
    """Two of four subscribers read nothing for 3 s, and until 512 KiB have gone to the
    others (more than the kernel's socket buffer holds, however slowly the events come),
    while a 4 KiB output limit overflows: each ends `lagged`, its notice naming the next seq
    it was owed; nobody loses silently."""
    from benchmarks import soak

    out = tmp_path / "soak.json"
    code = soak.main(["--uevents", "6000", "--subscribers", "4", "--log-max-bytes", "20000",
                      "--max-output-bytes", "4096", "--stall", "2", "--stall-seconds", "3",
                      "--stall-bytes", str(512 << 10), "--out", str(out)])
    result = json.loads(out.read_text())
    assert code == 0 and result["log_gapless"], result
    assert result["subscribers_silent_loss"] == 0
    assert (result["subscribers_complete"], result["subscribers_lagged"]) == (2, 2), result
    assert result["lagged_notices"] == 2 and result["missed_with_notice"] >= 2


def test_the_soak_tallies_events_and_lagged_notices_per_subscriber() -> None:
    """Every event, or a `lagged` notice naming where the loss starts; anything else fails."""
    from benchmarks.soak import Tally

    def events(*seqs: int) -> bytes:
        return b"".join(b'{"seq":%d,"time":"t","type":"probe-changed"}\n' % s for s in seqs)

    def notice(missed: int, first: int) -> bytes:
        return json.dumps({"type": "lagged", "missed": missed, "first_missed_seq": first,
                           "resume_since_seq": first - 1}).encode() + b"\n"

    whole = Tally(10)
    whole.feed(events(11, 12, 13))
    whole.feed(events(14, 15))
    assert (whole.verdict(15), whole.seen, whole.notices) == ("complete", 5, [])
    told = Tally(10)
    told.feed(events(11, 12) + notice(8, 13))
    assert (told.verdict(20), told.seen, told.notices) == ("lagged", 2, [(8, 13)])
    gap = Tally(10)
    gap.feed(events(11, 13, 14))
    assert gap.verdict(14) == "silent"  # 12 never came, and nothing said so
    cut_short = Tally(10)
    cut_short.feed(events(11))
    assert cut_short.verdict(20) == "silent"
    wrong = Tally(10)
    wrong.feed(events(11) + notice(3, 15))  # 12…14 missing, the notice says from 15
    assert wrong.verdict(20) == "silent"


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount") is None,
                    reason="mounting a tmpfs needs root and mount(8)")
def test_fs_type_follows_a_mount_made_after_it_was_asked(tmp_path: Path) -> None:
    """The answer is remembered per (path, device): a filesystem mounted over the path later
    is seen at once, and so is its unmounting."""
    where = tmp_path / "mnt"
    where.mkdir()
    before = fs_type(str(where))
    if before in ("", "tmpfs"):
        pytest.skip(f"the tmp dir's filesystem ({before or 'unknown'}) cannot show a change")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "gwtest", str(where)], check=True,
                   timeout=30)
    try:
        assert fs_type(str(where)) == "tmpfs"
    finally:
        subprocess.run(["umount", str(where)], check=True, timeout=30)
    assert fs_type(str(where)) == before
