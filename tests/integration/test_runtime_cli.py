"""`nodeagent runtime ...` end to end under --root (no containerd restart)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "containerd"


def _run(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nodeagent", "--root", str(root), "runtime", *args],
                          capture_output=True, text=True, check=False, timeout=60)


def test_configure_show_unconfigure(tmp_path: Path) -> None:
    cfg = tmp_path / "etc/containerd/config.toml"
    cfg.parent.mkdir(parents=True)
    shutil.copyfile(CORPUS / "containerd-1.7-systemd.toml", cfg)
    original = cfg.read_bytes()

    dry = _run(tmp_path, "configure", "--dry-run", "--set-as-default")
    assert dry.returncode == 0, dry.stderr
    assert '+imports = ["/etc/containerd/conf.d/99-nvidia.toml"]' in dry.stdout
    assert "+++ /etc/containerd/conf.d/99-nvidia.toml" in dry.stdout
    assert cfg.read_bytes() == original

    done = _run(tmp_path, "configure", "--set-as-default", "--restart", "none", "--json")
    assert done.returncode == 0, done.stderr
    res = json.loads(done.stdout)
    assert res["changed"] and res["restart_needed"] and res["mode"] == "drop-in"
    assert "restart containerd" in res["restart"]
    assert (tmp_path / "etc/containerd/conf.d/99-nvidia.toml").exists()
    assert (tmp_path / "var/lib/nodeagent/runtime.json").stat().st_mode & 0o777 == 0o600

    again = _run(tmp_path, "configure", "--set-as-default", "--restart", "none")
    assert again.returncode == 0 and again.stdout.strip().endswith("unchanged")

    shown = json.loads(_run(tmp_path, "show", "--json").stdout)
    assert shown["default_runtime"] == "nvidia" and shown["leak_guard"] is True
    assert shown["runtimes"]["nvidia"]["binary"] == "/usr/bin/nvidia-container-runtime"
    assert "nvidia" in _run(tmp_path, "show").stdout

    undo = _run(tmp_path, "unconfigure", "--restart", "none")
    assert undo.returncode == 0, undo.stderr
    assert cfg.read_bytes() == original
    assert not (tmp_path / "etc/containerd/conf.d/99-nvidia.toml").exists()


def test_bad_input_exits_2_and_writes_nothing(tmp_path: Path) -> None:
    cfg = tmp_path / "etc/containerd/config.toml"
    cfg.parent.mkdir(parents=True)
    cfg.write_bytes((CORPUS / "invalid.toml.bad").read_bytes())
    bad = _run(tmp_path, "configure", "--restart", "none")
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: /etc/containerd/config.toml: invalid TOML at line 2, column")
    both = _run(tmp_path, "configure", "--in-place", "--drop-in", "/x.toml")
    assert both.returncode == 2 and "exclude each other" in both.stderr
    assert sorted(p.name for p in cfg.parent.iterdir()) == ["config.toml"]
    assert not (tmp_path / "var").exists()


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_more_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path: Path) -> None:
    cfg = tmp_path / "etc/containerd/config.toml"
    cfg.parent.mkdir(parents=True)
    shutil.copyfile(CORPUS / "containerd-1.7-systemd.toml", cfg)
    before = _files(tmp_path)
    cases = [
        # path flags are paths as the shell sees them (here relative to a cwd outside the root)
        (("configure", "--containerd-config", "etc/containerd/config.toml"), "is not inside --root"),
        (("configure", "--drop-in", "conf.d/x.toml"), "is not inside --root"),
        # a host-style path under another root is ambiguous: refused, naming the path it may have meant
        (("configure", "--containerd-config", "/etc/containerd/config.toml"),
         f"did you mean '{tmp_path.resolve()}/etc/containerd/config.toml'?"),
        (("configure", "--restart", "bogus"), "'bogus' is not one of"),
        (("configure", "--kubeconfig", str(tmp_path / "nope.yaml"), "--restart", "none"), "nope.yaml' does not exist"),
        (("show", "--containerd-config", "config.toml"), "is not inside --root"),
    ]
    for args, message in cases:
        r = _run(tmp_path, *args)
        assert r.returncode == 2, (args, r.stderr)
        assert message in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert _files(tmp_path) == before, args
    tk = tmp_path / "etc/nvidia-container-runtime/config.toml"
    tk.parent.mkdir(parents=True)
    tk.write_text("bad = [\n")
    r = _run(tmp_path, "configure", "--restart", "none")
    assert r.returncode == 2
    assert r.stderr.startswith("error: /etc/nvidia-container-runtime/config.toml: invalid TOML at line ")
    assert r.stderr.endswith("; nothing was written\n") and r.stderr.count("\n") == 1
    assert cfg.read_bytes() == (CORPUS / "containerd-1.7-systemd.toml").read_bytes()
    cfg.write_text("version = 9\n")
    r = _run(tmp_path, "configure", "--restart", "none")
    assert r.returncode == 2 and r.stderr == (
        "error: /etc/containerd/config.toml: unsupported containerd config version 9 (1-4 known)\n")
    cfg.write_text('version = "3"\n')  # a string: containerd itself refuses the file
    r = _run(tmp_path, "configure", "--restart", "none")
    assert r.returncode == 2 and r.stderr == (
        "error: /etc/containerd/config.toml: version must be an integer, not '3' (containerd refuses such a file); "
        "nothing was written\n")


def test_failed_restart_is_exit_1_and_says_what_was_written(tmp_path: Path) -> None:
    cfg = tmp_path / "etc/containerd/config.toml"
    cfg.parent.mkdir(parents=True)
    shutil.copyfile(CORPUS / "containerd-1.7-systemd.toml", cfg)
    r = _run(tmp_path, "configure", "--restart", "signal", "--restart-timeout", "1")
    assert r.returncode == 1
    assert r.stderr.startswith("error: no process is serving ") and r.stderr.count("\n") == 1
    assert "(written: /etc/containerd/config.toml, /etc/containerd/conf.d/99-nvidia.toml" in r.stderr
    assert "containerd loads it at its next start)" in r.stderr


def test_path_flags_are_paths_as_the_shell_sees_them(tmp_path: Path) -> None:
    """--containerd-config and --drop-in name the files under --root as typed (the same convention as
    --kubelet-dir); the drop-in is imported by its host path."""
    cfg = tmp_path / "etc/containerd/config.toml"
    cfg.parent.mkdir(parents=True)
    shutil.copyfile(CORPUS / "containerd-1.7-systemd.toml", cfg)
    shown = _run(tmp_path, "show", "--containerd-config", str(cfg), "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["sources"] == ["/etc/containerd/config.toml"]
    dropin = tmp_path / "etc/containerd/conf.d/50-gpu.toml"
    done = _run(tmp_path, "configure", "--containerd-config", str(cfg), "--drop-in", str(dropin), "--json")
    assert done.returncode == 0, done.stderr
    assert dropin.is_file()
    assert "/etc/containerd/conf.d/50-gpu.toml" in cfg.read_text()


def test_exact_undo_leaves_the_tree_as_it_was(tmp_path: Path) -> None:
    """configure then unconfigure with nothing edited in between: the same files, bytes and directories
    as before (no backup of the original left beside it, no empty directory configure made)."""
    cfg = tmp_path / "etc/containerd/config.toml"
    cfg.parent.mkdir(parents=True)
    shutil.copyfile(CORPUS / "containerd-1.7-systemd.toml", cfg)

    def tree() -> dict[str, bytes | None]:
        return {str(p.relative_to(tmp_path)): p.read_bytes() if p.is_file() else None for p in tmp_path.rglob("*")}

    before = tree()
    assert _run(tmp_path, "configure", "--json").returncode == 0
    assert (tmp_path / "etc/nvidia-container-runtime/config.toml").is_file()
    undo = _run(tmp_path, "unconfigure")
    assert undo.returncode == 0, undo.stderr
    assert "backup" not in undo.stdout, undo.stdout
    after = tree()
    # nodeagent's own state directory stays (empty): it is the agent's, not containerd's or NVIDIA's
    assert not any((tmp_path / "var/lib/nodeagent").iterdir())
    assert {k: v for k, v in after.items() if not k.startswith("var")} == before


def test_undo_after_an_edit_keeps_the_edited_file_and_says_where(tmp_path: Path) -> None:
    cfg = tmp_path / "etc/containerd/config.toml"
    cfg.parent.mkdir(parents=True)
    shutil.copyfile(CORPUS / "containerd-1.7-systemd.toml", cfg)
    assert _run(tmp_path, "configure", "--in-place").returncode == 0
    edited = cfg.read_text() + "\n# an admin's note\n"
    cfg.write_text(edited)
    undo = _run(tmp_path, "unconfigure")
    assert undo.returncode == 0, undo.stderr
    backups = [line for line in undo.stdout.splitlines() if "(backup " in line]
    assert len(backups) == 1 and backups[0].startswith("restore   /etc/containerd/config.toml"), undo.stdout
    kept = Path(backups[0].split("(backup ", 1)[1].rstrip(")"))
    assert kept.is_file() and "# an admin's note" in kept.read_text()
    assert "# an admin's note" in cfg.read_text()
