"""NVIDIA device-plugin config file, version v1, parsed into frozen dataclasses.

A file written for NVIDIA's plugin is accepted unchanged: every key that plugin knows is accepted
(keys that only matter to NVIDIA's own binaries are parsed and ignored); anything else is rejected
so typos never pass silently. Pure: ``parse_plugin_config`` takes text, ``load_plugin_config`` is
the one function that reads a file.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from nodeagent.boundedyaml import load_document, plain, shown
from nodeagent.errors import ConfigError

MigStrategy = Literal["none", "single", "mixed"]
DeviceListStrategy = Literal["envvar", "volume-mounts", "cdi-annotations", "cdi-cri"]
DeviceIdStrategy = Literal["uuid", "index"]
SharingStrategy = Literal["none", "time-slicing", "mps"]
AllocationPolicy = Literal["distributed", "packed"]

MIG_STRATEGIES: tuple[str, ...] = ("none", "single", "mixed")
DEVICE_LIST_STRATEGIES: tuple[str, ...] = ("envvar", "volume-mounts", "cdi-annotations", "cdi-cri")
DEVICE_ID_STRATEGIES: tuple[str, ...] = ("uuid", "index")
ALLOCATION_POLICIES: tuple[str, ...] = ("distributed", "packed")
RESOURCE_PREFIX = "nvidia.com/"
# Bounds: the kubelet keeps every advertised ID in its checkpoint and every ListAndWatch answer carries all
# of them, so a typo like ``replicas: 1000000`` must be refused, not turned into millions of devices.
MAX_REPLICAS = 1024
MAX_ADVERTISED_DEVICES = 8192  # over all resources of the node
MAX_LIST_ITEMS = 4096  # entries of any list in the file

# An extended resource name as the API server accepts it: ``<DNS subdomain>/<name>``, the name part at most
# 63 characters of [A-Za-z0-9-_.] beginning and ending alphanumeric, not in the kubernetes.io domain.
_DNS_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
_RESOURCE_NAME_RE = re.compile(
    rf"^({_DNS_LABEL}(?:\.{_DNS_LABEL})*)/([A-Za-z0-9](?:[-A-Za-z0-9_.]{{0,61}}[A-Za-z0-9])?)$"
)

# Keys NVIDIA's config knows that change nothing in nodeagent (driver roots, GFD, MOFED, ...).
_IGNORED_FLAGS = frozenset(
    {
        "restartOnDeviceUnhealthy",
        "nvidiaDriverRoot",
        "nvidiaDevRoot",
        "gdsEnabled",
        "mofedEnabled",
        "useNodeFeatureAPI",
        "deviceDiscoveryStrategy",
        "mpsRoot",
        "gfd",
    }
)
_FLAG_KEYS = frozenset({"migStrategy", "failOnInitError", "plugin"}) | _IGNORED_FLAGS
_IGNORED_PLUGIN_FLAGS = frozenset({"nvidiaCTKPath", "containerDriverRoot", "cdiFeatureFlags"})
_PLUGIN_KEYS = (
    frozenset({"passDeviceSpecs", "deviceListStrategy", "deviceIDStrategy", "cdiAnnotationPrefix"})
    | _IGNORED_PLUGIN_FLAGS
)
_TOP_KEYS = frozenset({"version", "flags", "resources", "sharing", "imex"})
_SHARING_KEYS = frozenset({"timeSlicing", "mps"})
_REPLICATED_KEYS = frozenset({"renameByDefault", "failRequestsGreaterThanOne", "resources"})
_RESOURCE_KEYS = frozenset({"name", "rename", "devices", "replicas"})
_PATTERN_KEYS = frozenset({"pattern", "name"})
_IMEX_KEYS = frozenset({"channelIDs", "required"})


@dataclass(frozen=True)
class ImexChannelRef:
    """An IMEX channel the plugin hands to every container it allocates for (resolved on the node, not a
    config key): its number, its path in the container and its published host path."""

    number: int
    path: str
    host_path: str


@dataclass(frozen=True)
class ImexConfig:
    """``imex``: the channels NVIDIA's plugin injects (``channelIDs``: ``[]`` or ``[0]``) and whether a missing
    one is an error (``required``)."""

    channel_ids: tuple[int, ...] = ()
    required: bool = False


@dataclass(frozen=True)
class PluginFlags:
    """``flags.plugin``."""

    pass_device_specs: bool = False
    device_list_strategy: tuple[str, ...] = ("envvar",)
    device_id_strategy: str = "uuid"
    cdi_annotation_prefix: str = "cdi.k8s.io/"
    imex_channels: tuple[ImexChannelRef, ...] = ()  # from ``imex``, resolved by the device-plugin service


@dataclass(frozen=True)
class Flags:
    """``flags``."""

    mig_strategy: str = "none"
    fail_on_init_error: bool = True
    plugin: PluginFlags = field(default_factory=PluginFlags)


@dataclass(frozen=True)
class DeviceSelector:
    """``devices`` of a sharing entry: every device, the first ``count``, or explicit references.

    References are GPU indices (``"0"``), GPU UUIDs, MIG UUIDs or ``"<gpu>:<mig>"`` MIG indices.
    """

    all: bool = True
    count: int | None = None
    refs: tuple[str, ...] = ()


@dataclass(frozen=True)
class ReplicatedResource:
    """One ``sharing.<strategy>.resources[]`` entry."""

    name: str  # the resource it shares, e.g. nvidia.com/gpu or nvidia.com/mig-1g.10gb
    replicas: int
    rename: str | None = None  # fully prefixed new resource name
    devices: DeviceSelector = field(default_factory=DeviceSelector)
    position: int = 0  # index in the resources list (for messages)


@dataclass(frozen=True)
class Sharing:
    """The sharing section reduced to the one strategy in use."""

    strategy: str = "none"  # none | time-slicing | mps
    rename_by_default: bool = False
    fail_requests_greater_than_one: bool = False
    resources: tuple[ReplicatedResource, ...] = ()


@dataclass(frozen=True)
class ResourcePattern:
    """``resources.gpus[]`` / ``resources.mig[]``: product (or profile) glob → resource name."""

    pattern: str
    name: str


@dataclass(frozen=True)
class PluginConfig:
    """A whole NVIDIA plugin config (v1) plus nodeagent's allocation policy for replicas/MIG."""

    flags: Flags = field(default_factory=Flags)
    sharing: Sharing = field(default_factory=Sharing)
    gpu_patterns: tuple[ResourcePattern, ...] = ()
    mig_patterns: tuple[ResourcePattern, ...] = ()
    allocation_policy: str = "distributed"
    source: str = "<defaults>"
    imex: ImexConfig = field(default_factory=ImexConfig)


DEFAULT_CONFIG = PluginConfig()


def _where(source: str, path: str) -> str:
    return f"{source}: {path}"


def _mapping(value: Any, source: str, path: str, allowed: frozenset[str]) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{_where(source, path)} must be a mapping, got {type(value).__name__}", subject=source)
    unknown = sorted(plain(k) for k in value if k not in allowed)
    if unknown:
        listed = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise ConfigError(
            f"{_where(source, path)}: unknown key(s) {listed} (allowed: {', '.join(sorted(allowed))})",
            subject=source,
        )
    return value


def _bool(value: Any, default: bool, source: str, path: str) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"{_where(source, path)} must be true or false, got {shown(value)}", subject=source)
    return value


def _choice(value: Any, default: str, choices: tuple[str, ...], source: str, path: str) -> str:
    if value is None:
        return default
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(
            f"{_where(source, path)}: {shown(value)} is not one of {', '.join(choices)}", subject=source
        )
    return value


def _prefixed(name: str) -> str:
    return name if "/" in name else RESOURCE_PREFIX + name


def resource_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be an extended resource name, or None when it can."""
    m = _RESOURCE_NAME_RE.match(name)
    if m is None or len(m.group(1)) > 253:
        return ("not a valid extended resource name (<domain>/<name>: a lower-case DNS domain, then at most 63 "
                "characters of letters, digits, '-', '_' and '.', beginning and ending with a letter or digit)")
    domain = m.group(1)
    if domain == "kubernetes.io" or domain.endswith(".kubernetes.io") or name.startswith("requests."):
        return "extended resources may not be in the kubernetes.io domain"
    return None


def _resource_name(raw: str, source: str, path: str) -> str:
    name = _prefixed(raw)
    problem = resource_name_problem(name)
    if problem is not None:
        raise ConfigError(f"{_where(source, path)}: {shown(raw)} is {problem}", subject=source)
    return name


def _list_of(raw: Any, source: str, path: str) -> list[Any]:
    if not isinstance(raw, list):
        raise ConfigError(f"{_where(source, path)} must be a list", subject=source)
    if len(raw) > MAX_LIST_ITEMS:
        raise ConfigError(
            f"{_where(source, path)} has {len(raw)} entries, more than the {MAX_LIST_ITEMS} accepted", subject=source
        )
    return raw


def _parse_plugin(raw: Any, source: str) -> PluginFlags:
    m = _mapping(raw, source, "flags.plugin", _PLUGIN_KEYS)
    strategies_raw = m.get("deviceListStrategy")
    if strategies_raw is None:
        strategies: tuple[str, ...] = ("envvar",)
    else:
        items = [strategies_raw] if isinstance(strategies_raw, str) else strategies_raw
        if not isinstance(items, list) or not items:
            raise ConfigError(
                f"{_where(source, 'flags.plugin.deviceListStrategy')} must be a strategy name or a non-empty list",
                subject=source,
            )
        strategies = tuple(
            dict.fromkeys(
                _choice(s, "envvar", DEVICE_LIST_STRATEGIES, source, f"flags.plugin.deviceListStrategy[{i}]")
                for i, s in enumerate(items)
            )
        )
    prefix = m.get("cdiAnnotationPrefix")
    if prefix is not None and (not isinstance(prefix, str) or not prefix.endswith("/")):
        raise ConfigError(
            f"{_where(source, 'flags.plugin.cdiAnnotationPrefix')} must be a string ending in '/', "
            f"got {shown(prefix)}",
            subject=source,
        )
    return PluginFlags(
        pass_device_specs=_bool(m.get("passDeviceSpecs"), False, source, "flags.plugin.passDeviceSpecs"),
        device_list_strategy=strategies,
        device_id_strategy=_choice(
            m.get("deviceIDStrategy"), "uuid", DEVICE_ID_STRATEGIES, source, "flags.plugin.deviceIDStrategy"
        ),
        cdi_annotation_prefix=prefix or "cdi.k8s.io/",
    )


def _parse_flags(raw: Any, source: str) -> Flags:
    m = _mapping(raw, source, "flags", _FLAG_KEYS)
    return Flags(
        mig_strategy=_choice(m.get("migStrategy"), "none", MIG_STRATEGIES, source, "flags.migStrategy"),
        fail_on_init_error=_bool(m.get("failOnInitError"), True, source, "flags.failOnInitError"),
        plugin=_parse_plugin(m.get("plugin"), source),
    )


def _parse_devices(raw: Any, source: str, path: str) -> DeviceSelector:
    if raw is None or raw == "all":
        return DeviceSelector()
    if isinstance(raw, bool):
        raise ConfigError(f"{_where(source, path)}: {shown(raw)} is not 'all', a count or a list", subject=source)
    if isinstance(raw, int):
        if raw < 1:
            raise ConfigError(f"{_where(source, path)}: device count must be ≥ 1, got {raw}", subject=source)
        return DeviceSelector(all=False, count=raw)
    if isinstance(raw, list) and raw:
        refs: dict[str, None] = {}
        for i, item in enumerate(_list_of(raw, source, path)):
            if isinstance(item, bool) or not isinstance(item, int | str) or item == "":
                raise ConfigError(
                    f"{_where(source, f'{path}[{i}]')}: {shown(item)} is not a GPU index, GPU UUID or MIG UUID",
                    subject=source,
                )
            ref = str(item)
            if ref in refs:
                raise ConfigError(f"{_where(source, path)}: device {plain(ref)} is listed twice", subject=source)
            refs[ref] = None
        return DeviceSelector(all=False, refs=tuple(refs))
    raise ConfigError(f"{_where(source, path)}: {shown(raw)} is not 'all', a count or a non-empty list", subject=source)


def _parse_replicated(raw: Any, source: str, path: str, strategy: str) -> Sharing:
    m = _mapping(raw, source, path, _REPLICATED_KEYS)
    entries_raw = _list_of(m.get("resources") or [], source, path + ".resources")
    entries: list[ReplicatedResource] = []
    for i, er in enumerate(entries_raw):
        epath = f"{path}.resources[{i}]"
        e = _mapping(er, source, epath, _RESOURCE_KEYS)
        name = e.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{_where(source, epath)}: 'name' is required (e.g. nvidia.com/gpu)", subject=source)
        name = _resource_name(name, source, epath + ".name")
        if not name.startswith(RESOURCE_PREFIX) or not (
            name == RESOURCE_PREFIX + "gpu" or name.startswith(RESOURCE_PREFIX + "mig-")
        ):
            raise ConfigError(
                f"{_where(source, epath)} ({name}): only nvidia.com/gpu and nvidia.com/mig-<profile> can be shared",
                subject=source,
            )
        if strategy == "mps" and name != RESOURCE_PREFIX + "gpu":
            raise ConfigError(
                f"{_where(source, epath)} ({name}): MPS shares whole GPUs only (nvidia.com/gpu); "
                "MIG devices cannot be shared with MPS",
                subject=source,
            )
        replicas = e.get("replicas")
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 2:
            raise ConfigError(
                f"{_where(source, epath)} ({name}): replicas must be an integer ≥ 2, got {shown(replicas)}",
                subject=source,
            )
        if replicas > MAX_REPLICAS:
            raise ConfigError(
                f"{_where(source, epath)} ({name}): replicas {replicas} is more than the {MAX_REPLICAS} accepted",
                subject=source,
            )
        rename = e.get("rename")
        if rename is not None and (not isinstance(rename, str) or not rename):
            raise ConfigError(f"{_where(source, epath)} ({name}): rename must be a non-empty string", subject=source)
        entries.append(
            ReplicatedResource(
                name=name,
                replicas=replicas,
                rename=_resource_name(rename, source, epath + ".rename") if rename else None,
                devices=_parse_devices(e.get("devices"), source, epath + ".devices"),
                position=i,
            )
        )
    _check_overlaps(entries, source, path)
    return Sharing(
        strategy=strategy,
        rename_by_default=_bool(m.get("renameByDefault"), False, source, path + ".renameByDefault"),
        # MPS: one replica per container unless the file says otherwise (NVIDIA's plugin defaults it so)
        fail_requests_greater_than_one=_bool(
            m.get("failRequestsGreaterThanOne"), strategy == "mps", source, path + ".failRequestsGreaterThanOne"
        ),
        resources=tuple(entries),
    )


def _check_overlaps(entries: list[ReplicatedResource], source: str, path: str) -> None:
    """Entries for the same resource may not claim the same device (deeper checks need the Inventory).

    Linear in the number of references: each reference remembers the first entry that named it."""
    whole: dict[str, ReplicatedResource] = {}  # resource → an entry with all/counted devices
    listed: dict[str, ReplicatedResource] = {}  # resource → any entry seen so far
    claimed: dict[tuple[str, str], ReplicatedResource] = {}
    for b in entries:
        a = whole.get(b.name)
        clash = "all/counted devices" if a is not None else None
        if a is None and (b.devices.all or b.devices.count) and b.name in listed:
            a, clash = listed[b.name], "all/counted devices"
        if a is None:
            for r in b.devices.refs:
                if (b.name, r) in claimed:
                    a, clash = claimed[(b.name, r)], f"device {plain(r)}"
                    break
        if a is not None:
            raise ConfigError(
                f"{_where(source, f'{path}.resources[{b.position}]')} ({b.name}): {clash} already shared by "
                f"{path}.resources[{a.position}]",
                subject=source,
            )
        listed.setdefault(b.name, b)
        if b.devices.all or b.devices.count:
            whole[b.name] = b
        for r in b.devices.refs:
            claimed[(b.name, r)] = b


def _parse_patterns(raw: Any, source: str, path: str) -> tuple[ResourcePattern, ...]:
    if raw is None:
        return ()
    out: list[ResourcePattern] = []
    for i, item in enumerate(_list_of(raw, source, path)):
        m = _mapping(item, source, f"{path}[{i}]", _PATTERN_KEYS)
        pattern, name = m.get("pattern"), m.get("name")
        if not isinstance(pattern, str) or not isinstance(name, str) or not pattern or not name:
            raise ConfigError(f"{_where(source, f'{path}[{i}]')}: 'pattern' and 'name' are required", subject=source)
        out.append(ResourcePattern(pattern=pattern, name=_resource_name(name, source, f"{path}[{i}].name")))
    return tuple(out)


def _check_imex(raw: Any, source: str) -> ImexConfig:
    """``imex``, as NVIDIA's plugin reads it (``api/config/v1/imex.go``): ``channelIDs`` a list of integers that is
    ``[]`` or ``[0]`` (``AssertChannelIDsValid``), ``required`` a boolean. Every container the plugin allocates
    for gets these channels (``deviceplugin.allocate``)."""
    m = _mapping(raw, source, "imex", _IMEX_KEYS)
    ids = m.get("channelIDs")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ConfigError(f"{_where(source, 'imex.channelIDs')} must be a list of channel numbers, got {shown(ids)}",
                              subject=source)
        if ids not in ([], [0]):
            raise ConfigError(f"{_where(source, 'imex.channelIDs')} must be [] or [0] (the one IMEX channel NVIDIA's "
                              f"plugin injects), got {shown(ids)}", subject=source)
    return ImexConfig(channel_ids=tuple(ids or ()), required=_bool(m.get("required"), False, source, "imex.required"))


def plugin_config_from_dict(
    data: Any, *, source: str = "<config>", allocation_policy: str = "distributed"
) -> PluginConfig:
    """Validate an already-decoded config document."""
    if data is None:
        raise ConfigError(f"{source}: the device-plugin config is empty (it needs at least 'version: v1')",
                          subject=source)
    top = _mapping(data, source, "<top level>", _TOP_KEYS)
    version = top.get("version")
    if version != "v1":
        raise ConfigError(f"{_where(source, 'version')}: must be v1, got {shown(version)}", subject=source)
    sharing_raw = _mapping(top.get("sharing"), source, "sharing", _SHARING_KEYS)
    ts = sharing_raw.get("timeSlicing")
    mps = sharing_raw.get("mps")
    sharing = Sharing()
    ts_parsed = _parse_replicated(ts, source, "sharing.timeSlicing", "time-slicing") if ts is not None else None
    mps_parsed = _parse_replicated(mps, source, "sharing.mps", "mps") if mps is not None else None
    if ts_parsed and ts_parsed.resources and mps_parsed and mps_parsed.resources:
        raise ConfigError(
            f"{_where(source, 'sharing')}: timeSlicing and mps cannot both list resources", subject=source
        )
    if ts_parsed is not None and ts_parsed.resources:
        sharing = ts_parsed
    flags = _parse_flags(top.get("flags"), source)
    if mps_parsed is not None and mps_parsed.resources:
        sharing = mps_parsed
        if flags.mig_strategy == "mixed":
            raise ConfigError(
                f"{_where(source, 'sharing.mps')}: MPS cannot be used with flags.migStrategy mixed "
                "(MPS shares whole GPUs only; NVIDIA's plugin refuses this pairing too)",
                subject=source,
            )
    imex = _check_imex(top.get("imex"), source)
    resources = _mapping(top.get("resources"), source, "resources", frozenset({"gpus", "mig"}))
    if allocation_policy not in ALLOCATION_POLICIES:
        raise ConfigError(f"allocation policy {shown(allocation_policy)} is not one of {', '.join(ALLOCATION_POLICIES)}")
    return PluginConfig(
        flags=flags,
        sharing=sharing,
        gpu_patterns=_parse_patterns(resources.get("gpus"), source, "resources.gpus"),
        mig_patterns=_parse_patterns(resources.get("mig"), source, "resources.mig"),
        allocation_policy=allocation_policy,
        source=source,
        imex=imex,
    )


def parse_plugin_config(
    text: str, *, source: str = "<config>", allocation_policy: str = "distributed"
) -> PluginConfig:
    """Parse the YAML (or JSON) text of an NVIDIA plugin config v1."""
    data = load_document(text, source)  # no aliases, bounded depth and size
    return plugin_config_from_dict(data, source=source, allocation_policy=allocation_policy)


def load_plugin_config(path: Path, *, allocation_policy: str = "distributed") -> PluginConfig:
    """Read and parse a plugin config file."""
    from nodeagent.config import require_named_file  # a FIFO or device in its place never blocks

    text = require_named_file(path, "device-plugin config", "device_plugin.config")
    return parse_plugin_config(text, source=str(path), allocation_policy=allocation_policy)
