"""``gpuwatch udev-rules [--group G]``: print udev rules granting a group access to /dev/vfio/*
and /dev/iommu (what a VM manager opens, through a group node or through iommufd)."""

from __future__ import annotations

import argparse
import grp
import sys

from gpuwatch.cli.common import EXIT_OK, UsageProblem, to_stderr
from gpuwatch.service.udev_rules import DEFAULT_GROUP, RULES_FILE, InvalidGroupName, render_rules


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "udev-rules",
        description=f"Print udev rules that give GROUP read/write on VFIO device nodes and "
                    f"/dev/iommu, for rootless GPU passthrough. Install with: gpuwatch "
                    f"udev-rules --group G > {RULES_FILE} (contrib/udev/README.md).")
    p.add_argument("--group", default=DEFAULT_GROUP, metavar="G",
                   help=f"the group granted access (default {DEFAULT_GROUP})")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        text = render_rules(args.group)
    except InvalidGroupName as exc:
        raise UsageProblem(f"udev-rules: --group: {exc}") from None
    try:
        grp.getgrnam(args.group)
    except KeyError:
        # Still print: the rules may be meant for another host. udev ignores an unknown group.
        to_stderr(f"gpuwatch: note: group {args.group!r} does not exist on this host "
                  "(create it before installing the rules)")
    sys.stdout.write(text)
    return EXIT_OK
