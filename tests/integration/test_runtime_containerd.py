"""The real containerd (Debian's) judges every rewritten config of the corpus.

For each corpus file and mode: containerd loads the result and its CRI plugin reports the ``nvidia`` handler
with the right BinaryName; lines nodeagent does not own are byte-identical; a second run changes nothing;
``unconfigure`` restores the original bytes. Version-3/4 files (containerd 2.x) are judged the same way by a
real containerd 2.4 in test_runtime_containerd2.py: Debian's containerd 1.6 does not understand them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from nodeagent.errors import ConfigError
from nodeagent.runtime import configure as rc
from nodeagent.runtime.containerd import DEFAULT_BINARY, DEFAULT_CDI_BINARY, view_of
from tests.integration._containerd import (
    Case,
    StatePaths,
    assert_idempotent_then_undone,
    assert_nvidia_runtime,
    only_additions,
)
from tests.peers.containerd import Containerd

pytestmark = pytest.mark.peers

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "containerd"
JUDGED = [*sorted(p.name for p in CORPUS.glob("*.toml") if "version = 3" not in p.read_text()), "(no file)"]
def _case(tmp_path: Path, name: str) -> Case:
    etc = tmp_path / "etc"
    etc.mkdir()
    config = etc / "config.toml"
    original: bytes | None = None
    if name != "(no file)":
        shutil.copyfile(CORPUS / name, config)
        original = config.read_bytes()
    # relative imports of the corpus resolve next to the config
    (etc / "registries.toml").write_text("version = 2\n")
    return Case(StatePaths(Path("/"), state=tmp_path / "state"), config, etc / "conf.d" / "99-nvidia.toml",
                tmp_path / "toolkit.toml", original)


def _cri(dump: dict[str, object]) -> dict[str, object]:
    plugins = dump["plugins"]
    assert isinstance(plugins, dict)
    cri = plugins["io.containerd.grpc.v1.cri"]
    assert isinstance(cri, dict)
    return cri


@pytest.mark.parametrize("mode", ["auto", "in-place"])
@pytest.mark.parametrize("name", JUDGED)
def test_containerd_loads_result(containerd: Containerd, tmp_path: Path, name: str, mode: rc.Mode) -> None:
    case = _case(tmp_path, name)
    before = containerd.config_dump(case.config) if case.original is not None else None
    opts = case.options(mode, set_as_default=(mode == "in-place"), cdi=(mode == "in-place"))
    first = rc.configure(case.paths, opts)
    assert first.changed and first.restart_needed
    expected_mode = mode if mode != "auto" else (
        "drop-in" if case.original and case.original.strip() and b"version = 2" in case.original else "in-place")
    assert first.mode == expected_mode
    written = case.config.read_bytes()
    only_additions(case.original, written)
    if case.original is not None and case.original.strip():
        assert (case.config.parent / "config.toml.nodeagent.bak").read_bytes() == case.original

    # containerd's own loader: effective config
    dump = _cri(containerd.config_dump(case.config))
    runtimes = dump["containerd"]["runtimes"]  # type: ignore[index]
    assert_nvidia_runtime(runtimes)
    if before is not None and case.original and "runc" in view_of(case.original.decode()).runtimes:
        old_runc = _cri(before)["containerd"]["runtimes"]["runc"]  # type: ignore[index]
        if old_runc:
            assert runtimes["runc"] == old_runc
            want = old_runc.get("options", {}).get("SystemdCgroup")
            if want is not None:
                assert runtimes["nvidia"]["options"]["SystemdCgroup"] == want
    if opts.set_as_default:
        assert dump["containerd"]["default_runtime_name"] == "nvidia"  # type: ignore[index]
        if containerd.version().split()[2] >= "1.7":
            assert dump["enable_cdi"] is True
        else:  # containerd 1.6 has no CDI: the key is written, and the user is told
            assert "enable_cdi = true" in (case.dropin if first.mode == "drop-in" else case.config).read_text()
            assert any("no CDI support" in w for w in first.warnings)
        assert runtimes["nvidia-cdi"]["options"]["BinaryName"] == DEFAULT_CDI_BINARY

    # a running containerd's CRI plugin reports the handler (in-place runs are covered by the dump)
    if mode == "auto":
        running = containerd.start(case.config)
        assert running.cri_error is None, running.cri_error
        assert running.runtimes["nvidia"]["Options"]["BinaryName"] == DEFAULT_BINARY
        assert "runc" in running.runtimes
        running.stop()

    # idempotent; undo: exact original bytes, drop-in and state gone; a second undo has nothing to do
    assert_idempotent_then_undone(case, opts)
    assert not rc.unconfigure(case.paths).changed


def test_unconfigure_after_hand_edit_removes_only_our_changes(containerd: Containerd, tmp_path: Path) -> None:
    case = _case(tmp_path, "comments-everywhere.toml")
    rc.configure(case.paths, case.options("in-place", set_as_default=True))
    edited = case.config.read_text().replace("enable_unprivileged_ports = true", "enable_unprivileged_ports = false")
    case.config.write_text(edited)
    rc.unconfigure(case.paths)
    assert case.config.read_bytes() == case.original.replace(  # type: ignore[union-attr]
        b"enable_unprivileged_ports = true", b"enable_unprivileged_ports = false")
    dump = _cri(containerd.config_dump(case.config))
    assert dump["containerd"]["default_runtime_name"] == "runc"  # type: ignore[index]
    assert "nvidia" not in dump["containerd"]["runtimes"]  # type: ignore[index]


def test_drop_in_unconfigure_keeps_user_imports_added_later(tmp_path: Path) -> None:
    case = _case(tmp_path, "existing-imports.toml")
    rc.configure(case.paths, case.options("drop-in"))
    text = case.config.read_text().replace('"registries.toml"', '"registries.toml", "/etc/containerd/more.toml"')
    case.config.write_text(text)
    rc.unconfigure(case.paths)
    assert case.config.read_bytes() == case.original.replace(  # type: ignore[union-attr]
        b'"registries.toml"', b'"registries.toml", "/etc/containerd/more.toml"')
    assert not case.dropin.exists()


def test_dry_run_writes_nothing_and_prints_diff(tmp_path: Path) -> None:
    case = _case(tmp_path, "containerd-1.7-systemd.toml")
    result = rc.configure(case.paths, case.options("auto", dry_run=True))
    assert result.changed and result.dry_run
    assert case.config.read_bytes() == case.original
    assert not case.dropin.exists() and not case.paths.state_dir.exists()
    diffs = {f.path: f.diff for f in result.files}
    assert diffs[str(case.config)].startswith(f"--- {case.config}\n+++ {case.config}\n")
    assert f'+imports = ["{case.dropin}"]' in diffs[str(case.config)]
    assert diffs[str(case.dropin)].startswith(f"--- /dev/null\n+++ {case.dropin}\n")


def test_template_and_invalid_toml_write_nothing(tmp_path: Path) -> None:
    case = _case(tmp_path, "containerd-1.7-systemd.toml")
    case.config.with_name("config.toml.tmpl").write_text("{{ template \"base\" . }}\n")
    with pytest.raises(ConfigError, match="k3s/rke2"):
        rc.configure(case.paths, case.options("auto"))
    case.config.with_name("config.toml.tmpl").unlink()
    case.config.write_bytes((CORPUS / "invalid.toml.bad").read_bytes())
    with pytest.raises(ConfigError, match=r"line 2, column \d+"):
        rc.configure(case.paths, case.options("auto"))
    assert case.config.read_bytes() == (CORPUS / "invalid.toml.bad").read_bytes()
    assert sorted(p.name for p in case.config.parent.iterdir()) == ["config.toml", "registries.toml"]
    assert not case.toolkit.exists() and not case.paths.state_dir.exists()


def test_show_reports_effective_runtimes(tmp_path: Path) -> None:
    case = _case(tmp_path, "containerd-1.7-systemd.toml")
    rc.configure(case.paths, case.options("auto", set_as_default=True))
    info = rc.show(case.paths, str(case.config), toolkit_config=str(case.toolkit))
    assert info["sources"] == [str(case.config), str(case.dropin)]
    assert info["default_runtime"] == "nvidia"
    assert info["runtimes"]["nvidia"] == {"runtime_type": "io.containerd.runc.v2", "binary": DEFAULT_BINARY,
                                          "systemd_cgroup": True}
    assert info["leak_guard"] is True and info["managed_by_nodeagent"] is True
