"""The benchmark harness end to end at tiny sizes: nothing is timed, only what it reports.

The full run belongs to ``python benchmarks/run.py``; this keeps its pieces working (the JSON
keys and shapes of issue 5, a storm that loses nothing, a model that matches a fresh scan)
in a few seconds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

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

    table = capsys.readouterr().out
    assert "storm lost" in table and "0 of 500" in table
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
