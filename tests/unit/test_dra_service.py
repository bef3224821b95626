"""NodePrepareResources / NodeUnprepareResources / NodeWatchResources / registration over the real gRPC
sockets (our own generated client stubs), with claims handed in as ResourceClaim JSON."""

from __future__ import annotations

import asyncio
import json
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import grpc
import pytest

from nodeagent.dra.api import (
    health_pb2,
    health_pb2_grpc,
    reg_pb2,
    reg_pb2_grpc,
    v1_pb2,
    v1_pb2_grpc,
    v1beta1_pb2,
    v1beta1_pb2_grpc,
)
from nodeagent.dra.cdi import ClaimSpecs
from nodeagent.dra.checkpoint import PREPARED, Checkpoint
from nodeagent.dra.devices import build_devices
from nodeagent.dra.health import unhealthy_devices
from nodeagent.dra.server import DraServer
from nodeagent.dra.service import ClaimPreparer, ClaimRef
from nodeagent.errors import KubeError
from tests.unit._dp_inventories import mig_box

POOL = "node-a"
DRIVER = "gpu.nodeagent.io"


def claim(
    uid: str, name: str, devices: list[tuple[str, str]], *, pool: str = POOL, driver: str = DRIVER
) -> dict[str, Any]:
    results = [{"request": r, "driver": driver, "pool": pool, "device": d} for r, d in devices]
    return {
        "metadata": {"namespace": "ns", "name": name, "uid": uid},
        "status": {"allocation": {"devices": {"results": results}}},
    }


class Claims:
    """ResourceClaims by name, counting reads."""

    def __init__(self, *items: dict[str, Any]) -> None:
        self.items = {c["metadata"]["name"]: c for c in items}
        self.reads = 0

    def read(self, namespace: str, name: str) -> Mapping[str, Any]:
        self.reads += 1
        if name not in self.items:
            raise KubeError(f"get ResourceClaim {namespace}/{name}: HTTP 404", status=404)
        return self.items[name]


def make_preparer(tmp_path: Path, claims: Claims) -> ClaimPreparer:
    p = ClaimPreparer(
        Checkpoint.load(tmp_path / "state" / "dra-claims.json"),
        ClaimSpecs(tmp_path / "cdi"),
        claims.read,
        POOL,
    )
    p.set_devices(build_devices(mig_box(per_gpu=2, gpus_on=1, gpus_off=2)))
    return p


async def test_a_withdrawn_gpu_takes_no_new_claim_and_a_claim_in_flight_counts_as_holder(
    tmp_path: Path,
) -> None:
    claims = Claims(
        claim("u1", "one", [("gpu", "gpu-1")]),
        claim("u2", "two", [("gpu", "gpu-2")]),
        claim("u3", "three", [("gpu", "gpu-1")]),
    )
    p = make_preparer(tmp_path, claims)
    assert (await p.prepare([ClaimRef("ns", "u1", "one")]))["u1"].error == ""
    p.withdrawn = frozenset({1})  # a MIG change on GPU 1
    out = await p.prepare([ClaimRef("ns", "u1", "one"), ClaimRef("ns", "u3", "three")])
    assert out["u1"].error == "" and out["u1"].devices  # already prepared: still answered
    assert out["u3"].error == (
        "cannot prepare claim ns/three now: GPU 1 is being reconfigured (a MIG change, or a move to the device plugin); the kubelet retries"
    )
    assert "u3" not in p.checkpoint.claims and p.specs.claim_uids() == {"u1"}
    # while a claim is being written it is a holder of its GPU even before its record exists
    seen: list[dict[int, tuple[ClaimRef, ...]]] = []
    write = p._write

    def spying_write(ref: ClaimRef, wanted: Any, *rest: Any) -> Any:
        seen.append(p.claims_on(frozenset({2})))
        return write(ref, wanted, *rest)

    p._write = spying_write  # type: ignore[method-assign,assignment]
    assert (await p.prepare([ClaimRef("ns", "u2", "two")]))["u2"].error == ""
    assert seen == [{2: (ClaimRef("ns", "u2", "two"),)}]
    assert p.claims_on(frozenset({2})) == {2: (ClaimRef("ns", "u2", "two"),)}  # now from the checkpoint
    p.withdrawn = frozenset()
    assert (await p.prepare([ClaimRef("ns", "u3", "three")]))["u3"].error == ""


async def test_prepare_is_per_claim_idempotent_and_persisted(tmp_path: Path) -> None:
    claims = Claims(
        claim("u1", "one", [("gpu", "gpu-1")]),
        claim("u2", "two", [("a", "gpu-0-mig-1-0"), ("b", "gpu-0-mig-1-0"), ("c", "gpu-2")]),
        {"metadata": {"name": "unalloc", "uid": "u3"}, "status": {}},
        claim("u4", "foreign", [("gpu", "gpu-1")], pool="other-node"),
        claim("u5", "ghost", [("gpu", "gpu-9")]),
        claim("u6x", "replaced", [("gpu", "gpu-1")]),
    )
    p = make_preparer(tmp_path, claims)
    refs = [
        ClaimRef("ns", "u1", "one"),
        ClaimRef("ns", "u2", "two"),
        ClaimRef("ns", "u3", "unalloc"),
        ClaimRef("ns", "u4", "foreign"),
        ClaimRef("ns", "u5", "ghost"),
        ClaimRef("ns", "u6", "replaced"),
        ClaimRef("ns", "u7", "missing"),
    ]
    out = await p.prepare(refs)
    assert out["u1"].error == ""
    assert [(d.device, d.cdi_device_ids) for d in out["u1"].devices] == [
        ("gpu-1", ("gpu.nodeagent.io/claim=u1-gpu-1",))
    ]
    assert [(d.request_names, d.device) for d in out["u2"].devices] == [
        (("a", "b"), "gpu-0-mig-1-0"),
        (("c",), "gpu-2"),
    ]
    assert "not allocated" in out["u3"].error
    assert "pool other-node" in out["u4"].error
    assert "gpu-9 does not exist" in out["u5"].error
    assert "the claim was replaced" in out["u6"].error
    assert "HTTP 404" in out["u7"].error
    assert p.specs.claim_uids() == {"u1", "u2"}
    on_disk = json.loads((tmp_path / "state" / "dra-claims.json").read_text())
    assert sorted(on_disk["claims"]) == ["u1", "u2"]
    assert {c["state"] for c in on_disk["claims"].values()} == {PREPARED}

    reads = claims.reads
    again = await p.prepare([ClaimRef("ns", "u1", "one")])
    assert again["u1"] == out["u1"] and claims.reads == reads  # answered from the checkpoint

    # a new process (restart) answers from the checkpoint as well
    p2 = make_preparer(tmp_path, claims)
    assert p2.recover() == []
    assert (await p2.prepare([ClaimRef("ns", "u2", "two")]))["u2"] == out["u2"]
    assert claims.reads == reads

    un = await p2.unprepare(
        [ClaimRef("ns", "u1", "one"), ClaimRef("ns", "u1", "one"), ClaimRef("ns", "u9", "x")]
    )
    assert un == {"u1": "", "u9": ""}
    assert p2.specs.claim_uids() == {"u2"}
    assert sorted(Checkpoint.load(p2.checkpoint.path).claims) == ["u2"]


async def test_recovery_removes_orphaned_specs_and_restores_missing_ones(tmp_path: Path) -> None:
    claims = Claims(claim("u1", "one", [("gpu", "gpu-1")]), claim("u2", "two", [("gpu", "gpu-2")]))
    p = make_preparer(tmp_path, claims)
    await p.prepare([ClaimRef("ns", "u1", "one")])
    # a process killed after writing u2's spec but before recording it
    p.specs.write("u2", [p.devices["gpu-2"]])
    p.specs.remove("u1")  # and a prepared claim whose spec vanished (tmpfs /var/run after a reboot)

    p2 = make_preparer(tmp_path, claims)
    done = p2.recover()
    assert len(done) == 2, done
    assert p2.specs.claim_uids() == {"u1"}
    assert sorted(p2.checkpoint.claims) == ["u1"]
    # the kubelet retries the interrupted claim: prepared exactly once
    out = await p2.prepare([ClaimRef("ns", "u2", "two")])
    assert out["u2"].error == "" and p2.specs.claim_uids() == {"u1", "u2"}
    assert p2.recover() == []


async def test_bad_uid_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    claims = Claims(claim("../x", "bad", [("gpu", "gpu-1")]))
    p = make_preparer(tmp_path, claims)
    out = await p.prepare([ClaimRef("ns", "../x", "bad")])
    assert "claim UID" in out["../x"].error
    assert not (tmp_path / "state" / "dra-claims.json").exists() and p.specs.claim_uids() == set()


async def test_grpc_registration_prepare_and_health(
    served: tuple[DraServer, Claims], short_dir: Path
) -> None:
    server, _ = served
    for sock in (server.reg_path, server.dra_path):
        assert stat.S_ISSOCK(sock.stat().st_mode) and sock.stat().st_mode & 0o777 == 0o600
    assert server.reg_path == short_dir / "kubelet/plugins_registry/gpu.nodeagent.io-reg.sock"
    assert server.dra_path == short_dir / "kubelet/plugins/gpu.nodeagent.io/dra.sock"
    async with grpc.aio.insecure_channel(f"unix://{server.reg_path}") as ch:
        info = await reg_pb2_grpc.RegistrationStub(ch).GetInfo(reg_pb2.InfoRequest())
        assert (info.type, info.name, info.endpoint) == ("DRAPlugin", DRIVER, str(server.dra_path))
        assert list(info.supported_versions) == [
            "v1.DRAPlugin",
            "v1beta1.DRAPlugin",
            "v1alpha1.DRAResourceHealth",
        ]
        await reg_pb2_grpc.RegistrationStub(ch).NotifyRegistrationStatus(
            reg_pb2.RegistrationStatus(plugin_registered=True)
        )
        assert server.registered
    async with grpc.aio.insecure_channel(f"unix://{server.dra_path}") as ch:
        req = v1_pb2.NodePrepareResourcesRequest(claims=[v1_pb2.Claim(namespace="ns", uid="u1", name="one")])
        resp = await v1_pb2_grpc.DRAPluginStub(ch).NodePrepareResources(req)
        dev = resp.claims["u1"].devices[0]
        assert (list(dev.request_names), dev.pool_name, dev.device_name, list(dev.cdi_device_ids)) == (
            ["gpu"],
            POOL,
            "gpu-1",
            ["gpu.nodeagent.io/claim=u1-gpu-1"],
        )
        beta = v1beta1_pb2.NodePrepareResourcesRequest(
            claims=[v1beta1_pb2.Claim(namespace="ns", uid="u1", name="one")]
        )
        resp_b = await v1beta1_pb2_grpc.DRAPluginStub(ch).NodePrepareResources(beta)
        assert list(resp_b.claims["u1"].devices[0].cdi_device_ids) == ["gpu.nodeagent.io/claim=u1-gpu-1"]
        un = await v1_pb2_grpc.DRAPluginStub(ch).NodeUnprepareResources(
            v1_pb2.NodeUnprepareResourcesRequest(claims=[v1_pb2.Claim(namespace="ns", uid="u1", name="one")])
        )
        assert un.claims["u1"].error == ""

        stream = health_pb2_grpc.DRAResourceHealthStub(ch).NodeWatchResources(
            health_pb2.NodeWatchResourcesRequest()
        )
        first = await asyncio.wait_for(stream.read(), 5)
        assert {d.device.device_name: d.health for d in first.devices}["gpu-1"] == health_pb2.HEALTHY
        assert {d.device.pool_name for d in first.devices} == {POOL}
        devices = list(server.preparer.devices.values())
        await server.feed.update([d.name for d in devices], unhealthy_devices(devices, {(0, None): "XID 79"}))
        second = await asyncio.wait_for(stream.read(), 5)
        states = {d.device.device_name: d.health for d in second.devices}
        assert states == {
            "gpu-0-mig-1-0": health_pb2.UNHEALTHY,
            "gpu-0-mig-2-0": health_pb2.UNHEALTHY,
            "gpu-1": health_pb2.HEALTHY,
            "gpu-2": health_pb2.HEALTHY,
        }
        stream.cancel()
    await server.stop()
    assert not server.reg_path.exists() and not server.dra_path.exists()


async def test_sockets_refuse_bad_input_time_out_and_end_cancelled_watches(
    served: tuple[DraServer, Claims], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The DRA sockets on grpc.aio: a malformed request is INVALID_ARGUMENT naming the message, a call the
    loop does not answer in time is DEADLINE_EXCEEDED (the loop stays free), a cancelled health watch ends
    its generator on the loop and frees its slot, and one watch more than MAX_WATCHES is RESOURCE_EXHAUSTED."""
    import nodeagent.dra.server as dra_server

    server, _ = served
    async with grpc.aio.insecure_channel(f"unix://{server.dra_path}") as ch:
        raw = ch.unary_unary("/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await raw(b"\xff\xff", timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (e.value.details() or "").startswith("malformed NodePrepareResourcesRequest (2 bytes)")

        monkeypatch.setattr(dra_server, "CALL_TIMEOUT_S", 0.3)
        release = asyncio.Event()
        real_prepare = server.preparer.prepare

        async def stuck(refs: Any) -> Any:
            await release.wait()
            return await real_prepare(refs)

        monkeypatch.setattr(server.preparer, "prepare", stuck)
        req = v1_pb2.NodePrepareResourcesRequest(claims=[v1_pb2.Claim(namespace="ns", uid="u1", name="one")])
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await v1_pb2_grpc.DRAPluginStub(ch).NodePrepareResources(req, timeout=5)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        release.set()

        for _ in range(3):  # more watches than one server runs at once would be refused if slots leaked
            for _ in range(4):
                stream = health_pb2_grpc.DRAResourceHealthStub(ch).NodeWatchResources(
                    health_pb2.NodeWatchResourcesRequest()
                )
                assert (await asyncio.wait_for(stream.read(), 5)).devices
                stream.cancel()
        for _ in range(100):
            if server.watches.in_use == 0:
                break
            await asyncio.sleep(0.02)
        assert server.watches.in_use == 0

        watch = health_pb2_grpc.DRAResourceHealthStub(ch).NodeWatchResources
        held = [watch(health_pb2.NodeWatchResourcesRequest()) for _ in range(dra_server.MAX_WATCHES)]
        for stream in held:
            assert (await asyncio.wait_for(stream.read(), 5)).devices
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await asyncio.wait_for(watch(health_pb2.NodeWatchResourcesRequest()).read(), 5)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "more than 8 NodeWatchResources streams" in (e.value.details() or "")
        assert server.watches.in_use == dra_server.MAX_WATCHES
        for stream in held:
            stream.cancel()


KILLED_CHILD = """
import asyncio, os, signal, sys
sys.path.insert(0, {repo!r})
from pathlib import Path
from nodeagent.dra.checkpoint import Checkpoint
from tests.unit.test_dra_service import Claims, claim, make_preparer, ClaimRef
from nodeagent.dra.service import ClaimPreparer

root = Path({root!r})
p = make_preparer(root, Claims(claim("u1", "one", [("gpu", "gpu-1")])))
def killed(*a, **k):
    os.kill(os.getpid(), signal.SIGKILL)  # kill -9 between the CDI spec and the checkpoint record
Checkpoint.put = killed
asyncio.run(p.prepare([ClaimRef("ns", "u1", "one")]))
"""


async def test_kill_9_during_prepare_is_undone_and_retried_once(tmp_path: Path) -> None:
    import subprocess
    import sys

    repo = str(Path(__file__).resolve().parents[2])
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_CHILD.format(repo=repo, root=str(tmp_path))],
        capture_output=True,
        check=False,
    )
    assert proc.returncode == -9, proc.stderr.decode()
    specs = ClaimSpecs(tmp_path / "cdi")
    assert specs.claim_uids() == {"u1"}  # the spec made it, the record did not
    assert not (tmp_path / "state" / "dra-claims.json").exists()

    claims = Claims(claim("u1", "one", [("gpu", "gpu-1")]))
    p = make_preparer(tmp_path, claims)
    assert p.recover() == ["removed the orphaned CDI spec of claim u1"]
    assert specs.claim_uids() == set()
    out = await p.prepare([ClaimRef("ns", "u1", "one")])  # the kubelet's retry
    assert out["u1"].error == "" and specs.claim_uids() == {"u1"}
    assert sorted(Checkpoint.load(tmp_path / "state" / "dra-claims.json").claims) == ["u1"]
