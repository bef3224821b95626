"""``nvidia-ctk runtime configure --runtime=containerd`` (v1.20.1) next to nodeagent's runtime configure on
EVERY file of the containerd corpus (tests/fixtures/containerd and its subdirectories: version 1, empty,
version 2, 3 and 4 shapes) and on a host with no config file at all. The containerd that loads that version
judges both results with its own ``config dump``: Debian's containerd 1.6 for versions 1 and 2 (and for an
empty or absent file), the containerd 2.4 peer for versions 3 and 4 (and again for an empty or absent file,
as on a containerd 2 host). Both show the same effective ``nvidia`` runtime (type, BinaryName) and the same
default runtime, with and without ``--set-as-default``.

Each tool runs the way it is deployed: nvidia-ctk with its drop-in (``--drop-in-config``), except on a
version-1 file, where containerd never reads imports, so nvidia-ctk's drop-in would be dead (that is one of
the named differences below) and it is run in place instead; nodeagent with its default mode (``auto``:
drop-in for a version 2+ file, in place otherwise). Each deliberate difference is one named test
(``test_difference_*``), listed in docs/simulator.md. Both write into the test's temp directory only.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from nodeagent.runtime import configure as rc
from nodeagent.runtime.containerd import DEFAULT_BINARY, RUNC_V2
from tests.abi._abi import built
from tests.integration._containerd import Case, ContainerdHostPaths
from tests.peers.containerd import Containerd, ContainerdConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # the backport of the same parser
    import tomli as tomllib

pytestmark = pytest.mark.peers

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "containerd"
ABSENT = "(no file)"
FILES = sorted(p.relative_to(CORPUS).as_posix() for p in CORPUS.rglob("*.toml"))


def _version(name: str) -> int:
    """The config version a file declares (containerd: missing key = 1); an absent file counts as empty."""
    if name == ABSENT:
        return 1
    return int(tomllib.loads((CORPUS / name).read_text()).get("version", 1))


def _blank(name: str) -> bool:
    return name == ABSENT or not (CORPUS / name).read_text().strip()


# (corpus file, peer fixture that judges it): the containerd that loads that version; an empty or absent
# file is what either containerd may find on a fresh host, so both judge it.
CASES = [(n, "containerd2" if _version(n) >= 3 else "containerd") for n in [*FILES, ABSENT]]
CASES += [(n, "containerd2") for n in [*FILES, ABSENT] if _blank(n)]


def _copy(tmp: Path, name: str, peer: Containerd) -> Case:
    etc = tmp / "etc"
    etc.mkdir(parents=True)
    config = etc / "config.toml"
    original: bytes | None = None
    if name != ABSENT:
        # the corpus names /etc/containerd/...; here that directory is `etc`
        config.write_text((CORPUS / name).read_text().replace("/etc/containerd/", f"{etc}/"))
        original = config.read_bytes()
    (etc / "registries.toml").write_text("version = 2\n")  # relative imports of the corpus
    (etc / "site").mkdir()
    return Case(ContainerdHostPaths(Path("/"), state=tmp / "state", containerd=peer.binary), config,
                etc / "conf.d" / "99-nvidia.toml", tmp / "toolkit.toml", original)  # fmt: skip


def _ctk_command(case: Case, set_as_default: bool, in_place: bool) -> list[str]:
    cmd = [
        str(built("NODEAGENT_NVIDIA_CTK")), "runtime", "configure", "--runtime=containerd",
        f"--config={case.config}", f"--drop-in-config={'' if in_place else case.dropin}",
        f"--nvidia-runtime-path={DEFAULT_BINARY}",
    ]  # fmt: skip
    return [*cmd, "--set-as-default"] if set_as_default else cmd


def _ctk(case: Case, set_as_default: bool, in_place: bool = False) -> float:
    start = time.perf_counter()
    proc = subprocess.run(_ctk_command(case, set_as_default, in_place), capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    return elapsed


def _nodeagent(case: Case, set_as_default: bool, mode: rc.Mode = "auto") -> float:
    start = time.perf_counter()
    rc.configure(case.paths, case.options(mode, set_as_default=set_as_default))
    return time.perf_counter() - start


def _cri(dump: dict[str, Any]) -> dict[str, Any] | None:
    """The CRI runtime plugin's table of a ``config dump`` (None: containerd loads no CRI plugin config)."""
    plugins = dump.get("plugins", {})
    for plugin_id in ("io.containerd.cri.v1.runtime", "io.containerd.grpc.v1.cri"):
        if plugin_id in plugins and "containerd" in plugins[plugin_id]:
            cri: dict[str, Any] = plugins[plugin_id]
            return cri
    return None


def effective(peer: Containerd, config: Path) -> dict[str, Any]:
    """What containerd makes of ``config``: its default runtime and its nvidia runtime (or the load error)."""
    if not config.exists():
        return {"config": "absent"}
    try:
        cri = _cri(peer.config_dump(config))
    except ContainerdConfigError as e:
        return {"error": str(e).splitlines()[-1]}
    if cri is None:
        return {"cri": None}
    runtimes = cri["containerd"].get("runtimes", {})
    nvidia = runtimes.get("nvidia")
    return {
        "default_runtime_name": cri["containerd"].get("default_runtime_name") or "runc",
        "nvidia": None if nvidia is None else {
            "runtime_type": nvidia.get("runtime_type"),
            "BinaryName": nvidia.get("options", {}).get("BinaryName"),
        },
    }  # fmt: skip


# Where the two deliberately differ, the corpus test leaves the case to the named test that shows how:
# (file, set_as_default or None for both) -> test
DIFFERENT: dict[tuple[str, bool | None], str] = {
    ("shapes/missing-import-v3.toml", None): "test_difference_drop_in_behind_a_missing_import",
    ("shapes/nvidia-default-v2.toml", False): "test_difference_previous_default_kept_on_containerd_1x",
}
PARAMS = [
    (name, peer, sad)
    for name, peer in CASES
    for sad in (False, True)
    if (name, sad) not in DIFFERENT and (name, None) not in DIFFERENT
]


def _original_default(peer: Containerd, case: Case) -> str:
    """The default runtime containerd runs with before either tool touched the file."""
    if case.original is None:
        return "runc"
    before = effective(peer, case.config)
    return str(before.get("default_runtime_name", "runc"))


@pytest.mark.parametrize(
    ("name", "peer_name", "set_as_default"),
    PARAMS,
    ids=[f"{n}@{p}-{'default' if d else 'added'}" for n, p, d in PARAMS],
)
def test_same_effective_nvidia_runtime_as_nvidia_ctk(
    request: pytest.FixtureRequest, tmp_path: Path, name: str, peer_name: str, set_as_default: bool
) -> None:
    peer: Containerd = request.getfixturevalue(peer_name)
    ours, theirs = _copy(tmp_path / "nodeagent", name, peer), _copy(tmp_path / "ctk", name, peer)
    before = _original_default(peer, ours)
    t_ours = _nodeagent(ours, set_as_default)
    t_theirs = _ctk(theirs, set_as_default, in_place=_version(name) == 1 and not _blank(name))
    mine, nvidia = effective(peer, ours.config), effective(peer, theirs.config)
    assert mine == nvidia, f"{name} judged by {peer.version()}"
    if mine.get("cri", {}) is None:
        # the file disables the CRI plugin: no runtime table at all in either result (nodeagent also warns)
        return
    assert mine["nvidia"] == {"runtime_type": RUNC_V2, "BinaryName": DEFAULT_BINARY}, mine
    assert mine["default_runtime_name"] == ("nvidia" if set_as_default else before), mine
    print(
        f"runtime configure {name} ({peer.version()}): nodeagent {t_ours * 1000:.1f} ms, "
        f"nvidia-ctk {t_theirs * 1000:.1f} ms"
    )


def test_corpus_covers_every_version_shape() -> None:
    """The corpus the test above walks holds version 1, empty, 2, 3 and 4 files."""
    versions = {_version(n) for n in FILES if not _blank(n)}
    assert {1, 2, 3, 4} <= versions, versions
    assert any(_blank(n) for n in FILES)


def test_difference_comments_kept_by_nodeagent_dropped_by_nvidia_ctk(
    containerd: Containerd, tmp_path: Path
) -> None:
    name = "comments-everywhere.toml"
    ours, theirs = _copy(tmp_path / "nodeagent", name, containerd), _copy(tmp_path / "ctk", name, containerd)
    _nodeagent(ours, False)
    _ctk(theirs, False)
    comments = [ln for ln in (CORPUS / name).read_text().splitlines() if ln.strip().startswith("#")]
    assert comments
    assert all(c in ours.config.read_text().splitlines() for c in comments)
    assert not any(c in theirs.config.read_text().splitlines() for c in comments)


def test_runc_options_copied_by_both(containerd: Containerd, tmp_path: Path) -> None:
    """Not a difference: both copy runc's options (SystemdCgroup = true) into the nvidia runtime."""
    name = "containerd-1.7-systemd.toml"
    ours, theirs = _copy(tmp_path / "nodeagent", name, containerd), _copy(tmp_path / "ctk", name, containerd)
    _nodeagent(ours, False)
    _ctk(theirs, False)

    def options(config: Path) -> dict[str, Any]:
        cri = _cri(containerd.config_dump(config))
        assert cri is not None
        opts: dict[str, Any] = cri["containerd"]["runtimes"]["nvidia"].get("options", {})
        return opts

    assert options(theirs.config).get("SystemdCgroup") is True
    assert options(ours.config).get("SystemdCgroup") is True


def test_difference_exact_undo_only_in_nodeagent(containerd: Containerd, tmp_path: Path) -> None:
    """nodeagent's unconfigure gives back the original bytes; nvidia-ctk v1.20.1 has no undo command."""
    name = "containerd-1.7-systemd.toml"
    ours = _copy(tmp_path / "nodeagent", name, containerd)
    _nodeagent(ours, True)
    assert ours.config.read_bytes() != ours.original
    rc.unconfigure(ours.paths)
    assert ours.config.read_bytes() == ours.original and not ours.dropin.exists()
    proc = subprocess.run([str(built("NODEAGENT_NVIDIA_CTK")), "runtime", "--help"], capture_output=True,
                          text=True, check=True)  # fmt: skip
    assert "unconfigure" not in proc.stdout and "remove" not in proc.stdout.lower().split("commands:")[-1]


def test_difference_version_1_drop_in_dead_with_nvidia_ctk(containerd: Containerd, tmp_path: Path) -> None:
    """On a version-1 file nvidia-ctk still writes its drop-in, which containerd never loads (version 1 has
    no ``imports``): the nvidia runtime does not exist. nodeagent edits a version-1 file in place."""
    name = "v1-no-version.toml"
    ours, theirs = _copy(tmp_path / "nodeagent", name, containerd), _copy(tmp_path / "ctk", name, containerd)
    _nodeagent(ours, False)
    _ctk(theirs, False)
    assert theirs.dropin.exists()
    assert effective(containerd, theirs.config)["nvidia"] is None
    assert effective(containerd, ours.config)["nvidia"] == {
        "runtime_type": RUNC_V2,
        "BinaryName": DEFAULT_BINARY,
    }
    assert not ours.dropin.exists()


def test_difference_new_file_in_newest_format_by_nodeagent(containerd2: Containerd, tmp_path: Path) -> None:
    """With no config on a containerd 2.4 host nodeagent writes the version that containerd reads without
    migrating (4); nvidia-ctk v1.20.1 writes a version-2 root and drop-in, which containerd 2.4 migrates at
    every start. Both end with the same effective runtime (see the corpus test above)."""
    ours, theirs = (
        _copy(tmp_path / "nodeagent", ABSENT, containerd2),
        _copy(tmp_path / "ctk", ABSENT, containerd2),
    )
    _nodeagent(ours, False)
    _ctk(theirs, False)
    assert tomllib.loads(ours.config.read_text())["version"] == 4
    assert tomllib.loads(theirs.config.read_text())["version"] == 2


def test_difference_drop_in_behind_a_missing_import(containerd2: Containerd, tmp_path: Path) -> None:
    """The root config imports a file that does not exist: containerd stops reading imports there, so
    nvidia-ctk's drop-in (added after it) is never loaded and there is no nvidia runtime. nodeagent sees the
    missing import and edits the root config in place (with a warning)."""
    name = "shapes/missing-import-v3.toml"
    ours, theirs = (
        _copy(tmp_path / "nodeagent", name, containerd2),
        _copy(tmp_path / "ctk", name, containerd2),
    )
    result = rc.configure(ours.paths, ours.options("auto"))
    _ctk(theirs, False)
    assert result.mode == "in-place" and any("does not exist" in w for w in result.warnings)
    assert theirs.dropin.exists()
    assert effective(containerd2, theirs.config)["nvidia"] is None
    assert effective(containerd2, ours.config)["nvidia"] == {
        "runtime_type": RUNC_V2,
        "BinaryName": DEFAULT_BINARY,
    }


def test_difference_previous_default_kept_on_containerd_1x(containerd: Containerd, tmp_path: Path) -> None:
    """containerd 1.x REPLACES a plugin table from an import: nvidia-ctk's drop-in carries a CRI table without
    the root's ``default_runtime_name = "nvidia"``, so containerd 1.6 falls back to runc. nodeagent's drop-in
    carries the whole CRI table, and the node keeps running pods on its default runtime."""
    name = "shapes/nvidia-default-v2.toml"
    ours, theirs = _copy(tmp_path / "nodeagent", name, containerd), _copy(tmp_path / "ctk", name, containerd)
    assert effective(containerd, ours.config)["default_runtime_name"] == "nvidia"
    _nodeagent(ours, False)
    _ctk(theirs, False)
    assert effective(containerd, ours.config)["default_runtime_name"] == "nvidia"
    assert effective(containerd, theirs.config)["default_runtime_name"] == "runc"


def test_every_difference_has_its_test() -> None:
    names = {n for n in globals() if n.startswith("test_difference_")}
    assert set(DIFFERENT.values()) <= names
