"""The per-claim DRA CDI spec names device nodes as the node-wide CDI spec does: under ``--root`` (a
simulated host) with the host path and the stand-in's numbers, on a real host by path alone."""

from __future__ import annotations

from pathlib import Path

from nodeagent.cdi import simhost
from nodeagent.cdi.host import collect
from nodeagent.dra.cdi import claim_spec
from nodeagent.dra.devices import build_devices
from nodeagent.hostpaths import HostPaths
from tests.unit._dp_inventories import mig_box


def test_claim_spec_uses_the_host_facts_of_a_simulated_root(tmp_path: Path) -> None:
    inv = mig_box(per_gpu=1, gpus_on=1, gpus_off=1)
    paths = HostPaths(tmp_path)
    simhost.materialise(paths, inv)
    facts = collect(paths, inv).nodes
    spec = claim_spec("uid-1", build_devices(inv), facts)
    nodes = [n for d in spec["devices"] for n in d["containerEdits"]["deviceNodes"]]
    nodes += spec["containerEdits"]["deviceNodes"]
    assert {n["path"] for n in nodes} >= {"/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl"}
    for n in nodes:
        assert n["hostPath"] == str(tmp_path) + n["path"], n
        assert n["type"] == "c" and isinstance(n["major"], int) and isinstance(n["minor"], int), n
        assert Path(n["hostPath"]).exists()
    gpu1 = next(n for n in nodes if n["path"] == "/dev/nvidia1")
    assert gpu1["minor"] == 1


def test_claim_spec_without_facts_names_paths_only() -> None:
    spec = claim_spec("uid-1", build_devices(mig_box(per_gpu=1, gpus_on=1, gpus_off=1)), {})
    nodes = [n for d in spec["devices"] for n in d["containerEdits"]["deviceNodes"]]
    assert all(set(n) == {"path"} for n in nodes + spec["containerEdits"]["deviceNodes"])
