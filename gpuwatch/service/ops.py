"""The socket's switch-side methods (``switch``, ``plan``, ``recover``, ``holders``) and the
live probes that read /proc.

They delegate to the host (`gpuwatch.host.Host` ``switch``/``plan``/``recover``/``holders``,
see docs/switch.md). Host reads
(holders in ``/proc/*/fd`` and ``maps``, task stacks) run in a bounded worker thread, the
switch's for its methods and `bounded` here for the live probes: a slow or wedged /proc must
not stall the event loop that every client and the watcher share.

Every `GpuwatchError` carries its reply code (`error_for`): one table, in `gpuwatch.errors`.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from gpuwatch.core.modes import MODES
from gpuwatch.errors import GpuwatchError
from gpuwatch.service import protocol as P
from gpuwatch.service.peers import PeerCred

if TYPE_CHECKING:
    from gpuwatch.host import Host

OpHandler = Callable[["Host", P.Params, PeerCred], Awaitable[Any]]

DEFAULT_VENDOR = "0x10de"
#: Bound on one /proc scan (holders, wedge): a task stuck in the kernel can block its reads.
READ_TIMEOUT = 10.0
#: The longest ``timeout`` a switch or recover may ask of the daemon: the switch's default
#: bound (`gpuwatch.switch.engine.DEFAULT_TIMEOUT`). A stopping daemon finishes a switch under
#: way, and the service gives a stop 120 s (docs/service.md): a longer switch would be
#: killed half way, its group in neither mode.
MAX_SWITCH_TIMEOUT = 90.0


def error_for(exc: BaseException) -> P.RpcError:
    """The error reply for an exception raised by the switch or the model; others re-raised."""
    if isinstance(exc, GpuwatchError):
        return P.RpcError(exc.code, str(exc))
    if isinstance(exc, PermissionError):
        return P.RpcError(P.NOT_ROOT, str(exc))
    if isinstance(exc, TimeoutError):
        return P.RpcError(P.SWITCH_FAILED, str(exc) or "timed out")
    raise exc


def _target(params: P.Params) -> tuple[str | None, str | None]:
    """``(addr, vendor)``: one of them, the vendor defaulting to 0x10de as in the CLI."""
    addr = params.opt_str("addr")
    vendor = params.opt_str("vendor")
    if addr is not None and vendor is not None:
        raise P.RpcError(P.INVALID_PARAMS, f"{params.method}: give 'addr' or 'vendor', not both")
    if addr is None and vendor is None:
        vendor = DEFAULT_VENDOR
    return addr, vendor


def _mode(params: P.Params, *, required: bool) -> str | None:
    mode = params.req_str("mode") if required else params.opt_str("mode")
    if mode is not None and mode not in MODES:
        raise P.RpcError(P.INVALID_PARAMS, f"mode must be vfio or nvidia, not {mode!r}")
    return mode


def _timeout(params: P.Params) -> float | None:
    timeout = params.opt_positive_float("timeout")
    if timeout is not None and timeout > MAX_SWITCH_TIMEOUT:
        raise P.RpcError(P.INVALID_PARAMS, f"{params.method}: timeout must be at most "
                         f"{MAX_SWITCH_TIMEOUT:g} seconds, not {_shown(timeout)}: a stopping "
                         "daemon finishes a switch under way, within its service's stop "
                         "timeout")
    return timeout


def _shown(number: float) -> str:
    """``number`` short (``300``, not ``300.0``) where that is exact; else every digit:
    90.0000001 was refused as "not 90", the very bound it names."""
    short = f"{number:g}"
    return short if float(short) == number else repr(number)


async def _guarded(call: Callable[[], Any]) -> Any:
    """Run ``call`` (sync or async) with the switch's errors turned into error replies."""
    try:
        result = call()
        if inspect.isawaitable(result):
            result = await result
    except P.RpcError:
        raise
    except ImportError as exc:
        raise P.RpcError(P.UNAVAILABLE, f"the switch is not available in this build: {exc}") \
            from None
    except Exception as exc:
        raise error_for(exc) from None
    return result


# --------------------------------------------------------------------------- reads


async def bounded(fn: Callable[[], Any], what: str) -> Any:
    """A blocking host read off the loop, given up after `READ_TIMEOUT`."""
    from gpuwatch.hostfs.facts import call_bounded

    return await call_bounded(fn, READ_TIMEOUT, what)


async def plan_probe(host: Host, mode: str | None, addr: str | None,
                     vendor: str | None) -> Any:
    """The ``plan`` probe action: the steps, or the refusal as an error (as the model does)."""
    target = addr if addr is not None else (vendor or DEFAULT_VENDOR)
    plan: dict[str, Any] = await host.plan(target, mode or "")
    refused = plan.get("refused")
    if refused:
        raise P.RpcError(P.SWITCH_REFUSED, str(refused.get("reason", "refused")))
    return plan["steps"]


# --------------------------------------------------------------------------- methods


async def op_switch(host: Host, params: P.Params, peer: PeerCred) -> Any:
    addr, vendor = _target(params)
    mode = _mode(params, required=True) or ""
    timeout = _timeout(params)
    tolerant = params.opt_bool("tolerant")
    force = params.opt_bool("force")
    vfio_driver = params.opt_str("vfio_driver")
    params.done()
    kwargs: dict[str, Any] = {"tolerant": bool(tolerant)}
    if force:
        kwargs["force"] = True  # a group kept for the host (BMC/console, VMD) to vfio anyway
    if timeout is not None:
        kwargs["timeout"] = timeout
    if vfio_driver is not None:
        kwargs["vfio_driver"] = vfio_driver
    target = addr if addr is not None else vendor or DEFAULT_VENDOR
    result = await _guarded(lambda: host.switch(target, mode, **kwargs))
    return result.as_result()


async def op_recover(host: Host, params: P.Params, peer: PeerCred) -> Any:
    addr, vendor = _target(params)
    timeout = _timeout(params)
    params.done()
    kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    target = addr if addr is not None else vendor or DEFAULT_VENDOR
    result = await _guarded(lambda: host.recover(target, **kwargs))
    return result.as_result()


async def op_plan(host: Host, params: P.Params, peer: PeerCred) -> Any:
    addr, vendor = _target(params)
    mode = _mode(params, required=True) or ""
    force = params.opt_bool("force")
    vfio_driver = params.opt_str("vfio_driver")
    params.done()
    target = addr if addr is not None else vendor or DEFAULT_VENDOR
    kwargs: dict[str, Any] = {"force": True} if force else {}
    if vfio_driver is not None:
        kwargs["vfio_driver"] = vfio_driver
    return await _guarded(lambda: host.plan(target, mode, **kwargs))


async def op_holders(host: Host, params: P.Params, peer: PeerCred) -> Any:
    addr, vendor = _target(params)
    params.done()
    target = addr if addr is not None else vendor or DEFAULT_VENDOR
    return await _guarded(lambda: host.holders(target))


def default_ops() -> dict[str, OpHandler]:
    return {"switch": op_switch, "plan": op_plan, "recover": op_recover, "holders": op_holders}


__all__ = ["OpHandler", "bounded", "default_ops", "error_for", "plan_probe"]
