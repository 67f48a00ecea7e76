"""Soak: a real daemon, N uevents through the file source, 50 socket subscribers, rotation on.

    python -m benchmarks.soak [--uevents 1000000] [--subscribers 50] [--out FILE]

A writer flips one function's driver link every ``--flip-every`` uevents and writes a
``bind`` uevent for it each time (the rest are ``change`` uevents that find nothing new):
the daemon reads the tree per uevent, so a flip becomes a ``driver-changed`` event. Checked
at the end, and printed as one JSON object:

- the log's seqs (over every rotated file) are gapless from ``ready`` to ``stopped``;
- every subscriber saw every event from its subscription on, or got a ``lagged`` notice
  (``{"type": "lagged", "missed": N, "first_missed_seq": S, …}``, docs/socket.md) that
  accounts for where its events stop: counted per subscriber, events seen plus lagged
  notices, and any gap without a notice fails the run;
- the daemon's RSS after warm-up (10 % of the uevents) grew by at most 5 %.

``--stall K`` makes the last K subscribers read nothing for ``--stall-seconds``, and until
the first subscriber has read ``--stall-bytes`` (with a small ``--max-output-bytes`` they
overflow, once more than the kernel's socket buffer has been published to them): they must
come out ``lagged``, with a notice, never with a silent gap.

Standard library plus gpuwatch's own test tree builder; nothing here is timed against a
baseline: the figures go to docs/performance.md.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from gpuwatch.core.limits import MAX_LOG_KEEP
from gpuwatch.service import protocol as P
from gpuwatch.testing import example_gpu_host
from gpuwatch.watch.eventlog import read_events

SEQ = re.compile(rb'"seq":(\d+)')
LAGGED = re.compile(rb'"type":\s*"lagged"')
FLIP = "0000:01:00.1"  # the NVIDIA HDMI audio function: snd_hda_intel <-> vfio-pci


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class Tally:
    """One subscriber's account, in stream order: events seen, gaps in their seqs, and the
    ``lagged`` notices (a notice must name the very next seq as the first one missed)."""

    def __init__(self, first_seq: int) -> None:
        self.first = self.last = first_seq
        self.seen = 0
        self.gaps = 0
        self.notices: list[tuple[int, int]] = []  # (missed, first_missed_seq)
        self.bad_notices = 0

    def feed(self, data: bytes) -> None:
        """Whole lines only (the reader keeps a partial line for the next read)."""
        pos = 0
        while (found := LAGGED.search(data, pos)) is not None:
            at = found.start()
            begin = data.rfind(b"\n", 0, at) + 1
            end = data.find(b"\n", at)
            end = len(data) if end < 0 else end
            self._events(data, pos, begin)
            notice = json.loads(data[begin:end])
            missed, first = int(notice["missed"]), int(notice["first_missed_seq"])
            self.notices.append((missed, first))
            if first != self.last + 1 or missed < 1:
                self.bad_notices += 1
            pos = end + 1
        self._events(data, pos, len(data))

    def _events(self, data: bytes, pos: int, end: int) -> None:
        for m in SEQ.finditer(data, pos, end):  # one "seq" per event line (a notice has none)
            seq = int(m.group(1))
            self.seen += 1
            if seq != self.last + 1:
                self.gaps += 1
            self.last = seq

    def verdict(self, last_seq: int) -> str:
        """``complete``: every event to the end; ``lagged``: gapless up to a notice that
        says where the loss starts; ``silent``: events missing and nothing said."""
        if self.gaps or self.bad_notices:
            return "silent"
        if self.notices:
            return "lagged"
        return "complete" if self.last >= last_seq - 1 else "silent"


class Subscribers(threading.Thread):
    """``count`` subscribed connections read in one thread, each with its `Tally` (events
    of every type are asked for)."""

    def __init__(self, path: str, count: int, stall: int = 0, stall_s: float = 0.0,
                 stall_bytes: int = 0) -> None:
        super().__init__(daemon=True)
        #: The last ``stall`` connections read nothing for ``stall_s`` seconds and until the
        #: first has read ``stall_bytes`` (a client that stops reading for a while: it must
        #: get a `lagged` notice, not a silent gap). Bytes as well as seconds: on a slow or
        #: busy machine fewer events come in the seconds, and the kernel's socket buffer
        #: (~200 KiB) may hold them all, so that no client of the daemon ever overflows.
        self.stalled = set(range(count - stall, count))
        self.resume_at = time.monotonic() + stall_s
        self.stall_bytes = stall_bytes
        self.resumed = threading.Event()
        if not self.stalled:
            self.resumed.set()
        self.lead_bytes = 0  # what the first connection has read
        self.socks: list[socket.socket] = []
        self.tallies: dict[int, Tally] = {}
        self.closed: set[int] = set()
        self.partial: dict[int, bytes] = {}  # each connection's unfinished last line
        self.bytes = 0
        self.stop = threading.Event()
        for i in range(count):
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            s.sendall(P.encode_request(i, "subscribe"))
            reply = b""
            while b"\n" not in reply:
                reply += s.recv(4096)
            head, _, rest = reply.partition(b"\n")
            self.tallies[i] = Tally(json.loads(head)["result"]["seq"])
            s.setblocking(False)
            self.socks.append(s)
            cut = rest.rfind(b"\n") + 1
            self.partial[i] = rest[cut:]
            self._feed(i, rest[:cut])

    def last_seen(self, i: int) -> int:
        return self.tallies[i].last

    def _feed(self, i: int, data: bytes) -> None:
        self.bytes += len(data)
        if i == 0:
            self.lead_bytes += len(data)
        self.tallies[i].feed(data)

    def run(self) -> None:
        sel = selectors.DefaultSelector()
        partial = self.partial
        for i, s in enumerate(self.socks):
            if i not in self.stalled:
                sel.register(s, selectors.EVENT_READ, i)
        while not self.stop.is_set() and len(self.closed) < len(self.socks):
            wait = 0.2
            if self.stalled:
                wait = min(wait, max(0.0, self.resume_at - time.monotonic()))
                if wait == 0.0 and self.lead_bytes < self.stall_bytes:
                    wait = 0.02  # the time is up, the bytes not yet
                elif wait == 0.0:
                    for i in self.stalled:
                        sel.register(self.socks[i], selectors.EVENT_READ, i)
                    self.stalled = set()
                    self.resumed.set()
            for key, _ in sel.select(wait):
                i = key.data
                try:
                    data = key.fileobj.recv(1 << 20)  # type: ignore[union-attr]
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    sel.unregister(key.fileobj)
                    self.closed.add(i)
                    continue
                buf = partial.get(i, b"") + data
                cut = buf.rfind(b"\n") + 1
                partial[i] = buf[cut:]
                self._feed(i, buf[:cut])


def open_writer(fifo: Path, daemon: subprocess.Popen[str]) -> TextIO:
    """The FIFO's writing end, once the daemon opened its reading end: a plain open would
    wait for ever for a daemon that refused its arguments and exited."""
    deadline = time.monotonic() + 60
    while True:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # ENXIO: no reader yet
                raise
        if daemon.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the daemon did not start: {daemon.communicate()[1].strip()}")
        time.sleep(0.05)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "w", buffering=1 << 20)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--uevents", type=int, default=1_000_000)
    ap.add_argument("--subscribers", type=int, default=50)
    ap.add_argument("--flip-every", type=int, default=10)
    ap.add_argument("--log-max-bytes", type=int, default=8 << 20)
    ap.add_argument("--max-output-bytes", type=int, default=None,
                    help="the daemon's --socket-max-output-bytes (default: its own)")
    ap.add_argument("--stall", type=int, default=0, metavar="K",
                    help="K subscribers (never the first) read nothing for --stall-seconds")
    ap.add_argument("--stall-seconds", type=float, default=2.0)
    ap.add_argument("--stall-bytes", type=int, default=0, metavar="N",
                    help="and until the first subscriber has read N bytes")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="gw-soak-"))
    host = example_gpu_host(work / "host")
    fifo, log, sock = work / "uevents", work / "log" / "events.jsonl", str(work / "gw.sock")
    os.mkfifo(fifo)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    daemon = subprocess.Popen(
        [sys.executable, "-m", "gpuwatch", "watch", "--root", str(host.root), "--source",
         f"file:{fifo}", "--log", str(log), "--log-max-bytes", str(args.log_max_bytes),
         "--log-keep", str(MAX_LOG_KEEP), "--reconcile-interval", "0", "--socket", sock,
         *([] if args.max_output_bytes is None
           else ["--socket-max-output-bytes", str(args.max_output_bytes)])],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    writer = open_writer(fifo, daemon)
    deadline = time.monotonic() + 60
    while not os.path.exists(sock):
        assert time.monotonic() < deadline and daemon.poll() is None, "daemon did not start"
        time.sleep(0.05)
    time.sleep(0.3)
    if not 0 <= args.stall < args.subscribers:
        ap.error("--stall must be less than --subscribers (the first one paces the writer)")
    subs = Subscribers(sock, args.subscribers, args.stall, args.stall_seconds,
                       args.stall_bytes)
    subs.start()

    props = host.uevent_props("change", FLIP)
    drivers = ("vfio-pci", "snd_hda_intel")
    started = time.monotonic()
    rss_warm = 0
    rss_samples = []
    seen = subs.last_seen(0)
    for k in range(args.uevents):
        if k % args.flip_every == 0:
            # Loosely in step: the previous flip has been seen (by subscriber 0) before the
            # next, so each flip is one event instead of many collapsing into the last.
            writer.flush()
            wait_until = time.monotonic() + 2
            while k and subs.last_seen(0) <= seen and time.monotonic() < wait_until:
                time.sleep(0.0002)
            seen = subs.last_seen(0)
            host.bind(FLIP, drivers[(k // args.flip_every) % 2])
            line = {**props, "ACTION": "bind", "SEQNUM": str(k + 1)}
        else:
            line = {**props, "ACTION": "change", "SEQNUM": str(k + 1)}
        writer.write(json.dumps(line) + "\n")
        if k == args.uevents // 10:
            writer.flush()
            time.sleep(1)
            rss_warm = rss_kib(daemon.pid)
        if k % 100_000 == 0 and k:
            rss_samples.append(rss_kib(daemon.pid))
    writer.flush()
    subs.resumed.wait(timeout=60)  # a stalled reader reads again before the daemon stops
    while args.stall and time.monotonic() < subs.resume_at + 1:
        time.sleep(0.05)
    writer.close()  # EOF: the daemon finishes the file, writes `stopped` and exits 0
    daemon_rc = daemon.wait(timeout=3600)
    elapsed = time.monotonic() - started
    subs.stop.set()
    subs.join(timeout=30)
    for s in subs.socks:
        s.close()
    stderr = daemon.stderr.read() if daemon.stderr else ""
    if daemon.stderr:
        daemon.stderr.close()
    events = list(read_events(log))
    seqs = [e["seq"] for e in events]
    gapless = seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    last = seqs[-1]
    verdicts = {i: t.verdict(last) for i, t in subs.tallies.items()}
    complete = [i for i, v in verdicts.items() if v == "complete"]
    lagged = [i for i, v in verdicts.items() if v == "lagged"]
    silent = [i for i, v in verdicts.items() if v == "silent"]
    result: dict[str, Any] = {
        "uevents": args.uevents,
        "events": len(events),
        "subscribers": args.subscribers,
        "seconds": round(elapsed, 1),
        "uevents_per_s": round(args.uevents / elapsed),
        "log_files": len(list(log.parent.glob("events.jsonl*"))) - 1,
        "log_gapless": gapless,
        "last_type": events[-1]["type"],
        "subscribers_complete": len(complete),
        "subscribers_lagged": len(lagged),  # gapless up to a `lagged` notice
        "subscribers_silent_loss": len(silent),  # must be 0
        "subscriber_events_seen": sum(t.seen for t in subs.tallies.values()),
        "lagged_notices": sum(len(t.notices) for t in subs.tallies.values()),
        "missed_with_notice": sum(m for t in subs.tallies.values() for m, _ in t.notices),
        "subscriber_gaps": sum(t.gaps for t in subs.tallies.values()),
        "subscriber_bytes": subs.bytes,
        "rss_warm_kib": rss_warm,
        "rss_max_kib": max(rss_samples or [rss_warm]),
        "rss_growth_pct": round(100 * (max(rss_samples or [rss_warm]) - rss_warm)
                                / max(rss_warm, 1), 2),
        "daemon_rc": daemon_rc,
        "stderr_tail": stderr[-500:],
    }
    shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    ok = (gapless and daemon_rc == 0 and result["rss_growth_pct"] <= 5 and not silent
          and len(complete) + len(lagged) == args.subscribers)
    return 0 if ok else 1


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    raise SystemExit(main())
