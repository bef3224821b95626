"""The one ledger of which plane offers each GPU when both serve a node (``[device_plugin] plane = "both"``),
and the pure planning of a move between them. No I/O: the DRA plane component applies what this decides.

A GPU is offered by exactly one plane, or by none while it moves: a move first withdraws the GPU from the
plane it leaves (the device plugin stops listing it, the ResourceSlices drop it), then waits until nothing
holds it there (a pod given one of its device-plugin devices, a claim prepared on it), and only then
offers it in the other plane. A held GPU stays withdrawn and assigned to the plane it leaves; it moves
by itself once its last holder is gone.

    split = PlaneSplit.initial(frozenset({0, 1}))              # [dra] gpus = [0, 1] at start
    split = split.toward(frozenset({1, 2}), all_gpus)           # a reload: GPU 0 leaves DRA, GPU 2 the plugin
    moved, split = split.settle({0: ("claim ml/a",)})           # GPU 2 was free: it moves; GPU 0 waits
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from nodeagent.config import AgentConfig
from nodeagent.errors import ConfigError

LEDGER_FILE = "planes.json"  # in the state directory: the split, so a restart keeps a move under way waiting

DRA = "DRA"
PLUGIN = "the device plugin"


@dataclass(frozen=True)
class Move:
    """One GPU changing plane: ``source`` and ``target`` are ``DRA`` or ``PLUGIN``."""

    gpu: int
    source: str
    target: str

    def __str__(self) -> str:
        return f"GPU {self.gpu} from {self.source} to {self.target}"


@dataclass(frozen=True)
class PlaneSplit:
    """Which plane offers each GPU. ``dra``: offered by DRA; ``to_dra``: withdrawn from the device plugin,
    waiting for its holders before DRA offers it; ``to_plugin``: withdrawn from DRA's slices (its prepared
    claims still answered), waiting the same way. Every other GPU of the node is the device plugin's."""

    dra: frozenset[int] = frozenset()
    to_dra: frozenset[int] = frozenset()
    to_plugin: frozenset[int] = frozenset()

    @classmethod
    def initial(cls, dra_gpus: Iterable[int]) -> PlaneSplit:
        return cls(dra=frozenset(dra_gpus))

    @property
    def moving(self) -> frozenset[int]:
        return self.to_dra | self.to_plugin

    @property
    def plugin_excluded(self) -> frozenset[int]:
        """The GPUs the device plugin must not list: DRA's and every GPU on its way between the planes."""
        return self.dra | self.moving

    @property
    def dra_served(self) -> frozenset[int]:
        """The GPUs whose devices the DRA driver knows (answers prepared claims for): its own and those
        leaving it; only ``dra`` is in the slices."""
        return self.dra | self.to_plugin

    @property
    def wanted_dra(self) -> frozenset[int]:
        """Where the split is heading: the GPUs DRA serves once every move is done."""
        return self.dra | self.to_dra

    def to_dict(self) -> dict[str, list[int]]:
        return {"dra": sorted(self.dra), "to_dra": sorted(self.to_dra), "to_plugin": sorted(self.to_plugin)}

    @classmethod
    def from_dict(cls, raw: object) -> PlaneSplit:
        """The split ``to_dict`` wrote; ``ValueError`` naming what is wrong otherwise."""
        if not isinstance(raw, dict) or set(raw) != {"dra", "to_dra", "to_plugin"}:
            raise ValueError("expected the keys dra, to_dra, to_plugin")
        sets: dict[str, frozenset[int]] = {}
        for key, value in raw.items():
            if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) or v < 0
                                                  for v in value):
                raise ValueError(f"{key}: expected a list of GPU indices")
            sets[key] = frozenset(value)
        if (sets["dra"] & sets["to_dra"]) or (sets["dra"] & sets["to_plugin"]) or (sets["to_dra"] & sets["to_plugin"]):
            raise ValueError("a GPU is in two places")
        return cls(**sets)

    def toward(self, wanted_dra: frozenset[int], gpus: Collection[int]) -> PlaneSplit:
        """The split right after a new ``[dra] gpus`` (``gpus``: every GPU of the node): GPUs that change
        plane are withdrawn from the one they leave. A GPU still on its way whose target is its source
        again returns there at once (it never left its holders' plane)."""
        to_dra = (self.to_dra | (frozenset(gpus) - self.dra - self.moving)) & wanted_dra
        to_plugin = (self.to_plugin | self.dra) - wanted_dra
        dra = (self.dra | self.to_plugin) & wanted_dra - to_plugin
        return PlaneSplit(dra=frozenset(dra), to_dra=frozenset(to_dra), to_plugin=frozenset(to_plugin))

    def settle(self, held: Mapping[int, Collection[object]]) -> tuple[list[Move], PlaneSplit]:
        """The moves that may finish now (GPUs on their way that nothing in ``held`` holds), in GPU order,
        and the split once they are done."""
        free_to_dra = {g for g in self.to_dra if not held.get(g)}
        free_to_plugin = {g for g in self.to_plugin if not held.get(g)}
        moves = sorted([Move(g, PLUGIN, DRA) for g in free_to_dra] + [Move(g, DRA, PLUGIN) for g in free_to_plugin],
                       key=lambda m: m.gpu)
        return moves, PlaneSplit(dra=self.dra | free_to_dra, to_dra=self.to_dra - free_to_dra,
                                 to_plugin=self.to_plugin - free_to_plugin)

    def blocked(self, held: Mapping[int, Collection[object]]) -> dict[int, Move]:
        """GPU → the move its holders keep waiting (only GPUs on their way that something holds)."""
        out = {g: Move(g, PLUGIN, DRA) for g in self.to_dra if held.get(g)}
        out.update({g: Move(g, DRA, PLUGIN) for g in self.to_plugin if held.get(g)})
        return dict(sorted(out.items()))


def check_dra_gpus(dra_gpus: Iterable[int], gpus: Collection[int], where: str) -> None:
    """Refuse a ``[dra] gpus`` that names a GPU the node does not have (one line naming the key)."""
    unknown = sorted(set(dra_gpus) - set(gpus))
    if unknown:
        have = ", ".join(map(str, sorted(gpus))) or "none"
        raise ConfigError(f"{where}: key 'dra.gpus' names GPU {', '.join(map(str, unknown[:8]))}"
                          f"{' ...' if len(unknown) > 8 else ''}, which this node does not have "
                          f"(GPU indices: {have})", subject="dra.gpus")


def only_the_split_changed(old: AgentConfig, new: AgentConfig, changed: Collection[str]) -> bool:
    """A reload whose only change is ``[dra] gpus`` while plane "both" stays: the GPUs move between the
    running planes instead of both being rebuilt."""
    return (set(changed) == {"dra"} and old.device_plugin.plane == new.device_plugin.plane == "both"
            and old.dra.gpus != new.dra.gpus and dataclasses.replace(old.dra, gpus=new.dra.gpus) == new.dra)
