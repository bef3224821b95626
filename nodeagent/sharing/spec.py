"""NVIDIA device-plugin config file, version v1, parsed into frozen dataclasses.

A file written for NVIDIA's plugin is accepted unchanged: every key that plugin knows is accepted
(keys that only matter to NVIDIA's own binaries are parsed and ignored); anything else is rejected
so typos never pass silently. Pure: ``parse_plugin_config`` takes text, ``load_plugin_config`` is
the one function that reads a file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

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


@dataclass(frozen=True)
class PluginFlags:
    """``flags.plugin``."""

    pass_device_specs: bool = False
    device_list_strategy: tuple[str, ...] = ("envvar",)
    device_id_strategy: str = "uuid"
    cdi_annotation_prefix: str = "cdi.k8s.io/"


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


DEFAULT_CONFIG = PluginConfig()


def _where(source: str, path: str) -> str:
    return f"{source}: {path}"


def _mapping(value: Any, source: str, path: str, allowed: frozenset[str]) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{_where(source, path)} must be a mapping, got {type(value).__name__}", subject=source)
    unknown = sorted(str(k) for k in value if k not in allowed)
    if unknown:
        raise ConfigError(
            f"{_where(source, path)}: unknown key(s) {', '.join(unknown)} (allowed: {', '.join(sorted(allowed))})",
            subject=source,
        )
    return value


def _bool(value: Any, default: bool, source: str, path: str) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"{_where(source, path)} must be true or false, got {value!r}", subject=source)
    return value


def _choice(value: Any, default: str, choices: tuple[str, ...], source: str, path: str) -> str:
    if value is None:
        return default
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(
            f"{_where(source, path)}: {value!r} is not one of {', '.join(choices)}", subject=source
        )
    return value


def _prefixed(name: str) -> str:
    return name if "/" in name else RESOURCE_PREFIX + name


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
            f"{_where(source, 'flags.plugin.cdiAnnotationPrefix')} must be a string ending in '/', got {prefix!r}",
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
        raise ConfigError(f"{_where(source, path)}: {raw!r} is not 'all', a count or a list", subject=source)
    if isinstance(raw, int):
        if raw < 1:
            raise ConfigError(f"{_where(source, path)}: device count must be ≥ 1, got {raw}", subject=source)
        return DeviceSelector(all=False, count=raw)
    if isinstance(raw, list) and raw:
        refs: list[str] = []
        for i, item in enumerate(raw):
            if isinstance(item, bool) or not isinstance(item, int | str) or item == "":
                raise ConfigError(
                    f"{_where(source, f'{path}[{i}]')}: {item!r} is not a GPU index, GPU UUID or MIG UUID",
                    subject=source,
                )
            ref = str(item)
            if ref in refs:
                raise ConfigError(f"{_where(source, path)}: device {ref} is listed twice", subject=source)
            refs.append(ref)
        return DeviceSelector(all=False, refs=tuple(refs))
    raise ConfigError(f"{_where(source, path)}: {raw!r} is not 'all', a count or a non-empty list", subject=source)


def _parse_replicated(raw: Any, source: str, path: str, strategy: str) -> Sharing:
    m = _mapping(raw, source, path, _REPLICATED_KEYS)
    entries_raw = m.get("resources") or []
    if not isinstance(entries_raw, list):
        raise ConfigError(f"{_where(source, path + '.resources')} must be a list", subject=source)
    entries: list[ReplicatedResource] = []
    for i, er in enumerate(entries_raw):
        epath = f"{path}.resources[{i}]"
        e = _mapping(er, source, epath, _RESOURCE_KEYS)
        name = e.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{_where(source, epath)}: 'name' is required (e.g. nvidia.com/gpu)", subject=source)
        name = _prefixed(name)
        if not name.startswith(RESOURCE_PREFIX) or not (
            name == RESOURCE_PREFIX + "gpu" or name.startswith(RESOURCE_PREFIX + "mig-")
        ):
            raise ConfigError(
                f"{_where(source, epath)} ({name}): only nvidia.com/gpu and nvidia.com/mig-<profile> can be shared",
                subject=source,
            )
        replicas = e.get("replicas")
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 2:
            raise ConfigError(
                f"{_where(source, epath)} ({name}): replicas must be an integer ≥ 2, got {replicas!r}",
                subject=source,
            )
        rename = e.get("rename")
        if rename is not None and (not isinstance(rename, str) or not rename):
            raise ConfigError(f"{_where(source, epath)} ({name}): rename must be a non-empty string", subject=source)
        entries.append(
            ReplicatedResource(
                name=name,
                replicas=replicas,
                rename=_prefixed(rename) if rename else None,
                devices=_parse_devices(e.get("devices"), source, epath + ".devices"),
                position=i,
            )
        )
    _check_overlaps(entries, source, path)
    return Sharing(
        strategy=strategy,
        rename_by_default=_bool(m.get("renameByDefault"), False, source, path + ".renameByDefault"),
        fail_requests_greater_than_one=_bool(
            m.get("failRequestsGreaterThanOne"), False, source, path + ".failRequestsGreaterThanOne"
        ),
        resources=tuple(entries),
    )


def _check_overlaps(entries: list[ReplicatedResource], source: str, path: str) -> None:
    """Entries for the same resource may not claim the same device (deeper checks need the Inventory)."""
    for i, a in enumerate(entries):
        for b in entries[i + 1 :]:
            if a.name != b.name:
                continue
            clash: str | None = None
            if a.devices.all or b.devices.all or a.devices.count or b.devices.count:
                clash = "all/counted devices"
            else:
                common = [r for r in a.devices.refs if r in b.devices.refs]
                clash = f"device {common[0]}" if common else None
            if clash:
                raise ConfigError(
                    f"{_where(source, f'{path}.resources[{b.position}]')} ({b.name}): {clash} already shared by "
                    f"{path}.resources[{a.position}]",
                    subject=source,
                )


def _parse_patterns(raw: Any, source: str, path: str) -> tuple[ResourcePattern, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ConfigError(f"{_where(source, path)} must be a list", subject=source)
    out: list[ResourcePattern] = []
    for i, item in enumerate(raw):
        m = _mapping(item, source, f"{path}[{i}]", _PATTERN_KEYS)
        pattern, name = m.get("pattern"), m.get("name")
        if not isinstance(pattern, str) or not isinstance(name, str) or not pattern or not name:
            raise ConfigError(f"{_where(source, f'{path}[{i}]')}: 'pattern' and 'name' are required", subject=source)
        out.append(ResourcePattern(pattern=pattern, name=_prefixed(name)))
    return tuple(out)


def plugin_config_from_dict(
    data: Any, *, source: str = "<config>", allocation_policy: str = "distributed"
) -> PluginConfig:
    """Validate an already-decoded config document."""
    if data is None:
        data = {}
    top = _mapping(data, source, "<top level>", _TOP_KEYS)
    version = top.get("version")
    if version != "v1":
        raise ConfigError(f"{_where(source, 'version')}: must be v1, got {version!r}", subject=source)
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
    if mps_parsed is not None and mps_parsed.resources:
        raise ConfigError(
            f"{_where(source, 'sharing.mps')}: MPS sharing is not supported (it needs NVIDIA's MPS control daemon, "
            "which nodeagent does not run); use sharing.timeSlicing",
            subject=source,
        )
    if ts_parsed is not None and ts_parsed.resources:
        sharing = ts_parsed
    resources = _mapping(top.get("resources"), source, "resources", frozenset({"gpus", "mig"}))
    if allocation_policy not in ALLOCATION_POLICIES:
        raise ConfigError(f"allocation policy {allocation_policy!r} is not one of {', '.join(ALLOCATION_POLICIES)}")
    return PluginConfig(
        flags=_parse_flags(top.get("flags"), source),
        sharing=sharing,
        gpu_patterns=_parse_patterns(resources.get("gpus"), source, "resources.gpus"),
        mig_patterns=_parse_patterns(resources.get("mig"), source, "resources.mig"),
        allocation_policy=allocation_policy,
        source=source,
    )


def parse_plugin_config(
    text: str, *, source: str = "<config>", allocation_policy: str = "distributed"
) -> PluginConfig:
    """Parse the YAML (or JSON) text of an NVIDIA plugin config v1."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{source}: not valid YAML{where}: {problem}", subject=source) from e
    return plugin_config_from_dict(data, source=source, allocation_policy=allocation_policy)


def load_plugin_config(path: Path, *, allocation_policy: str = "distributed") -> PluginConfig:
    """Read and parse a plugin config file."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read device-plugin config: {e.strerror}", subject=str(path)) from e
    return parse_plugin_config(text, source=str(path), allocation_policy=allocation_policy)
