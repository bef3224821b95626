"""Wire the nvidia runtime into containerd on the host: plan, write atomically, remember, undo.

``configure`` renders every file first (a bad input raises before anything is written), then records
the original bytes in a small state file and writes each changed file atomically with a backup.
``unconfigure`` puts back the exact original bytes of every file nodeagent wrote, as long as nobody
edited it since; a file edited since gets only nodeagent's own changes taken out (the drop-in is deleted,
the import it added removed, the previous default runtime restored). Restarting containerd is left to
the caller (``restart.restart_containerd``), guided by ``Result.restart_needed``.
"""

from __future__ import annotations

import base64
import difflib
import glob
import hashlib
import json
import posixpath
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from nodeagent import fileio
from nodeagent.config import RuntimeSettings
from nodeagent.errors import ConfigError, RuntimeConfigError
from nodeagent.hostpaths import HostPaths
from nodeagent.runtime import containerd as ctd
from nodeagent.runtime import host, toolkit

Mode = Literal["auto", "drop-in", "in-place"]
STATE_FILE = "runtime.json"
TOOLKIT_CONFIG = "/etc/nvidia-container-runtime/config.toml"


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
    leak_guard: bool = True
    toolkit_config: str = TOOLKIT_CONFIG
    dry_run: bool = False


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


def _state_path(paths: HostPaths) -> Path:
    return paths.state_dir / STATE_FILE


def load_state(paths: HostPaths) -> dict[str, Any] | None:
    data = fileio.read_bytes(_state_path(paths))
    if data is None:
        return None
    try:
        state = json.loads(data)
    except ValueError as e:
        raise RuntimeConfigError(f"{_state_path(paths)}: unreadable state: {e}") from e
    return state if isinstance(state, dict) else None


def _save_state(paths: HostPaths, state: dict[str, Any]) -> None:
    p = _state_path(paths)
    p.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    fileio.atomic_write(p, json.dumps(state, indent=2, sort_keys=True) + "\n", mode=0o600, backup=False)


def _check_not_template(paths: HostPaths, config: str) -> None:
    real = paths(config)
    tmpl = real.with_name(real.name + ".tmpl")
    if tmpl.exists() or config.endswith(".tmpl"):
        raise ConfigError(
            f"{config}: generated from the template {config if config.endswith('.tmpl') else config + '.tmpl'} "
            "(k3s/rke2); nothing was written. k3s/rke2 add the nvidia runtime themselves when "
            "/usr/bin/nvidia-container-runtime exists; for other changes edit the template by hand",
            subject=config,
        )


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
    root_bytes = fileio.read_bytes(paths(opts.containerd_config))
    root_text = _decode(root_bytes, opts.containerd_config)
    cversion = host.containerd_version(paths)
    desired = ctd.Desired(
        runtime_name=opts.runtime_name,
        binary_path=opts.binary_path,
        set_as_default=opts.set_as_default,
        enable_cdi=opts.cdi,
        systemd_cgroup=host.systemd_cgroup(paths),
        containerd_version=cversion,
    )
    file_version = ctd.config_version(ctd.parse(root_text or "", opts.containerd_config), opts.containerd_config)
    mode = opts.mode
    previous_state = load_state(paths)
    if mode == "auto" and previous_state and previous_state.get("root_config") == opts.containerd_config:
        mode = previous_state.get("mode", "auto")  # keep the mode of the last configure (the file changed)
    if mode == "auto":
        mode = "drop-in" if root_text is not None and root_text.strip() and file_version >= 2 else "in-place"
    plans: list[_Plan] = []
    facts: dict[str, Any] = {
        "mode": mode,
        "root_config": opts.containerd_config,
        "config_version": file_version if (root_text or "").strip() else None,
        "containerd_version": ".".join(map(str, cversion)) if cversion else None,
        "cversion": cversion,
    }
    if mode == "in-place":
        new_text, prev = ctd.render_with_previous(root_text, desired, source=opts.containerd_config)
        plans.append(_Plan(opts.containerd_config, root_bytes, new_text.encode(), "containerd"))
        facts["added_import"] = None
    else:
        dr = ctd.render_dropin(root_text, desired, dropin_path=opts.dropin, root_path=opts.containerd_config)
        prev = dr.previous
        plans.append(_Plan(opts.containerd_config, root_bytes, dr.root_text.encode(), "containerd"))
        dropin_old = fileio.read_bytes(paths(opts.dropin))
        plans.append(_Plan(opts.dropin, dropin_old, dr.dropin_text.encode(), "containerd"))
        facts["added_import"] = dr.added_import
    facts["previous"] = asdict(prev)
    if opts.leak_guard:
        tk_old = fileio.read_bytes(paths(opts.toolkit_config))
        tk_new = toolkit.render_leak_guard(_decode(tk_old, opts.toolkit_config), source=opts.toolkit_config)
        plans.append(_Plan(opts.toolkit_config, tk_old, tk_new.encode(), "toolkit"))
    return plans, facts


def configure(paths: HostPaths, opts: Options) -> Result:
    """Make containerd (and the toolkit config) say what ``opts`` asks; idempotent."""
    plans, facts = plan(paths, opts)
    changed = [p for p in plans if p.changed]
    result = Result(
        changed=bool(changed),
        restart_needed=any(p.kind == "containerd" for p in changed),
        mode=facts["mode"],
        config_version=facts["config_version"],
        containerd_version=facts["containerd_version"],
        dry_run=opts.dry_run,
    )
    if opts.cdi and facts["cversion"] is not None and facts["cversion"] < (1, 7, 0):
        result.warnings.append(
            f"containerd {facts['containerd_version']} has no CDI support (needs 1.7 or later); "
            "enable_cdi is written but ignored until containerd is upgraded"
        )
    for p in plans:
        action: Any = ("create" if p.old is None else "write") if p.changed else "unchanged"
        result.files.append(FileChange(p.path, action, diff=_diff(p.path, p.old, p.new) if p.changed else ""))
    if opts.dry_run or not changed:
        return result

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
    state["mode"] = facts["mode"]
    state["root_config"] = facts["root_config"]
    if facts["added_import"] is not None or "added_import" not in state:
        state["added_import"] = facts["added_import"]
    state.setdefault("previous", facts["previous"])
    # The state goes to disk before the files, so a crash in between still knows the originals.
    _save_state(paths, state)
    by_path = {f.path: f for f in result.files}
    for p in changed:
        assert p.new is not None
        target = paths(p.path)
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        bak = fileio.atomic_write(target, p.new)
        by_path[p.path].backup = str(bak) if bak is not None else None
    return result


def options_from_settings(settings: RuntimeSettings, *, dry_run: bool = False) -> Options:
    """``Options`` from the agent config's ``[runtime]`` section (what ``bootstrap`` and the daemon use)."""
    return Options(
        containerd_config=settings.containerd_config,
        mode=settings.mode,
        dropin=settings.dropin,
        set_as_default=settings.set_as_default,
        cdi=settings.cdi,
        leak_guard=settings.leak_guard,
        dry_run=dry_run,
    )


# ---------------------------------------------------------------------------------------- unconfigure
def unconfigure(paths: HostPaths, *, dry_run: bool = False) -> Result:
    """Undo ``configure``: exact original bytes where untouched since, else only nodeagent's changes."""
    state = load_state(paths)
    if not state:
        return Result(changed=False, restart_needed=False, mode="none", dry_run=dry_run)
    prev = ctd.Previous(
        default_runtime_name=state.get("previous", {}).get("default_runtime_name"),
        enable_cdi=state.get("previous", {}).get("enable_cdi"),
        added_runtimes=tuple(state.get("previous", {}).get("added_runtimes", ())),
    )
    steps: list[tuple[str, bytes | None, bytes | None, str]] = []
    for host_path, entry in state.get("files", {}).items():
        current = fileio.read_bytes(paths(host_path))
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
    by_path = {f.path: f for f in result.files}
    for host_path, old_b, new_b, _ in steps:
        if old_b == new_b:
            continue
        if new_b is None:
            fileio.remove(paths(host_path))
        else:
            bak = fileio.atomic_write(paths(host_path), new_b)
            by_path[host_path].backup = str(bak) if bak is not None else None
    fileio.remove(_state_path(paths))
    return result


# ----------------------------------------------------------------------------------------------- show
def _resolve_imports(paths: HostPaths, root_host: str, imports: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    base = posixpath.dirname(root_host)
    for entry in imports:
        pattern = entry if posixpath.isabs(entry) else posixpath.join(base, entry)
        matches = sorted(glob.glob(str(paths(posixpath.normpath(pattern)))))
        for m in matches:
            hp = paths.to_host(Path(m))
            if hp != root_host and hp not in out:
                out.append(hp)
    return out


def show(paths: HostPaths, containerd_config: str = "/etc/containerd/config.toml",
         toolkit_config: str = TOOLKIT_CONFIG) -> dict[str, Any]:
    """What containerd will load: effective runtimes, the default, and the files they come from."""
    root_text = _decode(fileio.read_bytes(paths(containerd_config)), containerd_config)
    cversion = host.containerd_version(paths)
    sources = [containerd_config] if root_text is not None else []
    imported: list[tuple[str, str]] = []
    if root_text is not None and root_text.strip():
        root_view = ctd.view_of(root_text, containerd_config)
        for hp in _resolve_imports(paths, containerd_config, root_view.imports):
            text = _decode(fileio.read_bytes(paths(hp)), hp)
            if text is not None:
                imported.append((hp, text))
                sources.append(hp)
    view = ctd.merged_view(root_text or "", imported, cversion)
    tk = fileio.read_bytes(paths(toolkit_config))
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
    }
