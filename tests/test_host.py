"""`open_host()`/`Host`: one composed object per host, wired by constructor arguments."""

from __future__ import annotations

import inspect
from pathlib import Path

import gpuwatch
from gpuwatch.host import open_host
from gpuwatch.sources.memory import MemorySource
from gpuwatch.switch import engine as engine_module
from gpuwatch.testing import example_gpu_host

NV = "0000:01:00.0"


async def test_each_host_owns_its_own_engine_over_its_own_model(tmp_path: Path) -> None:
    one, two = example_gpu_host(tmp_path / "one"), example_gpu_host(tmp_path / "two")
    async with open_host(one.root, source=MemorySource(), reconcile_interval=0,
                         cdi_poll_interval=0, vgpu_poll_interval=0, log_keep=2) as a, \
            open_host(two.root, source=MemorySource(), reconcile_interval=0,
                      cdi_poll_interval=0) as b:
        assert a.engine is not b.engine
        assert a.engine.model is a.model and b.engine.model is b.model
        assert not hasattr(a.engine, "watcher")  # it gets callables, never the watcher
        assert a.probe("current-mode", addr=NV) == b.probe("current-mode", addr=NV)
        assert a.snapshot().seq == a.seq == 1  # the `ready` event
        plan = await a.plan(NV, "vfio")
        assert plan["addr"] == NV and plan["to_mode"] == "vfio"
        holders = await a.holders(NV)
        assert holders["addr"] == NV


def test_no_module_level_registry_and_the_old_name_still_opens_a_host() -> None:
    source = inspect.getsource(engine_module)
    assert "WeakKeyDictionary" not in source and "engine_for" not in source
    assert gpuwatch.open_watcher is gpuwatch.open_host
