"""Wiring of the publishing layer into the daemon: the PodResources socket setting and API-request metrics."""

from __future__ import annotations

from pathlib import Path

import pytest
from kubernetes import client as k8s
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from nodeagent.config import AgentConfig, apply_overrides, load_config, parse_config
from nodeagent.errors import ConfigError
from nodeagent.hostpaths import HostPaths
from nodeagent.kube.client import KubeClient
from nodeagent.metrics import Metrics


def samples(m: Metrics, family: str, label: str) -> dict[str, float]:
    text = generate_latest(m.registry).decode()
    for f in text_string_to_metric_families(text):
        if f.name == family:
            return {s.labels[label]: s.value for s in f.samples if s.name.endswith("_total")}
    return {}


def test_pod_resources_socket_default_follows_the_kubelet_dir() -> None:
    assert AgentConfig().kubelet.pod_resources() == "/var/lib/kubelet/pod-resources/kubelet.sock"
    cfg = parse_config('[kubelet]\ndir = "/srv/kubelet"\n', "c.toml")
    assert cfg.kubelet.pod_resources() == "/srv/kubelet/pod-resources/kubelet.sock"
    assert cfg.kubelet.device_plugins == "/srv/kubelet/device-plugins"


def test_pod_resources_socket_from_file_and_flag(tmp_path: Path) -> None:
    cfg = parse_config('[kubelet]\npod_resources_socket = "/run/pr.sock"\n', "c.toml")
    assert cfg.kubelet.pod_resources() == "/run/pr.sock"
    assert cfg.kubelet.dir == "/var/lib/kubelet"
    flag = apply_overrides(cfg, {"kubelet.pod_resources_socket": "/other/kubelet.sock"})
    assert flag.kubelet.pod_resources() == "/other/kubelet.sock"
    with pytest.raises(ConfigError, match=r"c\.toml: key 'kubelet\.pod_resources_socket' must be an absolute path"):
        parse_config('[kubelet]\npod_resources_socket = "pr.sock"\n', "c.toml")
    # under --root the host path resolves inside the root
    paths = HostPaths(tmp_path)
    assert paths(load_config(paths).kubelet.pod_resources()) == tmp_path / "var/lib/kubelet/pod-resources/kubelet.sock"


def test_run_flag_sets_the_socket(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from nodeagent.cli import cli

    sock = tmp_path / "pr.sock"
    res = CliRunner().invoke(cli, ["--root", str(tmp_path), "run", "--pod-resources-socket", "/elsewhere/x.sock"])
    assert isinstance(res.exception, ConfigError)  # bad input: nothing starts (exit code 2 via main)
    assert "--pod-resources-socket '/elsewhere/x.sock' is not inside --root" in str(res.exception)
    help_text = CliRunner().invoke(cli, ["run", "--help"]).output
    assert "--pod-resources-socket" in help_text
    assert not sock.exists()


def test_kube_requests_are_counted_from_before_attach_and_after() -> None:
    kube = KubeClient(k8s.ApiClient())
    try:
        kube._record("GET", 200)
        kube._record("PATCH", 409)
        m = Metrics("n")
        m.attach_kube(kube)
        kube._record("PATCH", 200)
        kube._record("GET", 0, watch=True)
        assert samples(m, "nodeagent_kube_api_requests", "method") == {"GET": 2.0, "PATCH": 2.0}
        assert samples(m, "nodeagent_kube_api_errors", "code") == {"409": 1.0, "0": 1.0}
        other = Metrics("n")
        other.attach_kube(kube)  # a reloaded metrics component takes over
        m.detach_kube(kube)  # the old one leaves the new hook alone
        kube._record("DELETE", 200)
        assert samples(other, "nodeagent_kube_api_requests", "method")["DELETE"] == 1.0
        assert "DELETE" not in samples(m, "nodeagent_kube_api_requests", "method")
        other.detach_kube(kube)
        assert kube.on_request is None
    finally:
        kube.close()
