"""``HostPaths.within``: a path under the root resolved inside it at the moment of use, as a chroot would
(absolute link targets re-rooted, ``..`` stopped at the root), and the file functions that apply it when
they open, create, list, rename or remove."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nodeagent import fileio
from nodeagent.hostpaths import HostPathError, HostPaths
from nodeagent.mig.apply import MigStateFile


def _layout(tmp_path: Path) -> tuple[Path, Path, HostPaths]:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "var/lib/nodeagent").mkdir(parents=True)
    outside.mkdir()
    return root, outside, HostPaths(root)


def _files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def test_a_component_joined_after_resolution_is_resolved_inside_the_root(tmp_path: Path) -> None:
    root, outside, paths = _layout(tmp_path)
    state_dir = paths.state_dir  # resolved now: no links yet
    os.symlink(str(outside), root / "var/lib/nodeagent/mig")  # made afterwards, absolute, out of the root
    joined = state_dir / "mig" / "mig-state.json"
    assert paths.within(joined) == root / str(outside).lstrip("/") / "mig-state.json"


def test_dotdot_chains_stop_at_the_root(tmp_path: Path) -> None:
    root, _outside, paths = _layout(tmp_path)
    depth = len(root.parts) + 3
    os.symlink("/".join([".."] * depth) + "/outside/x.json", root / "var/lib/nodeagent/planes.json")
    assert paths.within(root / "var/lib/nodeagent/planes.json") == root / "outside/x.json"


def test_links_inside_the_root_are_followed_and_missing_components_kept(tmp_path: Path) -> None:
    root, _outside, paths = _layout(tmp_path)
    (root / "data").mkdir()
    os.symlink("/data", root / "var/lib/nodeagent/mig")
    assert paths.within(root / "var/lib/nodeagent/mig/new/f") == root / "data/new/f"
    assert paths.within(root) == root


def test_a_path_outside_the_root_is_refused(tmp_path: Path) -> None:
    root, outside, paths = _layout(tmp_path)
    with pytest.raises(HostPathError, match="is not under the root"):
        paths.within(outside / "x")
    with pytest.raises(HostPathError, match="is not under the root"):
        paths.within(str(root) + "-sibling/x")


def test_the_root_slash_leaves_paths_to_the_host(tmp_path: Path) -> None:
    assert HostPaths(Path("/")).within(tmp_path / "x") == tmp_path / "x"
    assert HostPaths(Path("/")).is_node_root and HostPaths(tmp_path, "/").is_node_root
    assert not HostPaths(tmp_path).is_node_root


def test_atomic_write_through_an_absolute_link_stays_inside(tmp_path: Path) -> None:
    root, outside, paths = _layout(tmp_path)
    (outside / "planes.json").write_text("outside\n")
    os.symlink(str(outside / "planes.json"), root / "var/lib/nodeagent/planes.json")
    fileio.atomic_write(root / "var/lib/nodeagent/planes.json", "new\n", backup=False, root=paths, parents=True)
    assert _files(outside) == ["planes.json"] and (outside / "planes.json").read_text() == "outside\n"
    assert (root / str(outside).lstrip("/") / "planes.json").read_text() == "new\n"
    assert (root / "var/lib/nodeagent/planes.json").is_symlink()  # the link stays, its target inside changed


def test_reads_removes_and_mkdirs_follow_links_inside_the_root(tmp_path: Path) -> None:
    root, outside, paths = _layout(tmp_path)
    (outside / "secret").write_text("not yours\n")
    os.symlink(str(outside / "secret"), root / "var/lib/nodeagent/checkpoint")
    assert fileio.read_text(root / "var/lib/nodeagent/checkpoint", root=paths) is None  # nothing inside
    os.symlink(str(outside), root / "var/lib/nodeagent/dir")
    made = fileio.makedirs(root / "var/lib/nodeagent/dir/a/b", root=paths)
    assert made == root / str(outside).lstrip("/") / "a/b" and made.is_dir()
    assert fileio.remove(root / "var/lib/nodeagent/checkpoint", root=paths)  # the link goes, not its target
    assert _files(outside) == ["secret"]
    with pytest.raises(fileio.UnreadableFileError):
        fileio.check_writable(root / "var/lib/nodeagent/dir", root=paths)  # a directory (inside), not a file


def test_mig_state_behind_a_dotdot_link_is_kept_inside_the_root(tmp_path: Path) -> None:
    """The attack: ``mig-state.json`` a ``../`` chain out of the root; read and replaced outside before."""
    root, outside, paths = _layout(tmp_path)
    (outside / "victim.json").write_text('{"phase": "outside"}\n')
    (root / "var/lib/nodeagent/mig").mkdir()
    up = "/".join([".."] * (len(root.parts) + 4))
    os.symlink(f"{up}{outside}/victim.json", root / "var/lib/nodeagent/mig/mig-state.json")
    state = MigStateFile(paths.mig_state_dir, paths)
    assert state.load() is None  # the outside file is not read
    state.update(phase="success")
    assert (outside / "victim.json").read_text() == '{"phase": "outside"}\n'
    assert _files(outside) == ["victim.json"]  # no temporary file made or renamed there
    assert (root / str(outside).lstrip("/") / "victim.json").is_file()
    assert state.load() is not None


def test_a_loop_of_links_is_an_os_error_for_the_file_functions(tmp_path: Path) -> None:
    """A loop planted under the root is what the kernel says of it (ELOOP), which the callers handle as any
    unreadable or unwritable file, not an exception they do not expect."""
    root, _outside, paths = _layout(tmp_path)
    os.symlink("/var/lib/nodeagent/b", root / "var/lib/nodeagent/a")
    os.symlink("/var/lib/nodeagent/a", root / "var/lib/nodeagent/b")
    with pytest.raises(HostPathError, match="too many levels"):
        paths.within(root / "var/lib/nodeagent/a")
    with pytest.raises(fileio.UnreadableFileError, match="too many levels"):
        fileio.read_text(root / "var/lib/nodeagent/a", root=paths)
    with pytest.raises(OSError, match="too many levels"):
        fileio.atomic_write(root / "var/lib/nodeagent/a", "x", root=paths)
