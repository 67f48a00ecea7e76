"""mode/plan/holders/recover through a running daemon: the daemon switches, the CLI reports."""

from __future__ import annotations

import json
import socket

import anyio
import pytest
from cli_helpers import run_cli

from gpuwatch.service.server import SocketServer
from gpuwatch.service.testing import short_socket_dir
from gpuwatch.testing import SysRoot
from gpuwatch.testing.simkernel import simulated_switch

NV, NV_AUDIO = "0000:01:00.0", "0000:01:00.1"


async def test_switch_plan_and_holders_go_through_the_daemon(
    host: SysRoot, capsys: pytest.CaptureFixture[str]
) -> None:
    root = str(host.root)
    host.add_process(777, "nvidia-smi", fds={3: "/dev/nvidia0"})
    with short_socket_dir() as sockdir:
        async with (
            simulated_switch(host) as (watcher, sim, _engine, events),
            anyio.create_task_group() as tg,
        ):
            server = SocketServer(watcher, f"{sockdir}/gw.sock")
            await tg.start(server.serve)
            sock = ["--root", root, "--socket", f"{sockdir}/gw.sock"]

            code, out, _ = await run_cli(capsys, "holders", "--addr", NV, "--json", *sock)
            assert code == 0
            assert [(h["pid"], h["comm"]) for h in json.loads(out)["holders"]] == [
                (777, "nvidia-smi")
            ]

            code, via_daemon, _ = await run_cli(
                capsys, "plan", "vfio", "--addr", NV, "--json", *sock
            )
            _, direct, _ = await run_cli(
                capsys, "plan", "vfio", "--addr", NV, "--json", "--root", root, "--no-daemon"
            )
            assert code == 1  # refused: nvidia-smi holds the card
            assert json.loads(via_daemon) == json.loads(direct)
            assert json.loads(via_daemon)["refused"]["holders"][0]["comm"] == "nvidia-smi"

            host.remove_process(777)
            code, out, err = await run_cli(capsys, "mode", "vfio", "--addr", NV, "--json", *sock)
            assert code == 0, err
            result = json.loads(out)
            assert (result["from_mode"], result["to_mode"]) == ("nvidia", "vfio")
            assert {m["addr"]: m["driver"] for m in result["members"]} == {
                NV: "vfio-pci",
                NV_AUDIO: "vfio-pci",
            }
            assert sim.writes  # the daemon's engine did the writing
            assert [e.type for e in events if e.type.startswith("switch-")] == [  # type: ignore[attr-defined]
                "switch-started",
                "switch-completed",
            ]
            assert watcher.probe("group-in-mode", addr=NV, mode="vfio") is True
            tg.cancel_scope.cancel()


async def test_a_stopping_daemon_finishes_a_recover_under_way(host: SysRoot) -> None:
    """A recover is a switch: a daemon stopped (SIGTERM) while it runs finishes it and answers
    it, as it does a `switch`, rather than cut it off and roll the group back onto nvidia,
    the driver whose wedge it recovers from."""
    from tests.test_switch_engine import SlowKernel

    sim = SlowKernel(host)
    with short_socket_dir() as sockdir:
        client = socket.socket(socket.AF_UNIX)
        async with simulated_switch(host, sim=sim) as (watcher, _sim, _engine, events):
            watcher.model.poisoned[13] = "write to nvidia's unbind did not return"
            async with anyio.create_task_group() as tg:
                server = SocketServer(watcher, f"{sockdir}/gw.sock")
                await tg.start(server.serve)
                client.connect(f"{sockdir}/gw.sock")
                client.sendall(b'{"id": 1, "method": "recover", "params": {"addr": "%s"}}\n'
                               % NV.encode())
                with anyio.fail_after(10):
                    while not any(getattr(e, "type", "") == "switch-started" for e in events):
                        await anyio.sleep(0.01)
                await anyio.sleep(0.12)  # a write or two into the rebind
                tg.cancel_scope.cancel()  # the daemon stops
            client.settimeout(5)
            reply = json.loads(client.makefile("rb").readline())
            client.close()
            assert reply["id"] == 1 and reply["result"]["to_mode"] == "vfio", reply
            assert [e.type for e in events if e.type.startswith("switch-")] == [  # type: ignore[attr-defined]
                "switch-started", "switch-completed"]
            assert 13 not in watcher.model.poisoned
            assert [watcher.model.state.functions[a].driver for a in (NV, NV_AUDIO)] == [
                "vfio-pci", "vfio-pci"]
