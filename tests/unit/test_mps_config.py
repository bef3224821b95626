"""``sharing.mps``: accepted as NVIDIA's plugin reads it, refused where NVIDIA's plugin refuses (one line each)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from nodeagent.errors import ConfigError
from nodeagent.sharing.devices import build_resources, mps_max_clients
from nodeagent.sharing.spec import parse_plugin_config
from tests.unit._dp_inventories import gpu, mig_box, nvswitch_box

README_EXAMPLE = "version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 10\n"


def test_nvidia_readme_example_served_with_one_replica_per_container() -> None:
    c = parse_plugin_config(README_EXAMPLE, source="dp.yaml")
    assert c.sharing.strategy == "mps"
    assert c.sharing.fail_requests_greater_than_one  # NVIDIA's default for MPS when the key is absent
    res = build_resources(nvswitch_box(2), c)
    r = res["nvidia.com/gpu"]
    assert r.sharing == "mps" and r.fail_requests_greater_than_one
    assert len(r.devices) == 20
    assert {d.replica for d in r.devices} == set(range(10))


def test_explicit_fail_requests_false_is_honoured_and_rename_by_default() -> None:
    c = parse_plugin_config(
        "version: v1\nsharing:\n  mps:\n    renameByDefault: true\n    failRequestsGreaterThanOne: false\n"
        "    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n      devices: [1]\n",
        source="dp.yaml",
    )
    res = build_resources(nvswitch_box(2), c)
    assert sorted(res) == ["nvidia.com/gpu", "nvidia.com/gpu.shared"]
    shared = res["nvidia.com/gpu.shared"]
    assert not shared.fail_requests_greater_than_one and len(shared.devices) == 4
    assert res["nvidia.com/gpu"].sharing == "none"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (
            "version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/mig-1g.10gb\n      replicas: 2\n",
            r"^dp.yaml: sharing.mps.resources\[0\] \(nvidia.com/mig-1g.10gb\): MPS shares whole GPUs only",
        ),
        (
            "version: v1\nflags:\n  migStrategy: mixed\nsharing:\n  mps:\n    resources:\n"
            "    - name: nvidia.com/gpu\n      replicas: 2\n",
            r"^dp.yaml: sharing.mps: MPS cannot be used with flags.migStrategy mixed",
        ),
        (
            "version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 1\n",
            r"^dp.yaml: sharing.mps.resources\[0\] \(nvidia.com/gpu\): replicas must be an integer ≥ 2, got 1$",
        ),
        (
            "version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n"
            "  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n",
            r"^dp.yaml: sharing: timeSlicing and mps cannot both list resources$",
        ),
        (
            "version: v1\nsharing:\n  mps:\n    failRequestsGreaterThanOne: 'no'\n    resources:\n"
            "    - name: nvidia.com/gpu\n      replicas: 2\n",
            r"^dp.yaml: sharing.mps.failRequestsGreaterThanOne must be true or false",
        ),
    ],
)
def test_refusals_are_one_line_naming_the_entry(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as e:
        parse_plugin_config(text, source="dp.yaml")
    assert "\n" not in str(e.value)


def test_mig_devices_refused_under_single_strategy() -> None:
    c = parse_plugin_config(
        "version: v1\nflags:\n  migStrategy: single\nsharing:\n  mps:\n    resources:\n"
        "    - name: nvidia.com/gpu\n      replicas: 2\n",
        source="dp.yaml",
    )
    with pytest.raises(ConfigError, match=r"^dp.yaml: sharing.mps.resources\[0\] \(nvidia.com/gpu\): device .* is a "
                       r"MIG device; MPS shares whole GPUs only"):
        build_resources(mig_box(gpus_on=1), c)


def test_replicas_beyond_the_mps_client_limit_refused() -> None:
    volta = dataclasses.replace(gpu(0), compute_major=7, compute_minor=0, name="Tesla V100-SXM2-16GB")
    assert mps_max_clients(volta) == 16 and mps_max_clients(gpu(1)) == 48
    inv = dataclasses.replace(nvswitch_box(1), gpus=(volta,), links=())
    text = "version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: {}\n"
    assert len(build_resources(inv, parse_plugin_config(text.format(16)))["nvidia.com/gpu"].devices) == 16
    with pytest.raises(ConfigError, match=r"replicas 17 is more than the 16 clients one MPS server accepts on GPU 0"):
        build_resources(inv, parse_plugin_config(text.format(17), source="dp.yaml"))
    with pytest.raises(ConfigError, match=r"replicas 49 is more than the 48 clients"):
        build_resources(nvswitch_box(1), parse_plugin_config(text.format(49), source="dp.yaml"))


def test_the_start_check_judges_only_the_gpus_an_entry_selects() -> None:
    from nodeagent.sharing.devices import check_mps_replicas

    volta = dataclasses.replace(gpu(0), compute_major=7, compute_minor=0, name="Tesla V100-SXM2-16GB")
    box = nvswitch_box(2)
    inv = dataclasses.replace(box, gpus=(volta, box.gpus[1]), links=())
    text = ("version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 20\n"
            "      devices: [{}]\n")
    check_mps_replicas(inv, parse_plugin_config(text.format(1), source="dp.yaml"))  # the Hopper GPU: 48
    with pytest.raises(ConfigError, match=r"replicas 20 is more than the 16 clients one MPS server accepts on GPU 0 "
                       r"\(Tesla V100-SXM2-16GB, compute capability 7.0\)$"):
        check_mps_replicas(inv, parse_plugin_config(text.format(0), source="dp.yaml"))
    check_mps_replicas(inv, parse_plugin_config(text.format(7), source="dp.yaml"))  # no GPU 7: left to the plugin


def test_gfd_labels_for_mps() -> None:
    from nodeagent.kube.labels import desired_labels, sharing_facts

    labels = desired_labels(nvswitch_box(2), sharing_facts(parse_plugin_config(README_EXAMPLE)))
    assert labels["nvidia.com/mps.capable"] == "true"
    assert labels["nvidia.com/gpu.sharing-strategy"] == "mps"
    assert labels["nvidia.com/gpu.replicas"] == "10"
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3-SHARED"


def test_mps_metrics_show_daemon_state_and_limits() -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.registry import Collector

    from nodeagent.gpu.mps import MpsDaemonState
    from nodeagent.metrics import mps_families

    state = MpsDaemonState("nvidia.com/gpu", ("GPU-a", "GPU-b"), pid=7, ready=True, restarts=2,
                           thread_percentage=25, pinned_limits=((0, "5757M"), (1, "5757M")))

    class One(Collector):
        def collect(self):  # type: ignore[no-untyped-def]
            return iter(mps_families([state]))

    reg = CollectorRegistry()
    reg.register(One())
    text = generate_latest(reg).decode()
    assert 'nodeagent_mps_daemon_ready{resource="nvidia.com/gpu"} 1.0' in text
    assert 'nodeagent_mps_daemon_restarts_total{resource="nvidia.com/gpu"} 2.0' in text
    assert 'nodeagent_mps_active_thread_percentage{resource="nvidia.com/gpu"} 25.0' in text
    assert 'nodeagent_mps_pinned_memory_limit_bytes{UUID="GPU-b",resource="nvidia.com/gpu"} 6.036652032e+09' in text
    assert 5757 << 20 == 6036652032


def test_a_share_of_a_shared_gpu_gives_its_mps_daemon_the_consumed_limits() -> None:
    """A claim with an MPS config on shares of shared GPUs: what each share consumed becomes its GPU's pinned
    memory limit, the smallest compute share the active thread percentage; the claim's own settings win."""
    from nodeagent.dra.devices import DraDevice, Share, with_share
    from nodeagent.dra.mps import MpsClaimConfig, daemon_spec, with_consumed_capacity

    def dev(i: int, share: Share | None) -> DraDevice:
        return with_share(DraDevice(f"gpu-{i}", "gpu", i, i, f"GPU-{i}", shared=share is not None), share)

    gib = 1 << 30
    devices = [dev(0, Share("a", 30 * gib, 40)), dev(1, None), dev(2, Share("b", 12 * gib, 25))]
    derived = with_consumed_capacity(MpsClaimConfig(), devices)
    assert derived == MpsClaimConfig(25, None, {"0": 30 * 1024, "2": 12 * 1024})
    spec = daemon_spec("uid-1", devices, derived, "claim uid-1", lambda p: Path("/r" + p))
    assert spec.thread_percentage == 25
    assert spec.pinned_limits == ((0, "30720M"), (2, "12288M"))  # the whole GPU 1 has no limit
    # the config's own values win: a default limit for every device, a per-device one, a thread percentage
    assert with_consumed_capacity(MpsClaimConfig(50, 8192, {}), devices) == MpsClaimConfig(50, 8192, {})
    assert with_consumed_capacity(MpsClaimConfig(None, None, {"GPU-0": 1024}), devices) == \
        MpsClaimConfig(25, None, {"GPU-0": 1024, "2": 12 * 1024})
    # devices taken whole: nothing added
    assert with_consumed_capacity(MpsClaimConfig(), [dev(1, None)]) == MpsClaimConfig()
