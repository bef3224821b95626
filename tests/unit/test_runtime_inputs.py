"""Bad and hostile inputs of `nodeagent runtime`: each is one error line and changes nothing.

--root confinement (``..`` above the root, symlinked config/drop-in/toolkit files, runtime.json entries),
a relative --root, --root after the subcommand, files that are not regular files or are too large, deeply
nested TOML, an immutable target, a malformed runtime.json, templates named by their language, and the
kubelet directory taken from the agent config.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent import fileio
from nodeagent.config import RuntimeSettings
from nodeagent.errors import ConfigError, RuntimeConfigError
from nodeagent.hostpaths import HostPathError, HostPaths
from nodeagent.runtime import configure as rc
from nodeagent.runtime import containerd_toml as ctd_toml
from nodeagent.runtime import host

V2 = ('version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]\n'
      'runtime_type = "io.containerd.runc.v2"\n')


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nodeagent", *args], capture_output=True, text=True,
                          check=False, timeout=60, cwd=cwd)


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
            and not p.is_symlink()}


def _root_with_config(tmp_path: Path, text: str = V2) -> tuple[Path, Path]:
    root = tmp_path / "root"
    cfg = root / "etc/containerd/config.toml"
    cfg.parent.mkdir(parents=True)
    cfg.write_text(text)
    return root, cfg


# ------------------------------------------------------------------------------------------- HostPaths
def test_relative_root_becomes_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    paths = HostPaths(Path("demo"))
    assert paths.root == tmp_path / "demo"
    assert paths.pod_resources_socket == tmp_path / "demo/var/lib/kubelet/pod-resources/kubelet.sock"
    assert f"unix://{paths.pod_resources_socket}".startswith("unix:///")


@pytest.mark.parametrize("bad", ["/../../x/config.toml", "/etc/../../x", "/..", "relative/path"])
def test_paths_above_the_root_are_refused(tmp_path: Path, bad: str) -> None:
    with pytest.raises(HostPathError):
        HostPaths(tmp_path)(bad)


def test_dotdot_inside_the_root_is_fine(tmp_path: Path) -> None:
    assert HostPaths(tmp_path)("/etc/containerd/../x") == tmp_path / "etc/x"


def test_symlinks_resolve_inside_the_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(str(outside), root / "etc/abs")  # absolute target: read as a path inside the root
    os.symlink("../../../../../..", root / "etc/up")  # climbs: stops at the root
    paths = HostPaths(root)
    assert paths("/etc/abs/config.toml") == root / str(outside).lstrip("/") / "config.toml"
    assert paths("/etc/up/etc/x") == root / "etc/x"


def test_symlink_loop_is_refused(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    os.symlink("/etc/b", tmp_path / "etc/a")
    os.symlink("/etc/a", tmp_path / "etc/b")
    with pytest.raises(HostPathError, match="too many levels"):
        HostPaths(tmp_path)("/etc/a/config.toml")


@pytest.mark.parametrize("which", ["config", "dropin", "toolkit"])
def test_symlinked_files_are_written_inside_the_root(tmp_path: Path, which: str) -> None:
    root, cfg = _root_with_config(tmp_path)
    victim = tmp_path / "victim" / "file.toml"
    victim.parent.mkdir()
    victim.write_text(V2 if which == "config" else "")
    before = victim.read_bytes()
    link = {"config": cfg, "dropin": root / "etc/containerd/conf.d/99-nvidia.toml",
            "toolkit": root / "etc/nvidia-container-runtime/config.toml"}[which]
    if which == "config":
        cfg.unlink()
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(str(victim), link)
    inside = root / str(victim).lstrip("/")
    inside.parent.mkdir(parents=True)
    inside.write_text(V2 if which == "config" else "")
    rc.configure(HostPaths(root), rc.Options(mode="drop-in"))
    assert victim.read_bytes() == before, "a file outside the root was written"
    assert inside.read_bytes() != (V2 if which == "config" else "").encode()


def test_dotdot_flag_is_one_line_and_writes_nothing(tmp_path: Path) -> None:
    root, _cfg = _root_with_config(tmp_path)
    (tmp_path / "x").mkdir()
    before = _tree(tmp_path)
    r = _cli("--root", str(root), "runtime", "configure", "--containerd-config", "/../../x/config.toml",
             "--restart", "none")
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "is not inside --root" in r.stderr, r.stderr
    assert f"did you mean '{root.resolve()}/x/config.toml'?" in r.stderr, r.stderr
    assert _tree(tmp_path) == before


# ------------------------------------------------------------------------------------------- the CLI root
def test_root_after_the_subcommand(tmp_path: Path) -> None:
    root, _cfg = _root_with_config(tmp_path)
    r = _cli("runtime", "configure", "--root", str(root), "--restart", "none", "--json")
    assert r.returncode == 0, r.stderr
    assert (root / "etc/containerd/conf.d/99-nvidia.toml").exists()
    shown = _cli("runtime", "show", "--root", str(root), "--json")
    assert json.loads(shown.stdout)["managed_by_nodeagent"] is True
    clash = _cli("--root", str(root), "runtime", "show", "--root", str(tmp_path))
    assert clash.returncode == 2 and "--root given twice" in clash.stderr


def test_relative_root_on_the_command_line(tmp_path: Path) -> None:
    root, _cfg = _root_with_config(tmp_path)
    r = _cli("--root", "root", "runtime", "configure", "--restart", "none", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (root / "etc/containerd/conf.d/99-nvidia.toml").exists()


# ------------------------------------------------------------------------------------ bounded file reads
def test_read_regular_refuses_fifo_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "config.toml"
    os.mkfifo(fifo)
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            fileio.read_regular(fifo)
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "reading a FIFO blocked"
    assert isinstance(outcome[0], fileio.UnreadableFileError) and "a FIFO" in str(outcome[0])


def test_read_regular_refuses_directory_device_and_oversize(tmp_path: Path) -> None:
    with pytest.raises(fileio.UnreadableFileError, match="a directory"):
        fileio.read_regular(tmp_path)
    with pytest.raises(fileio.UnreadableFileError, match="a character device"):
        fileio.read_regular("/dev/zero")
    big = tmp_path / "big"
    big.write_bytes(b"x" * 101)
    with pytest.raises(fileio.UnreadableFileError, match="more than the 100 bytes"):
        fileio.read_regular(big, max_bytes=100)
    assert fileio.read_regular(big, max_bytes=101) == b"x" * 101
    assert fileio.read_regular(tmp_path / "absent") is None


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_config_that_is_not_a_file_is_one_line(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "root"
    cfg = root / "etc/containerd/config.toml"
    cfg.parent.mkdir(parents=True)
    if kind == "fifo":
        os.mkfifo(cfg)
    else:
        cfg.mkdir()
    for cmd in (["configure", "--restart", "none"], ["show"]):
        r = _cli("--root", str(root), "runtime", *cmd)
        assert r.returncode == 2, r.stderr
        assert r.stderr.count("\n") == 1 and "expected a regular file" in r.stderr
    assert not (root / "var/lib/nodeagent").exists()


def test_oversized_and_deeply_nested_configs_are_one_line() -> None:
    with pytest.raises(ConfigError, match="more than the"):
        ctd_toml.parse("# " + "x" * ctd_toml.MAX_CONFIG_BYTES + "\n")
    for text in ("a = " + "[" * 5000 + "]" * 5000 + "\n",
                 "a = " + "{b = " * 3000 + "1" + "}" * 3000 + "\n",
                 "[" + ".".join(["k"] * 200) + "]\nx = 1\n"):
        with pytest.raises(ConfigError, match="nested more than") as e:
            ctd_toml.parse(text, "deep.toml")
        assert "\n" not in str(e.value)


def test_deeply_nested_config_via_cli(tmp_path: Path) -> None:
    root, _cfg = _root_with_config(tmp_path, "x = " + "[" * 20000 + "]" * 20000 + "\n")
    r = _cli("--root", str(root), "runtime", "configure", "--restart", "none")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "nested more than" in r.stderr, r.stderr


# ------------------------------------------------------------------------------------------ unwritable
@contextlib.contextmanager
def _immutable(path: Path) -> Iterator[None]:
    subprocess.run(["chattr", "+i", str(path)], check=True)
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def test_immutable_config_writes_nothing(tmp_path: Path) -> None:
    root, cfg = _root_with_config(tmp_path)
    before = _tree(root)
    with _immutable(cfg):
        r = _cli("--root", str(root), "runtime", "configure", "--restart", "none", "--in-place")
        assert r.returncode == 2, r.stderr
        assert r.stderr.count("\n") == 1 and "cannot write" in r.stderr
    assert _tree(root) == before, "a backup, drop-in or runtime.json was written"
    assert not (root / "var/lib/nodeagent").exists()


def test_read_only_directory_writes_nothing(tmp_path: Path) -> None:
    root, _cfg = _root_with_config(tmp_path)
    (root / "etc/containerd/conf.d").mkdir()
    before = _tree(root)
    with _immutable(root / "etc/containerd/conf.d"), \
            pytest.raises(fileio.UnreadableFileError, match="cannot write"):
        rc.configure(HostPaths(root), rc.Options(mode="drop-in"))
    assert _tree(root) == before and not (root / "var/lib/nodeagent").exists()


# ------------------------------------------------------------------------------------------ runtime.json
def _state(root: Path, state: object) -> Path:
    p = root / "var/lib/nodeagent/runtime.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(state) if not isinstance(state, str) else state)
    return p


def test_malicious_state_entries_are_refused(tmp_path: Path) -> None:
    root, cfg = _root_with_config(tmp_path)
    victim = tmp_path / "victim.toml"
    victim.write_text("keep me\n")
    sha = hashlib.sha256(victim.read_bytes()).hexdigest()
    escape = "/.." * 10 + str(victim)
    for files in ({escape: {"original": base64.b64encode(b"owned").decode(), "written_sha256": sha}},
                  {"etc/relative.toml": {"original": None, "written_sha256": sha}},
                  {"/etc/containerd/config.toml": {"original": "%%%", "written_sha256": sha}},
                  {"/etc/containerd/config.toml": {"original": None, "written_sha256": sha, "kind": "shell"}},
                  {"/etc/containerd/config.toml": ["not", "an", "object"]}):
        _state(root, {"files": files, "mode": "drop-in", "root_config": "/etc/containerd/config.toml"})
        with pytest.raises(RuntimeConfigError, match="malformed state") as e:
            rc.unconfigure(HostPaths(root))
        assert "\n" not in str(e.value)
        r = _cli("--root", str(root), "runtime", "unconfigure", "--restart", "none")
        assert r.returncode == 1 and r.stderr.count("\n") == 1 and "malformed state" in r.stderr, r.stderr
    assert victim.read_text() == "keep me\n"
    assert cfg.read_text() == V2


@pytest.mark.parametrize("text", ["{not json", "[]", '{"files": 3}',
                                  '{"previous": {"added_runtimes": "runc"}}', "[" * 100000 + "]" * 100000])
def test_malformed_state_is_one_line(tmp_path: Path, text: str) -> None:
    root, cfg = _root_with_config(tmp_path)
    _state(root, text)
    for cmd in (["unconfigure", "--restart", "none"], ["configure", "--restart", "none"], ["show"]):
        r = _cli("--root", str(root), "runtime", *cmd)
        assert r.returncode == 1 and r.stderr.count("\n") == 1, (cmd, r.stderr)
        assert "malformed state" in r.stderr, (cmd, r.stderr)
    assert cfg.read_text() == V2


# --------------------------------------------------------------------------------------------- templates
@pytest.mark.parametrize(("name", "text", "language", "generator"), [
    ("config.toml.j2", 'version = 2\n{% if containerd_use_systemd %}\nSystemdCgroup = true\n{% endif %}\n',
     "Jinja2", "Kubespray"),
    ("containerd.toml.gtpl",
     'version = 2\nroot = "{{.KubeletConfig.DataDir}}"\n{{- if .IsKata }}\n{{- end}}\n',
     "Go template", "AKS"),
    ("containerd.toml",
     '[plugins.cri]\n{{#if settings.container-runtime.x}}\n'
     'x = {{settings.container-runtime.x}}\n{{/if}}\n',
     "handlebars", "Bottlerocket"),
    ("config.toml.tmpl", 'version = 2\n{{ template "base" . }}\n', "Go template", "k3s/rke2"),
    ("containerd-template.toml", '[plugins.cri.containerd]\n  default_runtime_name = "${RUNTIME}"\n',
     "shell variables", "MicroK8s"),
])
def test_templates_are_named(name: str, text: str, language: str, generator: str) -> None:
    with pytest.raises(ConfigError) as e:
        ctd_toml.parse(text, f"/etc/containerd/{name}")
    msg = str(e.value)
    assert language in msg and generator in msg and "\n" not in msg
    if generator != "k3s/rke2":
        assert "k3s" not in msg


def test_template_sibling_names_its_language(tmp_path: Path) -> None:
    root, cfg = _root_with_config(tmp_path)
    cfg.with_name("config.toml.tmpl").write_text('{% for r in runtimes %}\n[x]\n{% endfor %}\n')
    with pytest.raises(ConfigError, match="Jinja2 template") as e:
        rc.configure(HostPaths(root), rc.Options())
    assert "k3s" not in str(e.value)


# ------------------------------------------------------------------------------------------- kubelet dir
def test_cgroup_driver_follows_the_kubelet_dir(tmp_path: Path) -> None:
    root = tmp_path / "root"
    kubelet = root / "data/kubelet"
    kubelet.mkdir(parents=True)
    (kubelet / "config.yaml").write_text("kind: KubeletConfiguration\ncgroupDriver: systemd\n")
    paths = HostPaths(root)
    assert host.systemd_cgroup(paths, "/data/kubelet") is True
    assert host.systemd_cgroup(paths) is False  # the default dir has no config, and no systemd in the root
    opts = rc.Options(mode="in-place", kubelet_dir="/data/kubelet")
    rc.configure(paths, opts)
    text = (root / "etc/containerd/config.toml").read_text()
    assert "SystemdCgroup = true" in text
    from_settings = rc.options_from_settings(RuntimeSettings(), kubelet_dir="/data/kubelet")
    assert from_settings.kubelet_dir == "/data/kubelet"
