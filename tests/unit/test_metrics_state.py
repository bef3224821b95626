"""The agent's state as Prometheus gauges (nodeagent.metrics.state_families): the Node conditions and the MIG
state as state sets, GPU faults with XID and recovery action, registrations and the containerd wiring."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from nodeagent.gpu.inventory import Gpu, Inventory, MigDevice
from nodeagent.kube.conditions import ConditionSnapshot, GpuFault, GpuHealthInput, MigInput, RuntimeInput
from nodeagent.metrics import Metrics

Sample = tuple[str, tuple[tuple[str, str], ...], float]


def samples(m: Metrics, prefix: str) -> set[Sample]:
    text = generate_latest(m.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name.startswith(prefix)
    }


def test_nothing_known_yet() -> None:
    m = Metrics("node-1")
    conditions = samples(m, "nodeagent_node_condition")
    # every condition shows its three statuses, Unknown current
    assert len(conditions) == 4 * 3
    assert (
        "nodeagent_node_condition",
        (("condition", "nodeagent.io/GPUReady"), ("status", "unknown")),
        1.0,
    ) in conditions
    assert not samples(m, "nodeagent_mig_config_state")
    assert not samples(m, "nodeagent_gpu_fault")
    assert not samples(m, "nodeagent_device_plugin_registered")
    assert not samples(m, "nodeagent_containerd_wired")


def test_a_sick_node() -> None:
    m = Metrics("node-1")
    health = GpuHealthInput(
        4, (GpuFault(2, "GPU-2", xid=48, recovery="GPU reset"), GpuFault(3, "GPU-3", gi_id=1))
    )
    m.update_state(
        ConditionSnapshot(
            health, MigInput(state="failed", config="all-1g.6gb"), RuntimeInput(containerd_wired=False)
        ),
        {"nvidia.com/gpu": True, "nvidia.com/mig-1g.6gb": False},
    )
    assert (
        "nodeagent_node_condition",
        (("condition", "nodeagent.io/GPUReady"), ("status", "false")),
        1.0,
    ) in samples(m, "nodeagent_node_condition")
    assert samples(m, "nodeagent_mig_config_state") == {
        (
            "nodeagent_mig_config_state",
            (("config", "all-1g.6gb"), ("state", s)),
            1.0 if s == "failed" else 0.0,
        )
        for s in ("pending", "rebooting", "success", "failed")
    }
    assert samples(m, "nodeagent_gpu_fault") == {
        (
            "nodeagent_gpu_fault",
            (
                ("GPU_I_ID", ""),
                ("UUID", "GPU-2"),
                ("gpu", "2"),
                ("lost", "false"),
                ("recovery_action", "GPU reset"),
                ("xid", "48"),
            ),
            1.0,
        ),
        (
            "nodeagent_gpu_fault",
            (
                ("GPU_I_ID", "1"),
                ("UUID", "GPU-3"),
                ("gpu", "3"),
                ("lost", "false"),
                ("recovery_action", ""),
                ("xid", ""),
            ),
            1.0,
        ),
    }
    assert samples(m, "nodeagent_device_plugin_registered") == {
        ("nodeagent_device_plugin_registered", (("resource", "nvidia.com/gpu"),), 1.0),
        ("nodeagent_device_plugin_registered", (("resource", "nvidia.com/mig-1g.6gb"),), 0.0),
    }
    assert samples(m, "nodeagent_containerd_wired") == {("nodeagent_containerd_wired", (), 0.0)}
    # back to health: the fault series go, the MIG state moves, wired
    m.update_state(
        ConditionSnapshot(
            GpuHealthInput(4),
            MigInput(state="success", config="all-1g.6gb"),
            RuntimeInput(containerd_wired=True),
        ),
        {"nvidia.com/gpu": True},
    )
    assert not samples(m, "nodeagent_gpu_fault")
    assert ("nodeagent_mig_config_state", (("config", "all-1g.6gb"), ("state", "success")), 1.0) in samples(
        m, "nodeagent_mig_config_state"
    )
    assert samples(m, "nodeagent_containerd_wired") == {("nodeagent_containerd_wired", (), 1.0)}


def test_switched_off_parts_show_no_series() -> None:
    m = Metrics("node-1")
    m.update_state(
        ConditionSnapshot(
            mig=MigInput(enabled=False, state="failed", config="x"),
            runtime=RuntimeInput(check_enabled=False, containerd_wired=False),
        ),
        {},
    )
    assert not samples(m, "nodeagent_mig_config_state")
    assert not samples(m, "nodeagent_containerd_wired")


def _gpu(
    index: int, *, capable: bool, current: bool = False, pending: bool = False, profiles: tuple[str, ...] = ()
) -> Gpu:
    devices = tuple(
        MigDevice(index, gi, 0, p, gi, 1, 5952, f"MIG-{index}-{gi}") for gi, p in enumerate(profiles)
    )
    return Gpu(
        index,
        f"GPU-{index}",
        "NVIDIA A30",
        f"00000000:0{index}:00.0",
        0x20B710DE,
        24576,
        0,
        8,
        0,
        index,
        "ampere",
        mig_capable=capable,
        mig_current=current,
        mig_pending=pending,
        mig_devices=devices,
    )


def test_mig_mode_and_devices_per_gpu() -> None:
    m = Metrics("node-1")
    inv = Inventory(
        "550.54.15",
        12040,
        (
            _gpu(0, capable=True, current=True, pending=True, profiles=("1g.6gb", "1g.6gb", "2g.12gb")),
            _gpu(1, capable=True, current=False, pending=True),  # enabling waits for a GPU reset
            _gpu(2, capable=False),  # no MIG: no series
        ),
    )
    m.update_gpus(inv, {})
    assert samples(m, "nodeagent_gpu_mig_enabled") == {
        ("nodeagent_gpu_mig_enabled", (("UUID", "GPU-0"), ("gpu", "0"), ("pending", "false")), 1.0),
        ("nodeagent_gpu_mig_enabled", (("UUID", "GPU-1"), ("gpu", "1"), ("pending", "true")), 0.0),
    }
    assert samples(m, "nodeagent_mig_devices") == {
        ("nodeagent_mig_devices", (("GPU_I_PROFILE", "1g.6gb"), ("UUID", "GPU-0"), ("gpu", "0")), 2.0),
        ("nodeagent_mig_devices", (("GPU_I_PROFILE", "2g.12gb"), ("UUID", "GPU-0"), ("gpu", "0")), 1.0),
    }


def test_allocate_counts() -> None:
    m = Metrics("node-1")
    m.update_state(
        ConditionSnapshot(), {}, {("nvidia.com/gpu", "answered"): 4, ("nvidia.com/gpu", "refused"): 1}
    )
    assert samples(m, "nodeagent_allocate_requests_total") == {
        ("nodeagent_allocate_requests_total", (("resource", "nvidia.com/gpu"), ("result", "answered")), 4.0),
        ("nodeagent_allocate_requests_total", (("resource", "nvidia.com/gpu"), ("result", "refused")), 1.0),
    }
