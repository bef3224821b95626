"""The inputs of the no-drain MIG wait: ``mig.release_timeout``, which pods and which ResourceClaims hold
which GPU, and how the holders are named (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nodeagent.config import parse_config
from nodeagent.dra.checkpoint import PREPARED, PREPARING, Checkpoint, ClaimRecord, MigInstance, PreparedDevice
from nodeagent.dra.devices import device_gpu_index
from nodeagent.dra.service import ClaimPreparer, ClaimRef
from nodeagent.errors import ConfigError
from nodeagent.kube.podresources import (
    Assignment,
    ClaimAssignment,
    assignments_from_response,
    claim_assignments_from_response,
    holders_by_gpu,
)
from nodeagent.kube.podresources_api import podresources_pb2 as pb
from nodeagent.mig.reconciler import ClaimHolder, Holder, _describe_holders


def test_release_timeout_default_zero_and_negative() -> None:
    assert parse_config("", "c.toml").mig.release_timeout == 300.0
    assert parse_config("[mig]\nrelease_timeout = 0\n", "c.toml").mig.release_timeout == 0.0
    with pytest.raises(ConfigError) as e:
        parse_config("[mig]\nrelease_timeout = -1\n", "c.toml")
    assert str(e.value) == "c.toml: key 'mig.release_timeout' must not be negative, got -1.0"
    with pytest.raises(ConfigError, match=r"key 'mig.release_timeout' must be a number, got '5m'$"):
        parse_config('[mig]\nrelease_timeout = "5m"\n', "c.toml")


def test_holders_by_gpu_names_every_pod_once_per_gpu() -> None:
    gpus = {("nvidia.com/gpu", "GPU-a"): 0, ("nvidia.com/gpu", "GPU-a::1"): 0,
            ("nvidia.com/mig-1g.10gb", "MIG-b"): 3}
    assignments = [
        Assignment("ml", "train", "main", "nvidia.com/gpu", ("GPU-a",)),
        Assignment("ml", "train", "side", "nvidia.com/gpu", ("GPU-a::1",)),  # same pod, other container
        Assignment("web", "infer", "c", "nvidia.com/mig-1g.10gb", ("MIG-b", "MIG-c")),
        Assignment("ab", "eval", "c", "nvidia.com/gpu", ("GPU-a",)),
        # same ID under a resource these GPUs do not give: not theirs
        Assignment("x", "other", "c", "example.com/gpu", ("GPU-a",)),
    ]
    assert holders_by_gpu(assignments, gpus) == {0: ("ab/eval", "ml/train"), 3: ("web/infer",)}
    assert holders_by_gpu(assignments, {}) == {}
    assert holders_by_gpu([], gpus) == {}


def test_claims_reported_by_podresources_are_read() -> None:
    resp = pb.ListPodResourcesResponse(pod_resources=[
        pb.PodResources(name="p", namespace="ml", containers=[
            pb.ContainerResources(name="c", dynamic_resources=[
                pb.DynamicResource(claim_name="c1", claim_namespace="ml", claim_resources=[
                    pb.ClaimResource(driver_name="gpu.nodeagent.io", pool_name="n1", device_name="gpu-2"),
                    pb.ClaimResource(driver_name="gpu.nodeagent.io", pool_name="n1", device_name="gpu-3-mig-1-0"),
                ]),
                pb.DynamicResource(claim_name="c2", claim_resources=[]),  # no namespace: the pod's
            ]),
        ]),
    ])
    assert assignments_from_response(resp) == []
    assert claim_assignments_from_response(resp) == [
        ClaimAssignment("ml", "p", "c", "ml", "c1", (("gpu.nodeagent.io", "n1", "gpu-2"),
                                                     ("gpu.nodeagent.io", "n1", "gpu-3-mig-1-0"))),
        ClaimAssignment("ml", "p", "c", "ml", "c2", ()),
    ]
    assert claim_assignments_from_response(resp)[0].claim == "ml/c1"


def test_device_names_of_the_dra_pool_carry_their_gpu() -> None:
    assert device_gpu_index("gpu-3") == 3
    assert device_gpu_index("gpu-12-mig-1-0") == 12
    assert device_gpu_index("gpu-0-mig-1g-10gb-plus-me-at-6") == 0
    assert [device_gpu_index(n) for n in ("gpu-0-counters", "gpu-x", "nic-0", "gpu-")] == [None] * 4


def test_claims_on_maps_every_recorded_claim_to_its_gpu(tmp_path: Path) -> None:
    from nodeagent.dra.cdi import ClaimSpecs

    def dev(name: str, pool: str = "n1", mig: MigInstance | None = None) -> PreparedDevice:
        return PreparedDevice(("r",), pool, name, (), mig)

    cp = Checkpoint(tmp_path / "dra-claims.json")
    cp.claims["u1"] = ClaimRecord("u1", "ml", "whole", PREPARED, (dev("gpu-1"),))
    cp.claims["u2"] = ClaimRecord("u2", "ml", "static", PREPARED, (dev("gpu-2-mig-1-0"),))
    cp.claims["u3"] = ClaimRecord("u3", "ab", "dyn", PREPARING, (
        dev("gpu-0-mig-2g-10gb-at-2", mig=MigInstance(0, "GPU-0", "2g.10gb", 2)),))
    cp.claims["u4"] = ClaimRecord("u4", "x", "elsewhere", PREPARED, (dev("gpu-1", pool="other-node"),))
    cp.claims["u5"] = ClaimRecord("u5", "ml", "two", PREPARED, (dev("gpu-1"), dev("gpu-2")))
    p = ClaimPreparer(cp, ClaimSpecs(tmp_path / "cdi"), lambda ns, name: {}, "n1")
    assert p.claims_on(frozenset(range(8))) == {
        0: (ClaimRef("ab", "u3", "dyn"),),
        1: (ClaimRef("ml", "u5", "two"), ClaimRef("ml", "u1", "whole")),
        2: (ClaimRef("ml", "u2", "static"), ClaimRef("ml", "u5", "two")),
    }
    assert p.claims_on(frozenset({0, 5})) == {0: (ClaimRef("ab", "u3", "dyn"),)}
    assert p.claims_on(frozenset()) == {}


def test_holders_named_in_one_line() -> None:
    held: dict[int, tuple[Holder, ...]] = {
        3: ("x/y", ClaimHolder("ml/c2"), ClaimHolder("ml/c1", ("ml/p", "ml/q"))),
        0: ("ml/a", "ml/b"),
        1: (ClaimHolder("ab/c", ("ab/p",)),),
    }
    assert _describe_holders(held) == (
        "GPU 0 is held by pods ml/a, ml/b; GPU 1 is held by claim ab/c (pod ab/p); "
        "GPU 3 is held by pod x/y and claim ml/c1 (pods ml/p, ml/q) and claim ml/c2")


def test_claims_are_unknown_while_the_dra_plane_that_serves_the_gpus_is_away() -> None:
    from nodeagent.daemon.components.mig import PlaneClaims
    from nodeagent.daemon.shared import DraLink
    from nodeagent.errors import OperationError
    from nodeagent.gpu.inventory import Inventory

    class Plane:
        async def withdraw(self, gpu_indices: set[int]) -> None: ...

        async def readvertise(self, gpu_indices: set[int]) -> None: ...

        async def update(self, inventory: Inventory) -> None: ...

        def claims_on(self, gpu_indices: frozenset[int]) -> dict[int, tuple[ClaimRef, ...]]:
            return {1: (ClaimRef("ml", "u", "c"),)} if 1 in gpu_indices else {}

    link = DraLink()
    everything = PlaneClaims(link, lambda: None)  # plane "dra": every GPU
    some = PlaneClaims(link, lambda: frozenset({1, 2}))  # plane "both" with [dra] gpus = [1, 2]
    none = PlaneClaims(link, frozenset)  # plane "device-plugin"
    with pytest.raises(OperationError) as e:
        everything.claims_on(frozenset({0, 3}))
    assert str(e.value) == "the DRA plane is not running: claims prepared on GPU(s) 0, 3 are unknown"
    with pytest.raises(OperationError, match=r"GPU\(s\) 2 are unknown$"):
        some.claims_on(frozenset({0, 2}))
    assert some.claims_on(frozenset({0, 3})) == {}  # GPUs the plane does not serve: no claim there
    assert none.claims_on(frozenset({0, 1})) == {}
    plane = Plane()
    link.attach(plane)
    assert everything.claims_on(frozenset({0, 1})) == {1: (ClaimRef("ml", "u", "c"),)}
    link.detach(plane)
    with pytest.raises(OperationError):
        some.claims_on(frozenset({1}))
