"""The part of kustomize that contrib/kubernetes uses, for machines without kubectl/kustomize.

Where kubectl exists the tests render with both and require the same objects, so this stays
honest; keys it does not know are an error, never silently ignored.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

#: Strategic-merge keys of the pod spec lists the manifests patch (Kubernetes' own tags).
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "env": "name",
    "ports": "containerPort",
}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}
KNOWN = {"apiVersion", "kind", "resources", "namespace", "labels", "images", "patches"}


def strategic_merge(base: Any, patch: Any, key: str | None = None) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            elif k in out:
                out[k] = strategic_merge(out[k], v, k)
            else:
                out[k] = copy.deepcopy(v)
        return out
    if (isinstance(base, list) and isinstance(patch, list) and key in MERGE_KEYS
            and all(isinstance(x, dict) for x in base + patch)):
        mk = MERGE_KEYS[key]
        out_list = [copy.deepcopy(x) for x in base]
        for item in patch:
            at = next((i for i, b in enumerate(out_list) if b.get(mk) == item.get(mk)), None)
            if at is None:
                out_list.append(copy.deepcopy(item))
            else:
                out_list[at] = strategic_merge(out_list[at], item)
        return out_list
    return copy.deepcopy(patch)


def _containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj.get("spec", {}).get("template", {}).get("spec", {})
    return [*spec.get("containers", []), *spec.get("initContainers", [])]


def build(directory: Path) -> list[dict[str, Any]]:
    """The objects ``kustomize build directory`` would print."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(k) - KNOWN
    if unknown:
        raise ValueError(f"{directory}: kustomize_lite does not know {sorted(unknown)}")
    objects: list[dict[str, Any]] = []
    for entry in k.get("resources", []):
        path = directory / entry
        if path.is_dir():
            objects.extend(build(path))
        else:
            objects.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    for patch_ref in k.get("patches", []):
        if set(patch_ref) != {"path"}:
            raise ValueError(f"only file patches are supported: {patch_ref}")
        patch = yaml.safe_load((directory / patch_ref["path"]).read_text())
        matches = [i for i, o in enumerate(objects) if o["kind"] == patch["kind"]
                   and o["metadata"]["name"] == patch["metadata"]["name"]]
        if len(matches) != 1:
            raise ValueError(f"patch {patch_ref['path']} matches {len(matches)} objects")
        objects[matches[0]] = strategic_merge(objects[matches[0]], patch)
    for obj in objects:
        if "namespace" in k and obj["kind"] not in CLUSTER_SCOPED:
            obj["metadata"]["namespace"] = k["namespace"]
        for group in k.get("labels", []):
            if set(group) - {"pairs"}:
                raise ValueError(f"only plain label pairs are supported: {group}")
            obj["metadata"].setdefault("labels", {}).update(group["pairs"])
        for image in k.get("images", []):
            for c in _containers(obj):
                name, _, _ = c["image"].partition(":")
                if name == image["name"]:
                    c["image"] = f"{image.get('newName', name)}:{image['newTag']}"
    return objects


def normalise(value: Any, key: str | None = None) -> Any:
    """Order-insensitive form for comparing renderings: lists keyed like Kubernetes sorted."""
    if isinstance(value, dict):
        return {k: normalise(v, k) for k, v in sorted(value.items())}
    if isinstance(value, list):
        items = [normalise(v) for v in value]
        if key in MERGE_KEYS and all(isinstance(x, dict) for x in items):
            return sorted(items, key=lambda x: str(x.get(MERGE_KEYS[key])))
        return items
    return value
