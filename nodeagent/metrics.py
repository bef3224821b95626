"""Prometheus exposition: dcgm-exporter's GPU metric names and labels, plus the agent's own metrics.

Everything lives in one dedicated ``CollectorRegistry`` per ``Metrics`` object (never the global one).
GPU values are pushed in with ``update_gpus`` (a snapshot swapped atomically) and rendered at scrape
time; pod/namespace/container come from the kubelet PodResources assignments. The HTTP listener
(``nodeagent.metricsserver``) is only started by ``serve`` and binds 127.0.0.1:9400 unless told otherwise.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from nodeagent.gpu.inventory import Inventory
from nodeagent.gpu.mps import MpsDaemonState
from nodeagent.kube.conditions import ConditionSnapshot, build_conditions
from nodeagent.kube.gpuobjects import gpu_of_device
from nodeagent.kube.podresources import Assignment
from nodeagent.metricsserver import MetricsServer, start_bounded_server

DEFAULT_ADDRESS = "127.0.0.1:9400"

DCGM_LABELS = (
    "gpu", "UUID", "pci_bus_id", "device", "modelName", "GPU_I_PROFILE", "GPU_I_ID", "Hostname",
    "namespace", "pod", "container",
)

# dcgm-exporter name → (help, GpuSample attribute), names and units as in dcgm-exporter's counter lists
# (etc/default-counters.csv, etc/dcp-metrics-included.csv). All are gauges here, the energy counter too:
# dcgm-exporter declares it a counter without the "_total" suffix Prometheus wants of one.
DCGM_METRICS: tuple[tuple[str, str, str], ...] = (
    ("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", "sm_clock_mhz"),
    ("DCGM_FI_DEV_MEM_CLOCK", "Memory clock frequency (in MHz).", "mem_clock_mhz"),
    ("DCGM_FI_DEV_MEMORY_TEMP", "Memory temperature (in C).", "memory_temp_c"),
    ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", "temp_c"),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", "power_w"),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "Total energy consumption since boot (in mJ).", "energy_mj"),
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", "gpu_util"),
    ("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered.", "last_xid"),
    ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", "fb_free_mib"),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", "fb_used_mib"),
    ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "Ratio of time the graphics engine is active.", "gr_engine_active"),
    ("DCGM_FI_PROF_SM_ACTIVE", "The ratio of cycles an SM has at least 1 warp assigned.", "sm_active"),
    ("DCGM_FI_PROF_SM_OCCUPANCY", "The ratio of number of warps resident on an SM.", "sm_occupancy"),
    ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "Ratio of cycles the tensor (HMMA) pipe is active.", "tensor_active"),
    ("DCGM_FI_PROF_DRAM_ACTIVE", "Ratio of cycles the device memory interface is active sending or receiving "
     "data.", "dram_active"),
    ("DCGM_FI_PROF_PIPE_FP64_ACTIVE", "Ratio of cycles the fp64 pipes are active.", "fp64_active"),
    ("DCGM_FI_PROF_PIPE_FP32_ACTIVE", "Ratio of cycles the fp32 pipes are active.", "fp32_active"),
    ("DCGM_FI_PROF_PIPE_FP16_ACTIVE", "Ratio of cycles the fp16 pipes are active.", "fp16_active"),
    ("DCGM_FI_PROF_PCIE_TX_BYTES", "The rate of data transmitted over the PCIe bus - including both protocol "
     "headers and data payloads - in bytes per second.", "pcie_tx_bytes"),
    ("DCGM_FI_PROF_PCIE_RX_BYTES", "The rate of data received over the PCIe bus - including both protocol "
     "headers and data payloads - in bytes per second.", "pcie_rx_bytes"),
)

# GPM metric (the NVML adapter's names) → (GpuSample attribute, factor): DCGM's profiling fields are ratios
# where GPM gives percentages, and bytes per second where it gives MiB/s
GPM_TO_DCGM: dict[str, tuple[str, float]] = {
    "graphics_util": ("gr_engine_active", 0.01),
    "sm_util": ("sm_active", 0.01),
    "sm_occupancy": ("sm_occupancy", 0.01),
    "any_tensor_util": ("tensor_active", 0.01),
    "dram_bw_util": ("dram_active", 0.01),
    "fp64_util": ("fp64_active", 0.01),
    "fp32_util": ("fp32_active", 0.01),
    "fp16_util": ("fp16_active", 0.01),
    "pcie_tx_mibs": ("pcie_tx_bytes", 1024.0 * 1024.0),
    "pcie_rx_mibs": ("pcie_rx_bytes", 1024.0 * 1024.0),
}


@dataclass(frozen=True)
class GpuSample:
    """One reading of one GPU (or of one GPU instance, in ``mig``); None = NVML did not give this value."""

    gpu_util: float | None = None
    fb_used_mib: float | None = None
    fb_free_mib: float | None = None
    temp_c: float | None = None
    power_w: float | None = None
    last_xid: float | None = None
    sm_clock_mhz: float | None = None
    mem_clock_mhz: float | None = None
    memory_temp_c: float | None = None
    energy_mj: float | None = None
    gr_engine_active: float | None = None
    sm_active: float | None = None
    sm_occupancy: float | None = None
    tensor_active: float | None = None
    dram_active: float | None = None
    fp64_active: float | None = None
    fp32_active: float | None = None
    fp16_active: float | None = None
    pcie_tx_bytes: float | None = None
    pcie_rx_bytes: float | None = None
    mig: tuple[tuple[int, GpuSample], ...] = ()  # (GPU-instance ID, its reading) in MIG mode


_ALIASES: dict[str, tuple[str, ...]] = {
    "gpu_util": ("gpu_util", "utilisation_pct", "utilization", "util", "gpu_utilization"),
    "fb_used_mib": ("fb_used_mib", "memory_used_mib", "fb_used", "used_mib"),
    "fb_free_mib": ("fb_free_mib", "memory_free_mib", "fb_free", "free_mib"),
    "temp_c": ("temp_c", "temperature_c", "temperature", "temp"),
    "power_w": ("power_w", "power_watts", "power", "power_usage_w"),
    "last_xid": ("last_xid", "xid"),
    "sm_clock_mhz": ("sm_clock_mhz",),
    "mem_clock_mhz": ("mem_clock_mhz",),
    "memory_temp_c": ("memory_temp_c", "memory_temperature_c"),
    "energy_mj": ("energy_mj",),
}


def _get(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _gpm_fields(gpm: Any) -> dict[str, Any]:
    out: dict[str, float] = {}
    if isinstance(gpm, Mapping):
        for name, (attr, factor) in GPM_TO_DCGM.items():
            v = _number(gpm.get(name))
            if v is not None:
                out[attr] = v * factor
    return out


def get_of(obj: Any, field_name: str) -> float | None:
    """The first number among ``field_name``'s aliases in ``obj``."""
    for alias in _ALIASES[field_name]:
        v = _number(_get(obj, alias))
        if v is not None:
            return v
    return None


def sample_from(obj: Any) -> GpuSample:
    """A ``GpuSample`` from the NVML adapter's metrics reading (a dataclass/object or a mapping): its values,
    its GPM metrics as DCGM's profiling fields, and one sample per GPU instance (``mig``)."""
    if isinstance(obj, GpuSample):
        return obj
    mig: list[tuple[int, GpuSample]] = []
    for reading in _get(obj, "mig") or ():
        gi = _get(reading, "gi_id")
        if isinstance(gi, int):
            values: dict[str, Any] = {f: get_of(reading, f) for f in ("fb_used_mib", "fb_free_mib")}
            mig.append((gi, GpuSample(**values, **_gpm_fields(_get(reading, "gpm")))))
    fields: dict[str, Any] = {f: get_of(obj, f) for f in _ALIASES}
    return GpuSample(**fields, **_gpm_fields(_get(obj, "gpm")), mig=tuple(mig))


@dataclass(frozen=True)
class _Series:
    labels: tuple[str, ...]
    sample: GpuSample


def gpu_series(
    inv: Inventory,
    samples: Mapping[int, GpuSample],
    assignments: Iterable[Assignment],
    hostname: str,
) -> list[_Series]:
    """One label set per GPU and per GPU instance (MIG device), each with its holders, with their readings
    (pure). A GPU's series carry GPU_I_ID/GPU_I_PROFILE ""; a GPU instance's carry its ID and profile, the
    parent's gpu/UUID/device, its own memory and GPM readings, and the pods that hold that MIG device."""
    holders: dict[tuple[int, int | None], list[tuple[str, str, str]]] = {}
    mig_by_uuid = {d.uuid: d for g in inv.gpus for d in g.mig_devices}
    for a in assignments:
        for dev in a.device_ids:
            idx = gpu_of_device(dev, inv)
            if idx is None:
                continue
            mig = mig_by_uuid.get(dev.split("::", 1)[0])
            key = (idx, mig.gi_id if mig is not None else None)
            entry = (a.namespace, a.pod, a.container)
            if entry not in holders.setdefault(key, []):
                holders[key].append(entry)
    out: list[_Series] = []
    nobody = [("", "", "")]
    for g in sorted(inv.gpus, key=lambda x: x.index):
        sample = samples.get(g.index)
        if sample is None:
            continue
        base = (str(g.index), g.uuid, g.pci_bus_id, f"nvidia{g.minor_number}", g.name)
        for ns, pod, ctr in holders.get((g.index, None)) or nobody:
            out.append(_Series((*base, "", "", hostname, ns, pod, ctr), sample))
        per_gi = dict(sample.mig)
        profiles = {d.gi_id: d.profile for d in g.mig_devices}
        for gi_id in sorted(set(per_gi) | set(profiles)):
            gi_sample = per_gi.get(gi_id, GpuSample())
            for ns, pod, ctr in holders.get((g.index, gi_id)) or nobody:
                out.append(_Series((*base, profiles.get(gi_id, ""), str(gi_id), hostname, ns, pod, ctr), gi_sample))
    return out


class _GpuCollector(Collector):
    def __init__(self) -> None:
        self._series: list[_Series] = []
        self._lock = threading.Lock()

    def set(self, series: list[_Series]) -> None:
        with self._lock:
            self._series = series

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            series = self._series
        for name, help_text, attr in DCGM_METRICS:
            fam = GaugeMetricFamily(name, help_text, labels=DCGM_LABELS)
            for s in series:
                v = getattr(s.sample, attr)
                if v is not None:
                    fam.add_metric(list(s.labels), v)
            yield fam


CONDITION_STATUSES = ("True", "False", "Unknown")
MIG_STATES = ("pending", "rebooting", "success", "failed")


def state_families(
    snapshot: ConditionSnapshot,
    registered: Mapping[str, bool],
    allocations: Mapping[tuple[str, str], int] | None = None,
    mps: Sequence[MpsDaemonState] = (),
) -> list[Metric]:
    """The agent's state as gauges (pure): the GPU Node conditions and the MIG config state as state sets
    (one series per possible value, 1 on the current one, as kube-state-metrics shows Node conditions), each
    GPU fault with its last XID and the driver's recovery action, the kubelet registration of every
    device-plugin resource and its Allocate calls, and whether containerd is wired."""
    cond = GaugeMetricFamily(
        "nodeagent_node_condition",
        "The agent's Node conditions (nodeagent.io/GPUReady, ...): 1 on the current status, 0 on the others.",
        labels=("condition", "status"),
    )
    for c in build_conditions(snapshot):
        for status in CONDITION_STATUSES:
            cond.add_metric([c.type, status.lower()], 1 if c.status == status else 0)
    mig = GaugeMetricFamily(
        "nodeagent_mig_config_state",
        "State of the last nvidia.com/mig.config apply: 1 on the current state, 0 on the others "
        "(no series before the first apply).",
        labels=("config", "state"),
    )
    if snapshot.mig.enabled and snapshot.mig.state is not None:
        for state in MIG_STATES:
            mig.add_metric([snapshot.mig.config, state], 1 if snapshot.mig.state == state else 0)
    faults = GaugeMetricFamily(
        "nodeagent_gpu_fault",
        "1 for each unhealthy GPU (or GPU instance), with its last XID and the recovery action the driver "
        "asks for (\"\" when none).",
        labels=("gpu", "UUID", "GPU_I_ID", "xid", "recovery_action", "lost"),
    )
    seen: set[tuple[str, ...]] = set()
    for f in snapshot.health.faults if snapshot.health is not None else ():
        labels = (str(f.index), f.uuid, "" if f.gi_id is None else str(f.gi_id),
                  "" if f.xid is None else str(f.xid), f.recovery or "", "true" if f.lost else "false")
        if labels not in seen:
            seen.add(labels)
            faults.add_metric(list(labels), 1)
    reg = GaugeMetricFamily(
        "nodeagent_device_plugin_registered",
        "1 when the kubelet accepted the device-plugin registration of the resource, 0 while it has not.",
        labels=("resource",),
    )
    for resource, ok in sorted(registered.items()):
        reg.add_metric([resource], 1 if ok else 0)
    wired = GaugeMetricFamily(
        "nodeagent_containerd_wired",
        "1 when containerd's config carries the NVIDIA runtime, 0 when not (no series while unchecked).",
    )
    if snapshot.runtime.check_enabled and snapshot.runtime.containerd_wired is not None:
        wired.add_metric([], 1 if snapshot.runtime.containerd_wired else 0)
    allocate = CounterMetricFamily(
        "nodeagent_allocate_requests",
        "The kubelet's Allocate calls, by resource and result (answered, refused).",
        labels=("resource", "result"),
    )
    for (resource, result), n in sorted((allocations or {}).items()):
        allocate.add_metric([resource, result], n)
    conflict = GaugeMetricFamily(
        "nodeagent_conflict",
        "1 for each other agent acting on what nodeagent acts on: kind device-plugin (another plugin serves a "
        "resource nodeagent would serve), dra-driver, mig-manager or feature-labels; subject is what both act "
        "on, owner the other one.",
        labels=("kind", "subject", "owner"),
    )
    for other in snapshot.conflicts:
        conflict.add_metric([other.kind, other.subject, other.owner], 1)
    return [cond, mig, faults, reg, wired, allocate, conflict, *mps_families(mps)]


def mps_families(daemons: Sequence[MpsDaemonState]) -> list[Metric]:
    """The MPS control daemons the agent runs: ready or not, restarts, and the limits in force per GPU."""
    ready = GaugeMetricFamily(
        "nodeagent_mps_daemon_ready",
        "1 while the MPS control daemon of the resource answers (its replicas are Healthy), 0 while not.",
        labels=("resource",),
    )
    restarts = CounterMetricFamily(
        "nodeagent_mps_daemon_restarts", "Restarts of the resource's MPS control daemon since it was first started.",
        labels=("resource",),
    )
    threads = GaugeMetricFamily(
        "nodeagent_mps_active_thread_percentage",
        "The default active thread percentage the resource's MPS control daemon gives each client.",
        labels=("resource",),
    )
    pinned = GaugeMetricFamily(
        "nodeagent_mps_pinned_memory_limit_bytes",
        "The default pinned device memory limit of each MPS client on the GPU.",
        labels=("resource", "UUID"),
    )
    for d in sorted(daemons, key=lambda d: d.name):
        ready.add_metric([d.name], 1 if d.ready else 0)
        restarts.add_metric([d.name], d.restarts)
        threads.add_metric([d.name], d.thread_percentage)
        for ordinal, limit in d.pinned_limits:
            if ordinal < len(d.gpu_uuids) and limit[:-1].isdigit():
                scale = 1 << (30 if limit.endswith("G") else 20)
                pinned.add_metric([d.name, d.gpu_uuids[ordinal]], int(limit[:-1]) * scale)
    return [ready, restarts, threads, pinned]


def mig_families(inv: Inventory) -> list[Metric]:
    """Each MIG-capable GPU's MIG mode and the MIG devices it carries, by profile (pure)."""
    mode = GaugeMetricFamily(
        "nodeagent_gpu_mig_enabled",
        "MIG mode of each MIG-capable GPU: 1 enabled, 0 disabled; pending=\"true\" while a mode change waits "
        "for a GPU reset.",
        labels=("gpu", "UUID", "pending"),
    )
    devices = GaugeMetricFamily(
        "nodeagent_mig_devices",
        "MIG devices of each GPU, by GPU-instance profile.",
        labels=("gpu", "UUID", "GPU_I_PROFILE"),
    )
    for g in sorted(inv.gpus, key=lambda x: x.index):
        if not g.mig_capable:
            continue
        pending = g.mig_pending != g.mig_current
        mode.add_metric([str(g.index), g.uuid, "true" if pending else "false"], 1 if g.mig_current else 0)
        counts: dict[str, int] = {}
        for d in g.mig_devices:
            counts[d.profile] = counts.get(d.profile, 0) + 1
        for profile, n in sorted(counts.items()):
            devices.add_metric([str(g.index), g.uuid, profile], n)
    return [mode, devices]


def fabric_families(inv: Inventory) -> list[Metric]:
    """Each GPU's NVLink fabric info and the node's clique label (pure); no series on GPUs without fabric."""
    from nodeagent.gpu.fabric import decide

    state = GaugeMetricFamily(
        "nodeagent_gpu_fabric_state",
        "NVLink fabric registration of each GPU (nvmlGpuFabricState_t: 1 not started, 2 in progress, "
        "3 completed); status is the nvmlReturn_t once completed, clique the cluster UUID and clique ID.",
        labels=("gpu", "UUID", "status", "clique"),
    )
    health = GaugeMetricFamily(
        "nodeagent_gpu_fabric_health",
        "NVLink fabric health summary of each GPU (0 not supported, 1 healthy, 2 unhealthy, "
        "3 limited capacity); mask is NVML's health mask.",
        labels=("gpu", "UUID", "mask"),
    )
    label = GaugeMetricFamily(
        "nodeagent_nvlink_clique_label",
        "1 while nvidia.com/gpu.clique is on the Node, 0 while it is withheld; reason says why.",
        labels=("clique", "reason"),
    )
    for g in sorted(inv.gpus, key=lambda x: x.index):
        f = g.fabric
        if f is None:
            continue
        state.add_metric([str(g.index), g.uuid, str(f.status), f"{f.cluster_uuid}.{f.clique_id}"], f.state)
        if f.health_summary is not None or f.health_mask is not None:
            health.add_metric([str(g.index), g.uuid, "" if f.health_mask is None else str(f.health_mask)],
                              f.health_summary or 0)
    d = decide(inv)
    if d.applicable:
        label.add_metric([d.value or "", d.reason.value if d.reason else ""], 1 if d.value else 0)
    return [state, health, label]


class _Families(Collector):
    """Families computed when the state changes, shown as they are at every scrape."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families
        self._lock = threading.Lock()

    def set(self, families: list[Metric]) -> None:
        with self._lock:
            self._families = families

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            families = self._families
        yield from families


class Metrics:
    """The agent's registry: GPU metrics in dcgm-exporter form and nodeagent's own counters."""

    def __init__(self, hostname: str, registry: CollectorRegistry | None = None) -> None:
        self.hostname = hostname
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self._gpus = _GpuCollector()
        self.registry.register(self._gpus)
        self._state = _Families(state_families(ConditionSnapshot(), {}))
        self.registry.register(self._state)
        self._mig = _Families([])
        self.registry.register(self._mig)
        r = self.registry
        self.reconciles = Counter(
            "nodeagent_reconciles", "Reconcile passes by component and result.", ["component", "result"], registry=r
        )
        self.apply_seconds = Histogram(
            "nodeagent_apply_duration_seconds",
            "Time taken to apply a change, by component.",
            ["component"],
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 15, 60, 300),
            registry=r,
        )
        self.api_requests = Counter(
            "nodeagent_kube_api_requests", "Kubernetes API requests sent, by HTTP method.", ["method"], registry=r
        )
        self.api_errors = Counter(
            "nodeagent_kube_api_errors", "Failed Kubernetes API requests, by HTTP status (0 = no answer).",
            ["code"], registry=r,
        )
        self.device_healthy = Gauge(
            "nodeagent_device_healthy", "1 when the GPU is healthy, 0 when not.", ["gpu", "UUID"], registry=r
        )
        self.publish_writes = Counter(
            "nodeagent_publish_writes", "Writes made by the node publisher, by target.", ["target"], registry=r
        )

    def update_gpus(
        self,
        inv: Inventory,
        samples: Mapping[int, Any],
        assignments: Iterable[Assignment] = (),
        health: Mapping[int, bool] | None = None,
        xids: Mapping[int, int] | None = None,
    ) -> None:
        """Replace the GPU readings shown at the next scrape.

        ``xids`` (GPU index → last XID, e.g. ``DevicePluginService.last_xids()``) fills DCGM_FI_DEV_XID_ERRORS
        where the reading has no XID; a GPU that never reported one shows 0, as dcgm-exporter does."""
        conv = {i: sample_from(s) for i, s in samples.items()}
        if xids is not None:
            conv = {i: s if s.last_xid is not None else replace(s, last_xid=float(xids.get(i, 0)))
                    for i, s in conv.items()}
        self._gpus.set(gpu_series(inv, conv, assignments, self.hostname))
        self._mig.set(mig_families(inv) + fabric_families(inv))
        for g in inv.gpus:
            ok = True if health is None else health.get(g.index, True)
            self.device_healthy.labels(gpu=str(g.index), UUID=g.uuid).set(1 if ok else 0)

    def update_state(
        self,
        snapshot: ConditionSnapshot,
        registered: Mapping[str, bool],
        allocations: Mapping[tuple[str, str], int] | None = None,
        mps: Sequence[MpsDaemonState] = (),
    ) -> None:
        """Replace the Node conditions, MIG state, GPU faults, registrations, Allocate counts and MPS daemons
        shown at the next scrape."""
        self._state.set(state_families(snapshot, registered, allocations, mps))

    def observe_reconcile(self, component: str, result: str, seconds: float) -> None:
        """One finished reconcile (e.g. ``MigReconciler(on_result=...)``: result is the state written)."""
        self.reconciles.labels(component=component, result=result).inc()
        self.apply_seconds.labels(component=component).observe(seconds)

    def count_publish(self, writes: Mapping[str, int]) -> None:
        """The writes of one publisher pass by target (``PublishResult.by_target()``: labels, status,
        gpu_objects)."""
        for target, n in writes.items():
            if n:
                self.publish_writes.labels(target=target).inc(n)

    def record_request(self, method: str, status: int | None) -> None:
        """Hook for ``KubeClient(on_request=...)``."""
        self.api_requests.labels(method=method).inc()
        if status is not None and not 200 <= status < 300:
            self.api_errors.labels(code=str(status)).inc()

    def kube_hook(self) -> Callable[[str, int | None], None]:
        return self.record_request

    def attach_kube(self, kube: Any) -> None:
        """Count every request of ``kube`` (a ``KubeClient``) from now on, starting from what it sent so far.

        The counters begin at the client's own ``stats`` so requests made before the metrics started (the
        first publish, the watch) are not missing from them.
        """
        snap = kube.stats.snapshot()
        for method, n in snap.get("by_method", {}).items():
            self.api_requests.labels(method=method).inc(n)
        for code, n in snap.get("errors", {}).items():
            self.api_errors.labels(code=str(code)).inc(n)
        kube.on_request = self.record_request

    def detach_kube(self, kube: Any) -> None:
        """Stop counting ``kube``'s requests (only if this registry is still the one counting them)."""
        if getattr(kube, "on_request", None) == self.record_request:
            kube.on_request = None

    def serve(self, address: str = DEFAULT_ADDRESS) -> MetricsServer:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"metrics address must be HOST:PORT, got {address!r}")
        host = host.strip("[]")
        return start_bounded_server(host, int(port), make_wsgi_app(self.registry))
