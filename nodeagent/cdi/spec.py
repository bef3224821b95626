"""Inventory + host facts → the CDI spec for ``nvidia.com/gpu`` (pure, no I/O).

Device names are those of ``names``. Every device carries its own device nodes (``/dev/nvidiaN``; a MIG
device also its GPU-instance and compute-instance ``/dev/nvidia-caps/nvidia-cap<N>``); the spec-wide
edits carry ``NVIDIA_VISIBLE_DEVICES=void`` (so a runtime hook does not inject a second time), the control
nodes, read-only mounts of the driver's files and, when installed, the ``nvidia-cdi-hook`` hooks.
``cdiVersion`` is the lowest version whose features the content uses, so older CDI consumers accept it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from nodeagent.cdi.host import CdiError, HostFacts, Mount, NodeFact
from nodeagent.cdi.names import ALL_DEVICES, CDI_KIND, gpu_names, mig_names, ordered_mig_devices
from nodeagent.gpu.inventory import Gpu, Inventory, MigDevice

HEADER = (
    "# CDI spec for the NVIDIA GPUs of this node, written by nodeagent from its GPU inventory.\n"
    "# nodeagent rewrites it whenever GPUs, MIG devices or the driver change; edits here do not last.\n"
)
MOUNT_OPTIONS = ("ro", "nosuid", "nodev", "rbind", "rprivate")
_VERSIONS = ("0.3.0", "0.4.0", "0.5.0", "0.6.0")


def node_entry(fact: NodeFact) -> dict[str, Any]:
    """A spec ``deviceNodes`` entry: the host path under ``--root``, the numbers of a stand-in file."""
    entry: dict[str, Any] = {"path": fact.path}
    if fact.host_path != fact.path:
        entry["hostPath"] = fact.host_path
    if fact.major is not None and fact.minor is not None:
        entry["type"] = "c"
        entry["major"] = fact.major
        entry["minor"] = fact.minor
    return entry


def _mount_entry(m: Mount) -> dict[str, Any]:
    return {"hostPath": m.host_path, "containerPath": m.container_path, "options": list(MOUNT_OPTIONS)}


def _gpu_node(gpu: Gpu, facts: HostFacts) -> NodeFact:
    path = f"/dev/nvidia{gpu.minor_number}"
    fact = facts.nodes.get(path)
    if fact is None:
        raise CdiError(f"GPU {gpu.index} ({gpu.uuid}): {path} is missing and its major number is unknown",
                       subject=path)
    return fact


def _mig_nodes(gpu: Gpu, mig: MigDevice, facts: HostFacts) -> list[NodeFact]:
    out = [_gpu_node(gpu, facts)]
    for key, what in (((gpu.minor_number, mig.gi_id, None), f"gpu{gpu.minor_number}/gi{mig.gi_id}/access"),
                      ((gpu.minor_number, mig.gi_id, mig.ci_id),
                       f"gpu{gpu.minor_number}/gi{mig.gi_id}/ci{mig.ci_id}/access")):
        minor = facts.mig_minors.get(key)
        if minor is None:
            raise CdiError(
                f"MIG device {mig.uuid} on GPU {gpu.index}: {facts.mig_minors_source} has no entry {what}",
                subject=facts.mig_minors_source,
            )
        path = f"/dev/nvidia-caps/nvidia-cap{minor}"
        fact = facts.nodes.get(path)
        if fact is None:
            raise CdiError(f"MIG device {mig.uuid}: {path} is missing and the nvidia-caps major is unknown",
                           subject=path)
        out.append(fact)
    return out


def _device(name: str, nodes: list[NodeFact]) -> dict[str, Any]:
    return {"name": name, "containerEdits": {"deviceNodes": [node_entry(n) for n in nodes]}}


def _hooks(hook: str, libraries: tuple[Mount, ...]) -> list[dict[str, Any]]:
    hooks: list[dict[str, Any]] = []
    cuda = next((m for m in libraries if m.container_path.rsplit("/", 1)[-1].startswith("libcuda.so.")), None)
    if cuda is not None:
        folder = cuda.container_path.rsplit("/", 1)[0]
        hooks.append({
            "hookName": "createContainer",
            "path": hook,
            "args": ["nvidia-cdi-hook", "create-symlinks", "--link", f"libcuda.so.1::{folder}/libcuda.so"],
        })
    folders = sorted({m.container_path.rsplit("/", 1)[0] for m in libraries})
    if folders:
        args = ["nvidia-cdi-hook", "update-ldcache"]
        for f in folders:
            args += ["--folder", f]
        hooks.append({"hookName": "createContainer", "path": hook, "args": args})
    return hooks


def required_version(spec: dict[str, Any]) -> str:
    """The lowest ``cdiVersion`` that allows what ``spec`` uses (rules of the CDI reference library)."""
    edits = [spec.get("containerEdits", {})] + [d.get("containerEdits", {}) for d in spec.get("devices", [])]
    if spec.get("annotations") or any(d.get("annotations") for d in spec.get("devices", [])):
        return "0.6.0"
    if "." in spec["kind"].partition("/")[2]:
        return "0.6.0"
    if any(d["name"][:1].isdigit() for d in spec.get("devices", [])):
        return "0.5.0"
    if any("hostPath" in n for e in edits for n in e.get("deviceNodes", [])):
        return "0.5.0"
    if any("type" in m for e in edits for m in e.get("mounts", [])):
        return "0.4.0"
    return _VERSIONS[0]


def generate(inventory: Inventory, facts: HostFacts) -> dict[str, Any] | None:
    """The spec for ``inventory`` (``None`` when there is no GPU: a CDI spec needs at least one device)."""
    gpus = sorted(inventory.gpus, key=lambda g: g.index)
    if not gpus:
        return None
    devices: list[dict[str, Any]] = []
    all_nodes: dict[NodeFact, None] = {}  # insertion-ordered set

    def add_all(nodes: list[NodeFact]) -> None:
        all_nodes.update(dict.fromkeys(nodes))

    for gpu in gpus:
        nodes = [_gpu_node(gpu, facts)]
        add_all(nodes)
        for name in gpu_names(gpu):
            devices.append(_device(name, nodes))
    for gpu in gpus:
        for mig in ordered_mig_devices(gpu):
            nodes = _mig_nodes(gpu, mig, facts)
            add_all(nodes)
            for name in mig_names(gpu, mig):
                devices.append(_device(name, nodes))
    devices.append(_device(ALL_DEVICES, list(all_nodes)))

    common: dict[str, Any] = {"env": ["NVIDIA_VISIBLE_DEVICES=void"]}
    control = [facts.nodes[p] for p in ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools",
                                        "/dev/nvidia-modeset") if p in facts.nodes]
    if control:
        common["deviceNodes"] = [node_entry(n) for n in control]
    mounts = [*facts.libraries, *facts.binaries, *facts.firmware, *facts.sockets]
    if mounts:
        common["mounts"] = [_mount_entry(m) for m in mounts]
    if facts.hook is not None:
        hooks = _hooks(facts.hook, facts.libraries)
        if hooks:
            common["hooks"] = hooks
    spec: dict[str, Any] = {"cdiVersion": "", "kind": CDI_KIND, "devices": devices, "containerEdits": common}
    spec["cdiVersion"] = required_version(spec)
    return spec


_PLAIN = re.compile(r"[A-Za-z0-9 _./:=+,@%-]*")


def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        if _PLAIN.fullmatch(v):  # what json.dumps would give, without its per-call cost
            return f'"{v}"'
        return json.dumps(v)  # a JSON string is a valid YAML double-quoted scalar
    raise TypeError(f"unexpected value in a CDI spec: {v!r}")


def _emit(value: Any, indent: str, out: list[str]) -> None:
    """Block-style YAML for the dicts, lists, strings and ints a spec holds (much faster than PyYAML)."""
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(v, dict | list) and v:
                out.append(f"{indent}{k}:")
                _emit(v, indent + "  ", out)
            elif isinstance(v, dict | list):
                out.append(f"{indent}{k}: {'[]' if isinstance(v, list) else '{}'}")
            else:
                out.append(f"{indent}{k}: {_scalar(v)}")
        return
    for item in value:
        if isinstance(item, dict) and item and not any(isinstance(v, dict | list) for v in item.values()):
            # a flat mapping (a device node, a mount's fields): its lines directly, the first one dashed
            lead = indent + "- "
            for k, v in item.items():
                out.append(f"{lead}{k}: {_scalar(v)}")
                lead = indent + "  "
        elif isinstance(item, dict) and item:
            sub: list[str] = []
            _emit(item, indent + "  ", sub)
            out.append(indent + "- " + sub[0][len(indent) + 2:])
            out.extend(sub[1:])
        elif isinstance(item, list):
            raise TypeError("nested lists do not occur in a CDI spec")
        else:
            out.append(f"{indent}- {_scalar(item)}")


def render(spec: dict[str, Any]) -> str:
    """The file's text: a comment header and block YAML with quoted strings, stable for equal specs."""
    out: list[str] = []
    _emit(spec, "", out)
    return HEADER + "\n".join(out) + "\n"


def device_names(spec: dict[str, Any] | None) -> list[str]:
    """Fully qualified names of the spec's devices."""
    if not spec:
        return []
    return [f"{spec['kind']}={d['name']}" for d in spec.get("devices", [])]
