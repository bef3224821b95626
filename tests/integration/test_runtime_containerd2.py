"""The real containerd 2 (built from github.com/containerd/containerd/v2) judges version-3 and -4 configs.

For every containerd 2 config of the corpus (``version = 3``/``4`` files in tests/fixtures/containerd and
tests/fixtures/containerd/v2) and mode: nodeagent sees containerd 2 on the host (``containerd --version``
under its root), configures; containerd 2's ``config dump`` shows the nvidia runtime with the right
BinaryName and runc untouched; a running containerd 2's CRI service serves the ``nvidia`` handler
(``RuntimeService.Status``, the call the kubelet makes); a drop-in carries only the delta and containerd 2
merges it into the root's CRI table key by key; a second run changes nothing; unconfigure restores the
original bytes.
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from nodeagent.runtime import configure as rc
from nodeagent.runtime.containerd import DEFAULT_BINARY, DEFAULT_CDI_BINARY, RUNC_V2
from nodeagent.runtime.containerd_versions import cri_path
from tests.integration._containerd import (
    Case,
    ContainerdHostPaths,
    assert_idempotent_then_undone,
    assert_nvidia_runtime,
    only_additions,
)
from tests.peers.containerd import Containerd
from tests.peers.containerd2 import Containerd2

if sys.version_info >= (3, 11):
    import tomllib
else:  # the backport of the same parser
    import tomli as tomllib

pytestmark = pytest.mark.peers

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "containerd"
CORPUS = sorted(
    [p for p in FIXTURES.glob("*.toml") if tomllib.loads(p.read_text()).get("version", 1) >= 3]
    + list((FIXTURES / "v2").glob("*.toml")),
    key=lambda p: p.name,
)
NAMES = [*(p.relative_to(FIXTURES).as_posix() for p in CORPUS), "(no file)"]
CRI = cri_path(3)[-1]  # io.containerd.cri.v1.runtime, versions 3 and 4
# mode, set_as_default, cdi
VARIANTS = [("drop-in", True, True), ("in-place", False, False), ("in-place", True, True)]


def _case(tmp_path: Path, name: str, containerd: Containerd) -> Case:
    etc = tmp_path / "etc"
    etc.mkdir()
    config = etc / "config.toml"
    original: bytes | None = None
    if name != "(no file)":
        # The corpus names /etc/containerd/...; here that directory is `etc` (so the default config's
        # conf.d/*.toml import covers the drop-in, as on a real host).
        config.write_text((FIXTURES / name).read_text().replace("/etc/containerd/", f"{etc}/"))
        original = config.read_bytes()
    (etc / "registries.toml").write_text(
        "version = 3\n[plugins.'io.containerd.cri.v1.images'.registry]\nconfig_path = '/etc/containerd/certs.d'\n")
    return Case(ContainerdHostPaths(Path("/"), state=tmp_path / "state", containerd=containerd.binary), config,
                etc / "conf.d" / "99-nvidia.toml", tmp_path / "toolkit.toml", original)


def _cri(dump: dict[str, Any]) -> dict[str, Any]:
    cri = dump["plugins"][CRI]
    assert isinstance(cri, dict)
    return cri


def _without(cri: dict[str, Any], *paths: tuple[str, ...]) -> dict[str, Any]:
    """A deep copy of ``cri`` without the given key paths (what nodeagent owns)."""
    out = copy.deepcopy(cri)
    for path in paths:
        node: Any = out
        for k in path[:-1]:
            node = node.get(k, {})
        node.pop(path[-1], None)
    return out


def _runtime_of(base_cri: dict[str, Any]) -> dict[str, Any]:
    """The runtime table nodeagent copies for nvidia: the default runtime's (else runc)."""
    runtimes = base_cri["containerd"]["runtimes"]
    default = base_cri["containerd"].get("default_runtime_name") or "runc"
    table = runtimes.get(default) or runtimes["runc"]
    assert isinstance(table, dict)
    return table


def _config_warnings(containerd2: Containerd2, config: Path) -> set[str]:
    """containerd 2's complaints about a config (unknown keys, deprecations), without times and paths."""
    if not config.exists():
        return set()
    proc = subprocess.run([str(containerd2.binary), "--config", str(config), "config", "dump"],
                          capture_output=True, text=True, check=True, timeout=30)
    out = set()
    for line in proc.stderr.splitlines():
        if "level=warning" in line and "migrated from version" not in line:
            out.add(re.sub(r'(time|t|file)="[^"]*" ?|row=\d+ ?|column=\d+ ?', "", line).strip())
    return out


def _zero(value: Any) -> bool:
    return value in ("", 0, False, [], {}, None)


def _normal(key: str, value: Any) -> Any:
    """What an empty runtime setting means to containerd 2 (or nodeagent's fill-in for runtime_type)."""
    return value or {"sandboxer": "podsandbox", "runtime_type": RUNC_V2}.get(key, value)


def _assert_copy_of(nvidia: dict[str, Any], base: dict[str, Any]) -> None:
    """``nvidia`` (effective) is the base runtime with BinaryName set. containerd 2 lays a file's ``runc``
    table over its built-in runc defaults, so keys only the effective base has must be ones whose absence
    means the same (zero values; an empty sandboxer is podsandbox)."""
    for key, value in base.items():
        if key == "options":
            continue
        if key in nvidia:
            assert _normal(key, nvidia[key]) == _normal(key, value), key
        else:
            assert _zero(value) or (key, value) == ("sandboxer", "podsandbox"), key
    opts, base_opts = nvidia["options"], base.get("options", {})
    assert opts["BinaryName"] == DEFAULT_BINARY
    for key, value in base_opts.items():
        if key != "BinaryName":
            assert opts.get(key, type(value)()) == value, f"options.{key}"
    assert set(opts) <= set(base_opts) | {"BinaryName"}


def test_corpus_has_version_3_and_4_files() -> None:
    versions = {tomllib.loads(p.read_text())["version"] for p in CORPUS}
    assert versions == {3, 4}
    assert len(CORPUS) >= 5


def test_containerd2_peer(containerd2: Containerd2) -> None:
    """The peer is containerd 2.x and its own default config is version 4 with the CRI runtime plugin."""
    assert containerd2.version_tuple() >= (2, 3, 0), containerd2.version()
    dump = containerd2.config_dump(FIXTURES / "v2" / "containerd-2.4-default.toml")
    assert dump["version"] == 4
    assert _cri(dump)["containerd"]["runtimes"]["runc"]["runtime_type"] == RUNC_V2


@pytest.mark.parametrize(("mode", "set_as_default", "cdi"), VARIANTS, ids=["drop-in+default+cdi", "in-place",
                                                                          "in-place+default+cdi"])
@pytest.mark.parametrize("name", NAMES)
def test_containerd2_loads_result(containerd2: Containerd2, tmp_path: Path, name: str, mode: rc.Mode,
                                  set_as_default: bool, cdi: bool) -> None:
    case = _case(tmp_path, name, containerd2)
    before = _cri(containerd2.config_dump(case.config)) if case.original is not None else None
    warnings_before = _config_warnings(containerd2, case.config)
    opts = case.options(mode, set_as_default=set_as_default, cdi=cdi)
    first = rc.configure(case.paths, opts)
    assert first.changed and first.restart_needed and first.mode == mode
    assert first.containerd_version == ".".join(map(str, containerd2.version_tuple()))
    root = case.config.read_bytes()
    only_additions(case.original, root)
    root_doc = tomllib.loads(root.decode())
    assert root_doc["version"] in (3, 4)

    if mode == "drop-in":
        # The drop-in carries only the delta, in the root's version; the root gains at most an import.
        drop = tomllib.loads(case.dropin.read_text())
        assert drop["version"] == root_doc["version"]
        assert set(drop) == {"version", "plugins"} and set(drop["plugins"]) == {CRI}
        delta = drop["plugins"][CRI]
        assert set(delta) <= {"containerd", "enable_cdi"}
        assert set(delta["containerd"]) <= {"runtimes", "default_runtime_name"}
        added = {"nvidia", "nvidia-cdi"} if cdi else {"nvidia"}
        assert added <= set(delta["containerd"]["runtimes"]) <= added | {"runc"}
        if before is not None and "runc" in before["containerd"]["runtimes"] and case.original:
            assert "runc" not in delta["containerd"]["runtimes"] or b"runtimes.runc" not in case.original
        if case.original is not None and str(case.dropin.parent) in case.original.decode():
            assert root == case.original, "the root's imports already cover the drop-in: root untouched"

    # containerd 2's own loader: the effective config, and nothing it complains about that was not there
    dump = _cri(containerd2.config_dump(case.config))
    assert _config_warnings(containerd2, case.config) <= warnings_before
    runtimes = dump["containerd"]["runtimes"]
    assert_nvidia_runtime(runtimes)
    if cdi:
        assert runtimes["nvidia-cdi"]["options"]["BinaryName"] == DEFAULT_CDI_BINARY
    assert dump["containerd"]["default_runtime_name"] == (
        "nvidia" if set_as_default else (before or {}).get("containerd", {}).get("default_runtime_name", "runc"))
    if before is not None:
        # runc (and every other runtime that was there) untouched; nvidia a copy of the default runtime's
        # table with only runtime_type/BinaryName set; every other CRI key as before (deep merge).
        for rname, table in before["containerd"]["runtimes"].items():
            assert runtimes[rname] == table, f"runtime {rname} changed"
        _assert_copy_of(runtimes["nvidia"], _runtime_of(before))
        owned = (("containerd", "runtimes"), ("containerd", "default_runtime_name"), ("enable_cdi",))
        assert _without(dump, *owned) == _without(before, *owned)

    # a running containerd 2: its CRI runtime plugin loaded the handler, and the CRI service serves it
    running = containerd2.start(case.config)
    assert running.cri_error is None, running.cri_error
    assert running.runtimes["nvidia"]["Options"]["BinaryName"] == DEFAULT_BINARY
    status = containerd2.cri_status(running)
    assert status.conditions["RuntimeReady"] is True
    want_handlers = {"", "nvidia", "runc"} | ({"nvidia-cdi"} if cdi else set())
    assert want_handlers <= set(status.handlers)
    assert status.runtimes["nvidia"]["options"]["BinaryName"] == DEFAULT_BINARY
    assert status.default_runtime == dump["containerd"]["default_runtime_name"]
    running.stop()

    # idempotent; undo: exact original bytes, drop-in and state gone, containerd 2 back to the original config
    assert_idempotent_then_undone(case, opts)
    if case.original is not None:
        assert _cri(containerd2.config_dump(case.config)) == before


def test_cdi_key_not_written_where_containerd2_ignores_it(containerd2: Containerd2, tmp_path: Path) -> None:
    """containerd >= 2.4 dropped ``enable_cdi`` (CDI is always on): nodeagent must not write a key containerd
    warns about; the CDI runtime is still added."""
    case = _case(tmp_path, "v2/containerd-2.4-default.toml", containerd2)
    rc.configure(case.paths, case.options("in-place", set_as_default=False, cdi=True))
    assert "enable_cdi" not in case.config.read_text()
    running = containerd2.start(case.config)
    assert "Ignoring unknown key" not in running.log()
    assert "nvidia-cdi" in containerd2.cri_status(running).handlers


def test_fixture_rewrite_keeps_top_level_keys_with_dotted_plugins(containerd: Containerd) -> None:
    """Debian's containerd on a config with a top-level dotted ``plugins.…`` key: the fixture's root/state
    land at the top level (before, tomlkit put them into the plugin table it added)."""
    running = containerd.start(FIXTURES / "dotted-and-inline.toml")
    written = tomllib.loads(running.config.read_text())
    assert written["root"] == str(running.workdir / "root")
    assert written["state"] == str(running.workdir / "state")
    assert "root" not in written["plugins"]["io.containerd.internal.v1.opt"]
    assert running.cri_error is None, running.cri_error
    assert "runc" in running.runtimes
    assert (running.workdir / "root").is_dir()


def test_new_file_is_version_4_and_loads_without_warnings(containerd2: Containerd2, tmp_path: Path) -> None:
    """No config file on containerd >= 2.3: nodeagent writes version 4, which containerd 2 loads as is
    (no migration, no warning of any kind) and whose CRI plugin serves the nvidia handler."""
    case = _case(tmp_path, "(no file)", containerd2)
    rc.configure(case.paths, case.options("in-place", set_as_default=False, cdi=False))
    assert tomllib.loads(case.config.read_text())["version"] == 4
    proc = subprocess.run([str(containerd2.binary), "--config", str(case.config), "config", "dump"],
                          capture_output=True, text=True, check=True, timeout=30)
    assert [line for line in proc.stderr.splitlines() if "level=warning" in line] == []
    assert tomllib.loads(proc.stdout)["version"] == 4
    running = containerd2.start(case.config)
    assert "migrat" not in running.log()
    assert "nvidia" in containerd2.cri_status(running).handlers
    running.stop()


@pytest.mark.parametrize("name", ["v2/containerd-2.4-default.toml", "v2/v3-indented-runtimes.toml",
                                  "v2/v3-runc-systemd.toml"])
def test_show_reports_cdi_on_by_default(containerd2: Containerd2, tmp_path: Path, name: str) -> None:
    """``runtime show`` on containerd 2.4 says CDI is on (without ``enable_cdi``: containerd 2's default;
    ``enable_cdi = false`` in a version-3 file: 2.4 no longer reads the key), as the running CRI plugin's own
    config says (CDI spec dirs set, no ``enableCDI: false``)."""
    assert containerd2.version_tuple() >= (2, 4, 0)
    case = _case(tmp_path, name, containerd2)
    info = rc.show(case.paths, str(case.config), toolkit_config=str(case.toolkit))
    assert info["enable_cdi"] is True
    running = containerd2.start(case.config)
    config = containerd2.cri_status(running).config
    assert config.get("enableCDI", True) is True and config["cdiSpecDirs"]
    running.stop()
