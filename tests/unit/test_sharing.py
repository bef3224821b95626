"""NVIDIA plugin config v1 parsing and the Inventory → resources mapping."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeagent.errors import ConfigError
from nodeagent.sharing.devices import build_resources, mig_resource_suffix, resource_ids
from nodeagent.sharing.spec import load_plugin_config, parse_plugin_config
from tests.unit._dp_inventories import mig_box, nvswitch_box


def cfg(text: str) -> object:
    return parse_plugin_config(textwrap.dedent(text), source="test.yaml")


NVIDIA_EXAMPLE = """
version: v1
flags:
  migStrategy: "none"
  failOnInitError: true
  nvidiaDriverRoot: "/"
  gdsEnabled: false
  mofedEnabled: false
  plugin:
    passDeviceSpecs: false
    deviceListStrategy: envvar
    deviceIDStrategy: uuid
    cdiAnnotationPrefix: cdi.k8s.io/
    nvidiaCTKPath: /usr/bin/nvidia-ctk
    containerDriverRoot: /driver-root
  gfd:
    oneshot: false
    noTimestamp: false
    outputFile: /etc/kubernetes/node-feature-discovery/features.d/gfd
    sleepInterval: 60s
sharing:
  timeSlicing:
    renameByDefault: false
    failRequestsGreaterThanOne: false
    resources:
    - name: nvidia.com/gpu
      replicas: 10
"""


def test_nvidia_example_config_accepted_unchanged() -> None:
    c = parse_plugin_config(NVIDIA_EXAMPLE)
    assert c.flags.mig_strategy == "none"
    assert c.flags.plugin.device_list_strategy == ("envvar",)
    assert c.sharing.strategy == "time-slicing"
    assert c.sharing.resources[0].replicas == 10
    res = build_resources(nvswitch_box(2), c)
    assert list(res) == ["nvidia.com/gpu"]
    ids = [d.id for d in res["nvidia.com/gpu"].devices]
    assert len(ids) == 20 and ids[0].endswith("::0") and ids[9].endswith("::9")


def test_defaults_and_list_strategy() -> None:
    c = parse_plugin_config("version: v1\nflags:\n  plugin:\n    deviceListStrategy: [envvar, cdi-cri, envvar]\n")
    assert c.flags.plugin.device_list_strategy == ("envvar", "cdi-cri")
    assert c.flags.plugin.device_id_strategy == "uuid"
    assert c.flags.fail_on_init_error is True
    assert c.sharing.strategy == "none"


def test_load_from_file(tmp_path: Path) -> None:
    p = tmp_path / "dp.yaml"
    p.write_text(NVIDIA_EXAMPLE)
    assert load_plugin_config(p).source == str(p)
    with pytest.raises(ConfigError, match="not found"):
        load_plugin_config(tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("version: v2\n", "version: must be v1"),
        ("flags: {}\n", "version: must be v1"),
        ("version: v1\nflagz: {}\n", "unknown key.*flagz"),
        ("version: v1\nflags:\n  migStrategy: double\n", "flags.migStrategy.*double"),
        ("version: v1\nflags:\n  plugin:\n    deviceIDStrategy: serial\n", "deviceIDStrategy"),
        ("version: v1\nflags:\n  plugin:\n    deviceListStrategy: [envvar, smoke]\n", r"deviceListStrategy\[1\]"),
        ("version: v1\nflags:\n  plugin:\n    passDeviceSpec: true\n", "unknown key.*passDeviceSpec"),
        ("version: v1\nflags:\n  failOnInitError: yes-please\n", "failOnInitError"),
        (
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 1\n",
            r"timeSlicing.resources\[0\] \(nvidia.com/gpu\): replicas must be an integer ≥ 2",
        ),
        (
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n      colour: red\n",
            r"resources\[0\]: unknown key.*colour",
        ),
        (
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n      devices: [0]\n"
            "    - name: nvidia.com/gpu\n      replicas: 4\n      devices: [1, 0]\n",
            r"resources\[1\] \(nvidia.com/gpu\): device 0 already shared by sharing.timeSlicing.resources\[0\]",
        ),
        (
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: example.com/fpga\n      replicas: 2\n",
            "only nvidia.com/gpu",
        ),
        ("version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n", "replicas must be"),
        ("version: [v1\n", r"^test.yaml: not valid YAML at line 2, column 1: expected ',' or ']', but got '<stream end>'$"),
        ("- v1\n", "must be a mapping"),
    ],
)
def test_invalid_configs_name_the_entry(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_plugin_config(text, source="test.yaml")


def test_unknown_device_named() -> None:
    c = parse_plugin_config(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n"
        "      devices: [0, GPU-nope]\n",
        source="dp.yaml",
    )
    with pytest.raises(ConfigError, match=r"dp.yaml: sharing.timeSlicing.resources\[0\] \(nvidia.com/gpu\): device GPU-nope does not exist"):
        build_resources(nvswitch_box(2), c)


def test_same_gpu_by_index_and_uuid_in_two_entries() -> None:
    inv = nvswitch_box(2)
    c = parse_plugin_config(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
        f"    - name: nvidia.com/gpu\n      replicas: 2\n      devices: [0]\n"
        f"    - name: nvidia.com/gpu\n      replicas: 3\n      devices: ['{inv.gpus[0].uuid}']\n"
    )
    with pytest.raises(ConfigError, match=r"resources\[1\].*already shared"):
        build_resources(inv, c)


def test_per_gpu_replicas_devices_and_rename_honoured() -> None:
    inv = nvswitch_box(4)
    c = parse_plugin_config(
        """
version: v1
sharing:
  timeSlicing:
    renameByDefault: true
    failRequestsGreaterThanOne: true
    resources:
    - name: nvidia.com/gpu
      replicas: 4
      devices: [0, 1]
    - name: nvidia.com/gpu
      replicas: 2
      devices: [2]
      rename: gpu-small
"""
    )
    res = build_resources(inv, c)
    assert set(res) == {"nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/gpu-small"}
    assert [d.physical.gpu_index for d in res["nvidia.com/gpu"].devices] == [3]
    assert res["nvidia.com/gpu"].sharing == "none"
    shared = res["nvidia.com/gpu.shared"]
    assert [d.id for d in shared.devices][:4] == [f"{inv.gpus[0].uuid}::{n}" for n in range(4)]
    assert len(shared.devices) == 8 and shared.fail_requests_greater_than_one
    assert [d.id.split("::")[1] for d in res["nvidia.com/gpu-small"].devices] == ["0", "1"]
    assert res["nvidia.com/gpu-small"].sharing == "time-slicing"


def test_devices_count_and_index_ids() -> None:
    c = parse_plugin_config(
        "version: v1\nflags:\n  plugin:\n    deviceIDStrategy: index\nsharing:\n  timeSlicing:\n    resources:\n"
        "    - name: nvidia.com/gpu\n      replicas: 2\n      devices: 1\n"
    )
    ids = resource_ids(build_resources(nvswitch_box(2), c))
    assert ids == {"nvidia.com/gpu": ["0::0", "0::1", "1"]}


def test_device_count_larger_than_node() -> None:
    c = parse_plugin_config(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n      devices: 9\n"
    )
    with pytest.raises(ConfigError, match="devices: 9 but only 2"):
        build_resources(nvswitch_box(2), c)


def test_mig_strategies() -> None:
    inv = mig_box("1g.10gb", per_gpu=7, gpus_on=2, gpus_off=1)
    none = resource_ids(build_resources(inv, parse_plugin_config("version: v1\n")))
    assert list(none) == ["nvidia.com/gpu"] and len(none["nvidia.com/gpu"]) == 3
    mixed = build_resources(inv, parse_plugin_config("version: v1\nflags:\n  migStrategy: mixed\n"))
    assert set(mixed) == {"nvidia.com/gpu", "nvidia.com/mig-1g.10gb"}
    assert len(mixed["nvidia.com/mig-1g.10gb"].devices) == 14
    assert mixed["nvidia.com/mig-1g.10gb"].devices[0].id.startswith("MIG-")
    # MIG devices carry their parent's NUMA node
    assert {d.numa_node for d in mixed["nvidia.com/mig-1g.10gb"].devices} == {0, 1}
    assert mixed["nvidia.com/gpu"].devices[0].numa_node is None
    # single with one plain GPU left is refused
    with pytest.raises(ConfigError, match=r"migStrategy single: GPU.*2 have MIG disabled"):
        build_resources(inv, parse_plugin_config("version: v1\nflags:\n  migStrategy: single\n"))
    single = resource_ids(
        build_resources(mig_box(per_gpu=7, gpus_on=2), parse_plugin_config("version: v1\nflags:\n  migStrategy: single\n"))
    )
    assert list(single) == ["nvidia.com/gpu"] and len(single["nvidia.com/gpu"]) == 14


def test_mixed_mig_profiles_refused_under_single() -> None:
    from nodeagent.gpu.inventory import Inventory
    from tests.unit._dp_inventories import gpu, mig_device

    inv = Inventory("550", 12040, gpus=(gpu(0, mig=(mig_device(0, 1, "1g.10gb"), mig_device(0, 2, "2g.20gb"))),))
    with pytest.raises(ConfigError, match=r"one profile, found 1g.10gb, 2g.20gb"):
        build_resources(inv, parse_plugin_config("version: v1\nflags:\n  migStrategy: single\n"))


def test_mig_index_ids_and_mig_time_slicing() -> None:
    inv = mig_box("1g.10gb+me", per_gpu=1, gpus_on=2)
    c = parse_plugin_config(
        "version: v1\nflags:\n  migStrategy: mixed\n  plugin:\n    deviceIDStrategy: index\n"
        "sharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/mig-1g.10gb.me\n      replicas: 3\n      devices: [1]\n"
    )
    ids = resource_ids(build_resources(inv, c))
    assert ids == {"nvidia.com/mig-1g.10gb.me": ["0:0", "1:0::0", "1:0::1", "1:0::2"]}
    assert mig_resource_suffix("1g.5gb+me") == "mig-1g.5gb.me"


def test_sharing_absent_resource_is_fine_unless_devices_named() -> None:
    ok = parse_plugin_config(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/mig-1g.10gb\n      replicas: 2\n"
    )
    assert list(build_resources(nvswitch_box(1), ok)) == ["nvidia.com/gpu"]
    bad = parse_plugin_config(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/mig-1g.10gb\n      replicas: 2\n      devices: [0]\n"
    )
    with pytest.raises(ConfigError, match=r"has no nvidia.com/mig-1g.10gb devices"):
        build_resources(nvswitch_box(1), bad)


def test_resource_patterns_rename_products() -> None:
    c = parse_plugin_config("version: v1\nresources:\n  gpus:\n  - pattern: '*H100*'\n    name: h100\n")
    assert list(build_resources(nvswitch_box(1), c)) == ["nvidia.com/h100"]


def test_withdrawn_gpus_are_not_advertised() -> None:
    res = build_resources(nvswitch_box(4), parse_plugin_config("version: v1\n"), withdrawn={1, 2})
    assert [d.physical.gpu_index for d in res["nvidia.com/gpu"].devices] == [0, 3]


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 20), st.text(max_size=8), st.lists(st.integers(0, 3), max_size=3))


@settings(max_examples=60, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["version", "flags", "sharing", "resources", "bogus"]),
        st.one_of(_scalars, st.dictionaries(st.sampled_from(["migStrategy", "timeSlicing", "plugin", "x"]), _scalars, max_size=3)),
        max_size=4,
    )
)
def test_fuzzed_documents_only_raise_config_error(doc: dict[str, object]) -> None:
    from nodeagent.sharing.spec import plugin_config_from_dict

    try:
        c = plugin_config_from_dict(doc)
    except ConfigError:
        return
    build_resources(nvswitch_box(2), c)
