"""Current layout + desired config → an explicit per-GPU plan (pure, no I/O).

For every GPU the config selects the plan says: whether the MIG mode changes, which instances are
destroyed, which stay, and which are created at which placement start. Placements come from the GPU's
placement table (``nodeagent.mig.layout``); instances that already fit the target stay where they are,
and a GPU that already matches gets no step at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nodeagent.errors import ConfigError
from nodeagent.gpu.inventory import Gpu, Inventory, MigDevice
from nodeagent.mig.layout import NoFit, Slot, find_layout
from nodeagent.mig.spec import Desired, Selection


def mig_mode(gpu: Gpu) -> tuple[bool, bool]:
    """(current, pending) MIG mode; ``mig_pending`` holds NVML's pending mode value."""
    return gpu.mig_current, gpu.mig_pending


@dataclass(frozen=True)
class GpuPlan:
    """What happens to one selected GPU."""

    index: int
    uuid: str
    name: str
    architecture: str
    desired: Desired
    mode: bool | None = None  # set MIG mode to this value; None: mode stays
    destroy: tuple[MigDevice, ...] = ()
    keep: tuple[MigDevice, ...] = ()
    create: tuple[Slot, ...] = ()

    @property
    def changes(self) -> bool:
        return self.mode is not None or bool(self.destroy) or bool(self.create)

    def describe(self) -> str:
        head = f"GPU {self.index} ({self.name})"
        if not self.changes:
            layout = ", ".join(f"{d.profile}@{d.placement_start}" for d in self.keep)
            state = "MIG on" if self.desired.enabled else "MIG off"
            return f"{head}: unchanged ({state}{': ' + layout if layout else ''})"
        steps: list[str] = []
        if self.destroy:
            steps.append("destroy " + ", ".join(
                f"{d.profile}@{d.placement_start} "
                f"(GI {d.gi_id}{', no compute instance' if d.ci_id < 0 else ''})"
                for d in self.destroy))
        if self.mode is not None:
            steps.append("enable MIG mode" if self.mode else "disable MIG mode")
        if self.keep:
            steps.append("keep " + ", ".join(f"{d.profile}@{d.placement_start}" for d in self.keep))
        if self.create:
            steps.append("create " + ", ".join(str(s) for s in self.create))
        return f"{head}: " + "; ".join(steps)

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "uuid": self.uuid,
            "changes": self.changes,
            "mode": self.mode,
            "destroy": [{"profile": d.profile, "start": d.placement_start, "gi_id": d.gi_id}
                        for d in self.destroy],
            "keep": [{"profile": d.profile, "start": d.placement_start, "gi_id": d.gi_id} for d in self.keep],
            "create": [{"profile": s.profile, "start": s.start} for s in self.create],
        }


@dataclass(frozen=True)
class Plan:
    config: str
    gpus: tuple[GpuPlan, ...]
    skipped: tuple[int, ...] = field(default=())

    @property
    def touched(self) -> tuple[GpuPlan, ...]:
        return tuple(g for g in self.gpus if g.changes)

    @property
    def applied(self) -> bool:
        """True when the node already matches the config."""
        return not self.touched

    def render(self) -> str:
        n = len(self.touched)
        lines = [f"config {self.config}: {n} of {len(self.gpus)} selected GPUs change"]
        lines += ["  " + g.describe() for g in self.gpus]
        if self.skipped:
            lines.append("  not selected: GPU " + ", ".join(str(i) for i in self.skipped))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "applied": self.applied,
            "gpus": [g.to_dict() for g in self.gpus],
            "skipped": list(self.skipped),
        }


def plan_gpu(gpu: Gpu, desired: Desired) -> GpuPlan:
    """The plan for one GPU; raises ``NoFit`` when the desired layout cannot exist on it."""
    base = GpuPlan(gpu.index, gpu.uuid, gpu.name, gpu.architecture, desired)
    current, pending = mig_mode(gpu)
    existing = tuple(sorted(gpu.mig_devices, key=lambda d: (d.placement_start, d.gi_id)))
    # GPU instances without a compute instance (left by an interrupted create or destroy) serve nobody
    # and hold memory slices: they are always destroyed, never kept.
    bare = (tuple(sorted(gpu.bare_gpu_instances, key=lambda d: (d.placement_start, d.gi_id)))
            if current else ())
    if not desired.enabled:
        if not current and not pending:
            return base
        return _replace(base, mode=False, destroy=_by_start(existing + bare))
    if current:
        layout = find_layout(gpu, desired.count_map, existing)
        kept = {d.gi_id for d in layout.keep}
        destroy = _by_start(tuple(d for d in existing if d.gi_id not in kept) + bare)
        # A pending switch to "off" is cancelled by setting the mode on again (no reset needed).
        return _replace(base, mode=None if pending else True, destroy=destroy, keep=layout.keep,
                        create=layout.create)
    layout = find_layout(gpu, desired.count_map, ())
    return _replace(base, mode=True, create=layout.create)


def _by_start(devices: tuple[MigDevice, ...]) -> tuple[MigDevice, ...]:
    return tuple(sorted(devices, key=lambda d: (d.placement_start, d.gi_id, d.ci_id)))


def _replace(p: GpuPlan, **kw: Any) -> GpuPlan:
    from dataclasses import replace

    return replace(p, **kw)


def plan(inventory: Inventory, selection: Selection) -> Plan:
    """Plan every GPU the selection names; a layout that cannot fit raises ``ConfigError`` with the reason."""
    plans: list[GpuPlan] = []
    for index in sorted(selection.desired):
        desired = selection.desired[index]
        try:
            gpu = inventory.gpu(index)
        except KeyError:
            raise ConfigError(f"{desired.origin}: GPU {index} does not exist on this node",
                              subject=desired.origin) from None
        try:
            plans.append(plan_gpu(gpu, desired))
        except NoFit as e:
            raise ConfigError(f"{desired.origin}: GPU {index}: {e.reason}", subject=desired.origin) from None
    return Plan(selection.config, tuple(plans), selection.skipped)
