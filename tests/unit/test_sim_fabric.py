"""Simulated racks: placement, the fabric manager's bring-up state machine, faults through `nodeagent sim`,
the conditions and metrics built from them (pure parts and the CLI, no daemon)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nodeagent.cli import main
from nodeagent.errors import InputError
from nodeagent.gpu.fabric import CliqueReason, decide
from nodeagent.gpu.nvml import NvmlAdapter
from nodeagent.kube.conditions import (
    IMEX_READY,
    NVLINK_CLIQUE_READY,
    ConditionSnapshot,
    ImexInput,
    build_conditions,
)
from nodeagent.metrics import fabric_families
from nodeagent.simulator import nvml_fabric
from nodeagent.simulator.nvml import SimulatedNvml
from nodeagent.simulator.state import SimStore


def _inv(store: SimStore):  # type: ignore[no-untyped-def]
    return NvmlAdapter(SimulatedNvml(store)).discover()


def test_bring_up_walks_not_started_in_progress_completed() -> None:
    store = SimStore.open("gb300-nvl", None)
    nvml_fabric.bring_up(store, 10)
    st = store.read()
    start = st["fabric"]["bringup_start"]
    states = [nvml_fabric.current(store.machine, st, 0, now=start + t)["state"] for t in (1, 6, 11)]
    assert states == [1, 2, 3]
    assert nvml_fabric.current(store.machine, st, 0, now=start + 1)["cluster"].int == 0  # no cluster yet
    assert decide(_inv(store)).reason is CliqueReason.NOT_STARTED


def test_racks_and_cliques_share_or_split_the_cluster() -> None:
    a, b, c = (SimStore.open("gb200-nvl", None) for _ in range(3))
    nvml_fabric.place(b, clique=2)  # two cliques in one rack
    nvml_fabric.place(c, rack="rack-7", node=18)  # a node of another rack
    va, vb, vc = (decide(_inv(s)).value for s in (a, b, c))
    assert va and vb and vc
    assert va.rsplit(".", 1)[0] == vb.rsplit(".", 1)[0] and va.endswith(".1") and vb.endswith(".2")
    assert vc.rsplit(".", 1)[0] != va.rsplit(".", 1)[0]
    with pytest.raises(InputError, match=r"node slot must be 1\.\.18"):
        nvml_fabric.place(a, node=19)
    with pytest.raises(InputError, match="not a compute tray"):
        nvml_fabric.place(SimStore.open("dgx-h100", None), clique=1)


def test_cli_injects_fabric_faults(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = str(tmp_path / "state.json")

    def run(argv: list[str]) -> tuple[int, str]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        out = capsys.readouterr()
        return int(e.value.code or 0), out.out + out.err

    sim = ["--simulate", "gb200-nvl", "--sim-state", state]
    assert run(["sim", "fabric", "--rack", "r2", "--clique", "3", *sim])[0] == 0
    assert run(["sim", "inject", "fabric", "--degraded-bandwidth", *sim])[0] == 0
    store = SimStore.open("gb200-nvl", Path(state))
    d = decide(_inv(store))
    assert d.value and d.value.endswith(".3") and d.degraded[0] == "GPU 0: degraded bandwidth"
    assert run(["sim", "inject", "fabric", "--status", "NOT_READY", *sim])[0] == 0
    assert decide(_inv(store)).reason is CliqueReason.FABRIC_ERROR
    assert run(["sim", "inject", "fabric", "--heal", "--gpu", "1", "--clique", "9", *sim])[0] == 0
    assert decide(_inv(store)).reason is CliqueReason.DISAGREE
    code, text = run(["sim", "inject", "fabric", "--gpu", "1", *sim])
    assert code == 2 and "--gpu and --clique go together" in text
    assert run(["sim", "inject", "xid", "--gpu", "0", "--code", "154", "--recovery-action", "recover-imex-domain",
                *sim])[0] == 0
    assert json.loads(Path(state).read_text())["gpus"][0]["recovery_action"] == 5  # RECOVER_IMEX_DOMAIN


def test_conditions_and_metrics_of_a_rack_node() -> None:
    store = SimStore.open("gb200-nvl", None)
    nvml_fabric.set_fabric(store, state="in-progress")
    inv = _inv(store)
    conds = {c.type: c for c in build_conditions(ConditionSnapshot(
        fabric=decide(inv), imex=ImexInput(running=True, ready=False, peers=2, answer="NOT_READY", clique="x.1")))}
    assert (conds[NVLINK_CLIQUE_READY].status, conds[NVLINK_CLIQUE_READY].reason) == ("False", "FabricInProgress")
    assert (conds[IMEX_READY].status, conds[IMEX_READY].reason) == ("False", "DomainNotReady")
    assert len(build_conditions(ConditionSnapshot())) == 4  # nothing of racks on other nodes
    families = {f.name: f for f in fabric_families(inv)}
    assert [s.value for s in families["nodeagent_gpu_fabric_state"].samples] == [2, 2, 2, 2]
    label = families["nodeagent_nvlink_clique_label"].samples
    assert len(label) == 1 and label[0].value == 0 and label[0].labels["reason"] == "FabricInProgress"
