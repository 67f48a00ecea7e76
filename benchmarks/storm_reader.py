"""The storm's baselines: the least a uevent reader can do, with the standard library only.

``python benchmarks/storm_reader.py [--per-line] ROOT FIFO LOG``: for each uevent line on the
FIFO, parse it, read the function's driver link under ROOT, and log one line. By default the
lines of each chunk read go out in one ``write`` (as gpuwatch writes each batch): the floor
gpuwatch's storm rate is compared with in the same run. With ``--per-line`` each line is
written as it is made (a line-buffered log, as a reader that logs what it sees usually is).
No model, no diffing, no probes.
"""

from __future__ import annotations

import json
import os
import sys


def batched(sys_dir: str, fifo: str, out: int) -> None:
    fd = os.open(fifo, os.O_RDONLY)
    carry = b""
    loads, readlink, basename = json.loads, os.readlink, os.path.basename
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            break
        lines = (carry + chunk).split(b"\n")
        carry = lines.pop()
        logged = []
        for line in lines:
            props = loads(line)
            devpath = props["DEVPATH"]
            try:
                driver = basename(readlink(sys_dir + devpath + "/driver"))
            except OSError:
                driver = ""
            addr = basename(devpath)
            logged.append(f'{{"type":"driver-changed","addr":"{addr}","new":"{driver}"}}\n')
        if logged:
            os.write(out, "".join(logged).encode())
    os.close(fd)


def per_line(sys_dir: str, fifo: str, out: int) -> None:
    # The same per-line work as `batched`, written out again on purpose: a shared helper
    # would add a call per uevent to a baseline that is meant to be the floor.
    loads, readlink, basename = json.loads, os.readlink, os.path.basename
    with open(fifo, "rb") as source, open(out, "w", buffering=1, closefd=False) as log:
        for line in source:
            props = loads(line)
            devpath = props["DEVPATH"]
            try:
                driver = basename(readlink(sys_dir + devpath + "/driver"))
            except OSError:
                driver = ""
            log.write(f'{{"type":"driver-changed","addr":"{basename(devpath)}",'
                      f'"new":"{driver}"}}\n')


def main(argv: list[str]) -> int:
    root, fifo, log = [a for a in argv if a != "--per-line"][:3]
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(out, b'{"type":"ready"}\n')
    (per_line if "--per-line" in argv else batched)(os.path.join(root, "sys"), fifo, out)
    os.close(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
