"""``gpuwatch list``: passthrough-capable GPUs with ready-to-paste libvirt ``<hostdev>`` blocks."""

from __future__ import annotations

import argparse
from typing import cast

from gpuwatch.cli.common import EXIT_OK, add_root_args, check_root, config_of
from gpuwatch.cli.daemon import add_daemon_args, ask_daemon
from gpuwatch.core.reporttext import MANAGED_VALUES
from gpuwatch.hostfs.noiommu import read_iommu_groups
from gpuwatch.jsonout import dumps
from gpuwatch.model import HostModel, scan
from gpuwatch.report import PassthroughGpu, iommu_enabled, passthrough_gpus, render_list
from gpuwatch.service.remote import RemoteModel
from gpuwatch.settings import tables_in_force


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("list",
                              description="Passthrough-capable GPUs and a libvirt <hostdev> block "
                                          "for every function of each GPU's IOMMU group "
                                          "but those pcieport keeps (bridges); a group "
                                          "two GPUs share is given once.")
    add_root_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--managed", choices=MANAGED_VALUES, default="yes",
                   help="libvirt's managed attribute of the blocks (default yes: libvirt "
                        "detaches the functions itself, without gpuwatch's holder checks; "
                        "no: for hosts that switch with `gpuwatch mode`)")
    add_daemon_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_root(args.root)
    answer = ask_daemon(args, lambda c: _gpus(
        cast(HostModel, RemoteModel(c, tables_in_force(config_of(args)), args.root)), args.managed))
    gpus, enabled = (answer.value if answer is not None
                           else _gpus(scan(args.root, config_of(args)), args.managed))
    if args.json:
        print(dumps(gpus))
    else:
        print(render_list(gpus, enabled))
    return EXIT_OK


def _gpus(model: HostModel, managed: str) -> tuple[list[PassthroughGpu], bool]:
    groups = read_iommu_groups(model.root)  # once for both: a host may have a thousand
    return passthrough_gpus(model, managed, groups), iommu_enabled(model, groups)
