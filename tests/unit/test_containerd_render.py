"""The pure containerd editor: preservation, idempotence, versions, bases, drop-ins, errors."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import pytest
import tomlkit

from nodeagent.errors import ConfigError
from nodeagent.runtime import containerd as ctd
from nodeagent.runtime import containerd_toml as ctd_toml
from nodeagent.runtime import containerd_versions as ctd_versions
from nodeagent.runtime.containerd import Desired, render, render_dropin

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "containerd"
FILES = sorted(p.name for p in CORPUS.glob("*.toml"))
DESIREDS = {
    "plain": Desired(),
    "default+cdi": Desired(set_as_default=True, enable_cdi=True),
}
# Lines a render may change (rather than only add): the keys it owns.
OWNED = ("default_runtime_name", "enable_cdi", "imports")


def _text(name: str) -> str:
    return (CORPUS / name).read_text()


def _only_additions(old: str, new: str) -> None:
    """Every old line is still there byte for byte, except lines of keys the editor owns."""
    a, b = old.splitlines(keepends=True), new.splitlines(keepends=True)
    for tag, i1, i2, _j1, _j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if tag in ("replace", "delete"):
            for line in a[i1:i2]:
                assert line.strip() == "" or any(k in line for k in OWNED), f"changed line: {line!r}"


def _leaves(text: str) -> dict[tuple[str, ...], Any]:
    return dict(ctd.iter_keys(tomlkit.parse(text).unwrap()))


def test_corpus_is_there() -> None:
    assert len(FILES) >= 9


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("dkey", list(DESIREDS))
def test_in_place_preserves_and_is_idempotent(name: str, dkey: str) -> None:
    desired = DESIREDS[dkey]
    old = _text(name)
    new = render(old, desired)
    assert render(new, desired) == new
    view = ctd.view_of(new)
    assert view.binary_of("nvidia") == ctd.DEFAULT_BINARY
    assert view.runtimes["nvidia"]["runtime_type"] == ctd.RUNC_V2
    if desired.enable_cdi:
        assert view.binary_of("nvidia-cdi") == ctd.DEFAULT_CDI_BINARY
        assert view.enable_cdi
    assert view.default_runtime == ("nvidia" if desired.set_as_default else ctd.view_of(old).default_runtime
                                    if old.strip() else "runc")
    if old.strip():
        _only_additions(old, new)
        old_leaves, new_leaves = _leaves(old), _leaves(new)
        for path, value in old_leaves.items():
            if path[-1] in OWNED:
                continue
            assert new_leaves[path] == value, path


@pytest.mark.parametrize("name", FILES)
def test_drop_in_changes_only_imports(name: str) -> None:
    old = _text(name)
    out = render_dropin(old, Desired(set_as_default=True), dropin_path="/etc/containerd/conf.d/99-nvidia.toml")
    again = render_dropin(out.root_text, Desired(set_as_default=True))
    assert again.root_text == out.root_text and again.added_import is None
    assert again.dropin_text == out.dropin_text
    if old.strip():
        _only_additions(old, out.root_text)
    assert "/etc/containerd/conf.d/99-nvidia.toml" in ctd.view_of(out.root_text).imports
    drop = ctd.view_of(out.dropin_text)
    assert drop.binary_of("nvidia") == ctd.DEFAULT_BINARY and drop.default_runtime == "nvidia"
    assert out.dropin_text.startswith("# Written by nodeagent")


def test_sigle_import_added_to_existing_list_and_glob_respected() -> None:
    old = _text("existing-imports.toml")
    out = render_dropin(old, Desired())
    assert ctd.view_of(out.root_text).imports == (
        "/etc/containerd/site/*.toml", "registries.toml", ctd.DEFAULT_DROPIN)
    covered = 'version = 2\nimports = ["/etc/containerd/conf.d/*.toml"]\n'
    out2 = render_dropin(covered, Desired())
    assert out2.root_text == covered and out2.added_import is None
    rel = 'version = 2\nimports = ["conf.d/*.toml"]\n'
    assert render_dropin(rel, Desired()).added_import is None


def test_v1_sets_runtime_option_and_uses_plugins_cri() -> None:
    new = render(_text("v1-no-version.toml"), Desired())
    doc = tomlkit.parse(new).unwrap()
    opts = doc["plugins"]["cri"]["containerd"]["runtimes"]["nvidia"]["options"]
    assert opts == {"SystemdCgroup": True, "BinaryName": ctd.DEFAULT_BINARY, "Runtime": ctd.DEFAULT_BINARY}
    assert "version" not in doc


def test_v3_uses_cri_runtime_plugin() -> None:
    new = render(_text("containerd-2.0-default.toml"), Desired(set_as_default=True))
    doc = tomlkit.parse(new).unwrap()
    cri = doc["plugins"]["io.containerd.cri.v1.runtime"]
    assert cri["containerd"]["default_runtime_name"] == "nvidia"
    nvidia = cri["containerd"]["runtimes"]["nvidia"]
    assert nvidia["sandboxer"] == "podsandbox" and nvidia["options"]["BinaryName"] == ctd.DEFAULT_BINARY
    # literal-quoted siblings keep their quoting
    assert "[plugins.'io.containerd.cri.v1.runtime'.containerd]\n      default_runtime_name = \"nvidia\"" in new


def test_copies_current_default_runtime_crun() -> None:
    new = render(_text("crun-default.toml"), Desired())
    nvidia = ctd.view_of(new).runtimes["nvidia"]
    assert nvidia["options"] == {"BinaryName": ctd.DEFAULT_BINARY, "SystemdCgroup": True}


def test_copy_keeps_comments_and_indent_of_base() -> None:
    new = render(_text("comments-everywhere.toml"), Desired())
    assert '\n    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]\n' in new
    copy = new.split("runtimes.nvidia]", 1)[1]
    assert 'runtime_type = "io.containerd.runc.v2"   # shim v2' in copy
    assert "SystemdCgroup = true   # must match the kubelet's cgroupDriver" in copy


@pytest.mark.parametrize("systemd", [True, False])
def test_sane_default_follows_cgroup_driver_and_keeps_runc(systemd: bool) -> None:
    new = render("", Desired(systemd_cgroup=systemd))
    view = ctd.view_of(new)
    assert view.version == 2
    assert view.runtimes["nvidia"]["options"]["SystemdCgroup"] is systemd
    assert view.runtimes["runc"] == {"runtime_type": ctd.RUNC_V2, "options": {"SystemdCgroup": systemd}}
    assert render(None, Desired(containerd_version=(2, 1, 0))).startswith("version = 3\n")
    assert render(None, Desired(containerd_version=(2, 3, 0))).startswith("version = 4\n")
    assert render(None, Desired(containerd_version=(1, 7, 2))).startswith("version = 2\n")


def test_inline_options_table_is_edited_inline() -> None:
    new = render(_text("dotted-and-inline.toml"), Desired())
    assert 'options = {SystemdCgroup = true, BinaryName = "/usr/bin/nvidia-container-runtime"}' in new \
        or 'options = { SystemdCgroup = true, BinaryName = "/usr/bin/nvidia-container-runtime" }' in new


def test_existing_nvidia_runtime_is_fixed_not_recopied() -> None:
    old = (
        'version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]\n'
        '  privileged_without_host_devices = true # keep\n'
        '  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]\n'
        '    BinaryName = "/opt/old/nvidia-container-runtime"\n'
    )
    new = render(old, Desired())
    assert "  privileged_without_host_devices = true # keep\n" in new
    assert 'BinaryName = "/usr/bin/nvidia-container-runtime"\n' in new
    view = ctd.view_of(new)
    assert set(view.runtimes) == {"nvidia"}
    assert view.runtimes["nvidia"]["runtime_type"] == ctd.RUNC_V2
    assert render(new, Desired()) == new


def test_drop_in_carries_whole_cri_table_before_2_0_and_delta_after() -> None:
    old = _text("containerd-1.7-systemd.toml")
    full = ctd_toml.parse(render_dropin(old, Desired(containerd_version=(1, 7, 2))).dropin_text).unwrap()
    cri = full["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["sandbox_image"] == "registry.k8s.io/pause:3.9"
    assert set(cri["containerd"]["runtimes"]) == {"runc", "nvidia"}
    assert cri["containerd"]["runtimes"]["nvidia"]["options"]["SystemdCgroup"] is True
    delta = ctd_toml.parse(render_dropin(old, Desired(containerd_version=(2, 0, 0))).dropin_text).unwrap()
    cri2 = delta["plugins"]["io.containerd.grpc.v1.cri"]
    assert set(cri2) == {"containerd"} and set(cri2["containerd"]["runtimes"]) == {"nvidia"}
    v3 = ctd_toml.parse(render_dropin(_text("containerd-2.0-default.toml"), Desired()).dropin_text).unwrap()
    assert v3["version"] == 3
    assert set(v3["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]) == {"nvidia"}


def test_template_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"line 1 is a Go template.*nothing was written"):
        render((CORPUS / "template.toml.tmpl").read_text(), Desired(), source="config.toml.tmpl")
    with pytest.raises(ConfigError, match="template"):
        render("version = 2\n", Desired(), source="/x/config.toml.tmpl")


def test_invalid_toml_names_line_and_column() -> None:
    with pytest.raises(ConfigError, match=r"invalid TOML at line 2, column \d+") as e:
        render((CORPUS / "invalid.toml.bad").read_text(), Desired(), source="/etc/containerd/config.toml")
    assert e.value.exit_code == 2
    assert str(e.value).startswith("/etc/containerd/config.toml:")


def test_unknown_version_refused() -> None:
    with pytest.raises(ConfigError, match="unsupported containerd config version 7"):
        render("version = 7\n", Desired())


def test_render_remove_restores_previous_default_after_hand_edits() -> None:
    old = _text("comments-everywhere.toml")
    new, prev = ctd.render_with_previous(old, Desired(set_as_default=True, enable_cdi=True))
    edited = new.replace("enable_unprivileged_ports = true", "enable_unprivileged_ports = false")
    back = ctd.render_remove(edited, prev)
    assert back == old.replace("enable_unprivileged_ports = true", "enable_unprivileged_ports = false")


def test_remove_import_keeps_others() -> None:
    old = _text("existing-imports.toml")
    out = render_dropin(old, Desired())
    assert ctd.remove_import(out.root_text, ctd.DEFAULT_DROPIN) == old


def test_containerd_version_parsing() -> None:
    assert ctd_versions.parse_containerd_version(
        "containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+deb12u3\n") == (1, 6, 20)
    assert ctd_versions.parse_containerd_version("containerd containerd.io v2.0.4 1a43cb6a1035\n") == (2, 0, 4)
    assert ctd_versions.parse_containerd_version("garbage") is None
    assert ctd_versions.merges_plugins((2, 0, 0), 2) and not ctd_versions.merges_plugins((1, 7, 9), 3)
    assert ctd_versions.merges_plugins(None, 3) and not ctd_versions.merges_plugins(None, 2)


def test_merged_view_replaces_or_merges_plugin_tables() -> None:
    root = _text("containerd-1.7-systemd.toml")
    drop = 'version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]\nruntime_type = "x"\n'
    old = ctd.merged_view(root, [("d.toml", drop)], (1, 7, 0))
    assert set(old.runtimes) == {"nvidia"}
    new = ctd.merged_view(root, [("d.toml", drop)], (2, 0, 0))
    assert set(new.runtimes) == {"runc", "nvidia"}


@pytest.mark.parametrize(
    ("cri", "containerd", "config_ver", "on"),
    [
        ("", (1, 7, 2), 2, False),  # before 2.0 CDI needs the key
        ("enable_cdi = true\n", (1, 7, 2), 2, True),
        ("", (2, 0, 4), 2, True),  # 2.0: on by default, also for a migrated version-2 file
        ("", None, 3, True),  # no binary known: a version-3 file means containerd 2
        ("", None, 2, False),
        ("enable_cdi = false\n", (2, 1, 0), 3, False),  # only an explicit false turns it off
        ("enable_cdi = false\n", (2, 4, 0), 4, True),  # 2.4 removed the key: always on
    ],
)
def test_cdi_enabled_follows_containerd_defaults(
    cri: str, containerd: tuple[int, int, int] | None, config_ver: int, on: bool
) -> None:
    table = ".".join(ctd_versions.cri_path(config_ver))
    text = f"version = {config_ver}\n[{table}]\n{cri}" if config_ver > 1 else cri
    text = text.replace("plugins.io.containerd.grpc.v1.cri", 'plugins."io.containerd.grpc.v1.cri"')
    text = text.replace("plugins.io.containerd.cri.v1.runtime", 'plugins."io.containerd.cri.v1.runtime"')
    assert ctd.merged_view(text, [], containerd).enable_cdi is on


def test_version_table_rows_ordered_and_known() -> None:
    """The containerd releases are in order and each writes a config format the table knows."""
    since = [row.since for row in ctd_versions.RELEASES]
    assert since == sorted(since)
    assert all(row.config_version in ctd_versions.FORMATS for row in ctd_versions.RELEASES)
    assert ctd_versions.release(None) is ctd_versions.RELEASES[0]
    assert ctd_versions.release((1, 2, 0)) is ctd_versions.RELEASES[0]
    assert ctd_versions.release((2, 3, 5)).config_version == 4
    assert not ctd_versions.known(True) and not ctd_versions.known(5) and ctd_versions.known(4)
