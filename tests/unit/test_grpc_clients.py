"""nodeagent's three gRPC clients through ``nodeagent.grpcadapter.client``: device-plugin registration (asyncio),
PodResources (blocking, one channel kept) and containerd's Version probe (raw bytes), each against a small
grpcio server on a Unix socket; a failed call becomes the client's own error with its own text."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from nodeagent.deviceplugin.api import pb2, pb2_grpc
from nodeagent.deviceplugin.registrar import register
from nodeagent.errors import KubeletError
from nodeagent.grpcadapter.client import Failure, failure
from nodeagent.kube.podresources import Assignment, PodResourcesClient
from nodeagent.kube.podresources_api import podresources_pb2 as pr
from nodeagent.kube.podresources_api import podresources_pb2_grpc as pr_grpc
from nodeagent.runtime.restart import answers


@pytest.fixture
def short_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="gc-", dir="/tmp") as d:
        yield Path(d)


def serve(path: Path, add: Any, servicer: Any) -> Any:
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    add(servicer, server)
    server.add_insecure_port(f"unix://{path}")
    server.start()
    return server


class Kubelet:
    """The kubelet's Registration service: refuses ``nvidia.com/refused``."""

    def __init__(self) -> None:
        self.registered: list[str] = []

    def Register(self, request: Any, context: Any) -> Any:
        if request.resource_name == "nvidia.com/refused":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no such resource here")
        self.registered.append(request.resource_name)
        return pb2.Empty()


async def test_registration_and_its_refusal(short_dir: Path) -> None:
    with pytest.raises(KubeletError, match=r"kubelet.sock does not exist \(kubelet not running\?\)"):
        await register(short_dir, "nvidia.com/gpu", "nvidia-gpu.sock")
    kubelet = Kubelet()
    server = serve(short_dir / "kubelet.sock", pb2_grpc.add_RegistrationServicer_to_server, kubelet)
    try:
        await register(short_dir, "nvidia.com/gpu", "nvidia-gpu.sock")
        assert kubelet.registered == ["nvidia.com/gpu"]
        with pytest.raises(KubeletError) as e:
            await register(short_dir, "nvidia.com/refused", "x.sock")
        assert str(e.value) == "kubelet refused nvidia.com/refused: INVALID_ARGUMENT: no such resource here"
        assert e.value.retryable and e.value.subject == "nvidia.com/refused"
        assert isinstance(e.value.__cause__, grpc.RpcError)
    finally:
        server.stop(None)
    (short_dir / "kubelet.sock").touch()  # a path nobody serves: the deadline ends the wait
    t = time.monotonic()
    with pytest.raises(
        KubeletError, match=r"^kubelet refused nvidia.com/gpu: (DEADLINE_EXCEEDED|UNAVAILABLE)"
    ):
        await register(short_dir, "nvidia.com/gpu", "nvidia-gpu.sock", timeout=0.5)
    assert time.monotonic() - t < 5


class Lister:
    def __init__(self) -> None:
        self.fail = False

    def List(self, request: Any, context: Any) -> Any:
        if self.fail:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "not you")
        container = pr.ContainerResources(
            name="c", devices=[pr.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=["GPU-a"])]
        )
        return pr.ListPodResourcesResponse(
            pod_resources=[pr.PodResources(name="p", namespace="ns", containers=[container])]
        )

    def Get(self, request: Any, context: Any) -> Any:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "not used here")

    def GetAllocatableResources(self, request: Any, context: Any) -> Any:
        return pr.AllocatableResourcesResponse(
            devices=[pr.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=["GPU-a", "GPU-b"])]
        )


def test_podresources_answers_and_failures(short_dir: Path) -> None:
    sock = short_dir / "pod-resources.sock"
    lister = Lister()
    server = serve(sock, pr_grpc.add_PodResourcesListerServicer_to_server, lister)
    client = PodResourcesClient(sock, timeout=2)
    try:
        assert client.list() == [Assignment("ns", "p", "c", "nvidia.com/gpu", ("GPU-a",))]
        assert client.allocatable() == {"nvidia.com/gpu": ("GPU-a", "GPU-b")}
        lister.fail = True
        with pytest.raises(KubeletError) as e:
            client.list()
        assert str(e.value) == f"PodResources List on {sock} failed: PERMISSION_DENIED"
        assert e.value.retryable and e.value.subject == str(sock)
    finally:
        server.stop(None)
    t = time.monotonic()
    with pytest.raises(
        KubeletError, match=r"^PodResources GetAllocatableResources on .* failed: UNAVAILABLE$"
    ):
        client.allocatable()
    assert time.monotonic() - t < 5
    client.close()


def test_containerd_answers_only_when_its_version_method_does(short_dir: Path) -> None:
    sock = short_dir / "containerd.sock"
    assert not answers(sock)  # no socket at all
    handlers = {"Version": grpc.unary_unary_rpc_method_handler(lambda request, context: b"")}
    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("containerd.services.version.v1.Version", handlers),)
    )
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    try:
        assert answers(sock)
    finally:
        server.stop(None)
    sock.unlink(missing_ok=True)
    sock.touch()  # a file, no listener
    t = time.monotonic()
    assert not answers(sock, timeout=0.5)
    assert time.monotonic() - t < 5


def test_a_failure_without_a_status_is_unknown() -> None:
    assert failure(grpc.RpcError()) == Failure("UNKNOWN", "")


def test_cri_lists_the_ready_sandboxes_with_their_pods_labels(short_dir: Path) -> None:
    """``ListPodSandbox`` asked for ready sandboxes only; each pod named by the labels the kubelet gives its
    sandbox; a runtime that refuses is one error naming the socket."""
    from nodeagent.errors import RuntimeConfigError
    from nodeagent.runtime.cri import running_pods
    from nodeagent.runtime.cri_api import cri_pb2 as cri

    sock = short_dir / "cri.sock"
    asked: list[Any] = []

    def listing(raw: bytes, context: Any) -> bytes:
        request = cri.ListPodSandboxRequest.FromString(raw)
        asked.append(request)
        if request.filter.label_selector:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no")
        meta = cri.PodSandboxMetadata(name="ignored", namespace="ignored")
        answer: bytes = cri.ListPodSandboxResponse(items=[
            cri.PodSandbox(id="b", metadata=meta, labels={"io.kubernetes.pod.namespace": "ml",
                                                          "io.kubernetes.pod.name": "train-0", "app": "train"}),
            cri.PodSandbox(id="a", metadata=cri.PodSandboxMetadata(name="web", namespace="default")),
        ]).SerializeToString()
        return answer

    handlers = {"ListPodSandbox": grpc.unary_unary_rpc_method_handler(listing)}
    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("runtime.v1.RuntimeService", handlers),))
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    try:
        pods = running_pods(sock)
    finally:
        server.stop(None)
    assert [(str(p), dict(p.labels).get("app")) for p in pods] == [("default/web", None), ("ml/train-0", "train")]
    assert asked[0].filter.HasField("state") and asked[0].filter.state.state == cri.SANDBOX_READY
    with pytest.raises(RuntimeConfigError, match=r"cri\.sock did not list its pod sandboxes: UNAVAILABLE"):
        running_pods(sock, timeout=0.5)
