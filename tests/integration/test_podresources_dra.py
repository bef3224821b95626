"""The kubelet's PodResources v1 ``List`` with dynamic resources, as nodeagent reads it to find which pods
and ResourceClaims hold a GPU before a MIG change.

Real: the kube-apiserver of each release (v1.34.4 to v1.37.2, the session's shared API servers of
tests/integration/_releases.py), nodeagent's DRA driver
(DraComponent on a simulated inventory), the kubelet's DRA manager and plugin watcher of the same release
(tests/testbin/dra-harness), and the kubelet's own PodResources v1 server code (pkg/kubelet/apis/
podresources) that the harness serves. The harness stands in for the kubelet's container manager: its
provider answers each container's claims from the DRA manager's claim infos as the container manager does,
and pods are the ones the test prepared (not yet unprepared). It runs no device, CPU or memory manager, so
those parts of the answer are empty. No scheduler: the test writes each claim's allocation itself.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from nodeagent.daemon.components.mig import GpuHolderSources
from nodeagent.daemon.shared import Shared
from nodeagent.dra import DRIVER_NAME
from nodeagent.kube.client import KubeClient
from nodeagent.kube.podresources import ClaimAssignment, PodResourcesClient
from nodeagent.kube.podresources_api import podresources_pb2 as pb
from nodeagent.kube.podresources_api import podresources_pb2_grpc as pb_grpc
from nodeagent.mig.reconciler import ClaimHolder
from tests.integration._releases import release_binary, shared_release_apiserver
from tests.integration.test_dra_kubelet import component, create_allocated_claim, poll, slice_devices
from tests.peers.apiserver import KubeApiServer
from tests.peers.draharness import Pod, running_dra_harness
from tests.unit._dp_inventories import mig_box

pytestmark = pytest.mark.peers

kube_apiserver = shared_release_apiserver


@pytest.fixture(scope="module")
def harness_binary(kube_apiserver: KubeApiServer) -> Path:
    """The kubelet DRA harness of the API server's release."""
    return release_binary(kube_apiserver.version, "dra-harness")


@pytest.fixture
def root() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="prdra-", dir="/tmp"))  # socket paths must stay under 108 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


def raw_list(socket: Path) -> pb.ListPodResourcesResponse:
    """The server's answer as nodeagent's message definitions decode it (they leave out the CDI devices)."""
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        stub = pb_grpc.PodResourcesListerStub(channel)  # type: ignore[no-untyped-call]
        resp: pb.ListPodResourcesResponse = stub.List(pb.ListPodResourcesRequest(), timeout=5)
        return resp


def raw_get(socket: Path, namespace: str, name: str) -> pb.GetPodResourcesResponse:
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        stub = pb_grpc.PodResourcesListerStub(channel)  # type: ignore[no-untyped-call]
        resp: pb.GetPodResourcesResponse = stub.Get(
            pb.GetPodResourcesRequest(pod_namespace=namespace, pod_name=name), timeout=5
        )
        return resp


def claim_uses(client: PodResourcesClient) -> list[ClaimAssignment]:
    """The claims nodeagent's client reads from List (``claim_assignments_from_response``), by pod."""
    return sorted(client.list_with_claims()[1], key=lambda a: (a.pod, a.container))


async def test_list_reports_the_claims_the_kubelet_prepared_and_mig_holders_find_them(
    kube_apiserver: KubeApiServer, kube: KubeClient, node_name: str, root: Path, harness_binary: Path
) -> None:
    """Three pods with claims on devices of our driver (whole GPU 2; a MIG device of GPU 0; GPU 1 and the
    other MIG device of GPU 0 in one claim): once the kubelet code prepared them, ``List`` names pod,
    container, claim and (driver, pool, device), and ``GpuHolderSources`` reports each claim as a holder of
    each GPU it uses, with an empty DRA record (so PodResources alone found them). After unprepare, the
    pod and its claim are gone from ``List`` and from the holders."""
    inv = mig_box(per_gpu=2, gpus_on=1, gpus_off=2)
    dra = component(root, kube, node_name)
    await dra.start(inv)
    socket = root / "var/lib/kubelet/pod-resources/kubelet.sock"
    client = PodResourcesClient(socket)
    try:
        with running_dra_harness(
            kube_apiserver.kubeconfig,
            root / "var/lib/kubelet/plugins_registry",
            node_name,
            binary=harness_binary,
            pod_resources_socket=socket,
        ) as h:
            await asyncio.to_thread(h.wait_registered, DRIVER_NAME)
            assert socket.stat().st_mode & 0o777 == 0o600
            await poll(
                lambda: (
                    sorted(slice_devices(kube, node_name))
                    == ["gpu-0-mig-1-0", "gpu-0-mig-2-0", "gpu-1", "gpu-2"]
                )
            )
            assert (await asyncio.to_thread(raw_list, socket)).pod_resources == []

            train = Pod("default", "train", str(uuid.uuid4()), {}, {"main": ["gpu"], "sidecar": []})
            infer = Pod("default", "infer", str(uuid.uuid4()), {}, {"main": ["gpu"]})
            uid_t = await asyncio.to_thread(
                create_allocated_claim, kube, node_name, [("gpu", "gpu-2")], train
            )
            uid_i = await asyncio.to_thread(
                create_allocated_claim, kube, node_name, [("gpu", "gpu-0-mig-1-0")], infer
            )
            both = Pod("default", "both", str(uuid.uuid4()), {}, {"main": ["gpu"]})
            await asyncio.to_thread(
                create_allocated_claim, kube, node_name, [("whole", "gpu-1"), ("part", "gpu-0-mig-2-0")], both
            )
            [claim_t], [claim_i], [claim_b] = list(train.claims), list(infer.claims), list(both.claims)
            assert await asyncio.to_thread(h.prepare, train) == {
                "main": [f"gpu.nodeagent.io/claim={uid_t}-gpu-2", f"gpu.nodeagent.io/metadata={uid_t}_gpu"],
                "sidecar": [],
            }
            assert await asyncio.to_thread(h.prepare, infer) == {
                "main": [f"gpu.nodeagent.io/claim={uid_i}-gpu-0-mig-1-0", f"gpu.nodeagent.io/metadata={uid_i}_gpu"]
            }
            assert len((await asyncio.to_thread(h.prepare, both))["main"]) == 4  # 2 devices, 2 metadata mounts

            uses = await asyncio.to_thread(claim_uses, client)
            [use_b] = [u for u in uses if u.pod == "both"]
            assert (use_b.container, use_b.claim) == ("main", f"default/{claim_b}")
            assert sorted(use_b.devices) == [
                (DRIVER_NAME, node_name, "gpu-0-mig-2-0"),
                (DRIVER_NAME, node_name, "gpu-1"),
            ]
            infer_use = ClaimAssignment("default", "infer", "main", "default", claim_i,
                                        ((DRIVER_NAME, node_name, "gpu-0-mig-1-0"),))
            assert [u for u in uses if u.pod != "both"] == [
                infer_use,
                ClaimAssignment(
                    "default", "train", "main", "default", claim_t, ((DRIVER_NAME, node_name, "gpu-2"),)
                ),
            ]
            resp = await asyncio.to_thread(raw_list, socket)
            pods = {p.name: p for p in resp.pod_resources}
            assert sorted(pods) == ["both", "infer", "train"]
            assert [c.name for c in pods["train"].containers] == ["main", "sidecar"]
            assert list(pods["train"].containers[1].dynamic_resources) == []
            assert [
                r.device_name for r in pods["train"].containers[0].dynamic_resources[0].claim_resources
            ] == ["gpu-2"]
            # no device, CPU or memory manager behind this kubelet
            assert all(
                not c.devices and not c.cpu_ids and not c.memory
                for p in resp.pod_resources
                for c in p.containers
            )
            assert (await asyncio.to_thread(client.list_with_claims))[0] == []  # no device-plugin devices
            assert await asyncio.to_thread(client.allocatable) == {}
            # Get finds one pod by name (the pod provider's lookup) with the same claims
            got = (await asyncio.to_thread(raw_get, socket, "default", "infer")).pod_resources
            assert [
                (r.claim_name, [c.device_name for c in r.claim_resources])
                for r in got.containers[0].dynamic_resources
            ] == [(claim_i, ["gpu-0-mig-1-0"])]

            no_record = Shared().dra  # no DRA plane attached: its record holds no claim
            holders = GpuHolderSources(client, lambda g: {}, no_record, pool=node_name, driver=DRIVER_NAME)
            by_name = {claim_b: ("default/both",), claim_i: ("default/infer",)}
            assert await holders(frozenset(range(4))) == {
                0: tuple(ClaimHolder(f"default/{c}", by_name[c]) for c in sorted(by_name)),
                1: (ClaimHolder(f"default/{claim_b}", ("default/both",)),),
                2: (ClaimHolder(f"default/{claim_t}", ("default/train",)),),
            }
            assert await holders(frozenset({1})) == {
                1: (ClaimHolder(f"default/{claim_b}", ("default/both",)),)
            }
            assert await holders(frozenset({3})) == {}
            # a claim counts only for this driver's devices of this node's pool
            elsewhere = GpuHolderSources(
                client, lambda g: {}, no_record, pool="another-node", driver=DRIVER_NAME
            )
            assert await elsewhere(frozenset(range(3))) == {}

            await asyncio.to_thread(h.unprepare, train)
            await asyncio.to_thread(h.unprepare, both)
            assert await asyncio.to_thread(claim_uses, client) == [
                infer_use
            ]
            assert await holders(frozenset(range(3))) == {
                0: (ClaimHolder(f"default/{claim_i}", ("default/infer",)),)
            }
            await asyncio.to_thread(h.unprepare, infer)
            assert (await asyncio.to_thread(raw_list, socket)).pod_resources == []
            with pytest.raises(grpc.RpcError, match="pod infer in namespace default not found"):
                await asyncio.to_thread(raw_get, socket, "default", "infer")
            assert await holders(frozenset(range(3))) == {}
    finally:
        client.close()
        await dra.stop()
