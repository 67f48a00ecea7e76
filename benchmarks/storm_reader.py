"""The storm's baseline: the least a uevent reader can do, with the standard library only.

``python benchmarks/storm_reader.py ROOT FIFO LOG``: for each uevent line on the FIFO, parse
it, read the function's driver link under ROOT, and log one line, one ``write`` per chunk read
(as gpuwatch does per batch). No model, no diffing, no probes: the floor gpuwatch's storm rate
is compared with in the same run.
"""

from __future__ import annotations

import json
import os
import sys


def main(root: str, fifo: str, log: str) -> int:
    sys_dir = os.path.join(root, "sys")
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(out, b'{"type":"ready"}\n')
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
    os.close(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
