"""The event log as other processes touch it while a real ``gpuwatch watch`` writes it and a
real ``gpuwatch events --follow`` tails it: a line appended by someone else, the file
emptied in place, a follower that resumes after a seq before the log exists."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from daemon_helpers import Daemon

from gpuwatch.core.events import parse_event
from gpuwatch.service.testing import short_socket_dir
from gpuwatch.testing import SysRoot
from gpuwatch.watch import eventlog
from tests.test_events_runs import Follower

pytestmark = pytest.mark.timeout(120)

NV_AUDIO = "0000:01:00.1"


def toggle(d: Daemon, host: SysRoot, n: int) -> None:
    """Rebind the audio function (vfio-pci <-> snd_hda_intel): one driver-changed each."""
    host.bind(NV_AUDIO, "vfio-pci" if n % 2 == 0 else "snd_hda_intel")
    d.push(host.uevent_props("bind", NV_AUDIO))


def wait_seq(log: Path, seq: int) -> None:
    deadline = time.monotonic() + 30
    while (eventlog.last_seq_in(log) or 0) < seq:
        assert time.monotonic() < deadline, f"seq {seq} never reached {log}"
        time.sleep(0.02)


def test_a_line_another_process_leaves_unended_costs_the_follower_no_event(
        host: SysRoot, tmp_path: Path) -> None:
    """Something else appends to the log without ending its line (``printf … >> LOG``, a
    tool killed mid-write). The writer appended its next event right after those bytes:
    the two fused into one line that is no event, and that event was lost to every reader
    (the follower said it was "not in the log"). The writer now notices the file grew
    under it and ends that line first, as it ends a torn line of its own."""
    log = tmp_path / "events.jsonl"
    with short_socket_dir() as sockdir, Daemon(host.root, tmp_path, f"{sockdir}/gw.sock",
                                               log=log) as d:
        follower = Follower(log)
        try:
            toggle(d, host, 0)
            printed = follower.until("driver-changed")
            with log.open("ab") as f:
                f.write(b'{"seq":99,"note":"half a line, never ended')
            for n in (1, 2):  # one at a time: two rebinds in one batch are no change
                toggle(d, host, n)
                printed += follower.until("driver-changed", after=printed[-1]["seq"], timeout=10)
            assert d.stop() == 0, d.stderr
            printed += follower.until("stopped")
        finally:
            err = follower.stop()
    seqs = [e["seq"] for e in printed]
    assert seqs == list(range(1, seqs[-1] + 1)), seqs
    assert [e["new"] for e in printed if e["type"] == "driver-changed"] == [
        "vfio-pci", "snd_hda_intel", "vfio-pci"]
    for event in printed:  # each line printed is an event of docs/events.md
        assert parse_event(event).type == event["type"]
    assert "not in the log" not in err and "Traceback" not in err, err


def test_a_log_emptied_in_place_under_the_writer_rotates_at_its_own_size(
        tmp_path: Path) -> None:
    """``: > LOG`` (or logrotate's copytruncate) under a writer: the writer counted the
    bytes it wrote before, and rotated the nearly empty file at its next batch, long
    before it held ``max_bytes``. Its size is now read from the same ``stat`` that
    notices a moved log."""
    path = tmp_path / "ev.jsonl"
    line = json.dumps({"seq": 1, "time": "t", "type": "x", "pad": "p" * 60})
    with eventlog.EventLog(path, max_bytes=1000, keep=3) as log:
        for seq in range(1, 9):
            log.write_line(line.replace('"seq": 1,', f'"seq": {seq},'))
        assert 800 < path.stat().st_size <= 1000
        os.truncate(path, 0)
        for seq in range(9, 12):
            log.write_line(line.replace('"seq": 1,', f'"seq": {seq},'))
    assert eventlog.rotated_path(path, 1) not in map(str, tmp_path.iterdir())
    assert [e["seq"] for e in eventlog.read_events(path)] == [9, 10, 11]


def test_a_follower_resuming_before_the_log_exists_prints_all_the_new_log_holds(
        host: SysRoot, tmp_path: Path) -> None:
    """``--follow --since-seq N`` started before any log (the consumer comes up before the
    daemon, its log on a tmpfs begun anew): it says the log was begun anew and is to print
    what is added. A log that then held more than a bisection window when it first looked
    (it was slow, or the log arrived whole) was still entered by bisection towards N, and
    every event before where it landed was passed over in silence."""
    log = tmp_path / "events.jsonl"
    follower = Follower(log, "--since-seq", "100000")
    try:
        assert "below 100000" in follower.note()  # no log yet: taken for a new one
        follower.proc.send_signal(signal.SIGSTOP)
        try:
            with short_socket_dir() as sockdir, Daemon(
                    host.root, tmp_path, f"{sockdir}/gw.sock", log=log) as d:
                for n in range(100):  # one at a time: two rebinds in one batch are none
                    last = eventlog.last_seq_in(log) or 0
                    toggle(d, host, n)
                    wait_seq(log, last + 1)
                assert d.stop() == 0, d.stderr
            assert log.stat().st_size > 4 * eventlog._PROBE_WINDOW  # many windows
        finally:
            follower.proc.send_signal(signal.SIGCONT)
        printed = follower.until("stopped")
    finally:
        err = follower.stop()
    seqs = [e["seq"] for e in printed]
    assert seqs == list(range(1, seqs[-1] + 1)), seqs[:5]
    assert printed[0]["type"] == "ready" and "Traceback" not in err
