"""Bounded input for the device-plugin and mig-parted config parsers: every oversized, aliased or malformed
document is one short error line (never an echo of an unbounded value, never millions of devices), and the
checks stay linear. The property tests give each example a budget (hypothesis ``deadline``) and check the
size of every error line."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from nodeagent.errors import ConfigError
from nodeagent.mig.spec import parse_config as parse_mig
from nodeagent.sharing.devices import build_resources
from nodeagent.sharing.spec import MAX_ADVERTISED_DEVICES, MAX_REPLICAS, parse_plugin_config
from tests.unit._dp_inventories import mig_box, nvswitch_box

LINE_MAX = 400
QUICK = (Phase.explicit, Phase.reuse, Phase.generate)  # no shrinking: a failure is reported as found  # no error line is longer: a path, an entry, a short quote of the value


def one_line(e: ConfigError) -> str:
    msg = str(e)
    assert "\n" not in msg and len(msg) <= LINE_MAX, msg[:1000]
    return msg


def time_slicing(replicas: object, name: str = "nvidia.com/gpu", rename: str | None = None) -> str:
    entry: dict[str, object] = {"name": name, "replicas": replicas}
    if rename is not None:
        entry["rename"] = rename
    return yaml.safe_dump({"version": "v1", "sharing": {"timeSlicing": {"resources": [entry]}}})


def test_a_million_replicas_is_refused_before_any_device_is_built() -> None:
    with pytest.raises(ConfigError) as err:
        parse_plugin_config(time_slicing(1_000_000), source="dp.yaml")
    assert f"more than the {MAX_REPLICAS} accepted" in one_line(err.value)


def test_total_advertised_devices_are_capped() -> None:
    cfg = parse_plugin_config(time_slicing(MAX_REPLICAS), source="dp.yaml")
    assert len(build_resources(nvswitch_box(8), cfg)["nvidia.com/gpu"].devices) == 8 * MAX_REPLICAS
    with pytest.raises(ConfigError) as err:
        build_resources(nvswitch_box(16), cfg)
    msg = one_line(err.value)
    assert f"advertises {16 * MAX_REPLICAS} devices" in msg and str(MAX_ADVERTISED_DEVICES) in msg


# 389 bytes that expand to ~10^9 list items once aliases are resolved
ALIAS_BOMB = "\n".join(
    ["a: &a [x, x, x, x, x, x, x, x, x]"]
    + [f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
       f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]" for i in range(8)]
)


@pytest.mark.parametrize("parse", [
    lambda t: parse_plugin_config("version: v1\nflags:\n  migStrategy: none\n" + t, source="dp.yaml"),
    lambda t: parse_mig("version: v1\nmig-configs:\n  x: [{devices: all, mig-enabled: false}]\n" + t, "mig.yaml"),
], ids=["device-plugin", "mig-parted"])
def test_yaml_aliases_are_refused_with_one_line(parse: object) -> None:
    assert callable(parse)
    with pytest.raises(ConfigError) as err:
        parse(ALIAS_BOMB)
    assert "aliases are not accepted" in one_line(err.value)
    # a single harmless alias is refused too: neither format needs them
    with pytest.raises(ConfigError, match="alias"):
        parse("z: &z 1\ny: *z\n")


@pytest.mark.parametrize("parse", [
    lambda t: parse_plugin_config(t, source="dp.yaml"), lambda t: parse_mig(t, "mig.yaml"),
], ids=["device-plugin", "mig-parted"])
def test_deep_nesting_and_huge_documents_are_one_line(parse: object) -> None:
    assert callable(parse)
    for text in ("[" * 5000 + "]" * 5000, "version: v1\nx: '" + "y" * (2 << 20) + "'\n"):
        with pytest.raises(ConfigError) as err:
            parse(text)
        one_line(err.value)


def test_a_huge_bad_value_is_not_echoed() -> None:
    huge = "v" * 100_000
    for text in (f"version: {huge}\n", time_slicing(huge), f"version: v1\nflags:\n  migStrategy: {huge}\n"):
        with pytest.raises(ConfigError) as err:
            parse_plugin_config(text, source="dp.yaml")
        one_line(err.value)
    for text in (f"version: {huge}\n", f"version: v1\nmig-configs:\n  {huge}: [{{devices: all, mig-enabled: no}}]\n",
                 f"version: v1\nmig-configs:\n  x: [{{devices: all, mig-enabled: {huge}}}]\n"):
        with pytest.raises(ConfigError) as err:
            parse_mig(text, "mig.yaml")
        one_line(err.value)


def test_many_mig_device_indices_are_checked_in_linear_time() -> None:
    """100,000 indices took 50 s (a list scan per index); now a long list is refused at once and the longest
    accepted one is checked with one set lookup per index."""
    def text(n: int) -> str:
        return f"version: v1\nmig-configs:\n  big: [{{devices: {list(range(n))}, mig-enabled: false}}]\n"

    assert len(parse_mig(text(4096), "mig.yaml").configs["big"][0].devices) == 4096
    with pytest.raises(ConfigError) as err:
        parse_mig(text(100_000), "mig.yaml")
    assert "100000 device indices, more than the 4096 accepted" in one_line(err.value)


def test_many_sharing_device_references_are_checked_in_linear_time() -> None:
    entries = [{"name": "nvidia.com/gpu", "replicas": 2, "devices": [f"ref-{i}-{j}" for j in range(4096)]}
               for i in range(2)]
    text = yaml.safe_dump({"version": "v1", "sharing": {"timeSlicing": {"resources": entries}}},
                          default_flow_style=True)
    cfg = parse_plugin_config(text, source="dp.yaml")
    with pytest.raises(ConfigError, match="device ref-0-0 does not exist"):
        build_resources(nvswitch_box(8), cfg)


@pytest.mark.parametrize("name", ["nvidia.com/gpü ☃", "Not A Valid/../../name", "gpu shared", "kubernetes.io/gpu",
                                  "nvidia.com/" + "x" * 64, "nvidia.com/-gpu"])
def test_invalid_resource_names_are_refused(name: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_plugin_config(time_slicing(2, rename=name), source="dp.yaml")
    assert "not a valid extended resource name" in one_line(err.value) or "kubernetes.io" in str(err.value)
    doc = {"version": "v1", "resources": {"gpus": [{"pattern": "*", "name": name}]}}
    with pytest.raises(ConfigError):
        parse_plugin_config(yaml.safe_dump(doc), source="dp.yaml")


def test_valid_resource_names_are_kept() -> None:
    cfg = parse_plugin_config(time_slicing(2, rename="example.com/gpu.shared_1"), source="dp.yaml")
    assert list(build_resources(nvswitch_box(2), cfg)) == ["example.com/gpu.shared_1"]


def test_a_rename_onto_another_resource_is_refused() -> None:
    """Renaming the shared MIG devices to the name the whole GPUs already carry would merge two resources."""
    inv = mig_box(gpus_off=1)
    cfg = parse_plugin_config(
        "version: v1\nflags: {migStrategy: mixed}\n"
        "sharing: {timeSlicing: {resources: [{name: nvidia.com/mig-1g.10gb, replicas: 2, rename: nvidia.com/gpu}]}}\n",
        source="dp.yaml",
    )
    assert any(not g.mig_current for g in inv.gpus)
    with pytest.raises(ConfigError) as err:
        build_resources(inv, cfg)
    assert "rename nvidia.com/gpu is the name of another resource" in one_line(err.value)


_leaf = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.text(max_size=30),
                  st.floats(allow_nan=True), st.just("all"), st.just("nvidia.com/gpu"), st.just("1g.10gb"))
_tree = st.recursive(_leaf, lambda kids: st.one_of(st.lists(kids, max_size=6),
                                                   st.dictionaries(st.text(max_size=12) | st.sampled_from(
                                                       ["version", "flags", "sharing", "timeSlicing", "resources",
                                                        "name", "replicas", "rename", "devices", "mig-configs",
                                                        "mig-enabled", "mig-devices", "device-filter"]),
                                                       kids, max_size=6)), max_leaves=40)


@settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.too_slow], phases=QUICK)
@given(_tree, st.booleans())
def test_fuzzed_plugin_documents_give_a_config_or_one_line(doc: object, wrap: bool) -> None:
    if wrap:
        doc = {"version": "v1", "sharing": {"timeSlicing": {"resources": [doc]}}}
    text = yaml.safe_dump(doc)
    try:
        cfg = parse_plugin_config(text, source="dp.yaml")
    except ConfigError as e:
        one_line(e)
        return
    try:
        resources = build_resources(nvswitch_box(8), cfg)
    except ConfigError as e:
        one_line(e)
        return
    assert sum(len(r.devices) for r in resources.values()) <= MAX_ADVERTISED_DEVICES


@settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.too_slow], phases=QUICK)
@given(_tree, st.booleans())
def test_fuzzed_mig_documents_give_a_config_or_one_line(doc: object, wrap: bool) -> None:
    if wrap:
        doc = {"version": "v1", "mig-configs": {"c": [doc]}}
    text = yaml.safe_dump(doc)
    try:
        parsed = parse_mig(text, "mig.yaml")
    except ConfigError as e:
        one_line(e)
        return
    from nodeagent.mig.spec import resolve

    for name, entries in parsed.configs.items():
        try:
            resolve(name, entries, mig_box())
        except ConfigError as e:
            one_line(e)


@settings(max_examples=100, deadline=2000, suppress_health_check=[HealthCheck.too_slow], phases=QUICK)
@given(st.binary(max_size=400))
def test_fuzzed_bytes_give_a_config_or_one_line(raw: bytes) -> None:
    text = raw.decode("utf-8", errors="replace")
    for parse in (lambda: parse_plugin_config(text, source="dp.yaml"), lambda: parse_mig(text, "mig.yaml")):
        try:
            parse()
        except ConfigError as e:
            one_line(e)



_cfg_leaf = st.one_of(st.booleans(), st.integers(-10**15, 10**15), st.floats(allow_nan=True, allow_infinity=True),
                      st.text(max_size=40), st.sampled_from(["/etc/x.toml", "../../x", "drop-in", "dra", "both",
                                                              "127.0.0.1:9400", "signal", "json", ""]))
_cfg_value = st.one_of(_cfg_leaf, st.lists(_cfg_leaf, max_size=5))
_cfg_keys = st.sampled_from(["enabled", "dir", "config", "plane", "gpus", "interval", "address", "mode",
                             "dropin", "restart", "check_interval", "window", "poll_interval", "machine",
                             "state", "driver_root", "verify_interval", "labels", "cdi"]) | st.text(max_size=10)
_cfg_doc = st.dictionaries(
    st.sampled_from(["kubelet", "device_plugin", "dra", "mig", "runtime", "publish", "metrics", "health", "cdi",
                     "simulate", "node_name", "kube", "resync_interval", "log_format"]) | st.text(max_size=8),
    st.one_of(_cfg_value, st.dictionaries(_cfg_keys, _cfg_value, max_size=6)), max_size=8)


@settings(max_examples=200, deadline=2000, suppress_health_check=[HealthCheck.too_slow], phases=QUICK)
@given(_cfg_doc)
def test_fuzzed_agent_configs_give_a_config_or_one_line(doc: dict[str, object]) -> None:
    import math

    import tomlkit

    from nodeagent.config import AgentConfig, parse_config

    try:
        text = tomlkit.dumps(doc)
    except Exception:  # a document TOML cannot spell (e.g. a bare key after a table): not an input
        return
    try:
        cfg = parse_config(text, "config.toml")
    except ConfigError as e:
        one_line(e)
        return
    assert isinstance(cfg, AgentConfig)
    for number in (cfg.resync_interval, cfg.metrics.interval, cfg.health.window, cfg.health.poll_interval,
                   cfg.runtime.check_interval):
        assert math.isfinite(number)  # NaN/inf never pass validation


@settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.too_slow], phases=QUICK)
@given(st.text(max_size=400) | st.builds(lambda n: "a = " + "[" * n + "]" * n, st.integers(0, 5000)))
def test_fuzzed_agent_config_text_gives_a_config_or_one_line(text: str) -> None:
    from nodeagent.config import parse_config

    try:
        parse_config(text, "config.toml")
    except ConfigError as e:
        one_line(e)


def test_keys_and_references_with_line_breaks_stay_on_one_line() -> None:
    """Found by the fuzz test: an unknown key holding a line break was echoed raw, splitting the error."""
    doc = {"version": "v1", "sharing": {"timeSlicing": {"resources": [{"name": "gpu", "replicas": 2, "x\ny": 1}]}}}
    with pytest.raises(ConfigError) as err:
        parse_plugin_config(yaml.safe_dump(doc), source="dp.yaml")
    assert "'x\\ny'" in one_line(err.value)
    doc = {"version": "v1", "sharing": {"timeSlicing": {"resources": [
        {"name": "gpu", "replicas": 2, "devices": ["0\n1"]}]}}}
    with pytest.raises(ConfigError) as err:
        build_resources(nvswitch_box(2), parse_plugin_config(yaml.safe_dump(doc), source="dp.yaml"))
    one_line(err.value)
    with pytest.raises(ConfigError) as err:
        parse_mig(yaml.safe_dump({"version": "v1", "mig-configs": {"a\nb": [{"devices": "all", "mig-enabled": False}]}}),
                  "mig.yaml")
    assert "is not a label value" in one_line(err.value)
