"""Exceptions, named after the condition. CLIs map each to a documented exit code."""

from __future__ import annotations


class GpuwatchError(Exception):
    """Base of every error gpuwatch raises on purpose."""


class UsageError(GpuwatchError, ValueError):
    """The request itself is wrong: unknown action, bad address or mode, missing parameter.

    Exit code 2.
    """


class DeviceNotFound(GpuwatchError, LookupError):
    """No PCI function with that address (or no card of that vendor) on this host (exit 1)."""
