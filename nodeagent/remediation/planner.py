"""The steps that remediate one GPU (pure): which GPUs go together, which pods leave, in what order.

NVIDIA's rule for resetting one GPU of an NVLink machine (nvidia-smi(1)): Ampere and later GPUs can be
reset one by one, but Ampere NVSwitch systems need the fabric manager for that, and older or unmanaged
NVLink peers must be reset together. Hopper and later are always reset alone.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from nodeagent.gpu.inventory import Inventory, LinkKind
from nodeagent.remediation.policy import Action, Decision


class Step(str, enum.Enum):
    NOTIFY = "notify"  # tell the pods holding the GPU (RESTART_APP); the GPU stays in service
    WITHDRAW = "withdraw"  # device plugin Unhealthy, DRA device tainted: nothing new lands on it
    EVICT = "evict"  # the pods holding it leave through the Eviction API
    STOP_USERS = "stop-users"  # nodeagent's own users (its MPS control daemon)
    PERSISTENCE_OFF = "persistence-off"
    DRAIN = "drain"  # NVML drain state: no new NVML clients
    RESET = "reset"
    VERIFY = "verify"  # healthy, no new XID, recovery action none
    RESTORE = "restore"  # persistence mode, drain off, MIG layout, CDI entries, MPS
    OFFER = "offer"  # back in both planes
    QUARANTINE = "quarantine"  # reset too often: stays out
    REBOOT_REQUIRED = "reboot-required"
    IMEX_RECOVERY = "imex-recovery"  # the IMEX domain needs recovery (the node says so)


RESET_STEPS = (Step.WITHDRAW, Step.EVICT, Step.STOP_USERS, Step.PERSISTENCE_OFF, Step.DRAIN, Step.RESET,
               Step.VERIFY, Step.RESTORE, Step.OFFER)

# architectures NVIDIA documents as resettable alone whatever the NVLink fabric
_ALONE_ALWAYS = {"hopper", "blackwell", "rubin"}


@dataclass(frozen=True)
class GpuFacts:
    index: int
    uuid: str
    architecture: str  # "ampere", "hopper", ... as the inventory names it
    mig: bool = False
    nvlink_peers: tuple[str, ...] = ()  # UUIDs of the GPUs it has NVLink to


def facts_from_inventory(inv: Inventory) -> dict[str, GpuFacts]:
    """UUID → what the planner needs of each GPU (NVLink peers from the inventory's links)."""
    uuid_of = {g.index: g.uuid for g in inv.gpus}
    peers: dict[int, list[str]] = {g.index: [] for g in inv.gpus}
    for link in inv.links:
        if link.kind is LinkKind.NVLINK and link.a in uuid_of and link.b in uuid_of:
            peers[link.a].append(uuid_of[link.b])
            peers[link.b].append(uuid_of[link.a])
    return {g.uuid: GpuFacts(g.index, g.uuid, g.architecture, g.mig_current, tuple(peers[g.index]))
            for g in inv.gpus}


@dataclass(frozen=True)
class Plan:
    action: Action
    why: str
    gpus: tuple[str, ...]  # the UUIDs the steps act on; the faulty one first
    pods: tuple[str, ...]  # "namespace/name" of every pod holding one of them (MIG instances included)
    steps: tuple[Step, ...]

    @property
    def target(self) -> str:
        return self.gpus[0]


def reset_group(target: GpuFacts, gpus: Mapping[str, GpuFacts], fabric_manager: bool) -> tuple[str, ...]:
    """The GPUs reset together with ``target``: itself alone, or (pre-Hopper NVLink without the fabric
    manager's help) itself and its NVLink peers, transitively."""
    if target.architecture.lower() in _ALONE_ALWAYS or not target.nvlink_peers:
        return (target.uuid,)
    if target.architecture.lower() == "ampere" and fabric_manager:
        return (target.uuid,)
    group = [target.uuid]
    todo = list(target.nvlink_peers)
    while todo:
        u = todo.pop(0)
        if u in group or u not in gpus:
            continue
        group.append(u)
        todo.extend(gpus[u].nvlink_peers)
    return (target.uuid, *sorted(group[1:], key=lambda u: gpus[u].index))


def plan(
    decision: Decision,
    target: GpuFacts,
    gpus: Mapping[str, GpuFacts],
    holders: Mapping[str, Iterable[str]],
    *,
    fabric_manager: bool = True,
    quarantined: bool = False,
) -> Plan:
    """The plan for one fault. ``holders``: GPU UUID → the pods holding it or one of its MIG instances
    (PodResources and DRA claims, resolved to GPUs by the caller); pods of other GPUs are never named."""
    act = decision.action
    if act is Action.NONE:
        return Plan(act, decision.why, (target.uuid,), (), ())
    if act is Action.RESTART_APP:
        return Plan(act, decision.why, (target.uuid,), tuple(sorted(set(holders.get(target.uuid, ())))),
                    (Step.NOTIFY,))
    if act is Action.REBOOT_NODE:
        return Plan(act, decision.why, (target.uuid,), (), (Step.WITHDRAW, Step.REBOOT_REQUIRED))
    if act is Action.RECOVER_IMEX:
        return Plan(act, decision.why, (target.uuid,), (), (Step.IMEX_RECOVERY,))
    if quarantined:
        return Plan(act, decision.why + "; reset too often: quarantined", (target.uuid,), (),
                    (Step.WITHDRAW, Step.QUARANTINE))
    group = reset_group(target, gpus, fabric_manager)
    pods = sorted({p for u in group for p in holders.get(u, ())})
    steps: Sequence[Step] = RESET_STEPS if act is Action.DRAIN_AND_RESET else [
        s for s in RESET_STEPS if s is not Step.DRAIN]
    return Plan(act, decision.why, group, tuple(pods), tuple(steps))


def resume_from(steps: Sequence[Step], done: Sequence[Step]) -> tuple[Step, ...]:
    """The steps still to run after ``done`` (a successor agent's view of a recorded plan): every step
    is safe to run again, so the one that was running when the agent stopped is repeated."""
    finished = set(done)
    return tuple(s for s in steps if s not in finished)
