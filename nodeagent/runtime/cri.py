"""The node's running pods as its container runtime knows them (CRI ``ListPodSandbox`` on containerd's socket).

The kubelet gives every pod sandbox the pod's own labels, plus ``io.kubernetes.pod.namespace`` and
``io.kubernetes.pod.name``; a sandbox is ready from the pod's start until its containers are done. So the
runtime answers "which pods with these labels run on this node" with no API privilege at all: what a Kubernetes
token could only get by listing the pods of every node (RBAC cannot confine a list to one node's pods).

Blocking gRPC over a Unix socket; callers run it in a thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from nodeagent.errors import RuntimeConfigError

LIST_METHOD = "/runtime.v1.RuntimeService/ListPodSandbox"
NAMESPACE_LABEL = "io.kubernetes.pod.namespace"
NAME_LABEL = "io.kubernetes.pod.name"


@dataclass(frozen=True)
class NodePod:
    namespace: str
    name: str
    labels: Mapping[str, str]

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


def running_pods(socket: Path, timeout: float = 10.0) -> list[NodePod]:
    """The pods whose sandbox is ready on the runtime serving ``socket`` (``RuntimeConfigError`` naming the
    socket when it does not answer)."""
    from nodeagent.grpcadapter.client import Failure, call, open_channel, raw_method
    from nodeagent.runtime.cri_api import cri_pb2 as pb

    def failed(failure: Failure) -> RuntimeConfigError:
        return RuntimeConfigError(f"the container runtime on {socket} did not list its pod sandboxes: "
                                  f"{failure.code}: {failure.details}", subject=str(socket))

    request = pb.ListPodSandboxRequest(filter=pb.PodSandboxFilter(
        state=pb.PodSandboxStateValue(state=pb.SANDBOX_READY)))
    with open_channel(socket) as channel:
        raw = call(raw_method(channel, LIST_METHOD), request.SerializeToString(), timeout=timeout, error=failed)
    pods = []
    for item in pb.ListPodSandboxResponse.FromString(raw).items:
        labels = dict(item.labels)
        pods.append(NodePod(labels.get(NAMESPACE_LABEL, item.metadata.namespace),
                            labels.get(NAME_LABEL, item.metadata.name), labels))
    return sorted(pods, key=str)
