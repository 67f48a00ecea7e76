"""``gpuwatch list``: passthrough-capable GPUs with ready-to-paste libvirt ``<hostdev>`` blocks."""

from __future__ import annotations

import argparse

from gpuwatch.cli.common import EXIT_OK, add_root_args, check_root
from gpuwatch.jsonout import dumps
from gpuwatch.model import scan
from gpuwatch.report import passthrough_gpus, render_list


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("list", help="passthrough-capable GPUs as libvirt <hostdev> blocks",
                              description="Passthrough-capable GPUs and a libvirt <hostdev> block "
                                          "for every function of each GPU's IOMMU group.")
    add_root_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_root(args.root)
    model = scan(args.root, args.config)
    gpus = passthrough_gpus(model)
    if args.json:
        print(dumps(gpus))
    else:
        print(render_list(gpus, model.probe("detect-vfio").iommu_enabled))
    return EXIT_OK
