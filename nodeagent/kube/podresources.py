"""Client of the kubelet PodResources v1 API: which pod's container holds which device.

Blocking gRPC over the kubelet's unix socket (``/var/lib/kubelet/pod-resources/kubelet.sock``); callers
run it in a thread. Answers are converted into plain frozen dataclasses at this boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from nodeagent.errors import KubeletError
from nodeagent.grpcadapter.client import Channel, Failure, call, open_channel
from nodeagent.kube.podresources_api import podresources_pb2 as pb
from nodeagent.kube.podresources_api import podresources_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class Assignment:
    """Devices of one resource assigned to one container of one pod."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: tuple[str, ...]


@dataclass(frozen=True)
class ClaimAssignment:
    """A ResourceClaim (DRA) one container of one pod uses, with the claim's devices as
    (driver, pool, device) — present only when the kubelet reports dynamic resources."""

    namespace: str
    pod: str
    container: str
    claim_namespace: str
    claim_name: str
    devices: tuple[tuple[str, str, str], ...]

    @property
    def claim(self) -> str:
        return f"{self.claim_namespace}/{self.claim_name}"


def assignments_from_response(resp: pb.ListPodResourcesResponse) -> list[Assignment]:
    out: list[Assignment] = []
    for pod in resp.pod_resources:
        for c in pod.containers:
            for d in c.devices:
                if d.device_ids:
                    out.append(
                        Assignment(pod.namespace, pod.name, c.name, d.resource_name, tuple(d.device_ids))
                    )
    return out


def claim_assignments_from_response(resp: pb.ListPodResourcesResponse) -> list[ClaimAssignment]:
    out: list[ClaimAssignment] = []
    for pod in resp.pod_resources:
        for c in pod.containers:
            for r in c.dynamic_resources:
                devices = tuple((d.driver_name, d.pool_name, d.device_name) for d in r.claim_resources)
                out.append(
                    ClaimAssignment(
                        pod.namespace,
                        pod.name,
                        c.name,
                        r.claim_namespace or pod.namespace,
                        r.claim_name,
                        devices,
                    )
                )
    return out


def by_device(assignments: Iterable[Assignment]) -> dict[str, list[Assignment]]:
    """Device ID → the assignments holding it (pure)."""
    out: dict[str, list[Assignment]] = {}
    for a in assignments:
        for dev in a.device_ids:
            out.setdefault(dev, []).append(a)
    return out


def holders_by_gpu(
    assignments: Iterable[Assignment], device_gpus: Mapping[tuple[str, str], int]
) -> dict[int, tuple[str, ...]]:
    """GPU index → sorted ``namespace/name`` of the pods holding one of its devices, given (resource,
    device ID) → GPU index (pure). GPUs no pod holds are absent."""
    out: dict[int, set[str]] = {}
    for a in assignments:
        for dev in a.device_ids:
            gpu = device_gpus.get((a.resource, dev))
            if gpu is not None:
                out.setdefault(gpu, set()).add(f"{a.namespace}/{a.pod}")
    return {g: tuple(sorted(pods)) for g, pods in sorted(out.items())}


class PodResourcesClient:
    """Blocking client; one channel, reused. ``close`` when done."""

    def __init__(self, socket_path: Path, *, timeout: float = 5.0) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._channel: Channel | None = None
        self._stub: pb_grpc.PodResourcesListerStub | None = None

    def _lister(self) -> pb_grpc.PodResourcesListerStub:
        if self._stub is None:
            self._channel = open_channel(self.socket_path)
            self._stub = pb_grpc.PodResourcesListerStub(self._channel)  # type: ignore[no-untyped-call]
        return self._stub

    def _failed(self, what: str) -> Callable[[Failure], KubeletError]:
        def error(failure: Failure) -> KubeletError:
            return KubeletError(
                f"PodResources {what} on {self.socket_path} failed: {failure.code}",
                subject=str(self.socket_path),
                retryable=True,
            )

        return error

    def _list(self) -> pb.ListPodResourcesResponse:
        resp: pb.ListPodResourcesResponse = call(
            self._lister().List,
            pb.ListPodResourcesRequest(),
            timeout=self.timeout,
            error=self._failed("List"),
        )
        return resp

    def list(self) -> list[Assignment]:
        """Every device assignment the kubelet knows about."""
        return assignments_from_response(self._list())

    def pods(self) -> Sequence[tuple[str, str]]:
        """(namespace, name) of every pod the kubelet runs: List names them all, with devices or without."""
        return sorted({(p.namespace, p.name) for p in self._list().pod_resources})

    def list_with_claims(self) -> tuple[Sequence[Assignment], Sequence[ClaimAssignment]]:
        """Device-plugin assignments and the ResourceClaims containers use (one List call; no claims
        from a kubelet that does not report dynamic resources)."""
        resp = self._list()
        return assignments_from_response(resp), claim_assignments_from_response(resp)

    def allocatable(self) -> dict[str, tuple[str, ...]]:
        """Resource name → device IDs the kubelet can hand out."""
        resp = call(
            self._lister().GetAllocatableResources,
            pb.AllocatableResourcesRequest(),
            timeout=self.timeout,
            error=self._failed("GetAllocatableResources"),
        )
        out: dict[str, list[str]] = {}
        for d in resp.devices:
            out.setdefault(d.resource_name, []).extend(d.device_ids)
        return {k: tuple(v) for k, v in out.items()}

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        self._stub = None
