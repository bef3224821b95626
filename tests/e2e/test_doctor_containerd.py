"""``nodeagent doctor``: does the installed containerd load its config? A file in a format newer than the
release reads: containerd 2.x does not start with it, containerd 1.x starts and ignores its plugin tables (seen
here with Debian's real containerd 1.6); the same file under a containerd that reads it is no finding.

On the host itself (no ``--root``) containerd is asked too (``containerd --config FILE config dump``): here the
suite's containerd 2.4 (NODEAGENT_CONTAINERD2) through ``--containerd-binary``, on a file nodeagent reads without
a complaint and containerd refuses; under ``--root`` it is never asked, and the option is refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nodeagent.runtime.containerd_versions import load_problem
from tests.e2e._agent import REPO
from tests.e2e.test_doctor import _doctor, _one
from tests.peers._resolve import peer_binary
from tests.peers.containerd import containerd_binary

V3_WITH_NVIDIA = """version = 3
[plugins."io.containerd.cri.v1.runtime".containerd]
default_runtime_name = "nvidia"
[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.nvidia]
runtime_type = "io.containerd.runc.v2"
"""


@pytest.mark.parametrize(("installed", "fmt", "starts"), [
    ((2, 2, 1), 4, "containerd 2.2.1 does not start with a version-4 config (it reads up to version 3)"),
    ((1, 7, 2), 3, "containerd 1.7.2 ignores the plugin tables of a version-3 config (it reads up to version 2)"),
    ((2, 4, 2), 4, ""), ((2, 0, 0), 3, ""), ((1, 6, 20), 2, ""), (None, 4, ""),
])
def test_which_release_loads_which_format(installed: tuple[int, int, int] | None, fmt: int, starts: str) -> None:
    problem, fix = load_problem(installed, fmt)
    assert problem.startswith(starts) and bool(problem) == bool(starts) == bool(fix)


def _root(tmp_path: Path, version: str) -> Path:
    root = tmp_path / version
    (root / "var/lib/dpkg").mkdir(parents=True)
    (root / "var/lib/dpkg/status").write_text(f"Package: containerd\nStatus: install ok installed\nVersion: {version}\n\n")
    (root / "etc/containerd").mkdir(parents=True)
    (root / "etc/containerd/config.toml").write_text(V3_WITH_NVIDIA)
    return root


def test_a_config_newer_than_the_installed_containerd(tmp_path: Path) -> None:
    # the fact, from Debian's containerd 1.6: it loads the version-3 file without a word, and its CRI settings
    # are not there
    binary = containerd_binary()
    dumped = subprocess.run([str(binary), "--config", str(_root(tmp_path, "probe") / "etc/containerd/config.toml"),
                             "config", "dump"], capture_output=True, text=True, timeout=30, check=False)
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30, check=True)
    assert " 1.6." in version.stdout, version.stdout
    assert dumped.returncode == 0 and 'default_runtime_name = "runc"' in dumped.stdout, dumped.stderr

    sim = ["--simulate", "t4x1"]
    code, findings = _doctor(_root(tmp_path, "1.6.20~ds1-1+deb12u3"), *sim)
    ignored = _one(findings, "containerd", "error", "/etc/containerd/config.toml: containerd 1.6.20 ignores the "
                   "plugin tables of a version-3 config (it reads up to version 2): none of its CRI settings apply")
    assert ignored["fix"] == "write the file in version 2, or upgrade containerd to 2.0 or later"
    assert code == 2
    code, findings = _doctor(_root(tmp_path, "2.2.1-1"), *sim)  # reads version 3: no finding about loading
    assert not [f for f in findings if "does not start" in f["text"] or "ignores" in f["text"]], findings
    root = _root(tmp_path, "2.1.4-1")
    (root / "etc/containerd/config.toml").write_text(V3_WITH_NVIDIA.replace("version = 3", "version = 4"))
    code, findings = _doctor(root, *sim)
    refused = _one(findings, "containerd", "error", "containerd 2.1.4 does not start with a version-4 config")
    assert refused["fix"] == "write the file in version 3, or upgrade containerd to 2.3 or later"


# valid TOML in a shape nodeagent's reader takes; containerd's CRI plugin wants an integer there
REFUSED_BY_CONTAINERD = """version = 2
[plugins."io.containerd.grpc.v1.cri"]
  max_container_log_line_size = "16k"
"""


def _doctor_on_host(tmp_path: Path, containerd_config: Path, *args: str) -> tuple[int, list[dict[str, object]]]:
    """``nodeagent doctor`` without --root (the host itself), its containerd config named by an agent config."""
    agent = tmp_path / f"agent-{containerd_config.stem}.toml"
    agent.write_text(f'[runtime]\ncontainerd_config = "{containerd_config}"\n')
    r = subprocess.run([sys.executable, "-m", "nodeagent", "doctor", "--no-kube", "--json", "--config", str(agent),
                        *args], capture_output=True, text=True, timeout=120, check=False, cwd=REPO)
    assert "Traceback" not in r.stderr, r.stderr
    doc = json.loads(r.stdout)
    return r.returncode, doc["findings"]


def test_on_the_host_containerd_itself_judges_its_config(tmp_path: Path) -> None:
    containerd2 = peer_binary("NODEAGENT_CONTAINERD2", "nodeagent_peers_containerd2", "containerd 2")
    good, bad = tmp_path / "good.toml", tmp_path / "refused.toml"
    good.write_text(V3_WITH_NVIDIA)
    bad.write_text(REFUSED_BY_CONTAINERD)
    asked = ["--containerd-binary", str(containerd2)]

    _, findings = _doctor_on_host(tmp_path, good, *asked)
    _one(findings, "containerd", "ok", f"containerd loads {good} ({containerd2} --config {good} config dump)")

    code, findings = _doctor_on_host(tmp_path, bad, *asked)
    refused = _one(findings, "containerd", "error", f"containerd refuses {bad}: ")
    assert "MaxContainerLogLineSize" in str(refused["text"]) and "would not start" in str(refused["text"]), refused
    assert refused["fix"] == f"correct {bad} (then: {containerd2} --config {bad} config dump)"
    assert not [f for f in findings if f["area"] == "containerd" and "cannot be used" in str(f["text"])], findings
    assert code == 2


def test_under_a_root_containerd_is_never_asked(tmp_path: Path) -> None:
    root = _root(tmp_path, "2.4.2-1")
    (root / "etc/containerd/config.toml").write_text(REFUSED_BY_CONTAINERD)
    _, findings = _doctor(root, "--simulate", "t4x1")
    _one(findings, "containerd", "ok", "/etc/containerd/config.toml read by nodeagent only: containerd itself is "
         f"not asked under --root {root}")
    assert not [f for f in findings if "refuses" in str(f["text"])], findings
    containerd2 = peer_binary("NODEAGENT_CONTAINERD2", "nodeagent_peers_containerd2", "containerd 2")
    r = subprocess.run([sys.executable, "-m", "nodeagent", "--root", str(root), "doctor", "--no-kube",
                        "--containerd-binary", str(containerd2)], capture_output=True, text=True, timeout=60,
                       check=False, cwd=REPO)
    assert r.returncode == 2 and "under --root" in r.stderr and not r.stdout, (r.stdout, r.stderr)
