"""The test cluster's journal of host changes: a run killed before its stop (or a machine saved and restored
mid-run) leaves the host as it was changed; the next cluster's start undoes those changes from the journal.
A child process makes the changes and dies without its stop; files, a device node and a scratch directory
stand in (no iptables rule, no netns: those are the host's own)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.peers.cluster import undo_interrupted

REPO = Path(__file__).resolve().parents[2]


def _changes(tmp_path: Path, then: str) -> subprocess.Popen[str]:
    """A child that journals and makes changes under ``tmp_path``, prints "made", then runs ``then``."""
    code = textwrap.dedent(f"""
        import os, sys, time
        from pathlib import Path
        from tests.peers.cluster import _HostChanges
        t = Path({str(tmp_path)!r})
        host = _HostChanges(journal=t / "journal.json", scratch=[t / "scratch"])
        (t / "scratch").mkdir()
        host.write(t / "config.toml", b"changed\\n")
        host.write(t / "lib/libnvidia-ml.so.1", b"stand-in", 0o755)
        host.make_node(t / "nvidia0", 195, 0)
        print("made", flush=True)
        {then}
    """)
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.skipif(os.geteuid() != 0, reason="device nodes need CAP_MKNOD")
def test_a_killed_runs_changes_are_undone_from_its_journal(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_bytes(b"original\n")
    child = _changes(tmp_path, "os._exit(9)")  # no stop, no undo
    assert child.communicate(timeout=60)[0] == "made\n" and child.returncode == 9
    assert (tmp_path / "config.toml").read_bytes() == b"changed\n"
    assert stat.S_ISCHR((tmp_path / "nvidia0").stat().st_mode)

    done = undo_interrupted(tmp_path / "journal.json")

    assert len(done) == 1 and f"process {child.pid}" in done[0] and "2 files, 1 device nodes, 0 iptables rules, 0 cgroups" in done[0]
    assert (tmp_path / "config.toml").read_bytes() == b"original\n"
    assert not (tmp_path / "lib/libnvidia-ml.so.1").exists()
    assert not (tmp_path / "nvidia0").exists()
    assert not (tmp_path / "scratch").exists()
    assert not (tmp_path / "journal.json").exists()
    # nothing left to undo: a second call is a no-op
    assert undo_interrupted(tmp_path / "journal.json") == []


@pytest.mark.skipif(os.geteuid() != 0, reason="device nodes need CAP_MKNOD")
def test_a_running_clusters_journal_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    child = _changes(tmp_path, "time.sleep(120)")
    try:
        assert child.stdout is not None and child.stdout.readline() == "made\n"
        with pytest.raises(RuntimeError, match=f"a test cluster of process {child.pid} still runs on this host"):
            undo_interrupted(tmp_path / "journal.json")
        assert (tmp_path / "config.toml").read_bytes() == b"changed\n"
        assert (tmp_path / "nvidia0").exists() and (tmp_path / "journal.json").exists()
    finally:
        child.kill()
        child.communicate(timeout=30)
    # once that process is gone, its changes are undone
    assert undo_interrupted(tmp_path / "journal.json")
    assert not (tmp_path / "config.toml").exists() and not (tmp_path / "nvidia0").exists()
