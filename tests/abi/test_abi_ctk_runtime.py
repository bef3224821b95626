"""``nvidia-ctk runtime configure --runtime=containerd`` (v1.20.1) next to nodeagent's runtime configure on
every file of the containerd corpus: containerd's own ``config dump`` of both results shows the same
effective ``nvidia`` runtime (type, BinaryName) and the same default runtime, with and without
``--set-as-default``. Each deliberate difference is one named test below (``test_difference_*``). Both write into the test's
temp directory only (nvidia-ctk gets an explicit drop-in path; nodeagent its state/toolkit paths there).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from nodeagent.runtime import configure as rc
from nodeagent.runtime.containerd import DEFAULT_BINARY
from tests.abi._abi import built
from tests.integration._containerd import Case, StatePaths
from tests.peers.containerd import Containerd

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "containerd"
# version-2 files (Debian's containerd 1.6 judges them; nvidia-ctk writes drop-ins for them)
V2 = sorted(p.name for p in CORPUS.glob("*.toml") if "version = 2" in p.read_text())


def _copy(tmp: Path, name: str) -> Case:
    etc = tmp / "etc"
    etc.mkdir(parents=True)
    config = etc / "config.toml"
    shutil.copyfile(CORPUS / name, config)
    (etc / "registries.toml").write_text("version = 2\n")  # relative imports of the corpus
    return Case(StatePaths(Path("/"), state=tmp / "state"), config, etc / "conf.d" / "99-nvidia.toml",
                tmp / "toolkit.toml", config.read_bytes())  # fmt: skip


def _ctk(case: Case, set_as_default: bool) -> float:
    cmd = [
        str(built("NODEAGENT_NVIDIA_CTK")), "runtime", "configure", "--runtime=containerd",
        f"--config={case.config}", f"--drop-in-config={case.dropin}", f"--nvidia-runtime-path={DEFAULT_BINARY}",
    ]  # fmt: skip
    if set_as_default:
        cmd.append("--set-as-default")
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    return elapsed


def _nodeagent(case: Case, set_as_default: bool) -> float:
    start = time.perf_counter()
    rc.configure(case.paths, case.options("drop-in", set_as_default=set_as_default))
    return time.perf_counter() - start


def _effective(containerd: Containerd, config: Path) -> dict[str, Any]:
    cri = containerd.config_dump(config)["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]
    nvidia = cri["runtimes"]["nvidia"]
    return {
        "default_runtime_name": cri["default_runtime_name"],
        "runtime_type": nvidia["runtime_type"],
        "BinaryName": nvidia.get("options", {}).get("BinaryName"),
    }


@pytest.mark.parametrize("set_as_default", [False, True], ids=["added", "default"])
@pytest.mark.parametrize("name", V2)
def test_same_effective_nvidia_runtime_as_nvidia_ctk(
    containerd: Containerd, tmp_path: Path, name: str, set_as_default: bool
) -> None:
    ours, theirs = _copy(tmp_path / "nodeagent", name), _copy(tmp_path / "ctk", name)
    t_ours = _nodeagent(ours, set_as_default)
    t_theirs = _ctk(theirs, set_as_default)
    mine, nvidia = _effective(containerd, ours.config), _effective(containerd, theirs.config)
    assert mine == nvidia
    assert mine["BinaryName"] == DEFAULT_BINARY
    assert (mine["default_runtime_name"] == "nvidia") is set_as_default
    print(f"runtime configure {name}: nodeagent {t_ours * 1000:.1f} ms, nvidia-ctk {t_theirs * 1000:.1f} ms")


def test_difference_comments_kept_by_nodeagent_dropped_by_nvidia_ctk(tmp_path: Path) -> None:
    name = "comments-everywhere.toml"
    ours, theirs = _copy(tmp_path / "nodeagent", name), _copy(tmp_path / "ctk", name)
    _nodeagent(ours, False)
    _ctk(theirs, False)
    comments = [ln for ln in (CORPUS / name).read_text().splitlines() if ln.strip().startswith("#")]
    assert comments
    assert all(c in ours.config.read_text().splitlines() for c in comments)
    assert not any(c in theirs.config.read_text().splitlines() for c in comments)


def test_runc_options_copied_by_both(containerd: Containerd, tmp_path: Path) -> None:
    """Not a difference: both copy runc's options (SystemdCgroup = true) into the nvidia runtime."""
    name = "containerd-1.7-systemd.toml"
    ours, theirs = _copy(tmp_path / "nodeagent", name), _copy(tmp_path / "ctk", name)
    _nodeagent(ours, False)
    _ctk(theirs, False)

    def options(config: Path) -> dict[str, Any]:
        cri = containerd.config_dump(config)["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]
        opts: dict[str, Any] = cri["runtimes"]["nvidia"].get("options", {})
        return opts

    assert options(theirs.config).get("SystemdCgroup") is True
    assert options(ours.config).get("SystemdCgroup") is True


def test_difference_exact_undo_only_in_nodeagent(tmp_path: Path) -> None:
    """nodeagent's unconfigure gives back the original bytes; nvidia-ctk v1.20.1 has no undo command."""
    name = "containerd-1.7-systemd.toml"
    ours = _copy(tmp_path / "nodeagent", name)
    _nodeagent(ours, True)
    assert ours.config.read_bytes() != ours.original
    rc.unconfigure(ours.paths)
    assert ours.config.read_bytes() == ours.original and not ours.dropin.exists()
    proc = subprocess.run([str(built("NODEAGENT_NVIDIA_CTK")), "runtime", "--help"], capture_output=True,
                          text=True, check=True)  # fmt: skip
    assert "unconfigure" not in proc.stdout and "remove" not in proc.stdout.lower().split("commands:")[-1]
