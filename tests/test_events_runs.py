"""``gpuwatch events --follow`` across runs of the watcher: real ``gpuwatch watch`` processes
(uevents through a FIFO, ``--source file:``) and a real follower process.

A watcher numbers its events after the last seq its log holds; with every log file deleted
it starts again at 1. A follower that only took seqs above the last one it printed would
then print nothing until the new run passed the old one.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import pytest

from gpuwatch.testing import SysRoot
from gpuwatch.watch import eventlog

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(120)


def _env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("GPUWATCH_")}
    e["PYTHONPATH"] = str(REPO)
    e.pop("NOTIFY_SOCKET", None)
    return e


class Watch:
    """One run of ``gpuwatch watch --source file:FIFO --log LOG`` over a fixture root."""

    def __init__(self, host: SysRoot, workdir: Path, log: Path) -> None:
        self.fifo = workdir / "uevents.fifo"
        if not self.fifo.exists():
            os.mkfifo(self.fifo)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpuwatch", "watch", "--root", str(host.root),
             "--source", f"file:{self.fifo}", "--log", str(log), "--reconcile-interval", "0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO)
        self.writer: IO[str] = open(self.fifo, "w")  # noqa: SIM115 - closed in stop()

    def push(self, props: dict[str, str]) -> None:
        self.writer.write(json.dumps(props) + "\n")
        self.writer.flush()

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGTERM)
        try:
            _, err = self.proc.communicate(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.communicate()
            self.writer.close()
        assert self.proc.returncode == 0, err
        return err


class Follower:
    """``gpuwatch events --follow`` as a process; its lines with a deadline."""

    def __init__(self, log: Path, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpuwatch", "events", str(log), "--follow", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO)
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        out = self.proc.stdout
        assert out is not None

        def pump() -> None:
            for text in out:
                self.lines.put(json.loads(text))

        threading.Thread(target=pump, daemon=True).start()

    def until(self, type_: str, after: int = 0, timeout: float = 30) -> list[dict[str, Any]]:
        """Events printed until one of ``type_`` (with seq > ``after`` when given)."""
        got: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"no {type_} printed; got {got}"
            try:
                event = self.lines.get(timeout=left)
            except queue.Empty:
                raise AssertionError(f"no {type_} printed; got {got}") from None
            got.append(event)
            if event["type"] == type_ and event["seq"] > after:
                return got

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGTERM)
        try:
            _, err = self.proc.communicate(timeout=15)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.communicate()
        assert self.proc.returncode == 0, err
        return err


def _wait_for(log: Path, type_: str, count: int = 1) -> None:
    deadline = time.monotonic() + 30
    while sum(e["type"] == type_ for e in eventlog.read_events(log)) < count:
        assert time.monotonic() < deadline, f"no {type_} in {log}"
        time.sleep(0.05)


def test_a_follower_carries_on_with_a_watcher_restarted_on_a_deleted_log(
    host: SysRoot, tmp_path: Path
) -> None:
    """Run 1 writes seqs 1..N and stops; every log file is deleted; run 2 numbers from 1
    again. The follower prints run 2's events as they come (was: nothing until seq N+1)."""
    log = tmp_path / "events.jsonl"
    first = Watch(host, tmp_path, log)
    follower: Follower | None = None
    try:
        _wait_for(log, "ready")
        follower = Follower(log)
        addrs = [a for a in host.functions if (host.device_dir(a) / "driver").is_symlink()]
        assert len(addrs) >= 3
        for addr in addrs:
            host.unbind(addr)
            first.push(host.uevent_props("unbind", addr))
        first.stop()
        run1 = follower.until("stopped")
        last = run1[-1]["seq"]
        assert [e["seq"] for e in run1] == list(range(1, last + 1))
        assert last > 3  # run 2 stays below it for a while

        for path in eventlog_files(log):
            path.unlink()
        second = Watch(host, tmp_path, log)
        try:
            got = follower.until("ready")  # run 2's, seq 1: not above what was printed
            assert got[-1]["seq"] == 1
            host.bind(addrs[0], "vfio-pci")
            second.push(host.uevent_props("bind", addrs[0]))
            changed = follower.until("driver-changed")
            assert changed[-1]["addr"] == addrs[0] and changed[-1]["new"] == "vfio-pci"
            assert changed[-1]["seq"] < last  # still below run 1's seqs, yet printed
        finally:
            second.stop()
        run2 = [got[-1], *changed, *follower.until("stopped")]
        assert [e["seq"] for e in run2] == list(range(1, len(run2) + 1))
        err = follower.stop()
        follower = None
        assert err.count("\n") == 1 and "a new run of the watcher begins at seq 1" in err
    finally:
        if follower is not None:
            follower.stop()
        if first.proc.poll() is None:
            first.stop()


def eventlog_files(log: Path) -> list[Path]:
    return [p for p in [log, *log.parent.glob(log.name + ".*")] if p.exists()]


def test_a_follower_resuming_after_a_seq_the_log_no_longer_reaches_gets_the_new_run(
    host: SysRoot, tmp_path: Path
) -> None:
    """``--follow --since-seq N`` where the log (begun anew: a tmpfs after a reboot) has
    not reached N: what is appended from then on is printed, as a socket subscriber with a
    ``since_seq`` ahead of the daemon gets live events (was: nothing until seq N+1)."""
    log = tmp_path / "events.jsonl"
    follower = Follower(log, "--since-seq", "500")  # no log yet: the watcher comes later
    watch: Watch | None = None
    try:
        watch = Watch(host, tmp_path, log)
        got = follower.until("ready")
        assert [e["seq"] for e in got] == [1]
        addr = next(a for a in host.functions if (host.device_dir(a) / "driver").is_symlink())
        host.unbind(addr)
        watch.push(host.uevent_props("unbind", addr))
        changed = follower.until("driver-changed")
        assert changed[-1]["addr"] == addr and changed[-1]["seq"] < 500
    finally:
        if watch is not None:
            watch.stop()
        err = follower.stop()
    assert err.count("\n") == 1 and "below 500" in err


def test_a_rescan_that_meets_a_file_again_is_no_new_run(tmp_path: Path) -> None:
    """The new-run rule must not mistake a line read twice (a directory scan that raced a
    rotation opens a file again) for a restart: a ``ready`` read before is a duplicate."""
    path = tmp_path / "ev.jsonl"
    lines = [json.dumps({"seq": s, "time": f"t{s}", "type": "ready" if s % 5 == 1 else "x"})
             for s in range(1, 21)]
    path.write_text("".join(f"{text}\n" for text in lines))
    follower = eventlog._Follower(path, None, None, runs=True)
    try:
        batch, _ = follower.poll()
        assert [r.event["seq"] for r in batch] == list(range(1, 21))
        # The same file met again, as a raced scan meets it: nothing is printed twice.
        again, _ = eventlog._open_log_file(str(path)) or (None, None)
        assert again is not None
        follower._pending.append(eventlog._Source(again, (0, 0)))
        batch, _ = follower.poll()
        assert batch == [] and follower.new_runs == 0
        # A new run's `ready` at seq 1 (another time) is no duplicate: it and what follows.
        with open(path, "a") as f:
            f.write(json.dumps({"seq": 1, "time": "later", "type": "ready"}) + "\n")
            f.write(json.dumps({"seq": 2, "time": "later", "type": "x"}) + "\n")
        batch, _ = follower.poll()
        assert [(r.event["seq"], r.event["time"]) for r in batch] == [(1, "later"),
                                                                       (2, "later")]
        assert follower.new_runs == 1
    finally:
        follower.close()
