"""atomic_write: content, mode, backup, symlinks and a SIGKILL between write and rename."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nodeagent.fileio import (
    BACKUP_SUFFIX,
    TMP_MARKER,
    atomic_write,
    backup_path,
    read_bytes,
    read_text,
    remove,
)


def test_new_file_gets_default_mode_and_no_backup(tmp_path: Path) -> None:
    target = tmp_path / "config.toml"
    assert atomic_write(target, "a = 1\n") is None
    assert target.read_bytes() == b"a = 1\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert not backup_path(target).exists()


def test_replace_keeps_mode_and_backs_up_exact_bytes(tmp_path: Path) -> None:
    target = tmp_path / "config.toml"
    original = b"# comment\r\nversion = 2\n\n\xe2\x9c\x93 = 1"
    target.write_bytes(original)
    target.chmod(0o600)
    bak = atomic_write(target, b"version = 3\n")
    assert bak == tmp_path / ("config.toml" + BACKUP_SUFFIX)
    assert bak.read_bytes() == original
    assert stat.S_IMODE(bak.stat().st_mode) == 0o600
    assert target.read_bytes() == b"version = 3\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir() if TMP_MARKER in p.name] == []


def test_explicit_mode_and_no_backup(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    target.write_text("{}")
    assert atomic_write(target, "{\"a\": 1}", mode=0o640, backup=False) is None
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert not backup_path(target).exists()


def test_owner_is_kept(tmp_path: Path) -> None:
    target = tmp_path / "f"
    target.write_text("x")
    before = target.stat()
    atomic_write(target, "y")
    after = target.stat()
    assert (after.st_uid, after.st_gid) == (before.st_uid, before.st_gid)
    if os.geteuid() == 0:
        os.chown(target, 4242, 4343)
        atomic_write(target, "z")
        assert (target.stat().st_uid, target.stat().st_gid) == (4242, 4343)


def test_symlink_target_is_replaced_and_link_kept(tmp_path: Path) -> None:
    real = tmp_path / "real.toml"
    real.write_text("old")
    link = tmp_path / "link.toml"
    link.symlink_to(real)
    atomic_write(link, "new")
    assert link.is_symlink()
    assert real.read_text() == "new"
    assert (tmp_path / ("real.toml" + BACKUP_SUFFIX)).read_text() == "old"


def test_hook_failure_leaves_old_file_and_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "f"
    target.write_text("old")

    def boom(tmp: Path) -> None:
        assert tmp.read_text() == "new"
        raise RuntimeError("stop")

    with pytest.raises(RuntimeError):
        atomic_write(target, "new", backup=False, before_rename=boom)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f"]


def test_directory_target_rejected(tmp_path: Path) -> None:
    with pytest.raises(IsADirectoryError):
        atomic_write(tmp_path, "x")


def test_read_helpers_and_remove(tmp_path: Path) -> None:
    p = tmp_path / "x"
    assert read_bytes(p) is None
    assert read_text(p) is None
    p.write_bytes(b"a\r\nb")
    assert read_text(p) == "a\r\nb"
    assert remove(p) is True
    assert remove(p) is False


_CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from nodeagent.fileio import atomic_write

    def pause(tmp: Path) -> None:
        print(tmp, flush=True)
        time.sleep(60)

    atomic_write(Path(sys.argv[1]), b"NEW" * 100_000, before_rename=pause)
    """
)


def test_sigkill_between_write_and_rename_keeps_old_file(tmp_path: Path) -> None:
    target = tmp_path / "config.toml"
    original = b"# the old config\nversion = 2\n" * 50
    target.write_bytes(original)
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(target)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert proc.stdout is not None
        tmp_line = proc.stdout.readline().strip()
        assert tmp_line, "child did not reach the pause point"
        # The new content is complete on disk, but not yet in place.
        assert Path(tmp_line).stat().st_size == 300_000
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    assert target.read_bytes() == original
    # The backup was completed before the kill and holds the same old bytes.
    assert backup_path(target).read_bytes() == original
    # A later write succeeds despite the stray temp file.
    atomic_write(target, b"after")
    assert target.read_bytes() == b"after"
