"""RuntimeClass create-or-update against the real kube-apiserver."""

from __future__ import annotations

import random
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from kubernetes.client.exceptions import ApiException

from nodeagent.kube.client import KubeClient, connect
from nodeagent.kube.runtimeclass import MANAGED_BY, desired_classes, ensure_runtime_classes

pytestmark = pytest.mark.peers


@pytest.fixture
def kube(kube_apiserver) -> Iterator[KubeClient]:  # type: ignore[no-untyped-def]
    client = KubeClient(connect(kube_apiserver.kubeconfig))
    yield client
    client.close()


def _cleanup(kube: KubeClient, *names: str) -> None:
    for name in names:
        try:
            kube.node_api.delete_runtime_class(name)
        except ApiException as e:
            if e.status != 404:
                raise


def test_create_then_unchanged_then_replace_handler(kube: KubeClient) -> None:
    name = f"nvidia-{uuid.uuid4().hex[:6]}"
    cdi_name = f"{name}-cdi"
    try:
        classes = desired_classes(name=name, handler="nvidia", cdi=True, cdi_name=cdi_name)
        assert classes == {name: "nvidia", cdi_name: "nvidia-cdi"}
        assert ensure_runtime_classes(kube, classes) == {name: "created", cdi_name: "created"}
        got = kube.node_api.read_runtime_class(name)
        assert got.metadata is not None
        assert got.handler == "nvidia" and got.metadata.labels == MANAGED_BY
        assert kube.node_api.read_runtime_class(cdi_name).handler == "nvidia-cdi"
        version = got.metadata.resource_version
        assert ensure_runtime_classes(kube, classes) == {name: "unchanged", cdi_name: "unchanged"}
        again = kube.node_api.read_runtime_class(name).metadata
        assert again is not None and again.resource_version == version

        # labels lost by hand: patched back; a different handler (immutable) means delete + create
        kube.node_api.patch_runtime_class(name, {"metadata": {"labels": {"app.kubernetes.io/managed-by": None}}})
        assert ensure_runtime_classes(kube, {name: "nvidia"}) == {name: "updated"}
        assert ensure_runtime_classes(kube, {name: "nvidia-legacy"}) == {name: "replaced"}
        assert kube.node_api.read_runtime_class(name).handler == "nvidia-legacy"
    finally:
        _cleanup(kube, name, cdi_name)


def test_cli_configure_creates_runtime_classes(kube: KubeClient, kube_apiserver, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``nodeagent runtime configure --kubeconfig F --cdi --runtime-name N``: containerd wired and the
    RuntimeClasses N and nvidia-cdi exist with the right handlers; a second run reports them unchanged."""
    import json
    import subprocess
    import sys

    name = f"nv-{uuid.uuid4().hex[:6]}"
    args = [sys.executable, "-m", "nodeagent", "--root", str(tmp_path), "runtime", "configure", "--kubeconfig",
            str(kube_apiserver.kubeconfig), "--cdi", "--runtime-name", name, "--restart", "none", "--json"]
    created: list[str] = [name]
    try:
        first = subprocess.run(args, capture_output=True, text=True, check=False, timeout=60)
        assert first.returncode == 0, first.stderr
        done = json.loads(first.stdout)["runtimeclasses"]
        assert done[name] == "created" and done["nvidia-cdi"] in ("created", "unchanged")
        if done["nvidia-cdi"] == "created":
            created.append("nvidia-cdi")
        assert kube.node_api.read_runtime_class(name).handler == name
        assert kube.node_api.read_runtime_class("nvidia-cdi").handler == "nvidia-cdi"
        assert f"[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.{name}]" in (
            tmp_path / "etc/containerd/config.toml").read_text()
        second = subprocess.run(args, capture_output=True, text=True, check=False, timeout=60)
        assert json.loads(second.stdout)["runtimeclasses"] == {name: "unchanged", "nvidia-cdi": "unchanged"}
        assert not json.loads(second.stdout)["changed"]
    finally:
        _cleanup(kube, *created)


class _Turns(random.Random):
    """Hands out the given delays in turn (which agent wakes first is then known)."""

    def __init__(self, delays: list[float]) -> None:
        super().__init__(0)
        self.delays = delays
        self.lock = threading.Lock()

    def uniform(self, a: float, b: float) -> float:
        with self.lock:
            return self.delays.pop(0)


def test_a_fleet_starting_at_once_creates_the_class_once(kube_apiserver) -> None:  # type: ignore[no-untyped-def]
    """Six agents find the class missing at the same moment: with a spread, the first to wake creates it and
    the others read it (the apiserver answers one create, no 409)."""
    name = f"nvidia-{uuid.uuid4().hex[:6]}"
    clients = [KubeClient(connect(kube_apiserver.kubeconfig)) for _ in range(6)]
    turns = _Turns([0.0, 0.5, 0.6, 0.7, 0.8, 0.9])
    try:
        with ThreadPoolExecutor(6) as ex:
            done = list(ex.map(lambda c: ensure_runtime_classes(c, {name: "nvidia"}, spread=1.0, rng=turns)[name],
                               clients))
        assert sorted(done) == ["created"] + ["unchanged"] * 5
        assert sum(c.stats.writes for c in clients) == 1
    finally:
        _cleanup(clients[0], name)
        for c in clients:
            c.close()
