"""AMD KFD topology: the gfx target version that ROCm images are chosen by."""

from __future__ import annotations

from collections.abc import Iterable

#: ``gfx_target_version`` is a u32 in the kernel.
_U32_MAX = 0xFFFFFFFF


def parse_gfx_target_version(properties: str) -> int:
    """The ``gfx_target_version`` of a KFD node's properties; 0 when absent or garbage.

    The kernel writes a u32 in ASCII decimal: anything else (``11_00_00``, ``+110000``,
    other scripts' digits, which int() would all take) is garbage."""
    for line in properties.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "gfx_target_version":
            value = parts[1]
            if value.isascii() and value.isdigit() and len(value) <= 10:
                number = int(value)
                return number if number <= _U32_MAX else 0
            return 0
    return 0


def format_gfx_version(value: int) -> str:
    """100306 → ``"10.3.0"``: major and minor only, as ROCm's HSA_OVERRIDE_GFX_VERSION wants."""
    if value <= 0:
        return ""
    return f"{value // 10000}.{value % 10000 // 100}.0"


def first_gfx_version(nodes: Iterable[tuple[int, int]]) -> str:
    """The first non-zero version over ``(node_id, version)`` pairs in numeric node order.

    CPU nodes report 0, so the first GPU node wins; node 10 sorts after node 2.
    """
    for _node, version in sorted(nodes):
        if version:
            return format_gfx_version(version)
    return ""


def format_gfx_target(value: int) -> str:
    """The ISA name ROCm gives a ``gfx_target_version`` V: ``gfx{major}{minor:x}{stepping:x}``
    with major V//10000, minor V//100%100, stepping V%100. 90010 → ``gfx90a`` (MI210),
    90402 → ``gfx942`` (MI300), 100306 → ``gfx1036``, 110000 → ``gfx1100``; ``""`` for 0.

    Not derivable from `format_gfx_version`: that one drops the stepping, and 9.0.0 is
    gfx900's override, not an MI210's.
    """
    if value <= 0:
        return ""
    return f"gfx{value // 10000}{value // 100 % 100:x}{value % 100:x}"


def first_gfx_target(nodes: Iterable[tuple[int, int]]) -> str:
    """`format_gfx_target` of the same node `first_gfx_version` picks."""
    for _node, version in sorted(nodes):
        if version:
            return format_gfx_target(version)
    return ""
