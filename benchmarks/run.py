"""Run gpuwatch's benchmarks: ``python benchmarks/run.py [--quick] [--json PATH]``.

Prints a table of every figure of issue 5 with its target; ``--json`` writes the figures under
the issue's keys. ``--quick`` (fewer repetitions, same sizes) finishes within a minute on a
2-core machine; the full run within ten. What each figure means: docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout, not an install

from benchmarks.harness import FULL, QUICK, format_table, machine, run_all


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="fewer repetitions: within a minute, noisier figures")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    args = parser.parse_args(argv)
    started = time.monotonic()

    def progress(msg: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {msg}", file=sys.stderr, flush=True)

    notes: dict[str, Any] = {}
    results = run_all(QUICK if args.quick else FULL, progress, notes)
    m = machine()
    print(f"machine: {m['cpus']} CPUs, {m['cpu']}, Python {m['python']}; "
          f"fixtures on {m['fixtures']}; {'quick' if args.quick else 'full'} run, "
          f"{time.monotonic() - started:.0f} s")
    print(format_table(results, notes))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
