"""Test support shipped with the package: fake host trees for tests, benchmarks and simulations.

Kept importable without pytest so benchmarks and a simulated kernel can build hosts too.
"""

from gpuwatch.testing.sysroot import (
    DeviceExistsError,
    SysRoot,
    UnknownDeviceError,
    example_gpu_host,
    synthetic_host,
)

__all__ = [
    "DeviceExistsError",
    "SysRoot",
    "UnknownDeviceError",
    "example_gpu_host",
    "synthetic_host",
]
