"""The agent's state as Prometheus gauges (nodeagent.metrics.state_families): the Node conditions and the MIG
state as state sets, GPU faults with XID and recovery action, registrations and the containerd wiring."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

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
