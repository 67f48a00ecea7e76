"""The data tables (device patterns, GPU vendors, PCI class labels) and their override file.

Tables are data, not code, so operators can teach gpuwatch a new vendor or device node
without a release. A malformed override is a `ConfigError`, which every CLI turns into one
line on stderr and exit 2.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from importlib import resources
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

#: Where the daemon, the CLI and the library all look for the config file when none is named:
#: ``$GPUWATCH_CONFIG``, else this file when it exists (`config_file_path`).
DEFAULT_CONFIG_PATH = "/etc/gpuwatch/config.yaml"
CONFIG_ENV = "GPUWATCH_CONFIG"
#: The root the daemon watches when no ``--root`` is given (also the config file's ``root``).
ROOT_ENV = "GPUWATCH_ROOT"

TABLE_KEYS = ("device_patterns", "gpu_vendors", "pci_class_labels", "host_console_drivers")


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
    #: Drivers of BMC/console functions: a group with one bound to them stays with the host.
    host_console_drivers: tuple[str, ...] = ()

    @field_validator("device_patterns")
    @classmethod
    def _absolute_dev_paths(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for pattern in value:
            if not pattern.startswith("/dev/"):
                raise ValueError(f"pattern {pattern!r} must start with /dev/")
        return value

    @field_validator("host_console_drivers")
    @classmethod
    def _driver_names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            if not name or "/" in name or name.strip() != name:
                raise ValueError(f"{name!r} is not a driver name")
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


def config_file_path(flag: str | os.PathLike[str] | None, env: Mapping[str, str] | None = None,
                     default: str = DEFAULT_CONFIG_PATH) -> str | None:
    """``--config``, else ``$GPUWATCH_CONFIG``, else the default file when it exists."""
    env = os.environ if env is None else env
    if flag:
        return os.fspath(flag)
    if env.get(CONFIG_ENV):
        return env[CONFIG_ENV]
    return default if os.path.isfile(default) else None


def tables_in_force(config: str | os.PathLike[str] | Tables | None = None,
                    env: Mapping[str, str] | None = None) -> Tables:
    """The tables the daemon would use: ``config`` when given, else the file
    `config_file_path` finds, else the embedded ones. The library and every CLI command
    read through here, so a direct probe and the daemon never disagree."""
    if isinstance(config, Tables):
        return config
    return load_tables(config_file_path(config, env))


def root_in_force(root: str | os.PathLike[str] | None = None,
                  config: str | os.PathLike[str] | Tables | None = None,
                  env: Mapping[str, str] | None = None) -> str:
    """The host root the daemon would watch: ``root`` when given, else ``$GPUWATCH_ROOT``,
    else the config file's ``root``, else ``/`` (the daemon's own precedence)."""
    if root is not None:
        return os.fspath(root)
    env = os.environ if env is None else env
    if env.get(ROOT_ENV, "").strip():
        return env[ROOT_ENV]
    path = None if isinstance(config, Tables) else config_file_path(config, env)
    if path is not None:
        value = read_config_file(path).get("root")
        if isinstance(value, str) and value.strip():
            return value
    return "/"


_DEFAULT: Tables | None = None


def default_tables() -> Tables:
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = build_tables({}, "embedded tables")
    return _DEFAULT
