"""Wire the nvidia runtime into containerd on the host: plan, write atomically, remember, undo.

``configure`` renders every file first (a bad input raises before anything is written), then records
the original bytes in a small state file and writes each changed file atomically with a backup.
``unconfigure`` puts back the exact original bytes of every file nodeagent wrote, as long as nobody
edited it since; a file edited since gets only nodeagent's own changes taken out (the drop-in is deleted,
the import it added removed, the previous default runtime restored). Restarting containerd is left to
the caller (``restart.restart_containerd``), guided by ``Result.restart_needed``.

Order across files: every intermediate state must still load. ``configure`` checks that every target can
be written before writing anything, then writes its state file, the drop-in and the toolkit config, and
the root config (with the new ``imports`` entry) last; ``unconfigure`` first takes the import out of the
root config and only then removes the drop-in. A crash between any two writes leaves either an unused
drop-in or nothing of nodeagent's, never an import of a missing file.

Everything read from disk is bounded (``fileio.read_regular``): containerd configs up to
``containerd_toml.MAX_CONFIG_BYTES``, the state file up to ``MAX_STATE_BYTES``; the state's entries are
checked before they are used (paths must be host paths inside the root).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import difflib
import glob
import hashlib
import json
import posixpath
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from nodeagent import fileio
from nodeagent.config import RuntimeSettings
from nodeagent.errors import ConfigError, RuntimeConfigError
from nodeagent.hostpaths import KUBELET_DIR, HostPaths
from nodeagent.runtime import containerd as ctd
from nodeagent.runtime import host, toolkit
from nodeagent.runtime.containerd_toml import MAX_CONFIG_BYTES, detect_template, parse
from nodeagent.runtime.containerd_versions import config_version

Mode = Literal["auto", "drop-in", "in-place"]
STATE_FILE = "runtime.json"
TOOLKIT_CONFIG = "/etc/nvidia-container-runtime/config.toml"
# runtime.json holds at most three files' original bytes (each under containerd_toml.MAX_CONFIG_BYTES), base64
MAX_STATE_BYTES = 8 * MAX_CONFIG_BYTES
# Plugin IDs that, once in `disabled_plugins`, leave the kubelet without a CRI service.
CRI_PLUGIN_IDS = ("cri", "io.containerd.grpc.v1.cri", "io.containerd.cri.v1.runtime")
# device-plugin strategies whose Allocate answers name CDI devices that containerd must inject
CDI_STRATEGIES = ("cdi-annotations", "cdi-cri")
_GLOB_CHARS = re.compile(r"[*?\[]")


@dataclass(frozen=True)
class Options:
    """What ``configure`` should do; all paths are host paths (resolved under the root)."""

    containerd_config: str = "/etc/containerd/config.toml"
    mode: Mode = "auto"
    dropin: str = ctd.DEFAULT_DROPIN
    runtime_name: str = "nvidia"
    binary_path: str = ctd.DEFAULT_BINARY
    set_as_default: bool = False
    cdi: bool = False
    # CDI injection on in containerd (where it needs the switch) without the nvidia-cdi runtime: the device
    # plugin hands out CDI device names (deviceListStrategy cdi-annotations / cdi-cri)
    cdi_devices: bool = False
    leak_guard: bool = True
    toolkit_config: str = TOOLKIT_CONFIG
    dry_run: bool = False
    # the kubelet's directory (agent config ``[kubelet] dir``): its config.yaml names the cgroup driver
    kubelet_dir: str = KUBELET_DIR


@dataclass
class FileChange:
    path: str  # host path
    action: Literal["write", "create", "remove", "restore", "unchanged"]
    backup: str | None = None
    diff: str = ""


@dataclass
class Result:
    """What happened; ``to_dict`` is the JSON the CLI prints and ``bootstrap`` reports."""

    changed: bool
    restart_needed: bool
    mode: str
    files: list[FileChange] = field(default_factory=list)
    config_version: int | None = None
    containerd_version: str | None = None
    dry_run: bool = False
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # host paths of the containerd files this change manages (changed or not): a containerd started before
    # one of them was last written runs an older config
    containerd_files: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -------------------------------------------------------------------------------------------- helpers
def _sha(data: bytes | None) -> str | None:
    return None if data is None else hashlib.sha256(data).hexdigest()


def _decode(data: bytes | None, where: str) -> str | None:
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not UTF-8 text (byte {e.start}); nothing was written", subject=where) from e


def _diff(path: str, old: bytes | None, new: bytes | None) -> str:
    a = (old or b"").decode("utf-8", "replace").splitlines(keepends=True)
    b = (new or b"").decode("utf-8", "replace").splitlines(keepends=True)
    lines = difflib.unified_diff(
        a, b, fromfile=path if old is not None else "/dev/null", tofile=path if new is not None else "/dev/null"
    )
    return "".join(ln if ln.endswith("\n") else ln + "\n\\ No newline at end of file\n" for ln in lines)


def _read(paths: HostPaths, host_path: str, max_bytes: int = MAX_CONFIG_BYTES) -> bytes | None:
    """A file's bytes (``None``: absent); only regular files, at most ``max_bytes``."""
    return fileio.read_regular(paths(host_path), max_bytes=max_bytes)


def _state_path(paths: HostPaths) -> Path:
    return paths.within(paths.state_dir / STATE_FILE)  # resolved inside the root now, file name included


def _host_path_entry(paths: HostPaths, value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.startswith("/") or posixpath.normpath(value) != value \
            or value.startswith("//"):
        raise ValueError(f"{where} {value!r} is not a normalized absolute host path")
    paths(value)  # refuses paths that leave the root (HostPathError)
    return value


def _check_state(paths: HostPaths, state: Any) -> dict[str, Any]:
    """``state`` if it has the shape ``configure`` writes; raises ``ValueError`` naming the first bad entry."""
    if not isinstance(state, dict):
        raise ValueError("not a JSON object")
    files = state.get("files", {})
    if not isinstance(files, dict):
        raise ValueError("'files' is not an object")
    toolkits = 0
    for host_path, entry in files.items():
        _host_path_entry(paths, host_path, "file")
        if not isinstance(entry, dict):
            raise ValueError(f"entry of {host_path} is not an object")
        if entry.get("kind", "containerd") not in ("containerd", "toolkit"):
            raise ValueError(f"entry of {host_path}: unknown kind {entry.get('kind')!r}")
        toolkits += entry.get("kind") == "toolkit"
        sha = entry.get("written_sha256")
        if sha is not None and not (isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha)):
            raise ValueError(f"entry of {host_path}: written_sha256 is not a SHA-256")
        original = entry.get("original")
        if original is not None:
            if not isinstance(original, str):
                raise ValueError(f"entry of {host_path}: original is not base64 text")
            try:
                base64.b64decode(original, validate=True)
            except (binascii.Error, ValueError) as e:
                raise ValueError(f"entry of {host_path}: original is not base64 text") from e
    if toolkits > 1:
        raise ValueError("more than one toolkit file")
    if state.get("mode", "in-place") not in ("drop-in", "in-place"):
        raise ValueError(f"unknown mode {state.get('mode')!r}")
    if "root_config" in state:
        _host_path_entry(paths, state["root_config"], "root_config")
    if state.get("added_import") is not None and not isinstance(state["added_import"], str):
        raise ValueError("'added_import' is not a string")
    prev = state.get("previous", {})
    if not isinstance(prev, dict) \
            or not isinstance(prev.get("default_runtime_name"), str | type(None)) \
            or not isinstance(prev.get("enable_cdi"), bool | type(None)) \
            or not (isinstance(prev.get("added_runtimes", []), list)
                    and all(isinstance(x, str) for x in prev.get("added_runtimes", []))):
        raise ValueError("'previous' is malformed")
    return state


def load_state(paths: HostPaths) -> dict[str, Any] | None:
    """nodeagent's record of what ``configure`` changed (``None``: nothing); a malformed one is one error line."""
    where = _state_path(paths)
    data = fileio.read_regular(where, max_bytes=MAX_STATE_BYTES, root=paths)
    if data is None:
        return None
    try:
        return _check_state(paths, json.loads(data))
    except ConfigError as e:  # a path in it leaves the root
        raise RuntimeConfigError(f"{where}: malformed state: {e}; nothing was changed", subject=str(where)) from e
    except (ValueError, RecursionError) as e:
        raise RuntimeConfigError(f"{where}: malformed state: {e}; nothing was changed (move it away to start over)",
                                 subject=str(where)) from e


def _save_state(paths: HostPaths, state: dict[str, Any]) -> None:
    p = _state_path(paths)
    fileio.makedirs(p.parent, mode=0o755, root=paths)
    fileio.atomic_write(p, json.dumps(state, indent=2, sort_keys=True) + "\n", mode=0o600, backup=False, root=paths)


def _check_not_template(paths: HostPaths, config: str) -> None:
    # The template beside the config is looked up through the root like every host path (a link there
    # is followed inside the root, never out of it).
    tmpl_host = config if config.endswith(".tmpl") else config + ".tmpl"
    data = _read(paths, tmpl_host)
    if data is None:
        return
    tmpl_text = _decode(data, tmpl_host) or ""
    found = detect_template(tmpl_text, tmpl_host) or (detect_template("{{", tmpl_host))
    assert found is not None
    tmpl_kind = found[0]
    raise ConfigError(
        f"{config}: generated from the {tmpl_kind.language} {tmpl_host} ({tmpl_kind.generator}); nothing was "
        f"written ({tmpl_kind.hint})",
        subject=config,
    )


def cri_disabled(plain: dict[str, Any]) -> list[str]:
    """The CRI plugin IDs a config's ``disabled_plugins`` names (the kubelet cannot use that containerd)."""
    disabled = plain.get("disabled_plugins")
    if not isinstance(disabled, list):
        return []
    return [str(x) for x in disabled if str(x) in CRI_PLUGIN_IDS]


def _cri_warning(config: str, names: list[str]) -> str:
    return (f"{config}: disabled_plugins names the CRI plugin ({', '.join(names)}), so the kubelet cannot use this "
            "containerd and no pod gets the nvidia runtime; remove it from disabled_plugins "
            "(Docker's containerd.io package disables it by default)")


def blocking_import(paths: HostPaths, root_host: str, imports: list[str] | tuple[str, ...],
                    target: str | None = None) -> str | None:
    """The first ``imports`` entry naming a file that does not exist, before ``target`` is imported.

    containerd 2 stops loading imports at such an entry without a word (it treats the missing file like a
    missing config), so every later import, nodeagent's drop-in included, is silently ignored; containerd
    1.x does not start at all. Globs that match nothing are fine.
    """
    base = posixpath.dirname(root_host)
    for entry in imports:
        if target is not None and ctd.import_covered([entry], target, base):
            return None
        if _GLOB_CHARS.search(entry):
            continue
        path = entry if posixpath.isabs(entry) else posixpath.join(base, entry)
        try:
            missing = not paths(posixpath.normpath(path)).exists()
        except ConfigError:
            missing = True
        if missing:
            return entry
    return None


@dataclass
class _Plan:
    path: str
    old: bytes | None
    new: bytes | None  # None: remove
    kind: Literal["containerd", "toolkit"]

    @property
    def changed(self) -> bool:
        return self.old != self.new


# ------------------------------------------------------------------------------------------ configure
def plan(paths: HostPaths, opts: Options) -> tuple[list[_Plan], dict[str, Any]]:
    """Render every file; returns the per-file plan and facts for the state. Raises on bad input."""
    _check_not_template(paths, opts.containerd_config)
    root_bytes = _read(paths, opts.containerd_config)
    root_text = _decode(root_bytes, opts.containerd_config)
    cversion = host.containerd_version(paths)
    desired = ctd.Desired(
        runtime_name=opts.runtime_name,
        binary_path=opts.binary_path,
        set_as_default=opts.set_as_default,
        enable_cdi=opts.cdi or opts.cdi_devices,
        cdi_runtime=opts.cdi,
        systemd_cgroup=host.systemd_cgroup(paths, opts.kubelet_dir),
        containerd_version=cversion,
    )
    root_doc = parse(root_text or "", opts.containerd_config)
    file_version = config_version(root_doc, opts.containerd_config)
    root_plain = root_doc.unwrap()
    warnings: list[str] = []
    notes: list[str] = []
    disabled = cri_disabled(root_plain)
    if disabled:
        warnings.append(_cri_warning(opts.containerd_config, disabled))
    mode = opts.mode
    previous_state = load_state(paths)
    if mode == "auto" and previous_state and previous_state.get("root_config") == opts.containerd_config:
        mode = previous_state.get("mode", "auto")  # keep the mode of the last configure (the file changed)
    if mode == "auto":
        mode = "drop-in" if root_text is not None and root_text.strip() and file_version >= 2 else "in-place"
    if mode == "drop-in":
        imports = root_plain.get("imports")
        missing = blocking_import(paths, opts.containerd_config, [str(x) for x in imports], opts.dropin) \
            if isinstance(imports, list) else None
        if missing is not None and opts.mode == "drop-in":
            raise ConfigError(
                f"{opts.containerd_config}: imports names {missing}, which does not exist; containerd stops "
                f"reading imports there (1.x does not start), so it would never load the drop-in {opts.dropin}. "
                "Nothing was "
                "written (create that file, remove the entry, or use --in-place)",
                subject=opts.containerd_config,
            )
        if missing is not None:
            mode = "in-place"
            warnings.append(
                f"{opts.containerd_config}: imports names {missing}, which does not exist; containerd stops "
                "reading imports there (1.x does not start) and would never load a drop-in, so the root config "
                "is edited in place"
            )
    plans: list[_Plan] = []
    facts: dict[str, Any] = {
        "mode": mode,
        "root_config": opts.containerd_config,
        "config_version": file_version if (root_text or "").strip() else None,
        "containerd_version": ".".join(map(str, cversion)) if cversion else None,
        "cversion": cversion,
        "warnings": warnings,
        "notes": notes,
    }
    if mode == "in-place":
        new_text, prev = ctd.render_with_previous(root_text, desired, source=opts.containerd_config)
        plans.append(_Plan(opts.containerd_config, root_bytes, new_text.encode(), "containerd"))
        facts["added_import"] = None
    else:
        dr = ctd.render_dropin(root_text, desired, dropin_path=opts.dropin, root_path=opts.containerd_config)
        prev = dr.previous
        for name in dr.kept:
            notes.append(f"{opts.containerd_config} already defines runtime {name!r}: kept as it is")
        if dr.needed:
            dropin_old = _read(paths, opts.dropin)
            plans.append(_Plan(opts.containerd_config, root_bytes, dr.root_text.encode(), "containerd"))
            plans.append(_Plan(opts.dropin, dropin_old, dr.dropin_text.encode(), "containerd"))
        else:
            notes.append(f"already wired: {opts.containerd_config} says everything asked for; "
                         "no drop-in or import written")
        facts["added_import"] = dr.added_import
    facts["previous"] = asdict(prev)
    if opts.leak_guard:
        tk_old = _read(paths, opts.toolkit_config)
        tk_new = toolkit.render_leak_guard(_decode(tk_old, opts.toolkit_config), source=opts.toolkit_config)
        plans.append(_Plan(opts.toolkit_config, tk_old, tk_new.encode(), "toolkit"))
    return plans, facts


def _write_order(changes: list[_Plan], root_config: str) -> list[_Plan]:
    """Every file before the root config, so its new ``imports`` entry never names a file not yet written."""
    return [p for p in changes if p.path != root_config] + [p for p in changes if p.path == root_config]


def configure(paths: HostPaths, opts: Options, *, _after_write: Any = None) -> Result:
    """Make containerd (and the toolkit config) say what ``opts`` asks; idempotent.

    ``_after_write`` (tests): called with each host path right after it was written.
    """
    plans, facts = plan(paths, opts)
    changed = [p for p in plans if p.changed]
    result = Result(
        changed=bool(changed),
        restart_needed=any(p.kind == "containerd" for p in changed),
        mode=facts["mode"],
        config_version=facts["config_version"],
        containerd_version=facts["containerd_version"],
        dry_run=opts.dry_run,
        warnings=list(facts["warnings"]),
        notes=list(facts["notes"]),
    )
    if (opts.cdi or opts.cdi_devices) and facts["cversion"] is not None and facts["cversion"] < (1, 7, 0):
        result.warnings.append(
            f"containerd {facts['containerd_version']} has no CDI support (needs 1.7 or later); "
            "enable_cdi is written but ignored until containerd is upgraded"
        )
    result.containerd_files = [p.path for p in plans if p.kind == "containerd"]
    for p in plans:
        action: Any = ("create" if p.old is None else "write") if p.changed else "unchanged"
        result.files.append(FileChange(p.path, action, diff=_diff(p.path, p.old, p.new) if p.changed else ""))
    if opts.dry_run or not changed:
        return result

    # Nothing is written (not even a backup or the state) unless every target can be written now.
    for target in [paths(p.path) for p in changed] + [_state_path(paths)]:
        fileio.check_writable(target)
    state = load_state(paths) or {"files": {}}
    files: dict[str, Any] = state.setdefault("files", {})
    for p in changed:
        entry = files.get(p.path)
        if entry is None or entry.get("written_sha256") != _sha(p.old):
            # First time, or edited by someone since our last write: what is there now is the original.
            entry = {"original": None if p.old is None else base64.b64encode(p.old).decode()}
            if p.path == opts.containerd_config:
                state["previous"] = facts["previous"]
        entry["written_sha256"] = _sha(p.new)
        entry["kind"] = p.kind
        files[p.path] = entry
    # Directories this configure creates (none existed before): an exact undo removes them again.
    created: list[str] = list(state.get("created_dirs", []))
    for p in changed:
        for parent in _missing_parents(paths, p.path):
            if parent not in created:
                created.append(parent)
    state["created_dirs"] = created
    state["mode"] = facts["mode"]
    state["root_config"] = facts["root_config"]
    if facts["added_import"] is not None or "added_import" not in state:
        state["added_import"] = facts["added_import"]
    state.setdefault("previous", facts["previous"])
    # The state goes to disk before the files, so a crash in between still knows the originals.
    _save_state(paths, state)
    by_path = {f.path: f for f in result.files}
    for p in _write_order(changed, opts.containerd_config):
        assert p.new is not None
        target = paths(p.path)
        fileio.makedirs(target.parent, mode=0o755, root=paths)
        bak = fileio.atomic_write(target, p.new, root=paths)
        by_path[p.path].backup = str(bak) if bak is not None else None
        if _after_write is not None:
            _after_write(p.path)
    return result


def options_from_settings(settings: RuntimeSettings, *, dry_run: bool = False,
                          kubelet_dir: str = KUBELET_DIR,
                          device_list_strategies: Sequence[str] = ()) -> Options:
    """``Options`` from the agent config's ``[runtime]`` section (what ``bootstrap`` and the daemon use);
    ``kubelet_dir`` is the config's ``[kubelet] dir``; ``device_list_strategies`` the device plugin's
    ``deviceListStrategy``: with ``cdi-annotations`` or ``cdi-cri`` containerd must inject CDI devices, so
    CDI is switched on where the installed containerd needs it (``cdi_devices``), even without
    ``[runtime] cdi``."""
    return Options(
        containerd_config=settings.containerd_config,
        mode=settings.mode,
        dropin=settings.dropin,
        set_as_default=settings.set_as_default,
        cdi=settings.cdi,
        cdi_devices=any(s in CDI_STRATEGIES for s in device_list_strategies),
        leak_guard=settings.leak_guard,
        dry_run=dry_run,
        kubelet_dir=kubelet_dir,
    )


# ---------------------------------------------------------------------------------------- unconfigure
def unconfigure(paths: HostPaths, *, dry_run: bool = False, _after_write: Any = None) -> Result:
    """Undo ``configure``: exact original bytes where untouched since, else only nodeagent's changes.

    The root config goes first (its import of the drop-in is taken out before the drop-in goes).
    ``_after_write`` (tests): called with each host path right after it was restored or removed.
    """
    state = load_state(paths)
    if not state:
        return Result(changed=False, restart_needed=False, mode="none", dry_run=dry_run)
    prev = ctd.Previous(
        default_runtime_name=state.get("previous", {}).get("default_runtime_name"),
        enable_cdi=state.get("previous", {}).get("enable_cdi"),
        added_runtimes=tuple(state.get("previous", {}).get("added_runtimes", ())),
    )
    steps: list[tuple[str, bytes | None, bytes | None, str]] = []
    root_config = state.get("root_config")
    entries = sorted(state.get("files", {}).items(), key=lambda kv: kv[0] != root_config)
    for host_path, entry in entries:
        current = _read(paths, host_path)
        original = None if entry.get("original") is None else base64.b64decode(entry["original"])
        if _sha(current) == entry.get("written_sha256"):
            steps.append((host_path, current, original, entry.get("kind", "containerd")))
            continue
        if current is None:
            continue  # removed by someone else; nothing of ours left
        text = _decode(current, host_path) or ""
        if host_path == state.get("root_config"):
            if state.get("mode") == "drop-in":
                new = ctd.remove_import(text, state.get("added_import") or "", source=host_path) \
                    if state.get("added_import") else text
            else:
                new = ctd.render_remove(text, prev, source=host_path)
            steps.append((host_path, current, new.encode(), "containerd"))
        elif entry.get("kind") == "toolkit":
            orig_text = _decode(original, host_path)
            new = toolkit.restore_keys(text, orig_text, source=host_path)
            steps.append((host_path, current, new.encode(), "toolkit"))
        else:  # our drop-in, edited since: still ours to remove
            steps.append((host_path, current, None, "containerd"))
    result = Result(
        changed=any(old != new for _, old, new, _ in steps),
        restart_needed=any(kind == "containerd" and old != new for _, old, new, kind in steps),
        mode=str(state.get("mode", "none")),
        dry_run=dry_run,
    )
    for host_path, old_b, new_b, _ in steps:
        if old_b == new_b:
            result.files.append(FileChange(host_path, "unchanged"))
            continue
        action: Any = "remove" if new_b is None else "restore"
        result.files.append(FileChange(host_path, action, diff=_diff(host_path, old_b, new_b)))
    if dry_run:
        return result
    for host_path, old_b, new_b, _ in steps:
        if old_b != new_b:
            fileio.check_writable(paths(host_path))
    fileio.check_writable(_state_path(paths))
    by_path = {f.path: f for f in result.files}
    exact = True  # every file back to its original bytes (or gone, as before configure)
    files = state.get("files", {})
    for host_path, old_b, new_b, _ in steps:
        entry = files.get(host_path, {})
        original = None if entry.get("original") is None else base64.b64decode(entry["original"])
        if new_b != original:
            exact = False
        if old_b == new_b:
            continue
        if new_b is None:
            fileio.remove(paths(host_path), root=paths)
        else:
            # Back to the original: the copy of what configure wrote is worth nothing; a partial undo
            # (the file was edited since) keeps the edited file as a backup and says where.
            bak = fileio.atomic_write(paths(host_path), new_b, backup=new_b != original, root=paths)
            by_path[host_path].backup = str(bak) if bak is not None else None
        if _after_write is not None:
            _after_write(host_path)
    fileio.remove(_state_path(paths), root=paths)
    if exact:
        _remove_configure_leftovers(paths, [h for h, *_ in steps], state.get("created_dirs", []))
    return result


def _missing_parents(paths: HostPaths, host_path: str) -> list[str]:
    """The directories above ``host_path`` that do not exist yet, outermost first."""
    missing: list[str] = []
    parent = posixpath.dirname(host_path)
    while parent not in ("/", "") and not paths(parent).exists():
        missing.insert(0, parent)
        parent = posixpath.dirname(parent)
    return missing


def _remove_configure_leftovers(paths: HostPaths, host_paths: list[str], created_dirs: list[str]) -> None:
    """After an exact undo: configure's backups (copies of the originals now back in place) and the
    directories configure created, when nothing else was put in them."""
    for host_path in host_paths:
        with contextlib.suppress(OSError):
            fileio.remove(fileio.backup_path(paths(host_path)))
    for d in sorted(created_dirs, key=len, reverse=True):
        with contextlib.suppress(OSError):  # not empty (someone else's files) or gone: left alone
            paths(d).rmdir()


# ----------------------------------------------------------------------------------------------- show
def _resolve_imports(paths: HostPaths, root_host: str, imports: tuple[str, ...]) -> tuple[list[str], str | None]:
    """The files containerd imports, in order, and the missing entry where it stops reading them (if any)."""
    out: list[str] = []
    base = posixpath.dirname(root_host)
    for entry in imports:
        pattern = entry if posixpath.isabs(entry) else posixpath.join(base, entry)
        if not _GLOB_CHARS.search(entry) and blocking_import(paths, root_host, [entry]) is not None:
            return out, entry
        matches = sorted(glob.glob(str(paths(posixpath.normpath(pattern)))))
        for m in matches:
            # the match's own name under the root; a link there is followed inside the root when read
            hp = "/" + str(Path(m).relative_to(paths.root)) if paths.root != Path("/") else m
            if hp != root_host and hp not in out:
                out.append(hp)
    return out, None


def show(paths: HostPaths, containerd_config: str = "/etc/containerd/config.toml",
         toolkit_config: str = TOOLKIT_CONFIG) -> dict[str, Any]:
    """What containerd will load: effective runtimes, the default, and the files they come from."""
    root_text = _decode(_read(paths, containerd_config), containerd_config)
    cversion = host.containerd_version(paths)
    sources = [containerd_config] if root_text is not None else []
    imported: list[tuple[str, str]] = []
    warnings: list[str] = []
    if root_text is not None and root_text.strip():
        root_doc = parse(root_text, containerd_config)
        disabled = cri_disabled(root_doc.unwrap())
        if disabled:
            warnings.append(_cri_warning(containerd_config, disabled))
        root_view = ctd.view_of(root_text, containerd_config)
        found, missing = _resolve_imports(paths, containerd_config, root_view.imports)
        if missing is not None:
            later = root_view.imports[root_view.imports.index(missing) + 1:]
            warnings.append(f"{containerd_config}: imports names {missing}, which does not exist; containerd 2 "
                            "stops reading imports there" + (f" and ignores {', '.join(later)}" if later else "")
                            + " (containerd 1.x does not start)")
        for hp in found:
            text = _decode(_read(paths, hp), hp)
            if text is not None:
                imported.append((hp, text))
                sources.append(hp)
    view = ctd.merged_view(root_text or "", imported, cversion)
    tk = _read(paths, toolkit_config)
    return {
        "sources": sources,
        "config_version": view.version,
        "containerd_version": ".".join(map(str, cversion)) if cversion else None,
        "default_runtime": view.default_runtime,
        "enable_cdi": view.enable_cdi,
        "runtimes": {
            name: {
                "runtime_type": table.get("runtime_type", ""),
                "binary": view.binary_of(name) or "",
                "systemd_cgroup": (table.get("options") or {}).get("SystemdCgroup"),
            }
            for name, table in sorted(view.runtimes.items())
        },
        "leak_guard": toolkit.leak_guard_on(tk.decode("utf-8", "replace")) if tk is not None else None,
        "managed_by_nodeagent": load_state(paths) is not None,
        "warnings": warnings,
    }
