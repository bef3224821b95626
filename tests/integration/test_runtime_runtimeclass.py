"""RuntimeClass create-or-update against the real kube-apiserver."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

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
