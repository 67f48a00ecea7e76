"""Which vfio-pci driver the kernel would pick for a function: ``vfio_pci:`` aliases. Pure.

depmod writes, for every module built on vfio-pci-core, ``alias vfio_pci:v…d…sv…sd…bc…sc…i…
<module>`` lines into ``lib/modules/<release>/modules.alias`` (from the driver's
``PCI_DRIVER_OVERRIDE_DEVICE_VFIO`` id table); vfio-pci itself has the generic
``vfio_pci:v*d*sv*sd*bc*sc*i*``. Matched against a function's ``modalias``
(``pci:v000010DEd00002342sv…``), the most specific alias names the driver to bind, as
libvirt and NVIDIA's DRA driver choose it; no match means plain vfio-pci.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from dataclasses import dataclass

PREFIX = "vfio_pci:"
#: The module providing plain vfio-pci, and the driver name it registers.
VFIO_PCI_MODULE = "vfio_pci"
_LINE_RE = re.compile(r"^alias\s+(vfio_pci:\S+)\s+([A-Za-z0-9_-]+)\s*$")
_FIELDS_RE = re.compile(
    r"^v(?P<v>.*?)d(?P<d>.*?)sv(?P<sv>.*?)sd(?P<sd>.*?)bc(?P<bc>.*?)sc(?P<sc>.*?)i(?P<i>.*)$")
#: A pattern that long is no depmod output; beyond this many lines the file is not read on.
MAX_PATTERN = 256
MAX_ALIASES = 4096


@dataclass(frozen=True, slots=True)
class VfioAlias:
    """One ``alias vfio_pci:… module`` line."""

    pattern: str
    module: str

    def matches(self, modalias: str) -> bool:
        return fnmatch.fnmatchcase(modalias, "pci:" + self.pattern[len(PREFIX):])

    def specificity(self) -> tuple[int, int, int]:
        """(id fields given, class fields given, literal characters): more is more specific,
        so the generic ``v*d*sv*sd*bc*sc*i*`` loses to any vendor/device one."""
        body = self.pattern[len(PREFIX):]
        m = _FIELDS_RE.match(body)
        literal = sum(1 for c in body if c not in "*?[]")
        if m is None:
            return (0, 0, literal)
        ids = sum(1 for k in ("v", "d", "sv", "sd") if "*" not in m.group(k))
        classes = sum(1 for k in ("bc", "sc", "i") if "*" not in m.group(k))
        return (ids, classes, literal)


def parse_vfio_aliases(lines: Iterable[str]) -> tuple[VfioAlias, ...]:
    """The ``vfio_pci:`` aliases of modules.alias lines; everything else is ignored."""
    out: list[VfioAlias] = []
    for line in lines:
        if PREFIX not in line:
            continue
        m = _LINE_RE.match(line.strip())
        if m is not None and len(m.group(1)) <= MAX_PATTERN:
            out.append(VfioAlias(m.group(1), m.group(2)))
            if len(out) >= MAX_ALIASES:
                break
    return tuple(out)


def best_vfio_alias(aliases: Iterable[VfioAlias], modalias: str) -> VfioAlias | None:
    """The most specific alias matching ``modalias`` (ties: the module name, for a stable
    answer); None when none matches or the function has no modalias."""
    if not modalias.startswith("pci:"):
        return None
    hits = [a for a in aliases if a.matches(modalias)]
    if not hits:
        return None
    return min(hits, key=lambda a: (tuple(-n for n in a.specificity()), a.module))


__all__ = ["PREFIX", "VFIO_PCI_MODULE", "VfioAlias", "best_vfio_alias", "parse_vfio_aliases"]
