"""``gpuwatch status``: is this host ready for GPU passthrough, the way an operator reads it."""

from __future__ import annotations

import argparse

from gpuwatch.cli.common import EXIT_OK, add_root_args, check_root
from gpuwatch.hostfs.procfs import memlock
from gpuwatch.jsonout import dumps
from gpuwatch.model import scan
from gpuwatch.report import build_status, render_status


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("status", help="VFIO/passthrough readiness of this host",
                              description="IOMMU, vfio-pci, memlock and every GPU with its group.")
    add_root_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_root(args.root)
    report = build_status(scan(args.root, args.config), memlock())
    print(dumps(report) if args.json else render_status(report))
    return EXIT_OK
