"""GPU Node conditions: four ``status.conditions`` entries built from typed inputs, written only on change.

``build_conditions`` is pure: it turns what the components know (GPU health with XIDs and recovery actions,
the last MIG config apply, the containerd wiring check, the CDI spec) into four conditions:

- ``nodeagent.io/GPUReady``: every GPU found is healthy (the node can run GPU work); while another agent
  serves or configures them, the reason is the conflict's (e.g. ``AnotherDevicePlugin``). A node whose
  GPUs are all bound to a VFIO driver for virtual machines (``nvidia.com/gpu.workload.config=vm-passthrough``)
  is ready for its VMs: ``True``, reason ``VfioPassthrough`` (the nvidia driver, so NVML, sees none of them).
- ``nodeagent.io/GPUHealthy``: no GPU is marked unhealthy; the message names each unhealthy GPU's index,
  UUID, last XID and the recovery action the driver asks for.
- ``nodeagent.io/MIGConfigured``: the result of the last ``nvidia.com/mig.config`` apply.
- ``nodeagent.io/RuntimeReady``: containerd carries the NVIDIA runtime and the CDI spec is current.

On a rack node (GPUs on an NVLink fabric with a cluster) two more: ``nodeagent.io/NVLinkCliqueReady`` (the
``nvidia.com/gpu.clique`` label is set; its reason says why it is withheld: fabric not started, in progress,
an error status, GPUs in different cliques) and, with the host-managed IMEX daemon on,
``nodeagent.io/IMEXReady`` (``nvidia-imex-ctl -q`` answers READY). They are removed from the Node again when
they no longer apply (``retired_conditions``): ``NVLinkCliqueReady`` once the node's GPUs are on no fabric cluster
any more (it left the rack), ``IMEXReady`` once ``[imex]`` is off; a rack node whose clique label is withheld keeps
both, False with the reason.

Status follows the Kubernetes conventions: ``True``/``False`` when the agent knows, ``Unknown`` when it
cannot tell (the check is off or has not run). Reasons are CamelCase codes, messages one line of at most
``MESSAGE_MAX`` characters. ``ConditionWriter`` sends one strategic-merge patch of ``status.conditions``
(merged by ``type``, so the kubelet's own conditions are untouched) only when a condition's status, reason
or message changed; ``lastTransitionTime`` moves only when its status changes. A pass with nothing new
sends nothing: there are no heartbeat writes.

``StatusStage`` lets the publisher hand its status fields (unserved extended resources in ``capacity`` and
``allocatable``) to the ``ConditionWriter`` instead of writing them itself: they go out in the writer's next
status patch, together with the conditions. An agent's start then costs one Node status write, not two.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # the builder stays importable without the API client
    from nodeagent.gpu.fabric import CliqueDecision
    from nodeagent.kube.node import NodeClient, NodeView

log = logging.getLogger(__name__)

PREFIX = "nodeagent.io/"
GPU_READY = PREFIX + "GPUReady"
GPU_HEALTHY = PREFIX + "GPUHealthy"
MIG_CONFIGURED = PREFIX + "MIGConfigured"
RUNTIME_READY = PREFIX + "RuntimeReady"
NVLINK_CLIQUE_READY = PREFIX + "NVLinkCliqueReady"
IMEX_READY = PREFIX + "IMEXReady"
CONDITION_TYPES = (GPU_READY, GPU_HEALTHY, MIG_CONFIGURED, RUNTIME_READY)
RACK_CONDITION_TYPES = (NVLINK_CLIQUE_READY, IMEX_READY)
MESSAGE_MAX = 512

Status = Literal["True", "False", "Unknown"]


# -- inputs -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuFault:
    """One unhealthy GPU (``gi_id`` set: one of its GPU instances) as the health monitor sees it."""

    index: int
    uuid: str = ""
    xid: int | None = None  # the last XID the GPU reported
    recovery: str | None = None  # the driver's recovery action ("GPU reset", "node reboot", ...), None: none
    lost: bool = False  # NVML reports the GPU lost (fallen off the bus)
    gi_id: int | None = None


@dataclass(frozen=True)
class GpuHealthInput:
    """The GPUs found and the faults the health monitor holds; ``monitored`` False: no health checks run."""

    gpus: int
    faults: tuple[GpuFault, ...] = ()
    monitored: bool = True


@dataclass(frozen=True)
class PassthroughInput:
    """The workload switch's result while the node is in vm-passthrough: ``gpus`` GPUs on VFIO drivers
    (``drivers``, e.g. ``vfio-pci``), served to virtual machines as ``resources``."""

    gpus: int
    drivers: tuple[str, ...] = ("vfio-pci",)
    resources: tuple[str, ...] = ()


@dataclass(frozen=True)
class MigInput:
    """The last ``nvidia.com/mig.config`` reconcile: ``state`` one of success/failed/pending/rebooting, or
    None when no config was asked for since the agent started; ``enabled`` False: MIG management is off."""

    enabled: bool = True
    state: str | None = None
    config: str = ""
    error: str = ""


@dataclass(frozen=True)
class RuntimeInput:
    """``containerd_wired``: the runtime check's last answer (None: check off or not run yet);
    ``cdi_current``: the CDI spec writer's last answer (None: CDI off or not written yet)."""

    check_enabled: bool = True
    containerd_wired: bool | None = None
    containerd_detail: str = ""
    cdi_enabled: bool = True
    cdi_current: bool | None = None
    cdi_detail: str = ""


@dataclass(frozen=True, order=True)
class ConflictInput:
    """Another agent acting on what nodeagent acts on (another device plugin or DRA driver for the same
    GPUs, a MIG manager, NFD owning nodeagent's label keys): ``reason`` a CamelCase code, ``detail`` one line."""

    kind: str
    subject: str
    owner: str
    reason: str
    detail: str


@dataclass(frozen=True)
class ConditionSnapshot:
    """Everything the four conditions are built from; ``None`` parts are not known yet (Unknown)."""

    health: GpuHealthInput | None = None
    mig: MigInput = field(default_factory=MigInput)
    runtime: RuntimeInput = field(default_factory=RuntimeInput)
    conflicts: tuple[ConflictInput, ...] = ()
    fabric: CliqueDecision | None = None  # the NVLink clique decision (None: no inventory yet)
    imex: ImexInput | None = None  # the host-managed IMEX daemon (None: not run by the agent)
    imex_off: bool = False  # [imex] is off: an IMEXReady written before is removed
    passthrough: PassthroughInput | None = None  # the node is in vm-passthrough (None: it is not)


@dataclass(frozen=True)
class ImexInput:
    """The supervised IMEX daemon: running, its peers, the last ``nvidia-imex-ctl -q`` answer."""

    running: bool
    ready: bool
    peers: int = 0
    answer: str = ""
    clique: str | None = None  # the clique the domain is for (None: the node has no clique label)


# -- the pure builder --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Condition:
    type: str
    status: Status
    reason: str
    message: str
    # "not known yet": written only where the Node has no condition of this type, so a restarting agent
    # does not flap a condition to Unknown before its inputs have answered again
    provisional: bool = False

    def key(self) -> tuple[str, str, str]:
        return self.status, self.reason, self.message


def one_line(text: str, limit: int = MESSAGE_MAX) -> str:
    """``text`` on one line (runs of whitespace become one space), cut to ``limit`` characters with '...'."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3].rstrip() + "..."


def describe_fault(f: GpuFault) -> str:
    where = f"GPU {f.index}" + (f" GI {f.gi_id}" if f.gi_id is not None else "")
    if f.uuid:
        where += f" ({f.uuid})"
    parts = ["lost"] if f.lost else []
    if f.xid is not None:
        parts.append(f"XID {f.xid}")
    parts.append(f"recovery: {f.recovery or 'none'}")
    return where + ": " + ", ".join(parts)


def _sorted_faults(faults: Iterable[GpuFault]) -> list[GpuFault]:
    return sorted(faults, key=lambda f: (f.index, -1 if f.gi_id is None else f.gi_id))


def _in_passthrough(h: GpuHealthInput | None, p: PassthroughInput | None) -> bool:
    """Every GPU is on a VFIO driver: NVML finds none, the switch reports them bound for VMs."""
    return p is not None and p.gpus > 0 and h is not None and h.gpus == 0


def _passthrough_text(p: PassthroughInput) -> str:
    served = f", served as {', '.join(p.resources)}" if p.resources else ""
    return (f"{p.gpus} GPU(s) bound to {', '.join(p.drivers)} for virtual machines "
            f"(nvidia.com/gpu.workload.config=vm-passthrough){served}")


def gpu_healthy(h: GpuHealthInput | None, passthrough: PassthroughInput | None = None) -> Condition:
    if _in_passthrough(h, passthrough):
        assert passthrough is not None
        return Condition(GPU_HEALTHY, "Unknown", "VfioPassthrough", one_line(
            f"{_passthrough_text(passthrough)}: the nvidia driver does not own them, so it checks none"))
    if h is None or not h.monitored:
        why = "health checks are not running" if h is not None else "GPU health is not known yet"
        return Condition(GPU_HEALTHY, "Unknown", "HealthChecksUnavailable", why, provisional=h is None)
    if not h.faults:
        return Condition(GPU_HEALTHY, "True", "AllGpusHealthy", f"{h.gpus} GPU(s), none unhealthy")
    faults = _sorted_faults(h.faults)
    gpus = len({f.index for f in faults})
    if any(f.lost for f in faults):
        reason = "GpuLost"
    elif any(f.recovery for f in faults):
        reason = "GpuRecoveryRequired"
    elif any(f.xid is not None for f in faults):
        reason = "XidError"
    else:
        reason = "GpuUnhealthy"
    msg = f"{gpus} of {h.gpus} GPU(s) unhealthy: " + "; ".join(describe_fault(f) for f in faults)
    return Condition(GPU_HEALTHY, "False", reason, one_line(msg))


def gpu_ready(h: GpuHealthInput | None, conflicts: Sequence[ConflictInput] = (),
              passthrough: PassthroughInput | None = None) -> Condition:
    if _in_passthrough(h, passthrough):
        assert passthrough is not None
        ready = Condition(GPU_READY, "True", "VfioPassthrough", one_line(_passthrough_text(passthrough)))
    else:
        ready = _gpu_ready(h)
    if not conflicts or ready.status == "False":
        return ready
    # Another agent serves or configures these GPUs (nodeagent holds back until it is gone or it is told to take
    # over): the status keeps saying whether the GPUs can run work (the other plugin may be serving them, and a
    # False would taint a node in the middle of a migration); the reason is the first conflict's, the message
    # lists them all.
    first = sorted(conflicts)[0]
    return Condition(GPU_READY, ready.status, first.reason, one_line(
        f"{ready.message}; {len(conflicts)} conflict(s) with another agent: "
        + "; ".join(c.detail for c in sorted(conflicts))), provisional=False)


def _gpu_ready(h: GpuHealthInput | None) -> Condition:
    if h is None:
        return Condition(GPU_READY, "Unknown", "GpuStateUnknown", "GPU discovery and health are not known yet",
                         provisional=True)
    if h.gpus == 0:
        return Condition(GPU_READY, "False", "NoGpusFound", "no GPU was found on this node")
    if not h.monitored:
        return Condition(GPU_READY, "Unknown", "HealthChecksUnavailable",
                         f"{h.gpus} GPU(s) found; health checks are not running")
    if h.faults:
        bad = sorted({f.index for f in h.faults})
        return Condition(GPU_READY, "False", "GpusUnhealthy", one_line(
            f"{len(bad)} of {h.gpus} GPU(s) unhealthy: GPU " + ", ".join(str(i) for i in bad)))
    return Condition(GPU_READY, "True", "AllGpusReady", f"all {h.gpus} GPU(s) present and healthy")


def mig_configured(m: MigInput) -> Condition:
    if not m.enabled:
        return Condition(MIG_CONFIGURED, "Unknown", "MigManagementDisabled", "MIG management is off")
    name = repr(m.config)
    if m.state is None:
        return Condition(MIG_CONFIGURED, "Unknown", "MigConfigNotRequested",
                         "no nvidia.com/mig.config apply since the agent started", provisional=True)
    if m.state == "success":
        return Condition(MIG_CONFIGURED, "True", "MigConfigApplied", f"MIG config {name} is applied")
    if m.state == "failed":
        msg = f"MIG config {name} failed" + (f": {m.error}" if m.error else "")
        return Condition(MIG_CONFIGURED, "False", "MigConfigFailed", one_line(msg))
    if m.state == "rebooting":
        return Condition(MIG_CONFIGURED, "False", "MigConfigRebootRequired",
                         f"MIG config {name} waits for a host reboot")
    if m.state == "pending":
        return Condition(MIG_CONFIGURED, "False", "MigConfigPending", f"MIG config {name} is being applied")
    return Condition(MIG_CONFIGURED, "Unknown", "MigStateUnknown", one_line(f"MIG state {m.state!r}"))


def runtime_ready(r: RuntimeInput) -> Condition:
    if not r.check_enabled:
        return Condition(RUNTIME_READY, "Unknown", "RuntimeCheckDisabled", "the containerd runtime check is off")
    if r.containerd_wired is False:
        detail = f": {r.containerd_detail}" if r.containerd_detail else ""
        return Condition(RUNTIME_READY, "False", "ContainerdNotWired",
                         one_line(f"containerd does not carry the NVIDIA runtime{detail}"))
    if r.cdi_enabled and r.cdi_current is False:
        detail = f": {r.cdi_detail}" if r.cdi_detail else ""
        return Condition(RUNTIME_READY, "False", "CdiSpecStale", one_line(f"the CDI spec is not current{detail}"))
    if r.containerd_wired is None:
        why = r.containerd_detail or "the containerd runtime check has not answered yet"
        return Condition(RUNTIME_READY, "Unknown", "RuntimeCheckPending", one_line(why), provisional=True)
    if r.cdi_enabled and r.cdi_current is None:
        return Condition(RUNTIME_READY, "Unknown", "CdiSpecPending", "the CDI spec has not been written yet",
                         provisional=True)
    cdi = "; the CDI spec is current" if r.cdi_enabled else ""
    return Condition(RUNTIME_READY, "True", "RuntimeWired", f"containerd carries the NVIDIA runtime{cdi}")


def nvlink_clique_ready(d: CliqueDecision) -> Condition:
    if d.value is not None:
        return Condition(NVLINK_CLIQUE_READY, "True", d.reason.value if d.reason else "CliqueJoined",
                         one_line(d.message))
    return Condition(NVLINK_CLIQUE_READY, "False", d.reason.value if d.reason else "CliqueUnknown",
                     one_line("nvidia.com/gpu.clique withheld: " + d.message))


def imex_ready(i: ImexInput) -> Condition:
    if i.clique is None:
        return Condition(IMEX_READY, "False", "NoClique",
                         "the node has no NVLink clique label: no IMEX domain to join")
    if not i.running:
        return Condition(IMEX_READY, "False", "DaemonNotRunning",
                         one_line(f"the nvidia-imex daemon is not running ({i.answer or 'starting'})"))
    if i.ready:
        return Condition(IMEX_READY, "True", "DomainReady",
                         f"nvidia-imex answers READY for clique {i.clique} ({i.peers} node(s))")
    return Condition(IMEX_READY, "False", "DomainNotReady",
                     one_line(f"nvidia-imex-ctl -q: {i.answer or 'no answer yet'} ({i.peers} node(s) configured)"))


def build_conditions(s: ConditionSnapshot) -> list[Condition]:
    """The conditions for ``s``: the four of ``CONDITION_TYPES`` in that order, then on a rack node the
    clique's and, when the agent runs the IMEX daemon, the domain's."""
    out = [gpu_ready(s.health, s.conflicts, s.passthrough), gpu_healthy(s.health, s.passthrough),
           mig_configured(s.mig), runtime_ready(s.runtime)]
    if s.fabric is not None and s.fabric.applicable:
        out.append(nvlink_clique_ready(s.fabric))
    if s.imex is not None:
        out.append(imex_ready(s.imex))
    return out


def retired_conditions(s: ConditionSnapshot) -> tuple[str, ...]:
    """The rack condition types that no longer apply to the node and go from it: ``NVLinkCliqueReady`` when the
    inventory shows no GPU on a fabric cluster (not before the first inventory), ``IMEXReady`` when the agent is
    configured not to run the IMEX daemon."""
    out: list[str] = []
    if s.fabric is not None and not s.fabric.applicable:
        out.append(NVLINK_CLIQUE_READY)
    if s.imex_off and s.imex is None:
        out.append(IMEX_READY)
    return tuple(out)


def _timestamp(now: datetime) -> str:
    return now.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def plan_conditions(
    current: Sequence[Mapping[str, Any]], desired: Iterable[Condition], now: datetime, retired: Iterable[str] = ()
) -> list[dict[str, Any]]:
    """The condition objects to patch: those of ``desired`` whose status, reason or message differ from
    ``current`` (the Node's conditions). ``lastTransitionTime`` is kept from ``current`` when the status is
    the same, else ``now``; ``lastHeartbeatTime`` is the time of this write. A provisional condition ("not
    known yet") replaces none already there. A type of ``retired`` on the Node gets the strategic-merge patch's
delete directive (``{"type": ..., "$patch": "delete"}``). Empty: nothing to write."""
    by_type = {str(c.get("type", "")): c for c in current}
    stamp = _timestamp(now)
    out: list[dict[str, Any]] = []
    for d in desired:
        old = by_type.get(d.type)
        if old is not None and d.provisional:
            continue
        if old is not None and (old.get("status"), old.get("reason"), old.get("message")) == d.key():
            continue
        same_status = old is not None and old.get("status") == d.status and old.get("lastTransitionTime")
        out.append({
            "type": d.type,
            "status": d.status,
            "reason": d.reason,
            "message": d.message,
            "lastHeartbeatTime": stamp,
            "lastTransitionTime": str(old["lastTransitionTime"]) if same_status and old else stamp,
        })
    out += [{"type": t, "$patch": "delete"} for t in dict.fromkeys(retired) if t in by_type]
    return out


# -- the writer --------------------------------------------------------------------------------------


StatusFields = dict[str, dict[str, str | None]]  # status field -> name -> value (None: remove the name)


class StatusStage:
    """Node status fields waiting for the next status patch of a ``ConditionWriter`` (thread-safe).

    ``stage`` replaces what waits (the staging side computes the whole difference each pass) and wakes the
    listeners; the writer sends it with its conditions and ``clear``s it once written. ``expect``/``passes``
    let the writer wait, once at start, for the staging side's first pass so that both go out together
    (``subscribe_passes`` wakes it when a pass is done)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fields: StatusFields = {}
        self._listeners: list[Callable[[], None]] = []
        self._pass_listeners: list[Callable[[], None]] = []
        self.expected = False  # a publisher stages here (the writer waits for its first pass at start)
        self.passes = 0  # publish passes done since (staged or not)
        self._written: NodeView | None = None  # the Node as the writer's last patch returned it

    def subscribe(self, listener: Callable[[], None]) -> None:
        """``listener`` is called (from any thread) whenever something is staged."""
        with self._lock:
            self._listeners.append(listener)

    def subscribe_passes(self, listener: Callable[[], None]) -> None:
        """``listener`` is called (from any thread) whenever the staging side has done a pass."""
        with self._lock:
            self._pass_listeners.append(listener)

    def unsubscribe(self, listener: Callable[[], None]) -> None:
        """Stop calling ``listener`` (for staged fields and for passes alike)."""
        with self._lock:
            for listeners in (self._listeners, self._pass_listeners):
                if listener in listeners:
                    listeners.remove(listener)

    def stage(self, fields: Mapping[str, Mapping[str, str | None]]) -> None:
        with self._lock:
            changed = fields != self._fields
            self._fields = {k: dict(v) for k, v in fields.items()}
            listeners = list(self._listeners) if changed and fields else []
        for listener in listeners:
            listener()

    def expect(self) -> None:
        self.expected = True

    def pass_done(self) -> None:
        with self._lock:
            self.passes += 1
            listeners = list(self._pass_listeners)
        for listener in listeners:
            listener()

    def peek(self) -> StatusFields:
        with self._lock:
            return {k: dict(v) for k, v in self._fields.items()}

    def clear(self, written: Mapping[str, Mapping[str, str | None]], view: NodeView | None = None) -> None:
        """Forget ``written`` (what the writer sent) unless something newer was staged meanwhile; ``view``
        is the Node the patch returned (the staging side plans its next pass from it, not from older)."""
        with self._lock:
            if self._fields == written:
                self._fields = {}
            if view is not None:
                self._written = view

    def written_view(self) -> NodeView | None:
        with self._lock:
            return self._written


class ConditionWriter:
    """Writes the conditions to the own Node on change only (blocking; run it in a worker thread).

    The Node's conditions are read once (so a restarted agent keeps their transition times and writes
    nothing when they still hold); afterwards the writer compares with what it last wrote, and ``observe``
    (fed by the watch of the own Node) notices when somebody changed or removed them. ``writes`` counts the
    PATCH requests sent."""

    def __init__(self, node: NodeClient, clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc), *,
                 stage: StatusStage | None = None) -> None:
        self.node = node
        self.clock = clock
        self.stage = stage
        self.writes = 0
        self.fields_written = 0  # of ``writes``, those that carried staged status values
        self._known: dict[str, dict[str, Any]] | None = None
        self._written_rv = -1  # resourceVersion of the Node our last write produced
        self._lock = threading.Lock()

    def sync(self, snapshot: ConditionSnapshot) -> list[str]:
        """Bring the Node's conditions in line with ``snapshot``; the types written (empty: no request)."""
        with self._lock:
            if self._known is None:
                view = self.node.get()
                self._known = {str(c.get("type", "")): dict(c) for c in view.conditions
                               if str(c.get("type", "")) in CONDITION_TYPES + RACK_CONDITION_TYPES}
            changes = plan_conditions(list(self._known.values()), build_conditions(snapshot), self.clock(),
                                      retired_conditions(snapshot))
            fields = self.stage.peek() if self.stage is not None else {}
            if not changes and not fields:
                return []
            written = self.node.patch_status_conditions(changes, fields)
            self.writes += 1
            if written is not None:
                self._written_rv = _rv(written.resource_version)
            if self.stage is not None and fields:
                self.fields_written += 1
                self.stage.clear(fields, written)
                log.info("node %s: status %s written", self.node.name, ", ".join(sorted(fields)))
            for c in changes:
                if c.get("$patch") == "delete":
                    self._known.pop(c["type"], None)
                    log.info("node %s: condition %s removed (no longer applies)", self.node.name, c["type"])
                    continue
                self._known[c["type"]] = c
                log.info("node %s: condition %s=%s (%s): %s", self.node.name, c["type"], c["status"],
                         c["reason"], c["message"])
            return [c["type"] for c in changes]

    def observe(self, view: NodeView) -> bool:
        """A version of the own Node (from its watch): True when our conditions on it differ from what this
        writer last wrote or read (somebody changed or removed them, or the Node was recreated); the next
        ``sync`` then writes them again. Versions older than our last write are ignored."""
        with self._lock:
            if view.deleted:
                self._known = None
                return False
            if self._known is None or _rv(view.resource_version) < self._written_rv:
                return False
            seen = {str(c.get("type", "")): dict(c) for c in view.conditions
                    if str(c.get("type", "")) in CONDITION_TYPES + RACK_CONDITION_TYPES}
            fields = ("status", "reason", "message")
            if all(t in seen and all(seen[t].get(f) == c.get(f) for f in fields) for t, c in self._known.items()):
                return False
            self._known = seen
            return True

    def forget(self) -> None:
        """Read the Node again before the next write (after the Node was recreated, say)."""
        with self._lock:
            self._known = None


def _rv(resource_version: str) -> int:
    try:
        return int(resource_version)
    except ValueError:
        return -1
