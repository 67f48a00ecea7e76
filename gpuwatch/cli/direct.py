"""The stdlib-only path of ``gpuwatch probe`` when no daemon answers: one scan, no pydantic.

A cold direct probe spent more time importing pydantic and the model's records than
reading the host. Here the scan's own reads (`gpuwatch.hostfs.scan`) feed `FreshHost`, which
answers with the model's own rules (`gpuwatch.core.probes`) as plain JSON values, printed as
the full command prints them. Every function is outlined (class, IOMMU group, cdev: three
reads) and read in full only when the answer shows it (a GPU and its group for
``detect-vfio``), as the scan would have read it. Only what it can answer exactly as the full
command would is handled: a plain command line, a valid request, a model-answered action,
the embedded tables (no config file, no ``$GPUWATCH_PROC_READ_TIMEOUT`` to validate), no
daemon to ask. Anything else returns None and the full command runs, so every error message
and exit code stays its own; tests compare the bytes over many fixture hosts.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from gpuwatch.cli.common import EXIT_OK, fail
from gpuwatch.cli.fast import _OPTIONS, _split, compact, daemon_socket, reader_may_leave
from gpuwatch.core.probes import FRESH_ACTIONS, FreshHost, FunctionGone, check_params
from gpuwatch.core.tabledata import table_data
from gpuwatch.errors import EXIT_INTERRUPTED, GpuwatchError
from gpuwatch.hostfs import procfs
from gpuwatch.hostfs.scan import (
    HostPaths,
    function_entries,
    outline_function,
    read_listed,
    scan_host,
)
from gpuwatch.settings import (
    BY_KEY,
    config_file_path,
    embedded_tables_raw,
    host_namespaces_in_force,
    root_in_force,
)

_FLAGS = frozenset({"--no-daemon", "--fresh"})


def parse_direct(argv: Sequence[str]) -> tuple[str, dict[str, Any], str] | None:
    """``(action, params, root)`` of a plain ``probe`` command line this path answers, with
    ``params`` checked as the full command checks them; None for anything else."""
    if len(argv) < 2 or argv[0] != "probe":
        return None
    split = _split(argv[1:], _OPTIONS, _FLAGS)
    if split is None or len(split[0]) != 1 or split[0][0] not in FRESH_ACTIONS:
        return None
    (action,), values = split
    try:
        group = int(values["--group"]) if "--group" in values else None
        addr = check_params(action, group, values.get("--addr"), values.get("--mode"))
    except (ValueError, GpuwatchError):
        return None  # the full command says why, in its words
    if not direct_settings_plain():
        return None  # a config file's tables, or a setting the full command validates
    try:
        root = values["--root"] if "--root" in values else root_in_force(None)
    except GpuwatchError:
        return None  # (a blank $GPUWATCH_ROOT) the full command says why
    if not os.path.isdir(root):
        return None
    if not _FLAGS & values.keys() and daemon_socket(root, values.get("--socket")) is not None:
        return None  # a daemon that did not answer the fast way: the full command asks it
    return action, {"group": group, "addr": addr, "mode": values.get("--mode")}, root


def direct_settings_plain() -> bool:
    """No config file in force and no ``$GPUWATCH_PROC_READ_TIMEOUT`` to validate: a scan
    with the embedded tables is what the full command would make."""
    return config_file_path(None) is None and BY_KEY["proc_read_timeout"].env not in os.environ


def fresh_host(root: str) -> FreshHost:
    """`FreshHost` on ``root`` read now with the embedded tables: every function outlined
    (class, group, cdev), in full only those the answers show. ``nvidia-ctk`` is looked for
    where ``$GPUWATCH_HOST_NAMESPACES`` says the switch runs it (no config file is in force
    here: `direct_settings_plain`); a bad value is the full command's error."""
    tables = table_data(embedded_tables_raw())
    paths = HostPaths(root, host_namespaces=host_namespaces_in_force(None)[0])
    outlines = [o for name, devpath in function_entries(paths)
                if (o := outline_function(paths, name, devpath)) is not None]
    return FreshHost(scan_host(paths, tables, ()), tables, os.geteuid(),
                     frozenset((os.getegid(), *os.getgroups())), outlines,
                     lambda o: read_listed(paths, o.addr, o.devpath),
                     dac_override=procfs.own_dac_override())


def run_direct(argv: Sequence[str]) -> int | None:
    """Answer ``gpuwatch probe ACTION`` from one scan with the stdlib; None: not here."""
    try:
        parsed = parse_direct(argv)
        if parsed is None:
            return None
        action, params, root = parsed
        host = fresh_host(root)
        try:
            result = host.answer(action, **params)
        except FunctionGone:
            return None  # the host changed under the outline: the full command scans anew
        except GpuwatchError as exc:  # no such function: the full command's line and code
            return fail(str(exc), exc.exit_status)
        text = compact({"action": action, "result": result})
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception:  # whatever it is, the full command reports it in its words
        return None
    with reader_may_leave():
        print(text)
        sys.stdout.flush()
    return EXIT_OK


__all__ = ["direct_settings_plain", "fresh_host", "parse_direct", "run_direct"]
