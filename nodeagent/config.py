"""The agent's own configuration: ``/etc/nodeagent/config.toml`` → frozen dataclasses.

Every key has a default, so an empty or missing default file is a valid configuration. Command-line flags
override the file through dotted keys (``{"mig.with_reboot": True}``). Unknown keys, wrong types and bad
values raise ``ConfigError`` naming the key and the file (or the flag) they came from; nothing is applied
from a file that fails validation. Paths inside the config are HOST paths (``/etc/...``); callers resolve
them through ``HostPaths`` so ``--root`` keeps working.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import socket
import sys
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from nodeagent.boundedyaml import shown
from nodeagent.errors import ConfigError
from nodeagent.hostpaths import KUBELET_DIR, HostPaths

if sys.version_info >= (3, 11):
    import tomllib
else:  # the backport of the same parser
    import tomli as tomllib

DEFAULT_CONFIG = "/etc/nodeagent/config.toml"

LogFormat = Literal["text", "json"]
LogLevel = Literal["debug", "info", "warning", "error"]
RuntimeMode = Literal["drop-in", "in-place"]
RestartMode = Literal["systemd", "signal", "none"]
DevicePlane = Literal["device-plugin", "dra", "both"]
# Where the labels go: the Node ("node", or true), NFD's NodeFeature object of the node ("nodefeature"), nowhere (false)
LabelTarget = Literal[True, False, "node", "nodefeature"]
EvictionPath = Literal["controller", "direct"]


@dataclass(frozen=True)
class KubeletSettings:
    dir: str = KUBELET_DIR  # device-plugins/ and pod-resources/ live below it
    pod_resources_socket: str = ""  # kubelet PodResources API socket; "" = <dir>/pod-resources/kubelet.sock

    @property
    def device_plugins(self) -> str:
        return self.dir.rstrip("/") + "/device-plugins"

    def pod_resources(self) -> str:
        """The PodResources socket (a host path): the configured one, else the one below ``dir``."""
        return self.pod_resources_socket or self.dir.rstrip("/") + "/pod-resources/kubelet.sock"


@dataclass(frozen=True)
class DevicePluginSettings:
    enabled: bool = True
    config: str = ""  # NVIDIA device-plugin config (version: v1); "" = built-in defaults
    # how GPUs reach pods: the kubelet device plugin, the DRA driver gpu.nodeagent.io (needs the API), or
    # both, each with its own GPUs ([dra] gpus)
    plane: DevicePlane = "device-plugin"


@dataclass(frozen=True)
class DraSettings:
    verify_interval: float = 60.0  # seconds between checks that the node's ResourceSlices are intact
    gpus: tuple[int, ...] = ()  # with plane = "both": the GPU indices DRA serves (the device plugin the rest)
    # GPUs in MIG mode without a static layout publish every MIG placement (partitionable devices, needs
    # the API's DRAPartitionableDevices); NodePrepareResources creates the GPU instance of a claim
    dynamic_mig: bool = False
    # GPU indices whose whole GPU (or static MIG devices) DRA publishes as shared: several claims each take
    # part of its memory and compute (consumable capacity, Kubernetes >= 1.36; earlier: published whole)
    shared_gpus: tuple[int, ...] = ()


@dataclass(frozen=True)
class MigSettings:
    enabled: bool = True
    config_file: str = "/etc/nodeagent/mig-config.yaml"  # mig-parted v1 file with named configs
    hooks_file: str = ""  # mig-parted hooks file; "" = none
    with_reboot: bool = False  # allowed to reboot the node when a mode change cannot take effect otherwise
    # seconds the label-driven apply waits for the pods holding a GPU that must change to let it go (its
    # devices are withdrawn meanwhile; the free GPUs are changed at once); then the apply fails and the
    # GPUs still held are not changed (0 = do not wait)
    release_timeout: float = 300.0
    # the agents' namespace holding the fleet's disruption budget (ConfigMap nodeagent-fleet) and its slot
    # Leases: a change that empties GPUs waits for a slot of the node's pool (docs/fleet.md); "" = no budget
    fleet_namespace: str = ""


@dataclass(frozen=True)
class VfioSettings:
    # follow nvidia.com/gpu.workload.config (container | vm-passthrough): bind all GPUs to vfio-pci and back
    enabled: bool = False
    release_timeout: float = 300.0  # seconds to wait for the pods holding the GPUs before giving up


@dataclass(frozen=True)
class CcSettings:
    enabled: bool = False  # follow nvidia.com/cc.mode (on | off | devtools | ppcie)
    tool: str = ""  # the CC-mode tool; "" = NVIDIA gpu-admin-tools' nvidia_gpu_tools.py where installed
    release_timeout: float = 300.0  # seconds to wait for the pods holding the GPUs before giving up


@dataclass(frozen=True)
class RuntimeSettings:
    enabled: bool = True
    containerd_config: str = "/etc/containerd/config.toml"
    mode: RuntimeMode = "drop-in"
    dropin: str = "/etc/containerd/conf.d/99-nvidia.toml"
    set_as_default: bool = False
    cdi: bool = False
    leak_guard: bool = True
    restart: RestartMode = "systemd"
    check_interval: float = 300.0  # seconds between checks that the wiring is still in place (0 = never)


@dataclass(frozen=True)
class PublishSettings:
    labels: LabelTarget = True
    nodefeature_namespace: str = "nodeagent"  # with labels = "nodefeature": the namespace of the NodeFeature

    @property
    def through_nodefeature(self) -> bool:
        return self.labels == "nodefeature"
    extended_resources: bool = True
    gpu_objects: bool = True
    events: bool = True


@dataclass(frozen=True)
class MetricsSettings:
    address: str = "127.0.0.1:9400"  # localhost only by default; "" = no listener at all
    interval: float = 15.0

    def host_port(self) -> tuple[str, int] | None:
        return parse_address(self.address) if self.address else None


@dataclass(frozen=True)
class HealthSettings:
    window: float = 60.0  # seconds an event counts towards a device's health
    poll_interval: float = 30.0  # fallback poll of every GPU's health


@dataclass(frozen=True)
class CdiSettings:
    enabled: bool = True  # keep /var/run/cdi/nvidia.yaml true to the GPUs and MIG devices
    driver_root: str = "/"  # where the driver's libraries and tools are found (host path)


@dataclass(frozen=True)
class SimulateSettings:
    machine: str = ""  # simulated machine name; "" = real NVML
    state: str = ""  # simulator state file: a path on this machine, never re-rooted under --root


@dataclass(frozen=True)
class AdoptSettings:
    # Another device plugin serving at nodeagent's socket name (NVIDIA's uses the same one): False leaves
    # it alone (nodeagent does not register that resource until it is gone); True replaces its socket.
    take_over: bool = False
    # Hand the node over from NVIDIA's GPU Operator at start: nvidia.com/gpu.deploy.<operand> = "false" for
    # the operands nodeagent replaces, then nodeagent serves once their pods have left the node.
    gpu_operator: bool = False
    dcgm_exporter: bool = False  # with gpu_operator: dcgm-exporter too (nodeagent's metrics carry its names)
    detect: bool = True  # look for other device plugins, DRA drivers, MIG managers, NFD labels (start, resync)


# the remediation actions an operator may name per XID (nodeagent.remediation.policy.Action)
REMEDIATION_ACTIONS = ("none", "restart-app", "reset-gpu", "drain-and-reset", "reboot-node", "recover-imex-domain")


@dataclass(frozen=True)
class RemediationSettings:
    """Per-GPU remediation of faults (docs/remediation.md); off unless enabled."""

    enabled: bool = False
    # "" = the node driver's ``nvidia-smi -r -i <UUID>``; else a command line, "{uuid}" replaced by the GPU
    reset_command: str = ""
    # "controller": requested on the own Node, executed by `nodeagent controller --remediation` (the agent's
    # token cannot evict); "direct": the agent calls the Eviction API itself (a token that may evict pods)
    evictions: EvictionPath = "controller"
    eviction_grace: float = 30.0  # seconds each evicted pod is given to terminate
    eviction_timeout: float = 300.0  # how long evictions may be refused (PodDisruptionBudgets) before giving up
    step_timeout: float = 120.0  # the bound of every other step
    max_resets: int = 3  # resets of one GPU within reset_window before it is quarantined
    reset_window: float = 3600.0
    cordon_on_failure: bool = False  # cordon the node when a GPU cannot be brought back
    reboot_command: str = ""  # "" = never reboot; else run when a node reboot is required
    fabric_manager: bool = True  # False: Ampere NVLink peers are reset together
    # a GPU kept out (quarantined, reboot required): its DRA devices' taint NoExecute instead of NoSchedule
    noexecute_when_out: bool = False
    xid_actions: dict[str, str] = field(default_factory=dict)  # [remediation.xid_actions] "48" = "drain-and-reset"


@dataclass(frozen=True)
class ImexSettings:
    # run the host-managed nvidia-imex for the node's NVLink clique (the peers: the Nodes with the same
    # nvidia.com/gpu.clique label, by InternalIP) and make the IMEX channel devices of ``channels``
    enabled: bool = False
    address: str = ""  # the address the daemon binds and is known by; "" = the own Node's InternalIP
    server_port: int = 50000  # SERVER_PORT: daemons reach each other here
    cmd_port: int = 50005  # IMEX_CMD_PORT: the command service (nvidia-imex-ctl)
    channels: tuple[int, ...] = (0,)  # /dev/nvidia-caps-imex-channels/channel<N> made at start


@dataclass(frozen=True)
class AgentConfig:
    node_name: str = ""  # "" = $NODE_NAME, else the host name
    kube: bool = True  # False = no Kubernetes API at all (demos, kubelet-only nodes)
    kubeconfig: str = ""  # "" = in-cluster service account; a path on this machine, never re-rooted
    log_format: LogFormat = "text"
    log_level: LogLevel = "info"
    resync_interval: float = 60.0  # seconds between full rediscovery + publish passes
    kubelet: KubeletSettings = field(default_factory=KubeletSettings)
    device_plugin: DevicePluginSettings = field(default_factory=DevicePluginSettings)
    dra: DraSettings = field(default_factory=DraSettings)
    mig: MigSettings = field(default_factory=MigSettings)
    vfio: VfioSettings = field(default_factory=VfioSettings)
    cc: CcSettings = field(default_factory=CcSettings)
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)
    publish: PublishSettings = field(default_factory=PublishSettings)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    health: HealthSettings = field(default_factory=HealthSettings)
    cdi: CdiSettings = field(default_factory=CdiSettings)
    simulate: SimulateSettings = field(default_factory=SimulateSettings)
    adopt: AdoptSettings = field(default_factory=AdoptSettings)
    imex: ImexSettings = field(default_factory=ImexSettings)
    remediation: RemediationSettings = field(default_factory=RemediationSettings)
    source: str = field(default="", compare=False)  # where it was read from (for messages)

    def resolved_node_name(self) -> str:
        return self.node_name or os.environ.get("NODE_NAME", "") or socket.gethostname()

    def sections_changed(self, other: AgentConfig) -> set[str]:
        """Names of top-level keys/sections whose value differs between two configs."""
        return {
            f.name
            for f in dataclasses.fields(self)
            if f.compare and getattr(self, f.name) != getattr(other, f.name)
        }


def flag_path(paths: HostPaths, value: Path | str | None, flag: str) -> str | None:
    """A path typed on the command line as the host path the config holds.

    One convention for every path flag: the value is a path as the shell sees it (relative to the
    working directory), and under ``--root DIR`` it must lie inside DIR (``--root ./demo --kubelet-dir
    ./demo/var/lib/kubelet``). A host-style path that is not inside DIR is refused, naming the path under
    DIR it may have meant; with the root ``/`` a path is just made absolute.
    """
    if value is None:
        return None
    text = str(value)
    if "\0" in text:
        raise ConfigError(f"{flag}: the path contains a NUL byte", subject=flag)
    plain = Path(os.path.abspath(text))
    # the root is symlink-resolved; the path's directory may be spelt through a link to it
    candidates = (plain, Path(os.path.realpath(plain.parent)) / plain.name)
    for candidate in candidates:
        try:
            rel = candidate.relative_to(paths.root)
        except ValueError:
            continue
        return "/" + str(rel) if str(rel) != "." else "/"
    hint = ""
    if text.startswith("/"):
        hint = (f" (path flags are paths as your shell sees them: did you mean "
                f"{_quoted(str(paths.root / os.path.normpath(text).lstrip('/')), 200)}?)")
    raise ConfigError(f"{flag} {_quoted(text, 200)} is not inside --root {paths.root}{hint}", subject=flag)


MAX_PATH = 4095  # PATH_MAX less the terminating NUL
MAX_PATH_COMPONENT = 255


def path_problem(path: str) -> str:
    """Why a host path the config names is refused ("" when it is not): relative, NUL, ``..``, too long."""
    if not path.startswith("/"):
        return "must be an absolute path"
    if "\0" in path:
        return "must not contain a NUL byte"
    if len(path) > MAX_PATH:
        return f"is longer than {MAX_PATH} characters ({len(path)})"
    parts = path.split("/")
    if ".." in parts:
        return "must not contain '..' (name the directory itself)"
    if any(len(p.encode("utf-8", errors="surrogateescape")) > MAX_PATH_COMPONENT for p in parts):
        return f"has a name longer than {MAX_PATH_COMPONENT} bytes"
    if not path.isprintable():
        return "must not contain control characters"
    return ""


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` → (host, port); raises ValueError."""
    host, sep, port_s = address.rpartition(":")
    if not sep or not host or not port_s.isdigit() or not port_s.isascii():
        raise ValueError(f"expected HOST:PORT, got {shown(address)}")
    port = int(port_s) if len(port_s) <= 5 else 0
    if not 0 < port < 65536:
        raise ValueError(f"port out of range in {shown(address)}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, port


# --- validation ------------------------------------------------------------------------------------------

_POSITIVE = {
    "resync_interval",
    "metrics.interval",
    "health.window",
    "health.poll_interval",
    "dra.verify_interval",
    "remediation.eviction_grace",
    "remediation.eviction_timeout",
    "remediation.step_timeout",
    "remediation.reset_window",
}
_NON_NEGATIVE = {"runtime.check_interval", "mig.release_timeout", "vfio.release_timeout", "cc.release_timeout",
                 "remediation.max_resets"}
MAX_SECONDS = 366 * 24 * 3600.0  # no interval or window is longer than a year (the scheduler's limit is near)
_ABSOLUTE_PATHS = {
    "kubeconfig",
    "kubelet.dir",
    "kubelet.pod_resources_socket",
    "device_plugin.config",
    "mig.config_file",
    "mig.hooks_file",
    "cc.tool",
    "runtime.containerd_config",
    "runtime.dropin",
    "cdi.driver_root",
    "simulate.state",
}


def _check_value(key: str, tp: Any, value: Any, where: str) -> Any:
    """Value of ``value`` for a field of type ``tp``, or ConfigError naming key and source."""

    def bad(expected: str) -> ConfigError:
        return ConfigError(f"{where}: key '{key}' must be {expected}, got {shown(value)}", subject=key)

    origin = get_origin(tp)
    if origin is Literal:
        choices = get_args(tp)
        # by type too: 1 is not true, and "true" is not a boolean
        if not any(type(value) is type(c) and value == c for c in choices):
            raise bad("one of " + ", ".join(str(c).lower() if isinstance(c, bool) else repr(c) for c in choices))
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad("a number")
        try:
            number = float(value)
        except OverflowError:  # an integer too large for a float
            raise bad("a finite number") from None
        if not math.isfinite(number):  # TOML has nan and inf; no setting means either
            raise bad("a finite number")
        return number
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("an integer")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise bad("a string")
        return value
    if origin is tuple and get_args(tp) == (int, ...):
        if not isinstance(value, list | tuple) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
            raise bad("a list of integers")
        return tuple(value)
    if origin is dict and get_args(tp) == (str, str):
        if not isinstance(value, Mapping) or any(not isinstance(v, str) for v in value.values()):
            raise bad("a table of strings")
        return {str(k): v for k, v in value.items()}
    raise AssertionError(f"unsupported config type {tp!r} for {key}")


def _semantic_checks(key: str, value: Any, where: str) -> None:
    if key in _POSITIVE and value <= 0:
        raise ConfigError(f"{where}: key '{key}' must be greater than 0, got {shown(value)}", subject=key)
    if key in _NON_NEGATIVE and value < 0:
        raise ConfigError(f"{where}: key '{key}' must not be negative, got {shown(value)}", subject=key)
    if key in _POSITIVE | _NON_NEGATIVE and value > MAX_SECONDS:
        raise ConfigError(f"{where}: key '{key}' must be at most {MAX_SECONDS:.0f} seconds, got {shown(value)}",
                          subject=key)
    if key in _ABSOLUTE_PATHS and value:
        problem = path_problem(value)
        if problem:
            raise ConfigError(f"{where}: key '{key}' {problem}, got {shown(value)}", subject=key)
    if key == "metrics.address" and value:
        try:
            parse_address(value)
        except ValueError as e:
            raise ConfigError(f"{where}: key '{key}': {e}", subject=key) from e
    if key in ("dra.gpus", "dra.shared_gpus"):
        if any(v < 0 for v in value):
            raise ConfigError(f"{where}: key '{key}' lists a negative GPU index: {shown(list(value))}",
                              subject=key)
        if len(set(value)) != len(value):
            twice = sorted({v for v in value if value.count(v) > 1}) if len(value) <= 4096 else []
            which = f" (GPU {shown(twice[0])})" if twice else ""
            raise ConfigError(f"{where}: key '{key}' lists a GPU twice{which}: {shown(list(value))}", subject=key)
    if key in ("imex.server_port", "imex.cmd_port") and not 1 <= value <= 65535:
        raise ConfigError(f"{where}: key '{key}' must be a TCP port (1..65535), got {shown(value)}", subject=key)
    if key == "imex.address" and value:
        import ipaddress

        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ConfigError(f"{where}: key '{key}' is not an IP address: {shown(value)}", subject=key) from None
    if key == "imex.channels" and any(not 0 <= v < (1 << 20) for v in value):
        raise ConfigError(f"{where}: key '{key}' lists a channel outside 0..{(1 << 20) - 1}: {shown(list(value))}",
                          subject=key)
    if key == "remediation.xid_actions":
        for xid, action in value.items():
            if not xid.isdigit() or not 0 < int(xid) < 1 << 16:
                raise ConfigError(f"{where}: key '{key}.{_quoted(xid)[1:-1]}' is not an XID number", subject=key)
            if action not in REMEDIATION_ACTIONS:
                raise ConfigError(f"{where}: key '{key}.{xid}' must be one of "
                                  f"{', '.join(REMEDIATION_ACTIONS)}, got {shown(action)}", subject=f"{key}.{xid}")
    if key == "publish.nodefeature_namespace" and (len(value) > 63 or not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?",
                                                                             value)):
        raise ConfigError(f"{where}: key '{key}' is not a namespace name: {shown(value)}", subject=key)
    if key == "node_name" and value and (len(value) > 253 or not value.isprintable() or
                                         any(c.isspace() for c in value)):
        raise ConfigError(f"{where}: key '{key}' is not a valid node name: {shown(value)}", subject=key)


def _quoted(text: str, limit: int = 60) -> str:
    """A key the user typed, as one bounded line (escapes instead of line breaks)."""
    shown = repr(text)
    return shown if len(shown) <= limit else shown[: limit - 4] + "...'"


def _build(cls: type[Any], data: Mapping[str, Any], prefix: str, where: str) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.name != "source"}
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        key = prefix + name
        if name not in known:
            raise ConfigError(f"{where}: unknown key {_quoted(key)}", subject=key)
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{where}: key '{key}' must be a table ([{key}])", subject=key)
            kwargs[name] = _build(tp, value, key + ".", where)  # type: ignore[arg-type]
        else:
            checked = _check_value(key, tp, value, where)
            _semantic_checks(key, checked, where)
            kwargs[name] = checked
    return cls(**kwargs)


def parse_config(text: str, where: str) -> AgentConfig:
    """Parse and validate TOML text (pure)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{where}: not valid TOML: {e}", subject=where) from e
    except ValueError as e:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise ConfigError(f"{where}: not valid TOML: {str(e).partition(':')[0]}", subject=where) from e
    except RecursionError as e:  # tomllib parses nested arrays and inline tables recursively
        raise ConfigError(f"{where}: not valid TOML: arrays or tables nested too deeply", subject=where) from e
    cfg: AgentConfig = _build(AgentConfig, data, "", where)
    _check_together(cfg, where)
    return dataclasses.replace(cfg, source=where)


def apply_overrides(cfg: AgentConfig, overrides: Mapping[str, Any],
                    where: str = "command line") -> AgentConfig:
    """A copy of ``cfg`` with dotted keys replaced; ``None`` values mean "not given" and are skipped."""
    tree: dict[str, Any] = {}
    for dotted, value in overrides.items():
        if value is None:
            continue
        parts = dotted.split(".")
        node = tree
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    if not tree:
        return cfg
    merged = _merge(_as_dict(cfg), tree)
    new: AgentConfig = _build(AgentConfig, merged, "", where)
    _check_together(new, where)
    return dataclasses.replace(new, source=cfg.source)


def _check_together(cfg: AgentConfig, where: str) -> None:
    """Keys that are only valid together."""
    if cfg.device_plugin.plane == "both" and not cfg.dra.gpus:
        raise ConfigError(f"{where}: key 'dra.gpus' must list the GPU indices DRA serves when "
                          "device_plugin.plane is 'both' (the device plugin serves the others)", subject="dra.gpus")


def _as_dict(cfg: AgentConfig) -> dict[str, Any]:
    d = dataclasses.asdict(cfg)
    d.pop("source", None)
    return d


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def load_config(
    paths: HostPaths,
    config_file: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> AgentConfig:
    """Read the config file (the default one under the host root unless ``config_file`` is given).

    A missing default file means all defaults; a missing explicit file is an error.
    """
    if config_file is None:
        path = paths(DEFAULT_CONFIG)
        where = paths.shown(DEFAULT_CONFIG)
        explicit = False
    else:
        path = config_file
        where = str(path)
        explicit = True
    text = _read_text(path, "config file", "", where)
    if text is None:
        if explicit:
            raise ConfigError(f"{where}: config file not found", subject=where)
        cfg = dataclasses.replace(AgentConfig(), source="defaults")
    else:
        cfg = parse_config(text, where)
    return apply_overrides(cfg, overrides or {})


def _read_text(path: Path, what: str, key: str, shown: str | None = None) -> str | None:
    """UTF-8 text of a regular file of bounded size, None when it does not exist. Never blocks: a FIFO, a
    directory or a device in its place is a ``ConfigError`` naming the file (as ``shown``, when given), as
    is a file too big."""
    from nodeagent.fileio import read_text

    named = f" ({key})" if key else ""
    where = shown or str(path)
    try:
        return read_text(path)
    except ConfigError as e:  # fileio's own line, said as the configuration's
        reason = str(e).removeprefix(f"{path}: ").removeprefix("cannot read: ")
        raise ConfigError(f"{where}: cannot read the {what}{named}: {reason}", subject=where) from e


def read_named_file(path: Path, what: str, key: str, shown: str | None = None) -> str | None:
    """Text of a file the configuration names; None when it does not exist; ``ConfigError`` when it cannot
    be read (a directory, no permission, not UTF-8). ``shown``: the file's name in messages (``path`` by
    default; ``HostPaths.shown`` for a file read under the root)."""
    return _read_text(path, what, key, shown)


def require_named_file(path: Path, what: str, key: str, shown: str | None = None) -> str:
    """Like ``read_named_file``, with a missing file a ``ConfigError`` too."""
    text = read_named_file(path, what, key, shown)
    if text is None:
        where = shown or str(path)
        raise ConfigError(f"{where}: {what} ({key}) not found", subject=where)
    return text
