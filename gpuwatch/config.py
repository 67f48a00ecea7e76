"""The data tables (device patterns, GPU vendors, PCI class labels) and their override file.

Tables are data, not code, so operators can teach gpuwatch a new vendor or device node
without a release. A malformed override is a `ConfigError`, which every CLI turns into one
line on stderr and exit 2.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from importlib import resources
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

_DRIVER_NAME_RE = re.compile(r"[A-Za-z0-9_.-]+")
TABLE_KEYS = ("device_patterns", "gpu_vendors", "pci_class_labels", "vfio_variant_drivers")


class ConfigError(Exception):
    """The configuration file is missing, unreadable, not YAML, or has a bad key or value."""


def _hex_key(key: object) -> str:
    # YAML turns an unquoted 0x10de into the int 4318; give the user the key they meant.
    if isinstance(key, bool):
        raise ValueError(f"{key!r} is not a hex id")
    if isinstance(key, int):
        return f"0x{key:04x}"
    if isinstance(key, str):
        return key.strip().lower()
    raise ValueError(f"{key!r} is not a hex id")


class Tables(BaseModel):
    """The lookup tables every reader and the model share. Immutable once loaded."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    device_patterns: tuple[str, ...]
    gpu_vendors: Mapping[str, str]
    pci_class_labels: Mapping[str, str]
    #: vfio-pci variant drivers whose name does not end in ``vfio_pci`` (those are known).
    vfio_variant_drivers: tuple[str, ...] = ()

    @field_validator("vfio_variant_drivers")
    @classmethod
    def _driver_names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            if not _DRIVER_NAME_RE.fullmatch(name) or name in (".", ".."):
                raise ValueError(f"{name!r} is not a driver name ([A-Za-z0-9_.-]+)")
        return value

    @field_validator("device_patterns")
    @classmethod
    def _absolute_dev_paths(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for pattern in value:
            if not pattern.startswith("/dev/"):
                raise ValueError(f"pattern {pattern!r} must start with /dev/")
        return value

    @field_validator("gpu_vendors", "pci_class_labels", mode="before")
    @classmethod
    def _normalise_hex_keys(cls, value: Any) -> Any:
        if not isinstance(value, Mapping):
            return value
        return {_hex_key(k): v for k, v in value.items()}

    def class_label(self, klass: str) -> str:
        return self.pci_class_labels.get(klass, klass)


def _load_yaml_mapping(text: str, where: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{where}: not valid YAML{at}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of keys at the top level")
    return data


def embedded_tables_raw() -> dict[str, Any]:
    text = resources.files("gpuwatch").joinpath("data/tables.yaml").read_text(encoding="utf-8")
    return _load_yaml_mapping(text, "embedded tables")


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The raw mapping of a config file; every failure is a one-line `ConfigError`."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc}") from None
    return _load_yaml_mapping(text, str(path))


def build_tables(overrides: Mapping[str, Any], where: str = "config") -> Tables:
    """Embedded tables with each given key replacing the embedded one whole."""
    merged = embedded_tables_raw()
    for key in TABLE_KEYS:
        if key in overrides:
            merged[key] = overrides[key]
    try:
        return Tables.model_validate(merged)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise ConfigError(f"{where}: {loc}: {err['msg']}") from None


def load_tables(config: str | os.PathLike[str] | None = None) -> Tables:
    """The tables in force: embedded, or overridden key by key from ``config``.

    Unknown top-level keys are reported rather than ignored: a typo like ``gpu_vendor``
    would otherwise silently do nothing.
    """
    if config is None:
        return default_tables()
    raw = read_config_file(config)
    return build_tables(_only_table_keys(raw, str(config)), str(config))


def _only_table_keys(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    from gpuwatch.settings import SETTING_KEYS  # late: settings imports this module

    unknown = sorted(set(raw) - set(TABLE_KEYS) - set(SETTING_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}")
    return {k: v for k, v in raw.items() if k in TABLE_KEYS}


_DEFAULT: Tables | None = None


def default_tables() -> Tables:
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = build_tables({}, "embedded tables")
    return _DEFAULT
