"""mig-parted v1 config rules (REFERENCE §3), resolution against a node, generated and exported configs."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nodeagent.errors import ConfigError
from nodeagent.gpu.inventory import Gpu, Inventory, MigDevice
from nodeagent.gpu.profiles import PRODUCTS, gpu_instance_id
from nodeagent.mig.layout import fits
from nodeagent.mig.planner import plan
from nodeagent.mig.spec import (
    dump,
    export_config,
    generate_standard,
    load_config,
    normalize_profile,
    parse_config,
    resolve,
    to_document,
)

# mig-parted's own example file shape, unchanged.
MIG_PARTED_EXAMPLE = textwrap.dedent("""\
    version: v1
    mig-configs:
      all-disabled:
        - devices: all
          mig-enabled: false

      all-enabled:
        - devices: all
          mig-enabled: true
          mig-devices: {}

      all-1g.5gb:
        - device-filter: ["0x20B010DE", "0x20B110DE", "0x20F110DE", "0x20F610DE"]
          devices: all
          mig-enabled: true
          mig-devices:
            "1g.5gb": 7

      all-balanced:
        - device-filter: ["0x20B010DE", "0x20B110DE", "0x20F110DE", "0x20F610DE"]
          devices: all
          mig-enabled: true
          mig-devices:
            "1g.5gb": 2
            "2g.10gb": 1
            "3g.20gb": 1
        - device-filter: "0x20B710DE"
          devices: all
          mig-enabled: true
          mig-devices:
            "1g.6gb": 2
            "2g.12gb": 1

      custom-config:
        - devices: [0, 1, 2, 3]
          mig-enabled: false
        - devices: [4]
          mig-enabled: true
          mig-devices:
            "1g.5gb": 7
        - devices: [5, 6, 7]
          mig-enabled: true
          mig-devices:
            "3c.3g.20gb": 2
""")


def make_gpu(key: str, index: int, layout: tuple[tuple[str, int], ...] = ()) -> Gpu:
    prod = PRODUCTS[key]
    devs = []
    for name, start in layout:
        p = prod.profile(name)
        assert p is not None
        gi = gpu_instance_id(prod, start, p.placement_size)
        devs.append(MigDevice(index, gi, 0, name, start, p.placement_size, p.memory_mib, f"MIG-{index}-{gi}"))
    return Gpu(index=index, uuid=f"GPU-{index}", name=f"NVIDIA {key}", pci_bus_id=f"0000:{index:02x}:00.0",
               pci_device_id=prod.pci_device_ids[0], memory_mib=prod.profiles[-1].memory_mib, numa_node=0,
               compute_major=8, compute_minor=0, minor_number=index, architecture="ampere", mig_capable=True,
               mig_current=bool(layout), mig_pending=bool(layout), mig_profiles=prod.profiles,
               mig_devices=tuple(devs))


def plain_gpu(index: int) -> Gpu:
    return Gpu(index=index, uuid=f"GPU-{index}", name="NVIDIA L4", pci_bus_id=f"0000:{index:02x}:00.0",
               pci_device_id=0x27B810DE, memory_mib=23034, numa_node=0, compute_major=8, compute_minor=9,
               minor_number=index, architecture="ada")


def dgx40() -> Inventory:
    return Inventory("550.54.15", 12040, tuple(make_gpu("A100-40GB", i) for i in range(8)))


def test_mig_parted_example_accepted_unchanged() -> None:
    cfg = parse_config(MIG_PARTED_EXAMPLE, "config.yaml")
    assert cfg.names == ("all-disabled", "all-enabled", "all-1g.5gb", "all-balanced", "custom-config")
    bal = cfg.configs["all-balanced"]
    assert bal[0].device_filter == (0x20B010DE, 0x20B110DE, 0x20F110DE, 0x20F610DE)
    assert bal[1].device_filter == (0x20B710DE,)
    assert bal[0].counts == {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}
    assert cfg.configs["all-enabled"][0].counts == {}
    assert cfg.configs["custom-config"][2].counts == {"3g.20gb": 2}
    sel = resolve("custom-config", cfg.configs["custom-config"], dgx40())
    assert sorted(sel.desired) == list(range(8))
    assert sel.desired[5].count_map == {"3g.20gb": 2} and not sel.desired[0].enabled
    # the document round-trips through our own dump
    assert parse_config(dump(cfg)).configs == cfg.configs


BAD: list[tuple[str, Any, str]] = [
    ("not a mapping", [1], "expected a mapping"),
    ("no version", {"mig-configs": {"a": [{"devices": "all", "mig-enabled": False}]}}, "missing required key 'version'"),
    ("version v2", {"version": "v2", "mig-configs": {}}, "unsupported version 'v2'"),
    ("unknown top key", {"version": "v1", "mig-configs": {}, "extra": 1}, "unknown top-level key 'extra'"),
    ("no configs", {"version": "v1"}, "missing required key 'mig-configs'"),
    ("empty configs", {"version": "v1", "mig-configs": {}}, "non-empty mapping"),
    ("empty entries", {"version": "v1", "mig-configs": {"c": []}}, "config c: must be a non-empty list"),
]


def _one(entry: Any) -> dict[str, Any]:
    return {"version": "v1", "mig-configs": {"first": [{"devices": "all", "mig-enabled": False}], "cfg": [entry]}}


BAD_ENTRY: list[tuple[Any, str]] = [
    ("all", "must be a mapping"),
    ({"mig-enabled": True}, "missing required key 'devices'"),
    ({"devices": "all"}, "missing required key 'mig-enabled'"),
    ({"devices": "all", "mig-enabled": True, "mig-device": {}}, "unknown key 'mig-device'"),
    ({"devices": "some", "mig-enabled": True}, "'devices' must be \"all\" or a non-empty list"),
    ({"devices": [], "mig-enabled": True}, "non-empty list"),
    ({"devices": [0, -1], "mig-enabled": True}, "device index -1 is not a non-negative integer"),
    ({"devices": [0, "1"], "mig-enabled": True}, "device index '1'"),
    ({"devices": [True], "mig-enabled": True}, "device index True"),
    ({"devices": [2, 2], "mig-enabled": True}, "device index 2 listed twice"),
    ({"devices": "all", "mig-enabled": "yes"}, "'mig-enabled' must be true or false"),
    ({"devices": "all", "mig-enabled": True, "device-filter": "20B010DE"}, "not a PCI device id"),
    ({"devices": "all", "mig-enabled": True, "device-filter": []}, "non-empty list"),
    ({"devices": "all", "mig-enabled": True, "device-filter": [0x20B010DE]}, "not a PCI device id"),
    ({"devices": "all", "mig-enabled": False, "mig-devices": {"1g.5gb": 1}}, "listed with mig-enabled: false"),
    ({"devices": "all", "mig-enabled": True, "mig-devices": {"1g.5gb": -1}}, "must be an integer ≥ 0"),
    ({"devices": "all", "mig-enabled": True, "mig-devices": {"1g.5gb": "2"}}, "must be an integer ≥ 0"),
    ({"devices": "all", "mig-enabled": True, "mig-devices": {"1g.5gb": 0}}, "every count in 'mig-devices' is 0"),
    ({"devices": "all", "mig-enabled": True, "mig-devices": {"big": 1}}, "expected a name like"),
    ({"devices": "all", "mig-enabled": True, "mig-devices": {"1c.3g.20gb": 1}}, "sub-profiles are not supported"),
    ({"devices": "all", "mig-enabled": True, "mig-devices": {"3g.20gb": 1, "3c.3g.20gb": 1}}, "listed twice"),
    ({"devices": "all", "mig-enabled": True, "mig-devices": [1]}, "must be a mapping of profile"),
]


@pytest.mark.parametrize(("what", "doc", "msg"), BAD)
def test_invalid_files(what: str, doc: Any, msg: str) -> None:
    with pytest.raises(ConfigError, match="^f.yaml: .*" + _re(msg)):
        load_config(doc, "f.yaml")


def _re(s: str) -> str:
    import re

    return re.escape(s)


@pytest.mark.parametrize(("entry", "msg"), BAD_ENTRY)
def test_invalid_entries_name_config_and_entry(entry: Any, msg: str) -> None:
    with pytest.raises(ConfigError, match=r"^f.yaml: config cfg entry 0: .*" + _re(msg)):
        load_config(_one(entry), "f.yaml")


def test_valid_edge_forms() -> None:
    ok = [
        {"devices": "all", "mig-enabled": True, "mig-devices": {}},
        {"devices": "all", "mig-enabled": True, "mig-devices": None},
        {"devices": "all", "mig-enabled": False, "mig-devices": {}},
        {"devices": [0], "mig-enabled": True, "device-filter": "0x20b010de", "mig-devices": {"1g.5gb": 0, "2g.10gb": 1}},
        {"devices": "all", "mig-enabled": True, "mig-devices": {"1g.10gb+me": 1, "1g.24gb+me.all": 1, "1g.12gb-me": 1}},
    ]
    for e in ok:
        load_config(_one(e), "f.yaml")
    assert load_config(_one(ok[3])).configs["cfg"][0].mig_devices == (("2g.10gb", 1),)


def test_yaml_errors_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"^x.yaml: not valid YAML at line 3, column 1"):
        parse_config("version: v1\nmig-configs: [\n", "x.yaml")


def test_select() -> None:
    cfg = parse_config(MIG_PARTED_EXAMPLE, "c.yaml")
    with pytest.raises(ConfigError, match=r"no config named 'nope' \(known: all-disabled, "):
        cfg.select("nope")
    with pytest.raises(ConfigError, match="holds 5 configs"):
        cfg.select(None)
    single = load_config({"version": "v1", "mig-configs": {"only": [{"devices": "all", "mig-enabled": False}]}})
    assert single.select(None)[0] == "only"


def test_resolution_rules() -> None:
    inv = Inventory("550", 12040, (make_gpu("A100-40GB", 0), make_gpu("A30-24GB", 1), plain_gpu(2)))
    cfg = parse_config(MIG_PARTED_EXAMPLE)
    sel = resolve("all-balanced", cfg.configs["all-balanced"], inv)
    assert sel.desired[0].count_map == {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}
    assert sel.desired[1].count_map == {"1g.6gb": 2, "2g.12gb": 1}
    assert sel.skipped == (2,)
    assert sel.desired[1].origin == "config all-balanced entry 1"
    # all-disabled on a node with a non-MIG GPU: that GPU is left alone
    assert sorted(resolve("all-disabled", cfg.configs["all-disabled"], inv).desired) == [0, 1]
    # all-1g.5gb only matches the A100 through its filter
    assert sorted(resolve("all-1g.5gb", cfg.configs["all-1g.5gb"], inv).desired) == [0]

    def entries(*raw: dict[str, Any]) -> Any:
        return load_config({"version": "v1", "mig-configs": {"x": list(raw)}}).configs["x"]

    with pytest.raises(ConfigError, match=r"^c.yaml: config x entry 0: GPU index 5 does not exist on this node \(GPUs: 0, 1, 2\)"):
        resolve("x", entries({"devices": [5], "mig-enabled": False}), inv, "c.yaml")
    with pytest.raises(ConfigError, match=r"config x entry 0: GPU 2 \(NVIDIA L4\) does not support MIG"):
        resolve("x", entries({"devices": [2], "mig-enabled": True}), inv)
    with pytest.raises(ConfigError, match=r"config x entry 1: GPU 0 is already selected by entry 0"):
        resolve("x", entries({"devices": [0], "mig-enabled": False}, {"devices": "all", "mig-enabled": False}), inv)
    with pytest.raises(ConfigError, match=r"config x entry 0: GPU 1 \(NVIDIA A30-24GB\) has no MIG profile '1g.5gb'"):
        resolve("x", entries({"devices": [1], "mig-enabled": True, "mig-devices": {"1g.5gb": 1}}), inv)
    # a listed GPU outside the filter is left alone
    sel = resolve("x", entries({"devices": [0, 1], "device-filter": "0x20B710DE", "mig-enabled": False}), inv)
    assert sorted(sel.desired) == [1]


def test_generated_standard_configs() -> None:
    keys = ["A100-40GB", "A100-80GB", "H100-80GB", "H200-141GB", "A30-24GB"]
    inv = Inventory("550", 12040, (*(make_gpu(k, i) for i, k in enumerate(keys)), plain_gpu(len(keys))))
    cfg = generate_standard(inv)
    for name in ("all-disabled", "all-enabled", "all-balanced", "all-1g.5gb", "all-1g.5gb.me", "all-7g.80gb",
                 "all-4g.24gb", "all-1g.18gb"):
        assert name in cfg.configs, name
    # every generated config resolves and plans on the node it was made for
    for name, entries in cfg.configs.items():
        plan(inv, resolve(name, entries, inv))
    bal = resolve("all-balanced", cfg.configs["all-balanced"], inv).desired
    assert bal[0].count_map == {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}
    assert bal[2].count_map == {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}
    assert bal[4].count_map == {"1g.6gb": 2, "2g.12gb": 1}
    assert resolve("all-1g.10gb", cfg.configs["all-1g.10gb"], inv).desired[1].count_map == {"1g.10gb": 7}
    assert resolve("all-1g.10gb", cfg.configs["all-1g.10gb"], inv).desired[0].count_map == {"1g.10gb": 4}
    # the generated file is itself a valid mig-parted file
    assert parse_config(dump(cfg)).configs == cfg.configs


def test_export_current_layout() -> None:
    inv = Inventory("550", 12040, (
        make_gpu("A100-40GB", 0, (("3g.20gb", 4), ("1g.5gb", 0))),
        make_gpu("A100-40GB", 1, (("1g.5gb", 0), ("3g.20gb", 4))),
        make_gpu("A100-40GB", 2),
        plain_gpu(3),
    ))
    doc = to_document(export_config(inv, "now"))
    assert doc == {"version": "v1", "mig-configs": {"now": [
        {"devices": [0, 1], "mig-enabled": True, "mig-devices": {"1g.5gb": 1, "3g.20gb": 1}},
        {"devices": [2], "mig-enabled": False},
    ]}}
    cfg = parse_config(yaml.safe_dump(doc))
    assert plan(inv, resolve("now", cfg.configs["now"], inv)).applied


def test_normalize_profile() -> None:
    assert normalize_profile("7c.7g.80gb") == "7g.80gb"
    assert normalize_profile("1g.10gb+me") == "1g.10gb+me"
    assert normalize_profile("2c.3g.20gb") is None


# ---- fuzzing: arbitrary YAML-shaped input never escapes as anything but ConfigError ---------------

scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 9), st.sampled_from(
    ["all", "v1", "1g.5gb", "0x20B010DE", "3c.3g.20gb", "", "devices", "mig-enabled"]))
docs = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4),
    st.dictionaries(st.sampled_from(["version", "mig-configs", "devices", "mig-enabled", "mig-devices",
                                     "device-filter", "c", "1g.5gb", "x"]), inner, max_size=5)), max_leaves=20)

entry_st = st.fixed_dictionaries(
    {"devices": st.one_of(st.just("all"), st.lists(st.integers(0, 7), min_size=1, max_size=3, unique=True)),
     "mig-enabled": st.booleans()},
    optional={"device-filter": st.sampled_from(["0x20B010DE", ["0x20B010DE", "0x20B710DE"]]),
              "mig-devices": st.dictionaries(st.sampled_from(["1g.5gb", "2g.10gb", "3g.20gb", "7g.40gb", "1g.10gb"]),
                                             st.integers(0, 4), max_size=3)})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=docs)
def test_fuzz_arbitrary_documents(doc: Any) -> None:
    try:
        load_config(doc, "fuzz.yaml")
    except ConfigError as e:
        assert str(e).startswith("fuzz.yaml: ") and "\n" not in str(e)


@settings(max_examples=150, deadline=None)
@given(entries=st.lists(entry_st, min_size=1, max_size=3))
def test_fuzz_entries_resolve_and_plan(entries: list[dict[str, Any]]) -> None:
    """Structured entries: either a clean ConfigError naming the entry, or a plan that fits the table."""
    doc = {"version": "v1", "mig-configs": {"f": entries}}
    inv = dgx40()
    try:
        cfg = load_config(doc, "f.yaml")
        sel = resolve("f", cfg.configs["f"], inv, "f.yaml")
        pl = plan(inv, sel)
    except ConfigError as e:
        assert "entry " in str(e) and "\n" not in str(e)
        return
    for g in pl.gpus:
        want = g.desired.count_map
        if g.desired.enabled:
            assert fits(inv.gpu(g.index), want)
            got: dict[str, int] = {}
            for name in [d.profile for d in g.keep] + [s.profile for s in g.create]:
                got[name] = got.get(name, 0) + 1
            assert got == want


# ---- fuzzing every rule: valid documents are accepted and round-trip; one broken rule is named exactly ----

PROFILES_A100 = ["1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "3c.3g.20gb", "4g.20gb", "7g.40gb"]
config_names = st.from_regex(r"[a-z][a-z0-9.-]{0,14}", fullmatch=True)


@st.composite
def valid_entry(draw: st.DrawFn) -> dict[str, Any]:
    enabled = draw(st.booleans())
    e: dict[str, Any] = {
        "devices": draw(st.one_of(st.just("all"), st.lists(st.integers(0, 15), min_size=1, max_size=4, unique=True))),
        "mig-enabled": enabled,
    }
    if draw(st.booleans()):
        ids = st.integers(0, 2**32 - 1).map(lambda n: f"0x{n:08X}" if n % 2 else f"0x{n:08x}")
        e["device-filter"] = draw(st.one_of(ids, st.lists(ids, min_size=1, max_size=3)))
    if enabled and draw(st.booleans()):
        names = draw(st.lists(st.sampled_from([p for p in PROFILES_A100 if p != "3c.3g.20gb"]), max_size=3,
                              unique=True))
        counts = [draw(st.integers(0, 7)) for _ in names]
        if names and not any(counts):
            counts[0] = 1
        e["mig-devices"] = dict(zip(names, counts, strict=True))
    elif not enabled and draw(st.booleans()):
        e["mig-devices"] = {}
    return e


# rule → (mutation of a valid entry, the message fragment it must produce)
def _set(key: str, value: Any) -> Any:
    return lambda e: {**e, key: value}


def _drop(key: str) -> Any:
    return lambda e: {k: v for k, v in e.items() if k != key}


MUTATIONS: list[tuple[str, Any, str]] = [
    ("no devices", _drop("devices"), "missing required key 'devices'"),
    ("no mig-enabled", _drop("mig-enabled"), "missing required key 'mig-enabled'"),
    ("unknown key", _set("migDevices", {}), "unknown key 'migDevices'"),
    ("devices word", _set("devices", "none"), "'devices' must be \"all\" or a non-empty list"),
    ("devices empty", _set("devices", []), "'devices' must be \"all\" or a non-empty list"),
    ("devices negative", _set("devices", [0, -2]), "device index -2 is not a non-negative integer"),
    ("devices text", _set("devices", ["0"]), "device index '0' is not a non-negative integer"),
    ("devices twice", _set("devices", [3, 3]), "device index 3 listed twice"),
    ("enabled text", _set("mig-enabled", "true"), "'mig-enabled' must be true or false"),
    ("enabled int", _set("mig-enabled", 1), "'mig-enabled' must be true or false"),
    ("filter short", _set("device-filter", "0x20B0"), "device-filter value '0x20B0' is not a PCI device id"),
    ("filter int", _set("device-filter", [0x20B010DE]), "is not a PCI device id"),
    ("filter empty", _set("device-filter", []), "'device-filter' must be a PCI id string or a non-empty list"),
    ("devices while off", lambda e: {**e, "mig-enabled": False, "mig-devices": {"1g.5gb": 1}},
     "'mig-devices' listed with mig-enabled: false"),
    ("count negative", lambda e: {**e, "mig-enabled": True, "mig-devices": {"2g.10gb": -1}},
     "count for '2g.10gb' must be an integer ≥ 0"),
    ("count text", lambda e: {**e, "mig-enabled": True, "mig-devices": {"2g.10gb": "1"}},
     "count for '2g.10gb' must be an integer ≥ 0"),
    ("all zero", lambda e: {**e, "mig-enabled": True, "mig-devices": {"1g.5gb": 0, "7g.40gb": 0}},
     "every count in 'mig-devices' is 0"),
    ("bad profile", lambda e: {**e, "mig-enabled": True, "mig-devices": {"1g5gb": 1}}, "expected a name like"),
    ("sub-profile", lambda e: {**e, "mig-enabled": True, "mig-devices": {"1c.2g.10gb": 1}},
     "compute-instance sub-profiles are not supported"),
    ("profile twice", lambda e: {**e, "mig-enabled": True, "mig-devices": {"3g.20gb": 1, "3c.3g.20gb": 1}},
     "MIG profile '3g.20gb' listed twice"),
    ("not a mapping", lambda e: ["devices", "all"], "must be a mapping with 'devices' and 'mig-enabled'"),
]


@settings(max_examples=120, deadline=None)
@given(configs=st.dictionaries(config_names, st.lists(valid_entry(), min_size=1, max_size=3), min_size=1, max_size=3))
def test_fuzz_valid_documents_accepted_and_round_trip(configs: dict[str, list[dict[str, Any]]]) -> None:
    doc = {"version": "v1", "mig-configs": configs}
    cfg = parse_config(yaml.safe_dump(doc, sort_keys=False), "f.yaml")  # through YAML, as a file is read
    assert cfg.names == tuple(configs)
    for name, entries in configs.items():
        for raw, entry in zip(entries, cfg.configs[name], strict=True):
            assert entry.devices == (raw["devices"] if raw["devices"] == "all" else tuple(raw["devices"]))
            assert entry.mig_enabled is raw["mig-enabled"]
            assert entry.counts == {normalize_profile(p): n for p, n in (raw.get("mig-devices") or {}).items() if n}
            if "device-filter" in raw:
                f = raw["device-filter"]
                assert entry.device_filter == tuple(int(x, 16) for x in ([f] if isinstance(f, str) else f))
    assert parse_config(dump(cfg), "again.yaml").configs == cfg.configs


@settings(max_examples=200, deadline=None)
@given(name=config_names, entries=st.lists(valid_entry(), min_size=1, max_size=4), data=st.data())
def test_fuzz_each_broken_rule_is_named_with_config_and_entry(
    name: str, entries: list[dict[str, Any]], data: st.DataObject
) -> None:
    pos = data.draw(st.integers(0, len(entries) - 1), label="position")
    rule, mutate, fragment = data.draw(st.sampled_from(MUTATIONS), label="rule")
    broken = list(entries)
    broken[pos] = mutate(entries[pos])
    doc = {"version": "v1", "mig-configs": {name: broken}}
    with pytest.raises(ConfigError) as e:
        load_config(doc, "f.yaml")
    msg = str(e.value)
    assert msg.startswith(f"f.yaml: config {name} entry {pos}: "), (rule, msg)
    assert fragment in msg, (rule, msg)
    assert "\n" not in msg


@settings(max_examples=60, deadline=None)
@given(entries=st.lists(valid_entry(), min_size=1, max_size=2),
       top=st.sampled_from([
           ({"version": "v2"}, "unsupported version 'v2' (only v1)"),
           ({"version": 1}, "unsupported version 1 (only v1)"),
           ({"extra": True}, "unknown top-level key 'extra'"),
       ]))
def test_fuzz_top_level_rules(entries: list[dict[str, Any]], top: tuple[dict[str, Any], str]) -> None:
    change, fragment = top
    doc = {"version": "v1", "mig-configs": {"c": entries}, **change}
    with pytest.raises(ConfigError, match="^f.yaml: " + _re(fragment)):
        load_config(doc, "f.yaml")
