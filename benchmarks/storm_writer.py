"""The storm's "kernel": toggles drivers in a fixture tree and writes each uevent into a FIFO.

Run by the storm benchmark as its own process (``python benchmarks/storm_writer.py PLAN``), so
that it does not share the watcher's interpreter. Standard library only: it starts in
milliseconds and learns nothing of gpuwatch's but what the log says. While the clock runs it
changes only each function's ``driver`` link (what gpuwatch reads); the driver's back link and
the ``uevent`` file are brought to the final state after the clock stops.

Lockstep, because sysfs is the truth: the watcher re-reads a function when its uevent arrives,
so a function must not change again before the watcher has read its previous change. Event
``k`` toggles function ``k mod n`` and is written only once the log holds the driver-changed
events of ``0 … k-n`` (the previous toggle of the same function). Every uevent then meets a
tree that differs from what the model holds in exactly that function's driver, so it must
produce exactly one ``driver-changed`` event: the expected count is the number of uevents.

Plan (JSON): ``fifo``, ``log``, ``events``, ``chunk``, ``pipe_size``, ``stall_s``, ``poll_s`` and
``functions``: a list of ``{addr, devdir, driver_dir, driver_target, back_target,
uevent_bound, uevent_unbound, bound, props}`` (``props``: the uevent properties without
ACTION, DRIVER and SEQNUM; ``driver_dir`` is the home driver's directory). Prints one JSON
object: ``{"written", "seen", "t_first", "t_done", "stalled", "cpu_s"}`` (perf_counter seconds;
``cpu_s`` is the writer's own CPU time, to tell its share from the watcher's).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import resource
import sys
import time
from typing import Any

F_SETPIPE_SZ: int = getattr(fcntl, "F_SETPIPE_SZ", 1031)  # Linux's value
DRIVER_CHANGED = b'"type":"driver-changed"'
READY = b'"type":"ready"'


class LogTail:
    """Counts complete driver-changed lines appended to the watcher's log."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = -1
        self.carry = b""
        self.changed = 0
        self.ready = False

    def poll(self) -> int:
        if self.fd < 0:
            try:
                self.fd = os.open(self.path, os.O_RDONLY)
            except FileNotFoundError:
                return self.changed
        while True:
            chunk = os.read(self.fd, 1 << 20)
            if not chunk:
                return self.changed
            data = self.carry + chunk
            cut = data.rfind(b"\n") + 1
            self.carry = data[cut:]
            complete = data[:cut]
            self.changed += complete.count(DRIVER_CHANGED)
            if not self.ready and READY in complete:
                self.ready = True


def uevent_line(props: dict[str, str], action: str, driver: str | None, seqnum: int) -> bytes:
    """The same form ``gpuwatch record`` writes (``uevent_to_json``): sorted, compact."""
    full = dict(props, ACTION=action, SEQNUM=str(seqnum))
    if driver:
        full["DRIVER"] = driver
    return json.dumps(full, separators=(",", ":"), sort_keys=True).encode() + b"\n"


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def write_file(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def main(plan_path: str) -> int:
    with open(plan_path, encoding="utf-8") as fh:
        plan: dict[str, Any] = json.load(fh)
    fns: list[dict[str, Any]] = plan["functions"]
    n = len(fns)
    total = int(plan["events"])
    chunk = int(plan["chunk"])
    stall_s = float(plan["stall_s"])
    poll_s = float(plan["poll_s"])

    # Everything deterministic is prepared before the clock starts: which function each event
    # toggles, in which direction, and its line.
    initial = [bool(f["bound"]) for f in fns]
    bound = list(initial)
    steps: list[tuple[str, str]] = []  # the function's driver link, its target ("": unbind)
    lines: list[bytes] = []
    for k in range(total):
        i = k % n
        binding = not bound[i]
        bound[i] = binding
        f = fns[i]
        driver = os.path.basename(f["driver_dir"]) if binding else None
        steps.append((f["devdir"] + "/driver", f["driver_target"] if binding else ""))
        lines.append(uevent_line(f["props"], "bind" if binding else "unbind", driver, k + 1))

    fifo = os.open(plan["fifo"], os.O_WRONLY)  # blocks until the watcher's source opens it
    with contextlib.suppress(OSError):  # the default 64 KiB pipe works too, more wake-ups
        fcntl.fcntl(fifo, F_SETPIPE_SZ, int(plan["pipe_size"]))
    tail = LogTail(plan["log"])
    deadline = time.monotonic() + 120
    while not tail.ready:
        tail.poll()
        if time.monotonic() > deadline:
            print(json.dumps({"error": "watcher never logged ready"}))
            return 1
        time.sleep(0.001)
    seen_before = tail.changed

    stalled = False
    cpu_first = _cpu_s()
    t_first = time.perf_counter()
    k = 0
    try:
        while k < total:
            end = min(k + chunk, total)
            need = seen_before + end - n  # the previous toggle of every function in this chunk
            if tail.poll() < need:
                last_progress, last_seen = time.monotonic(), tail.changed
                while tail.poll() < need:
                    if tail.changed != last_seen:
                        last_progress, last_seen = time.monotonic(), tail.changed
                    elif time.monotonic() - last_progress > stall_s:
                        stalled = True
                        break
                    time.sleep(poll_s)
                if stalled:
                    break
            for j in range(k, end):
                link, target = steps[j]
                if target:
                    os.symlink(target, link)
                else:
                    os.unlink(link)
            os.write(fifo, b"".join(lines[k:end]))
            k = end
    finally:
        os.close(fifo)  # EOF: the watcher's file source ends after the last line

    goal = seen_before + k
    last_progress, last_seen = time.monotonic(), tail.changed
    while tail.poll() < goal:
        if tail.changed != last_seen:
            last_progress, last_seen = time.monotonic(), tail.changed
        elif time.monotonic() - last_progress > stall_s:
            stalled = True
            break
        time.sleep(poll_s)
    t_done = time.perf_counter()
    cpu = _cpu_s() - cpu_first
    # The driver's link back to the function and the uevent file follow after the clock: the
    # watcher's re-reads read neither, and keeping them in step per event would make this fake
    # kernel, not the watcher, what the storm measures (the two CPUs of a small machine are
    # shared). A fresh scan does read the uevent of a function without a driver link: the
    # harness compares the model with one only after this process has exited.
    final = list(initial)
    for j in range(k):
        final[j % n] = bool(steps[j][1])
    for i, f in enumerate(fns):
        back = f["driver_dir"] + "/" + f["addr"]
        if final[i] and not os.path.lexists(back):
            os.symlink(f["back_target"], back)
        elif not final[i] and os.path.lexists(back):
            os.unlink(back)
        write_file(f["devdir"] + "/uevent",
                   (f["uevent_bound"] if final[i] else f["uevent_unbound"]).encode())
    print(json.dumps({"written": k, "seen": tail.changed - seen_before, "t_first": t_first,
                      "t_done": t_done, "stalled": stalled, "cpu_s": cpu}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
