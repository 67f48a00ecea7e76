"""Shared fixtures: realistic host trees under tmp dirs, built by gpuwatch.testing.SysRoot."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuwatch.testing import SysRoot, example_gpu_host


@pytest.fixture
def host(tmp_path: Path) -> SysRoot:
    """The example passthrough workstation (NVIDIA dGPU + HDMI audio, Intel iGPU, NIC)."""
    return example_gpu_host(tmp_path / "host")


@pytest.fixture
def empty_host(tmp_path: Path) -> SysRoot:
    return SysRoot(tmp_path / "host")
