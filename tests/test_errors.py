"""The error hierarchy: one base, three blames, one stable code per condition on every surface."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import gpuwatch
from gpuwatch import errors as E
from gpuwatch.service import protocol as P
from gpuwatch.service.ops import error_for


def every_exception_class() -> list[type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(gpuwatch.__path__, "gpuwatch."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for _name, obj in inspect.getmembers(module, inspect.isclass):
            if (issubclass(obj, BaseException) and obj.__module__ == module.__name__
                    and not obj.__name__.startswith("_")):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return [found[k] for k in sorted(found)]


def test_every_exception_gpuwatch_defines_is_a_gpuwatch_error() -> None:
    classes = every_exception_class()
    assert len(classes) > 20
    strays = [c.__qualname__ for c in classes if not issubclass(c, E.GpuwatchError)]
    assert strays == []


def test_every_error_has_one_blame_and_a_known_code() -> None:
    branches = (E.CallerError, E.HostError, E.InternalError)
    for cls in every_exception_class():
        if cls is E.GpuwatchError:
            continue
        assert any(issubclass(cls, b) for b in branches), cls
        assert cls.blame in ("caller", "host", "gpuwatch")
        assert cls.code in E.EXIT_STATUS or cls.code in P.ERROR_CODES, (cls, cls.code)


@pytest.mark.parametrize(("exc", "code", "exit_status"), [
    (E.UsageError("bad"), "invalid-params", 2),
    (E.ConfigError("bad"), "bad-config", 2),
    (E.DeviceNotFound("none"), "not-found", 1),
    (E.SwitchRefused("held"), "switch-refused", 1),
    (E.GroupPoisoned("wedged before"), "group-poisoned", 1),
    (E.RebootRequired("stuck"), "reboot-required", 1),
    (E.GroupBusy("busy"), "group-busy", 1),
    (E.SwitchFailed("no"), "switch-failed", 1),
    (E.SwitchWedged("stuck"), "switch-wedged", 1),
    (E.NotPrivileged("root only"), "not-root", 1),
    (E.StepTimedOut("a write", 1.0), "switch-failed", 1),
    (E.UnsafeStep("never"), "switch-failed", 1),
])
def test_socket_reply_and_exit_status_share_the_code(exc: E.GpuwatchError, code: str,
                                                      exit_status: int) -> None:
    assert exc.code == code
    assert exc.exit_status == exit_status == E.EXIT_STATUS[code]
    reply = error_for(exc)
    assert reply.code == code and str(reply) == str(exc)


def test_protocol_codes_are_the_errors_codes() -> None:
    shared = {"INVALID_PARAMS", "NOT_FOUND", "SWITCH_REFUSED", "SWITCH_FAILED", "SWITCH_WEDGED",
              "GROUP_BUSY", "GROUP_POISONED", "REBOOT_REQUIRED", "NOT_ROOT", "INTERNAL"}
    for name in shared:
        assert getattr(P, name) is getattr(E, name)


def test_blame_splits_the_tree() -> None:
    assert issubclass(E.UsageError, E.CallerError) and issubclass(E.UsageError, ValueError)
    assert issubclass(E.DeviceNotFound, LookupError)
    assert issubclass(E.SwitchRefused, E.HostError)
    assert issubclass(E.NotPrivileged, PermissionError)
    assert issubclass(E.StepTimedOut, TimeoutError)
    assert issubclass(E.UnsafeStep, E.InternalError)
    assert E.exit_status("a-code-from-a-newer-daemon") == 1
