"""The container image and the Kubernetes manifests: rendered like kustomize, validated offline
against the Kubernetes schemas, their settings checked against the real ``gpuwatch watch``,
and the pod's configuration run for real over a fixture root (health probe, metrics parsed
with prometheus_client's own parser, NFD labels)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import kustomize_lite
import pytest
import yaml

from gpuwatch.cli.main import build_parser
from gpuwatch.hostfs.facts import modules_alias_path
from gpuwatch.hostfs.scan import HostPaths
from gpuwatch.settings import SETTINGS, load_settings, parse_listen_address
from gpuwatch.switch.poison import DEFAULT_POISON_FILE
from gpuwatch.testing import SysRoot

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate (the test extra) is not installed")

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "contrib/kubernetes"
DEFAULT, SWITCHING = K8S, K8S / "overlays/switching"
CONTAINERFILE = REPO / "contrib/container/Containerfile"
#: Kubernetes releases the manifests must be valid for (oldest supported to newest bundled).
K8S_VERSIONS = ("1.29.0", "1.33.0", kubernetes_validate.latest_version())
SETTING_ENVS = {s.env: s for s in SETTINGS}


# --------------------------------------------------------------------------- helpers


def render(directory: Path) -> list[dict[str, Any]]:
    return kustomize_lite.build(directory)


def daemonset(directory: Path) -> dict[str, Any]:
    (ds,) = [o for o in render(directory) if o["kind"] == "DaemonSet"]
    return ds


def container(ds: dict[str, Any]) -> dict[str, Any]:
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    return c


def containerfile() -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` of the final stage, continuation lines joined."""
    text = re.sub(r"\\\n", " ", CONTAINERFILE.read_text())
    lines = [ln.strip() for ln in text.splitlines()
             if ln.strip() and not ln.strip().startswith("#")]
    stages: list[list[tuple[str, str]]] = []
    for line in lines:
        word, _, rest = line.partition(" ")
        if word.upper() == "FROM":
            stages.append([])
        stages[-1].append((word.upper(), rest.strip()))
    return stages[-1]


def image_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for word, rest in containerfile():
        if word == "ENV":
            for pair in shlex.split(rest):
                key, _, value = pair.partition("=")
                env[key] = value
    return env


def pod_env(ds: dict[str, Any]) -> dict[str, str]:
    """What the daemon sees: the image's ENV, then the container's env over it."""
    env = image_env()
    env.update({e["name"]: e["value"] for e in container(ds).get("env", [])})
    return env


def mounts(ds: dict[str, Any]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """mountPath -> (volumeMount, volume)."""
    volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    return {m["mountPath"]: (m, volumes[m["name"]]) for m in container(ds)["volumeMounts"]}


# --------------------------------------------------------------------------- rendering


@pytest.mark.parametrize("directory", [DEFAULT, SWITCHING], ids=["default", "switching"])
def test_kustomize_renders_the_same_as_kubectl(directory: Path) -> None:
    kubectl = shutil.which("kubectl")
    objects = render(directory)
    assert sorted(o["kind"] for o in objects) == ["DaemonSet", "Namespace", "ServiceAccount"]
    if kubectl is None:
        pytest.skip("kubectl is not installed: rendered by tests/kustomize_lite.py only")
    proc = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr

    def key(o: dict[str, Any]) -> tuple[str, str]:
        return o["kind"], o["metadata"]["name"]

    theirs = sorted((d for d in yaml.safe_load_all(proc.stdout) if d), key=key)
    assert kustomize_lite.normalise(sorted(objects, key=key)) == kustomize_lite.normalise(theirs)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("directory", [DEFAULT, SWITCHING], ids=["default", "switching"])
def test_every_manifest_is_valid_for_kubernetes(directory: Path, version: str) -> None:
    for obj in render(directory):
        kubernetes_validate.validate(obj, version, strict=True)
    for raw in sorted((K8S / "base").glob("*.yaml")):
        for obj in yaml.safe_load_all(raw.read_text()):
            if obj and obj.get("kind") != "Kustomization":
                kubernetes_validate.validate(obj, version, strict=True)


def test_the_validator_catches_mistakes() -> None:
    ds = daemonset(DEFAULT)
    container(ds)["volumeMount"] = container(ds).pop("volumeMounts")  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, K8S_VERSIONS[-1], strict=True)
    ds = daemonset(DEFAULT)
    container(ds)["ports"][0]["containerPort"] = "metrics"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, K8S_VERSIONS[-1], strict=True)


# --------------------------------------------------------------------------- the image


def test_image_is_a_slim_python_with_runtime_dependencies_only() -> None:
    stage = containerfile()
    base = next(rest for word, rest in stage if word == "FROM")
    match = re.search(r"python:3\.(\d+)-slim", base)
    assert match and int(match.group(1)) >= 11
    runs = " ".join(rest for word, rest in stage if word == "RUN")
    assert "pip install" in runs and "/wheels/" in runs
    assert "[" not in runs.split("pip install", 1)[1].split("&&")[0]  # no extras: no test deps
    assert "-e " not in runs
    user = next(rest for word, rest in stage if word == "USER")
    assert user not in ("0", "root")
    # No "gpuwatch" group in the image: the socket would default to it, and chown to a group
    # needs CAP_CHOWN, which the pod drops: the daemon would not start.
    assert "--no-user-group" in runs and "groupadd" not in runs
    text = CONTAINERFILE.read_text()
    for source in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.M):
        for part in source.split():
            assert (REPO / part).exists(), part


def test_image_entrypoint_and_environment_are_real_watch_options() -> None:
    stage = dict(containerfile())
    entrypoint = json.loads(stage["ENTRYPOINT"])
    assert entrypoint == ["gpuwatch", "watch"]
    assert build_parser().parse_args(entrypoint[1:]).command == "watch"
    env = image_env()
    gpuwatch_env = {k: v for k, v in env.items() if k.startswith("GPUWATCH_")}
    assert set(gpuwatch_env) <= set(SETTING_ENVS), set(gpuwatch_env) - set(SETTING_ENVS)
    settings = load_settings({}, env=gpuwatch_env, default_config="/nonexistent")
    assert settings.root == "/host"
    assert settings.source == "kernel"  # no udevd in a container
    assert settings.socket == "/run/gpuwatch/gpuwatch.sock"
    assert settings.nfd_features == "/etc/kubernetes/node-feature-discovery/features.d/"
    assert settings.metrics is not None
    host, port = parse_listen_address(settings.metrics)
    assert host in ("", "0.0.0.0", "::")  # every address of the pod: the scraper is elsewhere
    assert stage["EXPOSE"] == str(port)
    health = json.loads(stage["HEALTHCHECK"].split("CMD", 1)[1])
    assert build_parser().parse_args(health[1:]).command == "health"


# --------------------------------------------------------------------------- the DaemonSet


def test_default_daemonset_reads_the_host_and_serves_the_node(tmp_path: Path) -> None:
    objects = render(DEFAULT)
    ds = daemonset(DEFAULT)
    (ns,) = [o for o in objects if o["kind"] == "Namespace"]
    (sa,) = [o for o in objects if o["kind"] == "ServiceAccount"]
    pod = ds["spec"]["template"]["spec"]
    assert ds["metadata"]["namespace"] == sa["metadata"]["namespace"] == ns["metadata"]["name"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    assert pod["automountServiceAccountToken"] is False
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    keys = {e["key"] for t in terms["nodeSelectorTerms"] for e in t["matchExpressions"]}
    assert "feature.node.kubernetes.io/pci-0300_10de.present" in keys
    assert "feature.node.kubernetes.io/pci-0302_10de.present" in keys  # datacenter GPUs

    settings = load_settings({}, env={k: v for k, v in pod_env(ds).items()
                                      if k.startswith("GPUWATCH_")},
                             default_config="/nonexistent")
    by_path = mounts(ds)
    # The host is read under GPUWATCH_ROOT, read-only, each from the same host path: what
    # the model scans, the CDI specs, and the kernel's modules.alias that a plan chooses the
    # VFIO driver by (looked up under the root, for the release the host's /proc names).
    fake = SysRoot(tmp_path / "node")
    fake.add_modules_alias("6.8.0-31-generic", "")
    alias = os.path.relpath(modules_alias_path(HostPaths(fake.root)), fake.root)
    alias_dir = alias.split("/6.8.0-31-generic/")[0]
    for sub in ("sys", "proc", "dev", "etc/cdi", "var/run/cdi", alias_dir):
        mount, volume = by_path[f"{settings.root}/{sub}"]
        assert volume["hostPath"]["path"] == f"/{sub}"
        assert mount.get("readOnly") is True
    # The socket, the log and the NFD file live in host directories, writable.
    for path in (settings.socket, settings.log, settings.nfd_features):
        assert path is not None
        folder = path.rstrip("/") if path.endswith("/") else os.path.dirname(path)
        mount, volume = by_path[folder]
        assert volume["hostPath"]["path"] == folder and not mount.get("readOnly")
    assert settings.log == "/var/log/gpuwatch/events.jsonl"

    c = container(ds)
    port = c["ports"][0]
    annotations = ds["spec"]["template"]["metadata"]["annotations"]
    assert settings.metrics is not None
    assert port["containerPort"] == int(annotations["prometheus.io/port"])
    assert port["containerPort"] == parse_listen_address(settings.metrics)[1]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    # The holders of a GPU are host processes: the runtime's AppArmor profile would refuse
    # the ptrace reads that name them (see the holders test below).
    assert annotations[f"container.apparmor.security.beta.kubernetes.io/{c['name']}"] == \
        "unconfined"

    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = c[probe]["exec"]["command"]
        assert command[0] == "gpuwatch" and "sleep" not in command
        assert build_parser().parse_args(command[1:]).command == "health"

    security = c["securityContext"]
    assert security["capabilities"]["drop"] == ["ALL"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert not security.get("privileged") and not pod.get("hostPID")


#: What a probe's ``timeoutSeconds`` leaves above ``gpuwatch health --timeout``: the CLI's
#: own start (Python, imports) in a container that may be CPU-throttled.
PROBE_START_MARGIN = 2


@pytest.mark.parametrize("directory", [DEFAULT, SWITCHING], ids=["default", "switching"])
def test_each_probe_gives_up_in_gpuwatch_health_before_kubelet_kills_it(
        directory: Path) -> None:
    """A slow daemon must be reported by ``gpuwatch health`` itself ("did not answer within
    N s", in the pod's events), not cut off by kubelet at ``timeoutSeconds`` with no reason:
    health's whole bound plus its start fits inside the probe's limit, for every probe and
    for the image's HEALTHCHECK alike."""
    c = container(daemonset(directory))
    for name in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = c[name]
        args = build_parser().parse_args(probe["exec"]["command"][1:])
        assert probe["timeoutSeconds"] - args.timeout >= PROBE_START_MARGIN, name
    stage = dict(containerfile())
    check = stage["HEALTHCHECK"]
    limit = float(re.search(r"--timeout=(\d+)s", check).group(1))  # type: ignore[union-attr]
    args = build_parser().parse_args(json.loads(check.split("CMD", 1)[1])[1:])
    assert limit - args.timeout >= PROBE_START_MARGIN


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to run as the pod's uid and capabilities")
def test_the_read_only_pod_sees_the_holders_of_a_node(tmp_path: Path) -> None:
    """The read-only pod answers ``holders`` and the ``nvidia-holders`` probe from the host's
    /proc: with the pod's uid and capabilities (as the container runtime gives them: the
    bounding set), a process of another user and one of root holding a node are both seen.
    With every capability dropped the kernel refuses both (/proc/PID/fd is the owner's,
    and reading a link there is a ptrace read), and the answer was "no holders": wrong,
    silently."""
    c = container(daemonset(DEFAULT))
    security = c["securityContext"]
    caps = ",".join(["-all", *(f"+{cap.lower()}" for cap in
                               security["capabilities"].get("add", []))])
    held = tmp_path / "renderD128"
    held.write_text("")
    held.chmod(0o644)
    others = []
    try:
        for who in (["--reuid", "65534", "--regid", "65534", "--clear-groups"], []):
            with held.open() as f:
                others.append(subprocess.Popen(["setpriv", *who, "--", "sleep", "60"],
                                               stdin=f))
        script = ("import json, sys; from gpuwatch.hostfs.procfs import holders; "
                  "from gpuwatch.core.plan import NodeScope; "
                  "found, stuck = holders('/', NodeScope(exact=frozenset(sys.argv[1:]))); "
                  "print(json.dumps(sorted({pid for pid, _, _ in found})))")
        pod = ["setpriv", "--reuid", str(security["runAsUser"]),
               "--regid", str(security["runAsGroup"]), "--clear-groups",
               f"--bounding-set={caps}", f"--inh-caps={caps}", "--no-new-privs", "--",
               sys.executable, "-c", script, str(held)]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        deadline = time.monotonic() + 10
        while True:  # until both children have exec'd sleep with the file open
            proc = subprocess.run(pod, capture_output=True, text=True, timeout=60, env=env,
                                  check=False)
            assert proc.returncode == 0, proc.stderr
            seen = json.loads(proc.stdout)
            if seen == sorted(p.pid for p in others) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        for other in others:
            other.kill()
            other.wait(timeout=10)
    assert seen == sorted(p.pid for p in others)


def test_switching_overlay_adds_exactly_what_a_switch_needs() -> None:
    base, ds = daemonset(DEFAULT), daemonset(SWITCHING)
    pod, c = ds["spec"]["template"]["spec"], container(ds)
    assert c["securityContext"]["privileged"] is True and pod["hostPID"] is True
    by_path = mounts(ds)
    root = pod_env(ds)["GPUWATCH_ROOT"]
    for writable in ("sys", "dev", "etc/cdi", "var/run/cdi"):
        assert by_path[f"{root}/{writable}"][0].get("readOnly") is False
    assert by_path[f"{root}/proc"][0]["readOnly"] is True
    # modprobe is the host's (in its namespaces), reading the host's /lib/modules: the
    # container's own /lib/modules, and its modprobe, are never used.
    assert "/lib/modules" not in by_path
    poison_dir = f"{root}/{os.path.dirname(DEFAULT_POISON_FILE)}"
    assert by_path[poison_dir][1]["hostPath"]["path"] == "/var/lib/gpuwatch"
    assert pod["terminationGracePeriodSeconds"] >= 120  # a switch's own bound is 90 s
    # Everything else is the base's.
    for key in ("affinity", "tolerations", "serviceAccountName"):
        assert pod[key] == base["spec"]["template"]["spec"][key]
    assert c["env"] == [*container(base)["env"],
                        {"name": "GPUWATCH_HOST_NAMESPACES", "value": "true"}]
    assert c["image"] == container(base)["image"]


def test_switching_overlay_runs_host_commands_in_the_hosts_namespaces() -> None:
    """The image has no systemctl, nvidia-modprobe or nvidia-ctk, its modprobe would read the
    image's modprobe.d, and the host's /run/systemd is not mounted: the overlay's switch runs
    each host command through nsenter into PID 1's namespaces. That needs the setting on (as
    the daemon reads the pod's environment), PID 1 to be the host's init (hostPID), the
    capabilities of setns (a privileged container has every one, and no seccomp filter), and
    nsenter in the image. The read-only base runs no command and sets none of it."""
    from gpuwatch.switch.hostops import NSENTER_ARGS

    ds, base = daemonset(SWITCHING), daemonset(DEFAULT)
    pod, c = ds["spec"]["template"]["spec"], container(ds)
    env = {k: v for k, v in pod_env(ds).items() if k.startswith("GPUWATCH_")}
    assert load_settings({}, env=env, default_config="/nonexistent").host_namespaces is True
    base_env = {k: v for k, v in pod_env(base).items() if k.startswith("GPUWATCH_")}
    assert load_settings({}, env=base_env, default_config="/nonexistent").host_namespaces is False
    assert NSENTER_ARGS[:2] == ("--target", "1") and pod["hostPID"] is True
    assert "hostPID" not in base["spec"]["template"]["spec"]
    security = c["securityContext"]
    assert security["privileged"] is True and security["allowPrivilegeEscalation"] is True
    assert not security["capabilities"].get("drop")  # the base's drop ALL is undone
    annotations = ds["spec"]["template"]["metadata"]["annotations"]
    assert annotations["container.apparmor.security.beta.kubernetes.io/gpuwatch"] == "unconfined"
    packages = " ".join(rest for word, rest in containerfile() if word == "RUN")
    assert re.search(r"apt-get install [^&]*\butil-linux\b", packages)  # nsenter


def test_switching_overlay_can_write_everywhere_a_switch_writes() -> None:
    """The container's own filesystem is read-only, so each place a switch writes under
    GPUWATCH_ROOT needs a writable mount of that same host directory. The lock directory
    is the one `gpuwatch mode` on the host locks in too, so the two never race."""
    from gpuwatch.core.plan import CDI_OUTPUT
    from gpuwatch.hostfs.journal import LOCK_DIR

    ds = daemonset(SWITCHING)
    assert container(ds)["securityContext"]["readOnlyRootFilesystem"] is True
    root = pod_env(ds)["GPUWATCH_ROOT"]
    by_path = mounts(ds)
    for sub in (LOCK_DIR, os.path.dirname(DEFAULT_POISON_FILE), os.path.dirname(CDI_OUTPUT),
                "sys/bus/pci/drivers_probe"):
        path = f"{root}/{sub}"
        covering = [m for m in by_path if path == m or path.startswith(m.rstrip("/") + "/")]
        assert covering, f"{path} is on the read-only root filesystem"
        mount_path = max(covering, key=len)
        mount, volume = by_path[mount_path]
        assert not mount.get("readOnly"), path
        assert volume["hostPath"]["path"] + path[len(mount_path):] == f"/{sub}"


# --------------------------------------------------------------------------- run it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_pods_configuration_runs(host: SysRoot, tmp_path: Path) -> None:
    """``gpuwatch watch`` with the pod's environment, its host paths moved under tmp_path:
    the probe command passes, the metrics parse, the NFD file appears, SIGTERM stops it."""
    from prometheus_client.parser import text_string_to_metric_families

    ds = daemonset(DEFAULT)
    env = pod_env(ds)
    port = free_port()
    sockdir = Path(f"/tmp/gw-pod-{os.getpid()}")
    sockdir.mkdir(exist_ok=True)
    moved = {
        "GPUWATCH_ROOT": str(host.root),
        "GPUWATCH_SOCKET": str(sockdir / "gpuwatch.sock"),
        "GPUWATCH_LOG": str(tmp_path / "log/events.jsonl"),
        "GPUWATCH_NFD_FEATURES": str(tmp_path / "features.d") + "/",
        "GPUWATCH_METRICS": f"127.0.0.1:{port}",
    }
    assert set(moved) <= set(env)
    (tmp_path / "features.d").mkdir()
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWATCH_")}
    run_env.update(env)
    run_env.update(moved)
    run_env["PYTHONPATH"] = str(REPO)
    entrypoint = json.loads(dict(containerfile())["ENTRYPOINT"])
    errors = tmp_path / "stderr"
    with errors.open("w") as err_file:
        proc = subprocess.Popen([sys.executable, "-m", "gpuwatch", *entrypoint[1:]],
                                env=run_env, stdout=subprocess.DEVNULL, stderr=err_file)
    try:
        probe = container(ds)["readinessProbe"]["exec"]["command"]
        deadline = time.monotonic() + 60
        while True:
            check = subprocess.run([sys.executable, "-m", "gpuwatch", *probe[1:]],
                                   env=run_env, capture_output=True, text=True, timeout=30,
                                   check=False)
            if check.returncode == 0:
                break
            if proc.poll() is not None:
                err = errors.read_text()
                if "netlink" in err.lower() or "uevent" in err.lower():
                    pytest.skip(f"no kernel uevent source here: {err.strip()}")
                pytest.fail(f"the daemon exited {proc.returncode}: {err}")
            assert time.monotonic() < deadline, check.stderr
            time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        gpus = {(s.labels["vendor"], s.labels["mode"]): s.value
                for s in families["gpuwatch_gpus"].samples}
        assert gpus[("NVIDIA", "nvidia")] == 1 and sum(gpus.values()) == 2
        assert families["gpuwatch_pci_functions"].samples[0].value == len(host.functions)
        deadline = time.monotonic() + 30
        features = tmp_path / "features.d/gpuwatch"
        while not features.exists():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        labels = dict(line.split("=", 1) for line in features.read_text().splitlines()
                      if line and not line.startswith("#"))
        assert labels["gpuwatch.gpu.count"] == "2"
        assert labels["gpuwatch.gpu.nvidia.count"] == "1"
        first = json.loads((tmp_path / "log/events.jsonl").read_text().splitlines()[0])
        assert first["type"] == "ready"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
            shutil.rmtree(sockdir, ignore_errors=True)
    assert code == 0


def configmap_volume(where: Path, text: str) -> Path:
    """A ConfigMap volume as kubelet lays it out: a directory every user may write (an
    emptyDir, 0777), the keys in a timestamped directory, ``..data`` a link to it and each
    key a link through ``..data``."""
    where.mkdir()
    where.chmod(0o777)
    stamped = where / "..2024_01_01_00_00_00.000000001"
    stamped.mkdir(mode=0o755)
    (stamped / "config.yaml").write_text(text)
    (stamped / "config.yaml").chmod(0o644)
    (where / "..data").symlink_to(stamped.name)
    (where / "config.yaml").symlink_to("..data/config.yaml")
    return where / "config.yaml"


def test_the_documented_config_file_mount_is_read_and_the_directory_one_refused(
        tmp_path: Path) -> None:
    """docs/kubernetes.md gives the pod its data tables from a ConfigMap: mounted as one file
    (``subPath``: the key's file itself, root's, in a directory of root's) it loads; the whole
    ConfigMap as a directory, whose volume directory others may write, is refused in one
    line, as the docs say."""
    from gpuwatch.settings import ConfigError

    text = "host_console_drivers: [ast, mgag200]\n"
    docs = (REPO / "docs/kubernetes.md").read_text()
    assert "subPath: config.yaml" in docs and "GPUWATCH_CONFIG" in docs
    volume = configmap_volume(tmp_path / "volume", text)
    with pytest.raises(ConfigError, match="writable by other users"):
        load_settings({}, env={"GPUWATCH_CONFIG": str(volume)})
    # subPath: the runtime bind-mounts the resolved file at the path the container names.
    etc = tmp_path / "etc/gpuwatch"
    etc.mkdir(parents=True)
    shutil.copy(os.path.realpath(volume), etc / "config.yaml")
    settings = load_settings({}, env={"GPUWATCH_CONFIG": str(etc / "config.yaml")})
    assert settings.tables().host_console_drivers == ("ast", "mgag200")
