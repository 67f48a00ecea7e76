"""``gpuwatch status``: is this host ready for GPU passthrough, the way an operator reads it."""

from __future__ import annotations

import argparse
from typing import cast

from gpuwatch.cli.common import EXIT_OK, add_root_args, check_root, config_of
from gpuwatch.cli.daemon import add_daemon_args, ask_daemon
from gpuwatch.hostfs.procfs import memlock
from gpuwatch.jsonout import dumps
from gpuwatch.model import HostModel, scan
from gpuwatch.report import build_status, render_status
from gpuwatch.service.remote import RemoteModel
from gpuwatch.settings import tables_in_force


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("status",
                              description="IOMMU, vfio-pci, memlock and every GPU with its group.")
    add_root_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_daemon_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_root(args.root)
    answer = ask_daemon(args, lambda c: build_status(
        cast(HostModel, RemoteModel(c, tables_in_force(config_of(args)), args.root)), memlock()))
    report = answer.value if answer is not None else build_status(scan(args.root, config_of(args)),
                                                                   memlock())
    print(dumps(report) if args.json else render_status(report))
    return EXIT_OK
