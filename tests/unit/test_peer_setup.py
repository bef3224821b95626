"""tests/testbin/setup.sh on a fresh machine: every input of every peer resolves from EMPTY caches.

The guard against a setup that only works because an earlier run left something behind (a Go module in
the module cache, a binary in the nodeagent cache). It runs setup.sh's own steps in plan mode
(NODEAGENT_PEERS_PLAN=1: nothing is built or installed) with GOMODCACHE and NODEAGENT_CACHE pointed at
empty temporary directories, so it costs seconds (small module downloads), never a Kubernetes build.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.peers._resolve import SETUP_SH, PeerMissingError, peer_binary

# Every variable the test fixtures read a peer from (tests/peers/, tests/abi/_abi.py, tests/integration/).
SUITE_PEERS = {
    "NODEAGENT_CONTAINERD2",
    "NODEAGENT_CRI_STATUS",
    "NODEAGENT_KUBELET_HARNESS",
    "NODEAGENT_ETCD",
    "NODEAGENT_KUBE_APISERVER",
    "NODEAGENT_KUBE_SCHEDULER",
    "NODEAGENT_KUBE_CONTROLLER_MANAGER",
    "NODEAGENT_DRA_HARNESS",
    "NODEAGENT_KUBE_APISERVER_1_35",
    "NODEAGENT_KUBE_SCHEDULER_1_35",
    "NODEAGENT_KUBE_CONTROLLER_MANAGER_1_35",
    "NODEAGENT_DRA_HARNESS_1_35",
    "NODEAGENT_KUBE_APISERVER_1_36",
    "NODEAGENT_KUBE_SCHEDULER_1_36",
    "NODEAGENT_KUBE_CONTROLLER_MANAGER_1_36",
    "NODEAGENT_DRA_HARNESS_1_36",
    "NODEAGENT_KUBE_APISERVER_1_37",
    "NODEAGENT_KUBE_SCHEDULER_1_37",
    "NODEAGENT_KUBE_CONTROLLER_MANAGER_1_37",
    "NODEAGENT_DRA_HARNESS_1_37",
    "NODEAGENT_CDI_CHECK",
    "NODEAGENT_CRI_CDI",
    "NODEAGENT_CDI_PAUSE",
    "NODEAGENT_CONTAINERD2_SHIM",
    "NODEAGENT_NVML_LIBRARY",
    "NODEAGENT_NVML_VIEW",
    "NODEAGENT_NVIDIA_CTK",
    "NODEAGENT_HELM",
    "NODEAGENT_DEBIAN_ROOT",
    "NODEAGENT_KUBELET",
    "NODEAGENT_KUBECTL",
    "NODEAGENT_CNI_BIN_DIR",
    "NODEAGENT_BASE_IMAGE",
    "NODEAGENT_PAUSE_IMAGE",
    "NODEAGENT_AGENT_IMAGE",
    "NODEAGENT_DEBIAN13_ROOT",
    "NODEAGENT_DEBIAN_ARM64_ROOT",
    "NODEAGENT_BASE_IMAGE_ARM64",
    "NODEAGENT_AGENT_IMAGE_ARM64",
    "NODEAGENT_AGENT_IMAGE_MULTIARCH",
}
IMAGES = {"NODEAGENT_BASE_IMAGE": "debian-base", "NODEAGENT_PAUSE_IMAGE": "pause", "NODEAGENT_AGENT_IMAGE": "nodeagent",
          "NODEAGENT_BASE_IMAGE_ARM64": "debian-base-arm64", "NODEAGENT_AGENT_IMAGE_ARM64": "nodeagent-arm64",
          "NODEAGENT_AGENT_IMAGE_MULTIARCH": "nodeagent-multiarch"}


@pytest.fixture
def empty_caches(tmp_path: Path) -> Iterator[dict[str, str]]:
    if shutil.which("go") is None:
        pytest.fail("the Go toolchain is not on PATH (setup.sh needs it)", pytrace=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NODEAGENT_") and k != "GOFLAGS"}
    env.update(
        GOMODCACHE=str(tmp_path / "gomod"),
        GOCACHE=str(tmp_path / "gocache"),
        NODEAGENT_CACHE=str(tmp_path / "nodeagent-cache"),
        VENV=str(Path(sys.executable).parent.parent),
    )
    yield env
    # The module cache is written read-only by the go command.
    subprocess.run(["chmod", "-R", "u+w", str(tmp_path)], check=False)


def _setup(env: dict[str, str], script: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", f"NODEAGENT_PEERS_LIB_ONLY=1; source {SETUP_SH}; set -euo pipefail; {script}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_nvml_header_comes_from_a_download_not_a_warm_module_cache(empty_caches: dict[str, str]) -> None:
    """The step that once read nvml.h from wherever `go list -m` said (an empty path on a fresh machine)."""
    proc = _setup(
        dict(empty_caches, NODEAGENT_PEERS_PLAN="1"),
        'nodeagent_peers_nvml_abi; printf "%s\\n" "$NODEAGENT_NVML_LIBRARY"',
    )
    assert proc.returncode == 0, proc.stderr
    gomod = Path(empty_caches["GOMODCACHE"])
    headers = list(gomod.glob("github.com/!n!v!i!d!i!a/go-nvml@*/pkg/nvml/nvml.h"))
    assert len(headers) == 1, sorted(str(p) for p in gomod.rglob("nvml.h"))
    # The library's path is keyed by the header's hash, under the (empty) nodeagent cache: nothing built.
    lib = Path(proc.stdout.strip())
    assert lib.parent.parent == Path(empty_caches["NODEAGENT_CACHE"]) / "lib", lib
    assert not lib.exists()
    assert "plan: stand-in libnvidia-ml.so.1 to build" in proc.stderr


def test_whole_setup_resolves_every_peer_from_empty_caches(empty_caches: dict[str, str]) -> None:
    """Every step of nodeagent_peers_setup, in plan mode: each peer the suite reads is named, nothing is
    built, and the setup does not claim to be ready (so the fixtures would not trust a plan)."""
    proc = _setup(
        dict(empty_caches, NODEAGENT_PEERS_PLAN="1"), "nodeagent_peers_setup; env | grep '^NODEAGENT_' | sort"
    )
    assert proc.returncode == 0, proc.stderr
    exported = dict(line.split("=", 1) for line in proc.stdout.splitlines())
    assert set(exported) >= SUITE_PEERS, sorted(SUITE_PEERS - set(exported))
    assert "NODEAGENT_PEERS_READY" not in exported
    cache = Path(empty_caches["NODEAGENT_CACHE"])
    assert not any(cache.rglob("*")), sorted(str(p) for p in cache.rglob("*"))
    steps = [line for line in proc.stderr.splitlines() if line.startswith("peers: [")]
    assert len(steps) == 2 * len(_steps(empty_caches)), proc.stderr  # a start line and a time line each
    for name in SUITE_PEERS - {
        "NODEAGENT_CONTAINERD",
        "NODEAGENT_RUNC",
        "NODEAGENT_NVML_LIBRARY",
        "NODEAGENT_DEBIAN_ROOT",
        "NODEAGENT_CNI_BIN_DIR",
        *IMAGES,
        "NODEAGENT_DEBIAN13_ROOT",
        "NODEAGENT_DEBIAN_ARM64_ROOT",
    }:
        path = Path(exported[name])
        assert path.parent == cache / "bin", (name, path)
    roots = {Path(exported[v]) for v in ("NODEAGENT_DEBIAN_ROOT", "NODEAGENT_DEBIAN13_ROOT",
                                         "NODEAGENT_DEBIAN_ARM64_ROOT")}
    assert len(roots) == 3, roots  # each its own cache entry
    for root in roots:
        assert root.parent == cache and root.name.startswith("debian-root-"), root
    for suite in ("bookworm amd64", "trixie amd64", "bookworm arm64"):  # the last: the arm64 agent image's
        assert f"plan: Debian {suite} root to build" in proc.stderr, proc.stderr
    # the cluster's images: archives keyed by a hash of their inputs, all to build
    for name, image in IMAGES.items():
        path = Path(exported[name])
        assert path.parent == cache / "images" and path.name.startswith(f"{image}-"), (name, path)
        assert f"plan: image {image} to build" in proc.stderr, proc.stderr


def _steps(env: dict[str, str]) -> list[str]:
    proc = _setup(env, 'printf "%s\\n" "${NODEAGENT_PEERS_STEPS[@]}"', timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_unreachable_module_proxy_is_one_line_naming_the_module(empty_caches: dict[str, str]) -> None:
    env = dict(empty_caches, NODEAGENT_PEERS_PLAN="1", GOPROXY="http://127.0.0.1:9", GOFLAGS="-mod=mod")
    proc = _setup(env, "nodeagent_peers_nvml_abi", timeout=60)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "go-nvml" in line]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("peers: cannot download Go module github.com/NVIDIA/go-nvml"), lines
    assert "http://127.0.0.1:9" in lines[0]


def test_fixtures_never_build_once_the_setup_said_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    """After the whole setup (NODEAGENT_PEERS_READY=1), a peer variable missing is an error at once: the
    fixture must not fall back to a build inside a timed test."""
    monkeypatch.setenv("NODEAGENT_PEERS_READY", "1")
    monkeypatch.delenv("NODEAGENT_TEST_ONLY_PEER", raising=False)
    with pytest.raises(PeerMissingError, match="NODEAGENT_PEERS_STEPS"):
        peer_binary("NODEAGENT_TEST_ONLY_PEER", "false", "a test peer")


# (module directory, its module file, what setup.sh builds there, build tags, the peers' module file it builds on)
_SHARED_BUILDS = [
    *[("dra-harness", mf, "./cmd/dra-harness", tags, mf) for mf, tags in (
        ("go.mod", ""), ("go-1.35.mod", "k8s135"), ("go-1.36.mod", "k8s136"), ("go-1.37.mod", "k8s137"))],
    ("etcd", "go.mod", "./cmd/etcd", "", "go.mod"),
    ("helm", "go.mod", "helm.sh/helm/v3/cmd/helm", "", "go-1.36.mod"),
]


@pytest.mark.parametrize(("moddir", "modfile", "pkg", "tags", "peers_modfile"), _SHARED_BUILDS,
                         ids=[f"{b[0]}-{b[1]}" for b in _SHARED_BUILDS])
def test_a_build_reuses_the_packages_of_the_peers_before_it(moddir: str, modfile: str, pkg: str, tags: str,
                                                            peers_modfile: str) -> None:
    """Every module a build compiles is at the version the peers module it follows uses, so its build reuses the
    packages the peers' build compiled: the DRA harness of a release and that release's peers (in the cold run of
    2026-11-29, with grpc, protobuf and x/net at other versions, the 1.35 harness recompiled them and all of
    client-go above them: 105 s, against 11 s once aligned), etcd and the v1.34 API server (grpc, OpenTelemetry,
    Prometheus' client), helm and the v1.36 peers (client-go, the API types, apimachinery; helm is compiled
    without inlining like them)."""
    if shutil.which("go") is None:
        pytest.fail("the Go toolchain is not installed (need go on PATH)", pytrace=False)
    testbin = SETUP_SH.parent

    def go(directory: str, mf: str, *args: str) -> str:
        proc = subprocess.run(["go", *args[:1], f"-modfile={mf}", *args[1:]],
                              cwd=testbin / directory, capture_output=True, text=True, timeout=180, check=False,
                              env={**os.environ, "GOFLAGS": "-mod=readonly"})
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    version = "{{.Path}} {{with .Replace}}{{.Version}}{{else}}{{.Version}}{{end}}"  # a replaced module: its target's
    compiled = dict(line.split() for line in go(
        moddir, modfile, "list", "-deps", *([f"-tags={tags}"] if tags else []),
        "-f", "{{with .Module}}" + version + "{{end}}", pkg).splitlines()
        if line.strip() and not line.startswith("nodeagent.test/"))
    peers = dict(line.split() for line in go("peers", peers_modfile, "list", "-m", "-f", version,
                                             "all").splitlines()[1:])
    shared = {m for m in compiled if m in peers}
    assert len(shared) > len(compiled) // 2, f"{moddir}/{modfile} shares few modules with peers/{peers_modfile}"
    differ = {m: (v, peers.get(m)) for m, v in compiled.items() if m in shared and peers[m] != v}
    assert not differ, differ
