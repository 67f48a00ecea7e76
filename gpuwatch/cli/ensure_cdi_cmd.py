"""``gpuwatch ensure-cdi``: make sure containers can be given the NVIDIA GPU by CDI name.

If neither ``etc/cdi/nvidia.yaml`` nor ``var/run/cdi/nvidia.yaml`` exists and ``nvidia-ctk``
is on PATH, run ``nvidia-ctk cdi generate --output=<root>/etc/cdi/nvidia.yaml``. Root only.
"""

from __future__ import annotations

import argparse
import sys

import anyio

from gpuwatch.cli.common import EXIT_FAILURE, EXIT_OK, add_root_args, check_root, config_of, fail
from gpuwatch.cli.fast import reader_may_leave
from gpuwatch.jsonout import dumps
from gpuwatch.switch.engine import CdiOutcome, ensure_cdi
from gpuwatch.switch.hostops import make_backend


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "ensure-cdi",
        description="Report the NVIDIA CDI spec, generating it with nvidia-ctk when neither "
                    "spec exists. Root only.")
    add_root_args(p, config=False)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_root(args.root)
    backend = make_backend(args.root, config=config_of(args))

    async def go() -> CdiOutcome:
        return await ensure_cdi(args.root, backend.ops, euid=backend.geteuid())

    outcome = anyio.run(go)
    with reader_may_leave():  # a reader that left takes no failure with it: exit 1 all the same
        if args.json:
            print(dumps({"ok": outcome.ok, "generated": outcome.generated, "spec": outcome.spec,
                         "message": outcome.message}))
        elif outcome.ok:
            print(outcome.message)
        sys.stdout.flush()
    if not outcome.ok:
        return fail(outcome.message, EXIT_FAILURE)
    return EXIT_OK
