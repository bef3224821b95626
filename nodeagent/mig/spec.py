"""mig-parted ``version: v1`` config files: parse, validate, resolve against an Inventory, generate, export.

Pure: no I/O. Callers read the file and hand the text (or the loaded YAML document) in. Every error is a
``ConfigError`` whose one line names the config file, the config and the entry that is wrong.

File shape (mig-parted v1)::

    version: v1
    mig-configs:
      <name>:
        - devices: all | [0, 1, ...]          # required
          mig-enabled: true | false           # required
          device-filter: "0x20B010DE" | [..]  # optional: PCI device ids the entry applies to
          mig-devices: {"1g.10gb": 2, ...}    # optional; only with mig-enabled: true
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from nodeagent.boundedyaml import load_document, plain, shown
from nodeagent.errors import ConfigError
from nodeagent.gpu.inventory import Gpu, Inventory
from nodeagent.mig.layout import fits

ENTRY_KEYS = frozenset({"devices", "mig-enabled", "device-filter", "mig-devices"})
REQUIRED_ENTRY_KEYS = ("devices", "mig-enabled")
TOP_KEYS = frozenset({"version", "mig-configs"})
MAX_LIST_ITEMS = 4096  # entries, device indices or filter ids in one list
MAX_DEVICE_INDEX = 1 << 16
MAX_CONFIG_NAME = 63  # the name is the value of the nvidia.com/mig.config label

# "1g.10gb", "1g.10gb+me", "1g.24gb+me.all", "1g.12gb-me", and mig-parted's "<c>c.<g>g.<m>gb" form.
_PROFILE_RE = re.compile(r"^(?:(\d+)c\.)?(\d+)g\.(\d+)gb((?:[+-][a-z]+(?:\.[a-z]+)*)*)$")
_PCI_ID_RE = re.compile(r"^0x[0-9a-fA-F]{8}$")


@dataclass(frozen=True)
class MigEntry:
    """One entry of a named config: which GPUs, MIG on or off, and the MIG devices wanted on each."""

    position: int  # 0-based index in the config's list (messages print it as given)
    devices: Literal["all"] | tuple[int, ...]
    mig_enabled: bool
    device_filter: tuple[int, ...] | None = None  # PCI device ids (0x20B010DE form as ints)
    mig_devices: tuple[tuple[str, int], ...] = ()  # profile → count, in file order, zero counts dropped

    @property
    def counts(self) -> dict[str, int]:
        return dict(self.mig_devices)

    def matches_filter(self, gpu: Gpu) -> bool:
        return self.device_filter is None or gpu.pci_device_id in self.device_filter


@dataclass(frozen=True)
class MigConfigFile:
    """A whole parsed file: config name → entries."""

    configs: Mapping[str, tuple[MigEntry, ...]]
    source: str = "<config>"

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.configs)

    def select(self, name: str | None) -> tuple[str, tuple[MigEntry, ...]]:
        """The entries of config ``name``; ``None`` is allowed when the file holds exactly one config."""
        if name is None:
            if len(self.configs) == 1:
                only = next(iter(self.configs))
                return only, self.configs[only]
            raise ConfigError(
                f"{self.source}: holds {len(self.configs)} configs ({name_list(self.names)}); choose one with -c",
                subject=self.source,
            )
        if name not in self.configs:
            raise ConfigError(
                f"{self.source}: no config named {shown(name)} (known: {name_list(self.names)})", subject=name
            )
        return name, self.configs[name]


@dataclass(frozen=True)
class Desired:
    """What one GPU should look like after applying a config."""

    enabled: bool
    counts: tuple[tuple[str, int], ...] = ()  # profile → count (> 0)
    origin: str = ""  # "config all-balanced entry 0" for messages

    @property
    def count_map(self) -> dict[str, int]:
        return dict(self.counts)


@dataclass(frozen=True)
class Selection:
    """A config resolved against a node: GPU index → desired state, plus GPUs the config leaves alone."""

    config: str
    desired: Mapping[int, Desired]
    skipped: tuple[int, ...] = field(default=())


# --------------------------------------------------------------------------------------------------
# Parsing and validation


MAX_LISTED = 12  # names listed in a message before "and N more"


def name_list(items: tuple[str, ...] | list[str]) -> str:
    """Names for a message: the first ``MAX_LISTED``, each quoted in bounded space, then how many more (a file
    may name 20,000 configs; an error line lists a few)."""
    if not items:
        return "none"
    more = len(items) - MAX_LISTED
    return ", ".join(plain(n) for n in items[:MAX_LISTED]) + (f" and {more} more" if more > 0 else "")


def parse_config(text: str, source: str = "<config>") -> MigConfigFile:
    """Parse and validate a mig-parted v1 YAML document."""
    doc = load_document(text, source)  # no aliases, bounded depth and size
    return load_config(doc, source)


def load_config(doc: Any, source: str = "<config>") -> MigConfigFile:
    """Validate an already loaded document (dicts, lists, scalars)."""
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: expected a mapping with 'version' and 'mig-configs'", subject=source)
    unknown = sorted(str(k) for k in doc if k not in TOP_KEYS)
    if unknown:
        raise ConfigError(f"{source}: unknown top-level key {shown(unknown[0])}", subject=source)
    if "version" not in doc:
        raise ConfigError(f"{source}: missing required key 'version' (must be v1)", subject=source)
    if doc["version"] != "v1":
        raise ConfigError(f"{source}: unsupported version {shown(doc['version'])} (only v1)", subject=source)
    if "mig-configs" not in doc:
        raise ConfigError(f"{source}: missing required key 'mig-configs'", subject=source)
    raw = doc["mig-configs"]
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{source}: 'mig-configs' must be a non-empty mapping of name → entries",
                          subject=source)
    configs: dict[str, tuple[MigEntry, ...]] = {}
    for name, entries in raw.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{source}: config name {shown(name)} is not a non-empty string", subject=source)
        if len(name) > MAX_CONFIG_NAME or not name.isprintable():
            raise ConfigError(f"{source}: config name {shown(name)} is not a label value (at most {MAX_CONFIG_NAME} "
                              "printable characters)", subject=source)
        where = f"{source}: config {name}"
        if not isinstance(entries, list) or not entries:
            raise ConfigError(f"{where}: must be a non-empty list of entries", subject=name)
        _bounded(entries, where, "entries")
        configs[name] = tuple(_entry(e, i, where) for i, e in enumerate(entries))
    return MigConfigFile(configs, source)


def _entry(raw: Any, pos: int, where: str) -> MigEntry:
    here = f"{where} entry {pos}"
    if not isinstance(raw, dict):
        raise ConfigError(f"{here}: must be a mapping with 'devices' and 'mig-enabled'", subject=here)
    for key in raw:
        if key not in ENTRY_KEYS:
            raise ConfigError(
                f"{here}: unknown key {shown(key)} (allowed: {name_list(sorted(ENTRY_KEYS))})", subject=here
            )
    for key in REQUIRED_ENTRY_KEYS:
        if key not in raw:
            raise ConfigError(f"{here}: missing required key {key!r}", subject=here)

    devices = _devices(raw["devices"], here)
    enabled = raw["mig-enabled"]
    if not isinstance(enabled, bool):
        raise ConfigError(f"{here}: 'mig-enabled' must be true or false, not {shown(enabled)}", subject=here)
    dev_filter = _device_filter(raw["device-filter"], here) if "device-filter" in raw else None

    counts: tuple[tuple[str, int], ...] = ()
    if "mig-devices" in raw:
        md = raw["mig-devices"]
        if md is None:
            md = {}
        if not isinstance(md, dict):
            raise ConfigError(f"{here}: 'mig-devices' must be a mapping of profile → count", subject=here)
        if not enabled and md:
            raise ConfigError(f"{here}: 'mig-devices' listed with mig-enabled: false", subject=here)
        counts = _mig_devices(md, here)
    return MigEntry(pos, devices, enabled, dev_filter, counts)


def _devices(raw: Any, here: str) -> Literal["all"] | tuple[int, ...]:
    if raw == "all":
        return "all"
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{here}: 'devices' must be \"all\" or a non-empty list of GPU indices", subject=here)
    _bounded(raw, here, "device indices")
    out: dict[int, None] = {}
    for d in raw:
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise ConfigError(f"{here}: device index {shown(d)} is not a non-negative integer", subject=here)
        if d >= MAX_DEVICE_INDEX:
            raise ConfigError(f"{here}: device index {shown(d)} is larger than {MAX_DEVICE_INDEX - 1}", subject=here)
        if d in out:
            raise ConfigError(f"{here}: device index {d} listed twice", subject=here)
        out[d] = None
    return tuple(out)


def _bounded(items: list[Any], here: str, what: str) -> None:
    if len(items) > MAX_LIST_ITEMS:
        raise ConfigError(f"{here}: {len(items)} {what}, more than the {MAX_LIST_ITEMS} accepted", subject=here)


def _device_filter(raw: Any, here: str) -> tuple[int, ...]:
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not items:
        raise ConfigError(f"{here}: 'device-filter' must be a PCI id string or a non-empty list of them",
                          subject=here)
    _bounded(items, here, "device-filter values")
    out: list[int] = []
    for item in items:
        if not isinstance(item, str) or not _PCI_ID_RE.match(item):
            raise ConfigError(
                f"{here}: device-filter value {shown(item)} is not a PCI device id like \"0x20B010DE\"",
                subject=here,
            )
        out.append(int(item, 16))
    return tuple(out)


def normalize_profile(name: str) -> str | None:
    """The GPU-instance profile name for a mig-devices key, or None when the key is malformed.

    ``"3c.3g.20gb"`` (full-size compute instance) is the same as ``"3g.20gb"``.
    """
    m = _PROFILE_RE.match(name)
    if not m:
        return None
    c, g, mem, suffix = m.groups()
    if c is not None and c != g:
        return None
    return f"{g}g.{mem}gb{suffix}"


def _mig_devices(raw: dict[Any, Any], here: str) -> tuple[tuple[str, int], ...]:
    out: dict[str, int] = {}
    for key, count in raw.items():
        if not isinstance(key, str):
            raise ConfigError(f"{here}: MIG profile {shown(key)} is not a string", subject=here)
        prof = normalize_profile(key)
        if prof is None:
            m = _PROFILE_RE.match(key)
            why = (
                "compute-instance sub-profiles are not supported (use the full-size form)"
                if m
                else "expected a name like \"1g.10gb\""
            )
            raise ConfigError(f"{here}: MIG profile {shown(key)}: {why}", subject=here)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ConfigError(f"{here}: count for {shown(key)} must be an integer ≥ 0, not {shown(count)}", subject=here)
        if prof in out:
            raise ConfigError(f"{here}: MIG profile {prof!r} listed twice", subject=here)
        out[prof] = count
    if out and not any(out.values()):
        raise ConfigError(f"{here}: every count in 'mig-devices' is 0", subject=here)
    return tuple((p, n) for p, n in out.items() if n > 0)


# --------------------------------------------------------------------------------------------------
# Resolution against a node


def resolve(name: str, entries: tuple[MigEntry, ...], inventory: Inventory, source: str = "") -> Selection:
    """Which GPUs each entry selects and what they should become.

    ``devices: all`` selects the MIG-capable GPUs that pass the entry's device-filter. Listed indices must
    exist on the node; a listed GPU that fails the filter is left alone (mig-parted semantics). A GPU
    without MIG is left alone by a ``mig-enabled: false`` entry and is an error for ``true``. A GPU chosen
    by two entries, or a profile the GPU does not offer, is an error that names the entry.
    """
    prefix = f"{source}: " if source else ""
    by_index = {g.index: g for g in inventory.gpus}
    desired: dict[int, Desired] = {}
    owner: dict[int, int] = {}
    for entry in entries:
        here = f"{prefix}config {name} entry {entry.position}"
        if entry.devices == "all":
            chosen = [g for g in inventory.gpus if g.mig_capable and entry.matches_filter(g)]
        else:
            missing = [i for i in entry.devices if i not in by_index][:1]
            if missing:
                have = ", ".join(str(i) for i in sorted(by_index)) or "none"
                raise ConfigError(
                    f"{here}: GPU index {missing[0]} does not exist on this node (GPUs: {have})", subject=here
                )
            chosen = [by_index[i] for i in entry.devices if entry.matches_filter(by_index[i])]
        for gpu in chosen:
            if not gpu.mig_capable:
                if entry.mig_enabled:
                    raise ConfigError(f"{here}: GPU {gpu.index} ({gpu.name}) does not support MIG", subject=here)
                continue
            if gpu.index in owner:
                raise ConfigError(
                    f"{here}: GPU {gpu.index} is already selected by entry {owner[gpu.index]}", subject=here
                )
            for prof, _ in entry.mig_devices:
                if gpu.profile(prof) is None:
                    offered = ", ".join(p.name for p in gpu.mig_profiles) or "none"
                    raise ConfigError(
                        f"{here}: GPU {gpu.index} ({gpu.name}) has no MIG profile {prof!r} (offers: {offered})",
                        subject=here,
                    )
            owner[gpu.index] = entry.position
            desired[gpu.index] = Desired(entry.mig_enabled, entry.mig_devices, here)
    skipped = tuple(g.index for g in inventory.gpus if g.index not in desired)
    return Selection(name, desired, skipped)


# --------------------------------------------------------------------------------------------------
# Standard configs generated from the node, and export of the current layout


def label_safe(profile: str) -> str:
    """Profile name usable inside a label value (``+`` is not allowed there): ``1g.10gb+me`` → ``1g.10gb.me``."""
    return profile.replace("+", ".")


def _balanced(gpu: Gpu) -> tuple[tuple[str, int], ...]:
    """2 x the smallest 1g profile, 1 x 2g, 1 x 3g — as far as the GPU's memory slices allow."""
    plain = [p for p in gpu.mig_profiles if "+" not in p.name and "-" not in p.name]
    wanted: list[tuple[str, int]] = []
    for slices, count in ((1, 2), (2, 1), (3, 1)):
        options = sorted((p for p in plain if p.slice_count == slices), key=lambda p: (p.memory_mib, p.name))
        if not options:
            continue
        trial = [*wanted, (options[0].name, count)]
        if fits(gpu, dict(trial)):
            wanted = trial
    return tuple(wanted)


def generate_standard(inventory: Inventory) -> MigConfigFile:
    """The configs nodes usually carry, built for this node's GPUs.

    ``all-disabled``, ``all-enabled`` (MIG on, no devices), ``all-balanced`` and ``all-<profile>`` (as
    many instances of the profile as fit; ``+`` written as ``.`` so the name is a valid label value).
    Model-specific entries carry a device-filter so the file stays valid on other nodes.
    """
    capable = [g for g in inventory.gpus if g.mig_capable]
    configs: dict[str, tuple[MigEntry, ...]] = {
        "all-disabled": (MigEntry(0, "all", False),),
        "all-enabled": (MigEntry(0, "all", True),),
    }
    models: dict[int, Gpu] = {}
    for g in capable:
        models.setdefault(g.pci_device_id, g)

    balanced: dict[tuple[tuple[str, int], ...], list[int]] = {}
    for pci, g in models.items():
        layout = _balanced(g)
        if layout:
            balanced.setdefault(layout, []).append(pci)
    if balanced:
        configs["all-balanced"] = tuple(
            MigEntry(i, "all", True, tuple(pcis), layout) for i, (layout, pcis) in enumerate(balanced.items())
        )

    per_profile: dict[str, dict[int, int]] = {}
    for pci, g in models.items():
        for p in g.mig_profiles:
            per_profile.setdefault(p.name, {})[pci] = p.instance_count
    for prof in sorted(per_profile, key=lambda n: (_slices_of(n), n)):
        groups: dict[int, list[int]] = {}
        for pci, count in per_profile[prof].items():
            groups.setdefault(count, []).append(pci)
        configs[f"all-{label_safe(prof)}"] = tuple(
            MigEntry(i, "all", True, tuple(pcis), ((prof, count),))
            for i, (count, pcis) in enumerate(groups.items())
        )
    return MigConfigFile(configs, "<generated>")


def _slices_of(profile: str) -> int:
    m = _PROFILE_RE.match(profile)
    return int(m.group(2)) if m else 0


def export_config(inventory: Inventory, name: str = "current") -> MigConfigFile:
    """The node's current layout as a one-config file (GPUs with the same layout share an entry)."""
    groups: dict[tuple[bool, tuple[tuple[str, int], ...]], list[int]] = {}
    for g in inventory.gpus:
        if not g.mig_capable:
            continue
        counts: dict[str, int] = {}
        for d in sorted(g.mig_devices, key=lambda d: (d.placement_start, d.profile)):
            counts[d.profile] = counts.get(d.profile, 0) + 1
        groups.setdefault((g.mig_current, tuple(counts.items())), []).append(g.index)
    entries = tuple(
        MigEntry(i, tuple(idx), enabled, None, counts) for i, ((enabled, counts), idx) in enumerate(groups.items())
    )
    if not entries:
        entries = (MigEntry(0, "all", False),)
    return MigConfigFile({name: entries}, "<export>")


def to_document(cfg: MigConfigFile) -> dict[str, Any]:
    """The YAML-ready document of a config file (the inverse of ``load_config``)."""
    out: dict[str, Any] = {}
    for name, entries in cfg.configs.items():
        items: list[dict[str, Any]] = []
        for e in entries:
            item: dict[str, Any] = {}
            if e.device_filter is not None:
                item["device-filter"] = [f"0x{p:08X}" for p in e.device_filter]
            item["devices"] = e.devices if e.devices == "all" else list(e.devices)
            item["mig-enabled"] = e.mig_enabled
            if e.mig_enabled:
                item["mig-devices"] = dict(e.mig_devices)
            items.append(item)
        out[name] = items
    return {"version": "v1", "mig-configs": out}


def dump(cfg: MigConfigFile) -> str:
    return yaml.safe_dump(to_document(cfg), sort_keys=False, default_flow_style=False)
