"""Node config shapes that used to go wrong, judged by the real containerd 1.6 and containerd 2.4.

- An nvidia runtime the config already defines (a GPU node image: nvidia is the default, with a base runtime
  spec and the systemd cgroup driver) is kept exactly: containerd's effective nvidia runtime is the same
  before and after ``configure``; when it lacks only ``BinaryName`` the drop-in adds just that.
- ``disabled_plugins`` naming the CRI plugin is warned about in the result and in ``runtime show``.
- An earlier ``imports`` entry naming a missing file (containerd 2 then ignores every later import, 1.x does
  not start) makes the auto mode edit the root config in place, and an explicit drop-in refuse with one line.
- Crash ordering: a failure injected after each single write of ``configure`` and ``unconfigure`` leaves a
  config containerd loads, with no import of a missing file; running the command again finishes the job.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from nodeagent.errors import ConfigError
from nodeagent.runtime import configure as rc
from nodeagent.runtime.containerd import DEFAULT_BINARY
from tests.integration._containerd import Case, ContainerdHostPaths, StatePaths
from tests.peers.containerd import Containerd
from tests.peers.containerd2 import Containerd2

if sys.version_info >= (3, 11):
    import tomllib
else:  # the backport of the same parser
    import tomli as tomllib

pytestmark = pytest.mark.peers

SHAPES = Path(__file__).resolve().parents[1] / "fixtures" / "containerd" / "shapes"
CRI2 = "io.containerd.grpc.v1.cri"
CRI3 = "io.containerd.cri.v1.runtime"


def _case(tmp_path: Path, shape: str, binary: Path) -> Case:
    etc = tmp_path / "etc"
    (etc / "conf.d").mkdir(parents=True)
    config = etc / "config.toml"
    config.write_text((SHAPES / shape).read_text().replace("/etc/containerd/", f"{etc}/"))
    return Case(ContainerdHostPaths(Path("/"), state=tmp_path / "state", containerd=binary), config,
                etc / "conf.d" / "99-nvidia.toml", tmp_path / "toolkit.toml", config.read_bytes())


def _runtimes(dump: dict[str, Any], cri: str) -> dict[str, Any]:
    runtimes = dump["plugins"][cri]["containerd"]["runtimes"]
    assert isinstance(runtimes, dict)
    return runtimes


def _imports_exist(config: Path) -> None:
    """No import of the root config names a file that is missing (containerd would skip the rest)."""
    for entry in tomllib.loads(config.read_text()).get("imports", []):
        if not any(ch in entry for ch in "*?["):
            assert Path(entry).exists(), f"{config} imports {entry}, which is missing"


# ------------------------------------------------------------------------------- existing nvidia runtime
@pytest.mark.parametrize("mode", ["auto", "drop-in"])
def test_existing_nvidia_runtime_is_kept_containerd2(containerd2: Containerd2, tmp_path: Path,
                                                     mode: rc.Mode) -> None:
    case = _case(tmp_path, "nvidia-default-v3.toml", containerd2.binary)
    before = _runtimes(containerd2.config_dump(case.config), CRI3)
    result = rc.configure(case.paths, case.options(mode))
    after_dump = containerd2.config_dump(case.config)
    after = _runtimes(after_dump, CRI3)
    assert after["nvidia"] == before["nvidia"]
    assert after["nvidia"]["base_runtime_spec"].endswith("base-spec.json")
    assert after["nvidia"]["options"]["SystemdCgroup"] is True
    assert after_dump["plugins"][CRI3]["containerd"]["default_runtime_name"] == "nvidia"
    assert case.config.read_bytes() == case.original and not case.dropin.exists()
    assert any("already wired" in n for n in result.notes), result.notes
    assert not result.restart_needed
    # the second run says the same and writes nothing
    again = rc.configure(case.paths, case.options(mode))
    assert not again.restart_needed and case.config.read_bytes() == case.original


def test_existing_nvidia_runtime_is_kept_containerd1(containerd: Containerd, tmp_path: Path) -> None:
    case = _case(tmp_path, "nvidia-default-v2.toml", containerd.binary)
    before = _runtimes(containerd.config_dump(case.config), CRI2)
    result = rc.configure(case.paths, case.options("drop-in"))
    assert _runtimes(containerd.config_dump(case.config), CRI2)["nvidia"] == before["nvidia"]
    assert not case.dropin.exists() and case.config.read_bytes() == case.original
    assert any("already wired" in n for n in result.notes)


def test_nvidia_runtime_without_binary_gets_only_the_binary(containerd2: Containerd2, tmp_path: Path) -> None:
    case = _case(tmp_path, "nvidia-partial-v3.toml", containerd2.binary)
    before = _runtimes(containerd2.config_dump(case.config), CRI3)
    rc.configure(case.paths, case.options("drop-in"))
    dropin = tomllib.loads(case.dropin.read_text())
    only_binary = {"nvidia": {"options": {"BinaryName": DEFAULT_BINARY}}}
    assert dropin["plugins"][CRI3]["containerd"]["runtimes"] == only_binary
    after = _runtimes(containerd2.config_dump(case.config), CRI3)
    expected = {**before["nvidia"], "options": {**before["nvidia"]["options"], "BinaryName": DEFAULT_BINARY}}
    assert after["nvidia"] == expected
    assert after["runc"] == before["runc"]
    rc.unconfigure(case.paths)
    assert case.config.read_bytes() == case.original and not case.dropin.exists()


# ------------------------------------------------------------------------------------- CRI plugin disabled
@pytest.mark.parametrize("shape", ["cri-disabled-v1.toml", "cri-disabled-v3.toml"])
def test_disabled_cri_plugin_is_warned(tmp_path: Path, shape: str) -> None:
    case = _case(tmp_path, shape, Path("/nonexistent"))
    result = rc.configure(case.paths, case.options("auto"))
    assert any("disabled_plugins names the CRI plugin" in w for w in result.warnings), result.warnings
    shown = rc.show(case.paths, str(case.config))
    assert any("disabled_plugins names the CRI plugin" in w for w in shown["warnings"])


# ------------------------------------------------------------------------------ missing earlier imports
def test_missing_import_hides_later_imports_from_containerd(containerd2: Containerd2, tmp_path: Path) -> None:
    """The fact the fallback rests on: containerd 2 ignores the drop-in behind a missing import, silently."""
    case = _case(tmp_path, "missing-import-v3.toml", containerd2.binary)
    case.dropin.write_text(f'version = 3\n[plugins."{CRI3}".containerd.runtimes.nvidia]\n'
                           'runtime_type = "io.containerd.runc.v2"\n')
    text = case.config.read_text().replace('never-written.toml"]', f'never-written.toml", "{case.dropin}"]')
    case.config.write_text(text)
    assert "nvidia" not in _runtimes(containerd2.config_dump(case.config), CRI3)
    shown = rc.show(case.paths, str(case.config))
    assert any("never-written.toml, which does not exist" in w for w in shown["warnings"]), shown["warnings"]


def test_missing_import_falls_back_to_in_place(containerd2: Containerd2, tmp_path: Path) -> None:
    case = _case(tmp_path, "missing-import-v3.toml", containerd2.binary)
    result = rc.configure(case.paths, case.options("auto"))
    assert result.mode == "in-place" and not case.dropin.exists()
    assert any("never-written.toml, which does not exist" in w for w in result.warnings)
    runtimes = _runtimes(containerd2.config_dump(case.config), CRI3)
    assert runtimes["nvidia"]["options"]["BinaryName"] == DEFAULT_BINARY
    rc.unconfigure(case.paths)
    assert case.config.read_bytes() == case.original


def test_missing_import_refuses_explicit_dropin(tmp_path: Path) -> None:
    case = _case(tmp_path, "missing-import-v3.toml", Path("/nonexistent"))
    with pytest.raises(ConfigError, match=r"never-written\.toml, which does not exist") as e:
        rc.configure(case.paths, case.options("drop-in"))
    assert "\n" not in str(e.value)
    assert case.config.read_bytes() == case.original and not case.dropin.exists()
    assert not (case.paths.state_dir / rc.STATE_FILE).exists()


# ------------------------------------------------------------------------------------------ crash ordering
class _Crash(Exception):
    pass


def _crash_after(n: int) -> Callable[[str], None]:
    count = [0]

    def hook(host_path: str) -> None:
        count[0] += 1
        if count[0] == n:
            raise _Crash(host_path)
    return hook


def _v2_plain(tmp_path: Path) -> Case:
    etc = tmp_path / "etc"
    (etc / "conf.d").mkdir(parents=True)
    config = etc / "config.toml"
    config.write_text(f'version = 2\n[plugins."{CRI2}".containerd.runtimes.runc]\n'
                      'runtime_type = "io.containerd.runc.v2"\n')
    return Case(StatePaths(Path("/"), state=tmp_path / "state"), config, etc / "conf.d" / "99-nvidia.toml",
                tmp_path / "toolkit.toml", config.read_bytes())


@pytest.mark.parametrize("crash_at", [1, 2, 3])
def test_configure_crash_between_writes_leaves_a_loadable_config(
        containerd: Containerd, tmp_path: Path, crash_at: int) -> None:
    case = _v2_plain(tmp_path)
    opts = case.options("drop-in")
    with pytest.raises(_Crash) as crashed:
        rc.configure(case.paths, opts, _after_write=_crash_after(crash_at))
    written_last = str(crashed.value)
    if crash_at == 1:
        assert written_last == str(case.dropin), "the drop-in must be written before the root's import"
    _imports_exist(case.config)
    runtimes = _runtimes(containerd.config_dump(case.config), CRI2)
    assert "runc" in runtimes
    # the next run completes the wiring, and unconfigure still restores the original bytes
    rc.configure(case.paths, opts)
    nvidia = _runtimes(containerd.config_dump(case.config), CRI2)["nvidia"]
    assert nvidia["options"]["BinaryName"] == DEFAULT_BINARY
    rc.unconfigure(case.paths)
    assert case.config.read_bytes() == case.original and not case.dropin.exists()


@pytest.mark.parametrize("crash_at", [1, 2, 3])
def test_unconfigure_crash_between_writes_leaves_a_loadable_config(
        containerd: Containerd, tmp_path: Path, crash_at: int) -> None:
    case = _v2_plain(tmp_path)
    rc.configure(case.paths, case.options("drop-in"))
    with pytest.raises(_Crash) as crashed:
        rc.unconfigure(case.paths, _after_write=_crash_after(crash_at))
    if crash_at == 1:
        assert str(crashed.value) == str(case.config), "the import must go before the drop-in"
    _imports_exist(case.config)
    assert "runc" in _runtimes(containerd.config_dump(case.config), CRI2)
    rc.unconfigure(case.paths)
    assert case.config.read_bytes() == case.original and not case.dropin.exists()
    assert not (case.paths.state_dir / rc.STATE_FILE).exists()


# ----------------------------------------------------------------------------------------- relative root
def test_relative_root_reaches_a_grpc_socket(containerd: Containerd, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A relative --root (``./demo``) must still give ``unix:///abs/path`` gRPC targets: containerd
    answers."""
    from nodeagent.hostpaths import HostPaths
    from nodeagent.runtime.restart import DEFAULT_SOCKET, answers

    config = tmp_path / "config.toml"
    config.write_text("version = 2\n")
    running = containerd.start(config)
    sock = tmp_path / "demo" / DEFAULT_SOCKET.lstrip("/")
    sock.parent.mkdir(parents=True)
    os.link(running.address, sock)  # the same socket inode, reachable under the root
    monkeypatch.chdir(tmp_path)
    assert answers(HostPaths(Path("demo"))(DEFAULT_SOCKET))
