"""``gpuwatch events --follow`` across runs of the watcher: real ``gpuwatch watch`` processes
(uevents through a FIFO, ``--source file:``) and a real follower process.

A watcher numbers its events after the last seq its log holds; with every log file deleted
it starts again at 1. A follower that only took seqs above the last one it printed would
then print nothing until the new run passed the old one.
"""

from __future__ import annotations

import contextlib
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
        self.notes: queue.Queue[str] = queue.Queue()
        out, err = self.proc.stdout, self.proc.stderr
        assert out is not None and err is not None

        def pump() -> None:
            for text in out:
                self.lines.put(json.loads(text))

        def pump_notes() -> None:
            for text in err:
                self.notes.put(text)

        self._pumps = [threading.Thread(target=pump, daemon=True),
                       threading.Thread(target=pump_notes, daemon=True)]
        for thread in self._pumps:
            thread.start()

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

    def note(self, timeout: float = 30) -> str:
        """The next line on its stderr."""
        try:
            return self.notes.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError("no note on stderr") from None

    def stop(self) -> str:
        """SIGTERM; its exit status must be 0. Returns what it wrote on stderr not yet
        taken by `note`."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        for pump in self._pumps:
            pump.join(10)  # both end at EOF
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
        err = []
        while not self.notes.empty():
            err.append(self.notes.get())
        assert self.proc.returncode == 0, err
        return "".join(err)


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
    watch = Watch(host, tmp_path, log)
    follower: Follower | None = None
    try:
        _wait_for(log, "ready")
        follower = Follower(log, "--since-seq", "500")
        assert "below 500" in follower.note()  # it read the log: seq 1, from another run
        addr = next(a for a in host.functions if (host.device_dir(a) / "driver").is_symlink())
        host.unbind(addr)
        watch.push(host.uevent_props("unbind", addr))
        changed = follower.until("driver-changed")
        assert changed[0]["addr"] == addr and 1 < changed[0]["seq"] < 500
        assert all(e["seq"] > 1 for e in changed)  # what the log held before: not printed
    finally:
        watch.stop()
        if follower is not None:
            follower.stop()


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


# ------------------------------------------------------------------ `--log -`, a stalled reader


def _wedge(host: SysRoot, n: int) -> str:
    """A DRM ``change`` with ``WEDGED=``: one ``gpu-wedged`` event each, no sysfs change."""
    card = host.devpath("0000:00:02.0") + "/drm/card0"
    return json.dumps({"ACTION": "change", "DEVPATH": card, "SUBSYSTEM": "drm",
                       "WEDGED": "rebind", "PID": str(n), "TASK": "hung"}) + "\n"


def _snapshot_seq(sock: str) -> int | None:
    from tests.daemon_helpers import Lines, connect

    try:
        with connect(sock, timeout=2) as s:
            seq: int = Lines(s).request("snapshot")["result"]["seq"]
            return seq
    except (OSError, EOFError, KeyError):
        return None


def test_a_stdout_log_whose_reader_stops_reading_leaves_the_daemon_live(
    host: SysRoot, tmp_path: Path
) -> None:
    """``gpuwatch watch --log -`` into a pipe nobody reads: the model and the socket go on
    (a write that blocked the event loop froze them all), the log degrades, and once the
    reader reads again the log resumes with a ``log-gap`` record naming exactly the seqs it
    lacks. stdout itself stays a blocking pipe: a writer thread waits on it, nothing else."""
    from gpuwatch.service.testing import short_socket_dir

    fifo = tmp_path / "uevents.fifo"
    os.mkfifo(fifo)
    errfile = tmp_path / "stderr"
    # A small hand-over buffer (4 MiB by default) so a few hundred events fill it.
    code = ("import sys, gpuwatch.watch.eventlog as e; e.STDOUT_BUFFER = 16384; "
            "from gpuwatch.cli.main import main; sys.exit(main())")
    with short_socket_dir() as sockdir, open(errfile, "w") as err:
        sock = f"{sockdir}/gw.sock"
        proc = subprocess.Popen(
            [sys.executable, "-c", code, "watch", "--root", str(host.root), "--source",
             f"file:{fifo}", "--log", "-", "--socket", sock, "--reconcile-interval", "0"],
            stdout=subprocess.PIPE, stderr=err, env=_env(), cwd=REPO)
        assert proc.stdout is not None
        out_fd = proc.stdout.fileno()
        try:
            writer = open(fifo, "w")  # noqa: SIM115 - closed below
            deadline = time.monotonic() + 30
            while _snapshot_seq(sock) is None:
                assert proc.poll() is None and time.monotonic() < deadline, "no socket"
                time.sleep(0.05)
            assert os.get_blocking(out_fd)  # the pipe as the daemon got it

            # Far more than the pipe (64 KiB) and the hand-over buffer hold, never read.
            burst = 3000
            pushing = threading.Thread(
                target=lambda: (writer.write("".join(_wedge(host, n) for n in range(burst))),
                                writer.flush()), daemon=True)
            pushing.start()
            pushing.join(60)
            assert not pushing.is_alive(), "the daemon stopped reading its uevents"
            deadline = time.monotonic() + 60
            while (_snapshot_seq(sock) or 0) < burst + 1:  # ready + every gpu-wedged
                assert proc.poll() is None
                assert time.monotonic() < deadline, "the daemon froze behind its stdout"
                time.sleep(0.1)

            # The reader comes back: what the pipe holds, then the log resumes with a gap.
            os.set_blocking(out_fd, False)  # the test's own end of the pipe
            data = b""
            n = burst
            deadline = time.monotonic() + 90
            while b'"log-gap"' not in data:
                assert time.monotonic() < deadline, "the log never resumed"
                with contextlib.suppress(BlockingIOError):
                    while chunk := os.read(out_fd, 1 << 16):
                        data += chunk
                writer.write(_wedge(host, n))  # a write is tried with the next event
                writer.flush()
                n += 1
                time.sleep(0.2)
            os.set_blocking(out_fd, True)
            writer.close()  # the source ends: the watch stops, writing `stopped`
            data += proc.stdout.read()
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
    stderr = errfile.read_text()
    assert "EAGAIN" in stderr and "Traceback" not in stderr
    events = [json.loads(text) for text in data.decode().splitlines()]  # whole lines only
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(set(seqs))
    assert events[0]["type"] == "ready" and events[-1]["type"] == "stopped"
    gaps = [e for e in events if e["type"] == "log-gap"]
    assert gaps and all(g["error"].startswith("EAGAIN") for g in gaps)
    covered = {e["seq"] for e in events if e["type"] != "log-gap"}
    for gap in gaps:
        missing = set(range(gap["first_seq"], gap["last_seq"] + 1))
        assert gap["seq"] == gap["last_seq"] and not missing & covered
        covered |= missing
    assert covered == set(range(1, seqs[-1] + 1))  # each seq written or named by a gap
    assert not any(e["type"] == "log-degraded" for e in events)


def test_a_stdout_log_whose_reader_goes_away_ends_the_watch_with_exit_0(
    host: SysRoot, tmp_path: Path
) -> None:
    """``gpuwatch watch | head -1``: once the reader has gone, the next event ends the
    watch, exit 0, quietly (the writer thread sees EPIPE; the watcher hears of it at its
    next write)."""
    proc, writer = _watch_with_stdout_reader_gone(host, tmp_path)
    try:
        deadline = time.monotonic() + 30
        n = 0
        while proc.poll() is None:
            assert time.monotonic() < deadline, "the watch outlived its reader"
            with contextlib.suppress(BrokenPipeError):
                writer.write(_wedge(host, n))
                writer.flush()
            n += 1
            time.sleep(0.1)
    finally:
        err = _reap(proc, writer)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "internal error" not in err, err


def _watch_with_stdout_reader_gone(host: SysRoot, tmp_path: Path,
                                   ) -> tuple[subprocess.Popen[bytes], IO[str]]:
    """``gpuwatch watch`` writing to a pipe whose reader took ``ready`` and left (``| head
    -1``), and the writer of its uevent FIFO."""
    fifo = tmp_path / "uevents.fifo"
    os.mkfifo(fifo)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuwatch", "watch", "--root", str(host.root), "--source",
         f"file:{fifo}", "--log", "-", "--reconcile-interval", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), cwd=REPO)
    assert proc.stdout is not None
    writer = open(fifo, "w")  # noqa: SIM115 - the caller closes it
    assert json.loads(proc.stdout.readline())["type"] == "ready"
    proc.stdout.close()  # `head -1` has what it wanted
    return proc, writer


def _reap(proc: subprocess.Popen[bytes], writer: IO[str]) -> str:
    """End the watch of `_watch_with_stdout_reader_gone` (killed if still running) and its
    FIFO's writer: what it said on stderr."""
    assert proc.stderr is not None
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    err = proc.stderr.read().decode()
    proc.stderr.close()
    with contextlib.suppress(BrokenPipeError):
        writer.close()
    return err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("end", ["one event", "SIGTERM"])
def test_a_watch_whose_stdout_reader_has_gone_ends_at_the_next_event_quietly(
    host: SysRoot, tmp_path: Path, end: str
) -> None:
    """``gpuwatch watch | head -1`` on a quiet host: ONE event after the reader left ends
    the watch, exit 0, as documented (was: that event was handed to the writer thread,
    which found EPIPE after taking it, and the watch ran on until a second event, on a
    quiet host a reconcile or two later). A SIGTERM then ends it with exit 0 and nothing on
    stderr (was, once a write had found the reader gone: "stopping on SIGTERM; on the way
    out: BrokenPipeError ...", its ``stopped`` record refused)."""
    proc, writer = _watch_with_stdout_reader_gone(host, tmp_path)
    assert proc.stderr is not None
    try:
        time.sleep(0.3)  # the reader has gone for a while, and nothing was written since
        if end == "one event":
            writer.write(_wedge(host, 1))
            writer.flush()
        else:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the watch outlived its reader after {end}") from None
    finally:
        err = _reap(proc, writer)
    assert proc.returncode == 0, err
    assert err == ""


def test_a_follower_carries_on_when_the_log_is_emptied_in_place_and_a_new_run_begins(
    tmp_path: Path,
) -> None:
    """``: > events.jsonl`` (no rotated files) and a restart: the writer numbers from 1 in
    the same file, which the follower reads again from its start."""
    from tests.test_eventlog import Collector, line

    path = tmp_path / "ev.jsonl"
    with eventlog.EventLog(path) as log:
        for seq in range(1, 41):
            log.write_line(line(seq, "ready" if seq == 1 else "x"))
    col = Collector(path)
    try:
        col.wait_for(lambda events: len(events) == 40)
        os.truncate(path, 0)
        with eventlog.EventLog(path) as log:
            assert log.last_seq is None  # the writer's view: a new log
            log.write_line(json.dumps({"seq": 1, "time": "later", "type": "ready"}))
            log.write_line(json.dumps({"seq": 2, "time": "later", "type": "x"}))
        col.wait_for(lambda events: len(events) == 42)
    finally:
        events = col.stop()
    assert [(e["seq"], e["time"]) for e in events[40:]] == [(1, "later"), (2, "later")]


def _run_lines(time_: str, count: int, pad: int = 0) -> bytes:
    """A run of the watcher as its log holds it: ``ready`` at seq 1, then ``count - 1``
    events (each ``pad`` bytes longer, so a later run can outgrow an earlier one)."""
    return b"".join(
        json.dumps({"seq": seq, "time": time_, "type": "ready" if seq == 1 else "x",
                    "pad": "p" * pad}, separators=(",", ":")).encode() + b"\n"
        for seq in range(1, count + 1))


def _refill_in_place(path: Path, content: bytes) -> None:
    """Empty the file in place (same inode, as ``: > PATH`` or copytruncate) and write
    ``content`` into it: what a watcher restarted on the emptied log does."""
    ident = path.stat().st_ino
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, content)
    finally:
        os.close(fd)
    assert path.stat().st_ino == ident


def test_a_python_follower_notices_a_log_emptied_and_refilled_past_it_at_once(
    tmp_path: Path,
) -> None:
    """Emptied and written anew past the follower's position before it looks again (its
    size never seen below where it was): the follower reads the new run from its start, not
    from the middle of it (was: a torn line and the new run's first events lost)."""
    path = tmp_path / "ev.jsonl"
    path.write_bytes(_run_lines("run-1", 20))
    old_size = path.stat().st_size
    deadline = time.monotonic() + 30
    records = eventlog.follow_records(path, poll_interval=0.01,
                                      stop=lambda: time.monotonic() > deadline)
    first = [next(records).event for _ in range(20)]
    assert [(e["seq"], e["time"]) for e in first] == [(s, "run-1") for s in range(1, 21)]
    # The follower is suspended between two looks: the refill lands within one interval.
    new_run = _run_lines("run-2", 20, pad=40)
    assert len(new_run) > old_size + 500
    _refill_in_place(path, new_run)
    second = [next(records).event for _ in range(20)]
    records.close()
    assert [(e["seq"], e["time"]) for e in second] == [(s, "run-2") for s in range(1, 21)]


def test_an_async_follower_notices_a_log_emptied_and_refilled_past_it_at_once(
    tmp_path: Path,
) -> None:
    import anyio

    path = tmp_path / "ev.jsonl"
    path.write_bytes(_run_lines("run-1", 20))

    async def follow() -> list[tuple[int, str]]:
        got: list[tuple[int, str]] = []
        with anyio.fail_after(30):
            records = eventlog.afollow_records(path, poll_interval=0.01)
            try:
                async for record in records:
                    got.append((record.event["seq"], record.event["time"]))
                    if len(got) == 20:  # suspended here: the refill is within one look
                        _refill_in_place(path, _run_lines("run-2", 20, pad=40))
                    if len(got) == 40:
                        break
            finally:
                await records.aclose()
        return got

    got = anyio.run(follow)
    assert got == [(s, "run-1") for s in range(1, 21)] + [(s, "run-2") for s in range(1, 21)]


def test_events_follow_notices_a_log_emptied_and_refilled_while_it_was_stopped(
    tmp_path: Path,
) -> None:
    """``gpuwatch events --follow`` held still (SIGSTOP) while the log is emptied in place
    and refilled beyond what it had read: it prints the new run from seq 1 and says so."""
    path = tmp_path / "ev.jsonl"
    path.write_bytes(_run_lines("run-1", 20))
    follower = Follower(path)
    try:
        got = follower.until("x", after=19)
        assert [(e["seq"], e["time"]) for e in got] == [(s, "run-1") for s in range(1, 21)]
        follower.proc.send_signal(signal.SIGSTOP)
        try:
            _refill_in_place(path, _run_lines("run-2", 20, pad=40))
        finally:
            follower.proc.send_signal(signal.SIGCONT)
        got = follower.until("x", after=19)
        assert [(e["seq"], e["time"]) for e in got] == [(s, "run-2") for s in range(1, 21)]
        assert "a new run of the watcher begins at seq 1" in follower.note()
    finally:
        err = follower.stop()
    assert "Traceback" not in err
