"""What the containerd 1.x and containerd 2 integration tests share: the case layout and the checks every
rewritten config must pass whichever containerd judges it."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from nodeagent.hostpaths import HostPaths
from nodeagent.runtime import configure as rc
from nodeagent.runtime.containerd import DEFAULT_BINARY, RUNC_V2

# top-level keys nodeagent may change in a user's file
OWNED = ("default_runtime_name", "enable_cdi", "imports")


@dataclass(frozen=True)
class StatePaths(HostPaths):
    """Real absolute paths (root /), but nodeagent's state in the test's temp directory."""

    state: Path = Path("/nonexistent")

    @property
    def state_dir(self) -> Path:
        return self.state


@dataclass(frozen=True)
class ContainerdHostPaths(StatePaths):
    """As StatePaths, with ``containerd`` standing in as the host's /usr/bin/containerd (nodeagent reads
    its version to decide the file format and whether CDI needs switching on)."""

    containerd: Path = Path("/usr/bin/containerd")

    def __call__(self, host_path: str | PurePosixPath) -> Path:
        if str(host_path) == "/usr/bin/containerd":
            return self.containerd
        return super().__call__(host_path)


@dataclass
class Case:
    """One corpus file copied into a temp ``etc``; ``original`` is its bytes (None: no file at all)."""

    paths: StatePaths
    config: Path
    dropin: Path
    toolkit: Path
    original: bytes | None

    def options(self, mode: rc.Mode, *, set_as_default: bool = False, cdi: bool = False,
                dry_run: bool = False) -> rc.Options:
        return rc.Options(containerd_config=str(self.config), dropin=str(self.dropin),
                          toolkit_config=str(self.toolkit), mode=mode, set_as_default=set_as_default, cdi=cdi,
                          dry_run=dry_run)


def only_additions(old: bytes | None, new: bytes) -> None:
    """Every line of ``old`` that ``new`` changed or dropped is blank or one of the keys nodeagent owns."""
    if not old:
        return
    a, b = old.decode().splitlines(keepends=True), new.decode().splitlines(keepends=True)
    for tag, i1, i2, _j1, _j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if tag in ("replace", "delete"):
            for line in a[i1:i2]:
                assert line.strip() == "" or any(k in line for k in OWNED), f"changed line: {line!r}"


def assert_nvidia_runtime(runtimes: dict[str, Any]) -> None:
    """The effective runtimes table (from ``config dump``) has nvidia as a runc shim, and runc still there."""
    assert runtimes["nvidia"]["options"]["BinaryName"] == DEFAULT_BINARY
    assert runtimes["nvidia"]["runtime_type"] == RUNC_V2
    assert "runc" in runtimes, "the previous default runtime must still exist"


def assert_idempotent_then_undone(case: Case, opts: rc.Options) -> None:
    """A second configure changes nothing; unconfigure restores the original bytes and removes the drop-in,
    the toolkit config and nodeagent's state."""
    files = {p: p.read_bytes() for p in (case.config, case.dropin, case.toolkit) if p.exists()}
    second = rc.configure(case.paths, opts)
    assert not second.changed and not second.restart_needed
    assert {p: p.read_bytes() for p in files} == files

    undone = rc.unconfigure(case.paths)
    assert undone.changed and undone.restart_needed
    if case.original is None:
        assert not case.config.exists()
    else:
        assert case.config.read_bytes() == case.original
    assert not case.dropin.exists() and not case.toolkit.exists()
    assert not (case.paths.state_dir / rc.STATE_FILE).exists()
