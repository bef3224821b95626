"""Recovery after the agent died in the middle of a MIG apply (issue 8's kill -9 drill, in process).

A death is emulated by ``Killed`` (a BaseException, so no ``except Exception`` in the applier catches it
and no rollback runs — exactly what SIGKILL leaves: the simulator state and the MIG state file as they
were at that instant). ``DyingAdapter`` raises it before, after or in the middle of the n-th call of one
adapter operation; "in the middle" uses the simulator's fail-next faults so that, e.g., a GPU instance
exists whose compute instance was never created.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml
import pytest

from nodeagent.errors import NvmlError, OperationError
from nodeagent.gpu.inventory import GpuProcess, Inventory, MigDevice, MigProfile
from nodeagent.gpu.nvml import NvmlAdapter
from nodeagent.mig.apply import Applier, GpuCheckpoint, MigStateFile, recover_interrupted
from nodeagent.mig.planner import Plan, plan
from nodeagent.mig.spec import parse_config, resolve
from nodeagent.nvmlsource import adapter_for_sim
from nodeagent.simulator import inject
from nodeagent.simulator.open import open_sim
from nodeagent.simulator.state import SimStore

UNKNOWN = int(pynvml.NVML_ERROR_UNKNOWN)


class Killed(BaseException):
    """The agent process died here."""


class DyingAdapter:
    """Delegates to the real adapter; dies at the ``nth`` call of ``op`` (``when``: before/after/inside)."""

    def __init__(self, inner: NvmlAdapter, op: str, nth: int, when: str) -> None:
        self.inner = inner
        self.op, self.nth, self.when = op, nth, when
        self.counts: dict[str, int] = {}

    def _call(self, op: str, call: Callable[[], Any]) -> Any:
        self.counts[op] = self.counts.get(op, 0) + 1
        if op != self.op or self.counts[op] != self.nth:
            return call()
        if self.when == "before":
            raise Killed(op)
        if self.when == "inside":
            try:
                call()
            except NvmlError as e:
                raise Killed(op) from e
            raise AssertionError(f"{op} was expected to fail half-way")
        call()
        raise Killed(op)

    def discover(self) -> Inventory:
        return self.inner.discover()

    @property
    def restricted_facts(self) -> tuple[str, ...]:
        return self.inner.restricted_facts

    def processes(self, index: int) -> tuple[GpuProcess, ...]:
        return self.inner.processes(index)

    def mig_mode(self, index: int) -> tuple[bool, bool]:
        return self.inner.mig_mode(index)

    def offered_profile(self, index: int, profile_name: str) -> MigProfile:
        return self.inner.offered_profile(index, profile_name)

    def set_mig_mode(self, index: int, enabled: bool) -> bool:
        result: bool = self._call("set_mig_mode", lambda: self.inner.set_mig_mode(index, enabled))
        return result

    def reset_gpu(self, index: int) -> None:
        self._call("reset_gpu", lambda: self.inner.reset_gpu(index))

    def create_mig_device(self, index: int, profile_name: str, placement_start: int | None = None) -> MigDevice:
        dev: MigDevice = self._call("create", lambda: self.inner.create_mig_device(index, profile_name,
                                                                                     placement_start))
        return dev

    def destroy_mig_device(self, index: int, gi_id: int) -> None:
        self._call("destroy", lambda: self.inner.destroy_mig_device(index, gi_id))


def sim(machine: str) -> tuple[NvmlAdapter, SimStore]:
    nvml = open_sim(machine)
    return adapter_for_sim(nvml), nvml.store


CONFIG = "version: v1\nmig-configs:\n  c:\n    - devices: [0, 1, 2]\n      mig-enabled: true\n" \
         "      mig-devices: {1g.10gb: 7}\n"


def make_plan(adapter: NvmlAdapter, text: str = CONFIG) -> tuple[Inventory, Plan]:
    inv = adapter.discover()
    n, entries = parse_config(text, "t.yaml").select("c")
    return inv, plan(inv, resolve(n, entries, inv))


def layouts(adapter: NvmlAdapter) -> dict[int, GpuCheckpoint]:
    return {g.index: GpuCheckpoint.of(g) for g in adapter.discover().gpus}


def orphans(adapter: NvmlAdapter) -> dict[int, int]:
    return {g.index: len(g.bare_gpu_instances) for g in adapter.discover().gpus if g.bare_gpu_instances}


def h100_old_layout() -> tuple[NvmlAdapter, SimStore]:
    """GPU 0 and 1 with 2 x 3g.40gb, GPU 2 MIG off; the config turns GPUs 0-2 into 7 x 1g.10gb."""
    adapter, store = sim("dgx-h100")
    inject.write_mig_layout(store, 0, ["3g.40gb", "3g.40gb"])
    inject.write_mig_layout(store, 1, ["3g.40gb", "3g.40gb"])
    return adapter, store


# (operation, n-th call, when) — the plan runs: destroy GPU0 x2, GPU1 x2; mode on GPU 2;
# create 7 on GPU 0, 7 on GPU 1, 7 on GPU 2.
KILL_POINTS = [
    ("destroy", 1, "before"),
    ("destroy", 1, "inside"),  # compute instance gone, GPU instance left: an orphan of the OLD layout
    ("destroy", 3, "after"),
    ("set_mig_mode", 1, "before"),
    ("set_mig_mode", 1, "after"),  # GPU 2 in MIG mode without instances
    ("create", 1, "inside"),  # GPU instance created, compute instance not: the reported defect
    ("create", 1, "after"),
    ("create", 10, "inside"),  # GPU 1 half built
    ("create", 15, "before"),
    ("create", 21, "after"),  # everything built, the state file not yet updated
]


def arrange_inside(store: SimStore, op: str, nth: int) -> None:
    """Faults that make the n-th ``op`` stop half-way (and the adapter's own clean-up fail too)."""
    if op == "destroy":
        # GpuInstanceDestroy fails after the compute instances were destroyed
        inject.fail_next(store, "nvmlGpuInstanceDestroy", UNKNOWN, after=nth - 1)
    elif op == "create":
        inject.fail_next(store, "nvmlGpuInstanceCreateComputeInstance", UNKNOWN, after=nth - 1)
        inject.fail_next(store, "nvmlGpuInstanceDestroy", UNKNOWN, after=4)  # 4 destroys ran before


@pytest.mark.parametrize(("op", "nth", "when"), KILL_POINTS, ids=[f"{o}{n}-{w}" for o, n, w in KILL_POINTS])
def test_kill_anywhere_then_recover_gives_old_or_new_then_new(tmp_path: Path, op: str, nth: int,
                                                               when: str) -> None:
    adapter, store = h100_old_layout()
    old = layouts(adapter)
    inv, p = make_plan(adapter)
    new = {g.index: GpuCheckpoint.target(g) for g in p.gpus}
    state = MigStateFile(tmp_path)
    if when == "inside":
        arrange_inside(store, op, nth)
    with pytest.raises(Killed):
        Applier(DyingAdapter(adapter, op, nth, when), state=state).apply(p, inv)
    inject.recover(store)  # drop unused faults: the next agent runs on a healthy machine
    assert state.inflight(), "the in-flight record must survive the death"
    if when == "inside":
        assert orphans(adapter), "the kill point must leave a GPU instance without a compute instance"

    recovery = recover_interrupted(adapter, state)
    assert recovery is not None
    after = layouts(adapter)
    assert not orphans(adapter)
    for i in range(8):
        assert after[i] in (old[i], new.get(i, old[i])), f"GPU {i} is a mix: {after[i]}"
    assert set(recovery.gpus) == {0, 1, 2}
    assert state.inflight() == []
    # Old layouts come back at their exact placements.
    for i in recovery.restored:
        assert after[i] == old[i]
    # Then the selected config is applied normally and ends in the new layout.
    inv, p2 = make_plan(adapter)
    Applier(adapter, state=state).apply(p2, inv)
    final = layouts(adapter)
    for i in range(8):
        assert final[i] == new.get(i, old[i])
    doc = state.load()
    assert doc is not None and doc["inflight"] is None
    assert doc["phase"] == ("success" if p2.touched else "applying")  # nothing left to do: no new run


def test_kill_after_everything_built_keeps_the_new_layout(tmp_path: Path) -> None:
    adapter, _ = h100_old_layout()
    inv, p = make_plan(adapter)
    state = MigStateFile(tmp_path)
    with pytest.raises(Killed):
        Applier(DyingAdapter(adapter, "create", 21, "after"), state=state).apply(p, inv)
    uuids = {d.uuid for g in adapter.discover().gpus for d in g.mig_devices}
    recovery = recover_interrupted(adapter, state)
    assert recovery is not None and recovery.at_target == (0, 1, 2) and recovery.restored == ()
    assert {d.uuid for g in adapter.discover().gpus for d in g.mig_devices} == uuids  # nothing recreated
    assert "already complete in the new layout" in recovery.describe()


def test_ampere_kill_between_mode_change_and_reset(tmp_path: Path) -> None:
    adapter, store = sim("dgx-a100-40gb")
    for i in range(8):  # a held device keeps a mode change pending until the applier resets the GPU
        inject.hold_device(store, i, "nvidia-persistenced")
    old = layouts(adapter)
    inv, p = make_plan(adapter, CONFIG.replace("1g.10gb", "1g.5gb"))
    state = MigStateFile(tmp_path)
    with pytest.raises(Killed):
        Applier(DyingAdapter(adapter, "reset_gpu", 2, "before"), state=state).apply(p, inv)
    g1 = adapter.discover().gpu(1)
    assert (g1.mig_current, g1.mig_pending) == (False, True)  # pending mode, reset never happened
    recovery = recover_interrupted(adapter, state)
    assert recovery is not None and recovery.restored == (0, 1) and recovery.intact == (2,)
    assert layouts(adapter) == old  # MIG off again, nothing pending


def test_no_record_means_nothing_to_recover(tmp_path: Path) -> None:
    adapter, _ = h100_old_layout()
    state = MigStateFile(tmp_path)
    assert recover_interrupted(adapter, state) is None
    inv, p = make_plan(adapter)
    Applier(adapter, state=state).apply(p, inv)
    assert recover_interrupted(adapter, state) is None  # a finished apply leaves no record
    doc = state.load()
    assert doc is not None and doc["checkpoint"][0]["instances"] == [["3g.40gb", 0], ["3g.40gb", 4]]


def test_kill_during_recovery_then_recover_again(tmp_path: Path) -> None:
    adapter, store = h100_old_layout()
    old = layouts(adapter)
    inv, p = make_plan(adapter)
    state = MigStateFile(tmp_path)
    arrange_inside(store, "create", 10)
    with pytest.raises(Killed):
        Applier(DyingAdapter(adapter, "create", 10, "inside"), state=state).apply(p, inv)
    inject.recover(store)
    steps: list[str] = []

    def die_on_third(step: str) -> None:
        steps.append(step)
        if len(steps) == 3:
            raise Killed(step)

    with pytest.raises(Killed):
        recover_interrupted(adapter, state, on_step=die_on_third)
    assert state.inflight(), "a recovery that died keeps the record"
    recovery = recover_interrupted(adapter, state)
    assert recovery is not None and recovery.at_target == (0,) and recovery.restored == (1, 2)
    after = layouts(adapter)
    assert after[0] == GpuCheckpoint.target(p.gpus[0])  # finished before the first death: kept
    assert {i: after[i] for i in range(1, 8)} == {i: old[i] for i in range(1, 8)}
    assert not orphans(adapter)


def test_recovery_that_cannot_restore_fails_and_keeps_the_record(tmp_path: Path) -> None:
    adapter, store = h100_old_layout()
    inv, p = make_plan(adapter)
    state = MigStateFile(tmp_path)
    with pytest.raises(Killed):
        Applier(DyingAdapter(adapter, "create", 3, "after"), state=state).apply(p, inv)
    gi = adapter.discover().gpu(0).mig_devices[0].gi_id
    inject.inject_process(store, 0, 999, "squatter", gi_id=gi)  # pins one of the new instances
    with pytest.raises(OperationError, match=r"interrupted MIG apply .*FAILED: GPU 0: "):
        recover_interrupted(adapter, state)
    assert [r.checkpoint.index for r in state.inflight()] == [0, 1, 2]
    doc = state.load()
    assert doc is not None and doc["phase"] == "failed"
    inject.kill_process(store, 0)
    recovery = recover_interrupted(adapter, state)
    assert recovery is not None and 0 in recovery.restored


def test_record_of_another_gpu_is_ignored(tmp_path: Path) -> None:
    adapter, _ = h100_old_layout()
    inv, p = make_plan(adapter)
    state = MigStateFile(tmp_path)
    with pytest.raises(Killed):
        Applier(DyingAdapter(adapter, "create", 2, "after"), state=state).apply(p, inv)
    doc = state.load()
    assert doc is not None
    doc["inflight"]["gpus"][0]["checkpoint"]["uuid"] = "GPU-00000000-0000-0000-0000-000000000000"
    state.save(doc)
    recovery = recover_interrupted(adapter, state)
    assert recovery is not None and recovery.ignored == (0,) and recovery.restored == (1, 2)
    assert len(adapter.discover().gpu(0).mig_devices) == 2  # left alone: the record was not about it


def test_malformed_record_is_ignored(tmp_path: Path) -> None:
    adapter, _ = h100_old_layout()
    state = MigStateFile(tmp_path)
    state.path.write_text(json.dumps({"phase": "applying", "inflight": {"gpus": [{"nope": 1}]}}))
    assert recover_interrupted(adapter, state) is None


def test_planner_destroys_orphan_gpu_instances_and_apply_succeeds(tmp_path: Path) -> None:
    """Without any recovery: bare GPU instances are planned as destroys, never kept, and verified gone."""
    adapter, store = h100_old_layout()
    inv, p = make_plan(adapter)
    arrange_inside(store, "create", 2)
    with pytest.raises(Killed):
        Applier(DyingAdapter(adapter, "create", 2, "inside")).apply(p, inv)
    inject.recover(store)
    assert orphans(adapter) == {0: 1}
    inv, p2 = make_plan(adapter)
    g0 = p2.gpus[0]
    bare = [d for d in g0.destroy if d.ci_id == -1]
    assert len(bare) == 1 and "no compute instance" in g0.describe()
    assert not any(d.ci_id == -1 for d in g0.keep)
    Applier(adapter).apply(p2, inv)
    assert not orphans(adapter)
    assert all(len(adapter.discover().gpu(i).mig_devices) == 7 for i in (0, 1, 2))


def test_orphan_on_matching_layout_makes_the_gpu_change() -> None:
    adapter, store = sim("dgx-h100")
    inject.write_mig_layout(store, 0, ["3g.40gb"])
    # an orphan 3g.40gb at the other start: the layout "has" one 3g.40gb, the config wants exactly that
    inject.fail_next(store, "nvmlGpuInstanceCreateComputeInstance", UNKNOWN)
    inject.fail_next(store, "nvmlGpuInstanceDestroy", UNKNOWN)
    with pytest.raises(NvmlError):
        adapter.create_mig_device(0, "3g.40gb", 0)
    text = "version: v1\nmig-configs:\n  c:\n    - devices: [0]\n      mig-enabled: true\n" \
           "      mig-devices: {3g.40gb: 1}\n"
    inv, p = make_plan(adapter, text)
    assert [g.index for g in p.touched] == [0]
    assert [d.ci_id for d in p.gpus[0].destroy] == [-1] and len(p.gpus[0].keep) == 1
    Applier(adapter).apply(p, inv)
    assert not orphans(adapter)
    assert GpuCheckpoint.of(adapter.discover().gpu(0)).instances == (("3g.40gb", 4),)


def test_apply_without_recovery_rolls_back_to_the_recorded_checkpoint(tmp_path: Path) -> None:
    """A caller that skips recovery (e.g. ``mig apply`` after a crash) and then fails must not restore the
    half-built layout: the leftover record's checkpoints stay the rollback targets."""
    adapter, store = h100_old_layout()
    old = layouts(adapter)
    inv, p = make_plan(adapter)
    state = MigStateFile(tmp_path)
    with pytest.raises(Killed):
        Applier(DyingAdapter(adapter, "create", 10, "after"), state=state).apply(p, inv)
    inv, p2 = make_plan(adapter)  # planned from the mixed layout
    inject.fail_next(store, "nvmlDeviceCreateGpuInstanceWithPlacement", UNKNOWN, after=3)
    with pytest.raises(OperationError, match="restored to their previous layout"):
        Applier(adapter, state=state).apply(p2, inv)
    assert layouts(adapter) == old
    assert state.inflight() == []
