"""``nodeagent doctor``: does the installed containerd load its config? A file in a format newer than the
release reads: containerd 2.x does not start with it, containerd 1.x starts and ignores its plugin tables (seen
here with Debian's real containerd 1.6); the same file under a containerd that reads it is no finding."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from nodeagent.runtime.containerd_versions import load_problem
from tests.e2e.test_doctor import _doctor, _one
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
