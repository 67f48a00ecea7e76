"""The error hierarchy: one base, three blames, one stable code per condition on every surface."""

from __future__ import annotations

import copy
import importlib
import inspect
import pickle
import pkgutil

import pytest

import gpuwatch
from gpuwatch import errors as E
from gpuwatch.core.results import Holding
from gpuwatch.service import protocol as P
from gpuwatch.service.client import error_from_reply
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


#: A value for each constructor parameter an error class takes beyond its message.
_SAMPLE_ARGS: dict[str, object] = {
    "message": "no such function 0000:09:00.0", "code": "not-found", "missed": 3,
    "first_missed_seq": 1201, "what": "write of unbind", "timeout": 1.5, "rid": 7,
    "reason": "held by qemu",
}


def _instance(cls: type[BaseException]) -> BaseException:
    """One instance of ``cls``, built with the arguments its own ``__init__`` asks for."""
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    named = [p for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    if not named:  # Exception's own: the message alone
        return cls("something went wrong")
    missing = [p.name for p in named if p.name not in _SAMPLE_ARGS and p.default is p.empty]
    assert missing == [], f"add a sample for {cls.__qualname__}({', '.join(missing)})"
    return cls(*(_SAMPLE_ARGS[p.name] for p in named if p.name in _SAMPLE_ARGS))


@pytest.mark.parametrize("cls", every_exception_class(), ids=lambda c: c.__qualname__)
@pytest.mark.parametrize("how", ["pickle", "copy", "deepcopy"])
def test_every_error_survives_pickling_and_copying(cls: type[BaseException], how: str) -> None:
    """A multiprocessing orchestrator (a worker's exception comes back pickled) gets the
    same error: same class, same one-line message, same attributes. A class whose
    ``__init__`` takes its own arguments (``missed``, ``code`` and ``message``) was rebuilt
    from its message alone: a TypeError in the parent, or the message said twice."""
    exc = _instance(cls)
    exc.add_note("while switching group 12")
    copier = {"pickle": lambda e: pickle.loads(pickle.dumps(e)),
              "copy": copy.copy, "deepcopy": copy.deepcopy}[how]
    back = copier(exc)
    assert type(back) is cls
    assert str(back) == str(exc) and "\n" not in str(back)
    assert back.args == exc.args
    assert vars(back) == vars(exc)
    assert getattr(back, "code", None) == getattr(exc, "code", None)


def test_a_refusal_keeps_its_holders_across_processes() -> None:
    holders = (Holding(pid=4242, comm="qemu-system-x86", node="/dev/vfio/12"),)
    back = pickle.loads(pickle.dumps(E.SwitchRefused("held by qemu", holders)))
    assert back.holders == holders and back.reason == "held by qemu"


def test_a_daemon_error_unpickled_is_caught_as_the_in_process_one() -> None:
    """`except gpuwatch.DeviceNotFound` handles the daemon's ``not-found`` in the parent too."""
    exc = error_from_reply({"code": "not-found", "message": "no PCI function 0000:09:00.0"})
    back = pickle.loads(pickle.dumps(exc))
    assert isinstance(back, gpuwatch.DeviceNotFound) and isinstance(back, gpuwatch.DaemonError)
    assert (back.code, back.message, back.exit_status) == (
        "not-found", "no PCI function 0000:09:00.0", 1)
    lagged = pickle.loads(pickle.dumps(E.SubscriberLagged(3, 1201)))
    assert str(lagged) == "subscriber lagged: 3 event(s) missed; resubscribe with since_seq=1200"


def test_a_host_step_error_keeps_its_errno_and_path_across_processes() -> None:
    exc = E.HostStepError(5, "Input/output error", "/sys/bus/pci/drivers/nvidia/unbind")
    back = pickle.loads(pickle.dumps(exc))
    assert (back.errno, back.strerror, back.filename) == (
        5, "Input/output error", "/sys/bus/pci/drivers/nvidia/unbind")
    assert str(back) == str(exc)


@pytest.mark.parametrize(("code", "in_process"), [
    ("invalid-params", E.UsageError),
    ("not-found", E.DeviceNotFound),
    ("switch-refused", E.SwitchRefused),
    ("group-poisoned", E.GroupPoisoned),
    ("reboot-required", E.RebootRequired),
    ("group-busy", E.GroupBusy),
    ("switch-failed", E.SwitchFailed),
    ("switch-wedged", E.SwitchWedged),
    ("not-root", E.NotPrivileged),
])
def test_a_daemon_reply_is_caught_by_the_in_process_class(
        code: str, in_process: type[E.GpuwatchError]) -> None:
    """One ``except gpuwatch.GroupBusy`` (``SwitchRefused``, ...) serves a switch done in
    this process and one asked of the daemon through `gpuwatch.Client`: the error reply is
    raised as the class the same condition raises in process, with its code and exit status."""
    exc = error_from_reply({"code": code, "message": "group 13: qemu (pid 42) holds it"})
    assert isinstance(exc, in_process) and isinstance(exc, gpuwatch.DaemonError)
    assert exc.code == code and exc.message == "group 13: qemu (pid 42) holds it"
    assert exc.exit_status == E.EXIT_STATUS[code]
    assert str(exc) == "daemon: group 13: qemu (pid 42) holds it"


def test_a_daemon_reply_of_no_in_process_class_is_a_plain_daemon_error() -> None:
    for code in ("unavailable", "permission-denied", "a-code-from-a-newer-daemon"):
        exc = error_from_reply({"code": code, "message": "no"})
        assert type(exc) is gpuwatch.DaemonError and exc.code == code
