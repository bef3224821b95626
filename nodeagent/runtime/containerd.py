"""Pure containerd config editing: text in, text out, no I/O.

The editor works on tomlkit's document model, so everything it does not touch keeps its comments, key
order, quoting and whitespace, and rendering its own output again returns the identical text.

The facts of each containerd version are the rows of ``containerd_versions``; reading a file (bounds,
templates, types) is ``containerd_toml``.
"""

from __future__ import annotations

import copy
import fnmatch
import posixpath
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import tomlkit
from tomlkit.container import Container, OutOfOrderTableProxy
from tomlkit.items import AoT, InlineTable, Item, Table
from tomlkit.toml_document import TOMLDocument

from nodeagent.errors import ConfigError, RuntimeConfigError
from nodeagent.runtime.containerd_toml import parse
from nodeagent.runtime.containerd_versions import (
    FORMATS,
    Version,
    cdi_enabled,
    config_version,
    cri_path,
    merges_plugins,
    needs_enable_cdi,
    new_file_version,
)

RUNC_V2 = "io.containerd.runc.v2"
DEFAULT_BINARY = "/usr/bin/nvidia-container-runtime"
DEFAULT_CDI_BINARY = "/usr/bin/nvidia-container-runtime.cdi"
DEFAULT_CONFIG = "/etc/containerd/config.toml"
DEFAULT_DROPIN = "/etc/containerd/conf.d/99-nvidia.toml"
DROPIN_HEADER = (
    "# Written by nodeagent (`nodeagent runtime configure`); `nodeagent runtime unconfigure` removes it.\n"
    "# Changes here are overwritten on the next configure.\n"
)

TableLike = Container | Table | InlineTable | OutOfOrderTableProxy


@dataclass(frozen=True)
class Desired:
    """What the containerd config must say after rendering."""

    runtime_name: str = "nvidia"
    binary_path: str = DEFAULT_BINARY
    set_as_default: bool = False
    enable_cdi: bool = False
    # with enable_cdi: also the nvidia-cdi runtime (False: only CDI injection on, for CDI device names)
    cdi_runtime: bool = True
    cdi_runtime_name: str = "nvidia-cdi"
    cdi_binary_path: str = DEFAULT_CDI_BINARY
    # The node's cgroup driver; used only when no runtime table exists to copy from.
    systemd_cgroup: bool = False
    # The installed containerd's version (``containerd --version``), when known.
    containerd_version: Version | None = None

    def runtimes(self) -> dict[str, str]:
        """Runtime name -> BinaryName of every runtime this config adds."""
        out = {self.runtime_name: self.binary_path}
        if self.enable_cdi and self.cdi_runtime:
            out[self.cdi_runtime_name] = self.cdi_binary_path
        return out


@dataclass(frozen=True)
class Previous:
    """What a render replaced, so unconfigure can put it back even after later edits by hand."""

    default_runtime_name: str | None
    enable_cdi: bool | None
    added_runtimes: tuple[str, ...]


@dataclass(frozen=True)
class DropinRender:
    """Result of rendering in drop-in mode."""

    root_text: str
    dropin_text: str
    added_import: str | None
    previous: Previous
    # runtimes the root config already defines, kept as they are (only missing keys go into the drop-in)
    kept: tuple[str, ...] = ()
    # False: the root config already says everything asked for; neither the drop-in nor an import is needed
    needed: bool = True


@dataclass(frozen=True)
class RuntimeView:
    """What one config document (or the merged set) says about runtimes."""

    version: int
    default_runtime: str
    runtimes: dict[str, dict[str, Any]] = field(default_factory=dict)
    enable_cdi: bool = False
    imports: tuple[str, ...] = ()

    def binary_of(self, name: str) -> str | None:
        opts = self.runtimes.get(name, {}).get("options", {})
        value = opts.get("BinaryName") if isinstance(opts, dict) else None
        return value if isinstance(value, str) else None


# ----------------------------------------------------------------------------------------- table helpers
def _get(c: Any, keys: tuple[str, ...]) -> Any:
    for k in keys:
        if not isinstance(c, Mapping) or k not in c:
            return None
        c = c[k]
    return c


def _ensure(c: TableLike, keys: tuple[str, ...]) -> TableLike:
    for k in keys:
        if k not in c:
            c[k] = tomlkit.table(is_super_table=True)
        nxt = c[k]
        if not isinstance(nxt, Table | InlineTable | OutOfOrderTableProxy):
            raise ConfigError(f"containerd config: {'.'.join(keys)} must be a table, found {type(nxt).__name__}")
        c = nxt
    return c


def _key_indent(t: TableLike) -> str | None:
    body = t.value.body if isinstance(t, Table | InlineTable) else t.body if isinstance(t, Container) else []
    for k, v in body:
        if k is not None and not isinstance(v, Table | AoT) and isinstance(v, Item):
            return v.trivia.indent
    return None


def _set(t: Any, key: str, value: Any) -> bool:
    """Set ``t[key] = value`` keeping the old item's formatting; new keys take their siblings' indent.

    Returns whether anything changed.
    """
    if key in t:
        old = t[key]
        if isinstance(old, Item) and old.unwrap() == value and type(old.unwrap()) is type(value):
            return False
        t[key] = value
        return True
    indent = _key_indent(t) if not isinstance(t, InlineTable) else None
    t[key] = value
    if indent is not None:
        new = _item_of(t, key)
        if new is not None:
            new.trivia.indent = indent
    return True


def _item_of(t: TableLike, key: str) -> Item | None:
    # Table.__getitem__ unwraps booleans; go to the container for the formatting-carrying item.
    container = t.value if isinstance(t, Table | InlineTable) else t if isinstance(t, Container) else None
    if container is None:
        return None
    try:
        found = container.item(key)
    except KeyError:
        return None
    return found if isinstance(found, Item) else None


def _plain(value: Any) -> Any:
    return value.unwrap() if isinstance(value, Item | Container | OutOfOrderTableProxy) else value


def _runtime_tables(cri: Any) -> Any:
    return _get(cri, ("containerd", "runtimes"))


def _pick_base(cri: Any, exclude: set[str]) -> tuple[str | None, Any]:
    runtimes = _runtime_tables(cri)
    default = _get(cri, ("containerd", "default_runtime_name"))
    candidates = [str(default)] if isinstance(default, str) and default else []
    candidates += ["runc", "crun"]
    if isinstance(runtimes, Mapping):
        for name in candidates:
            if name not in exclude and isinstance(runtimes.get(name), Mapping):
                return name, runtimes[name]
    return None, None


def _sane_default(desired: Desired) -> dict[str, Any]:
    return {"runtime_type": RUNC_V2, "options": {"SystemdCgroup": desired.systemd_cgroup}}


def _new_runtime(base: Any, desired: Desired, binary: str, version: int, keep_style: bool) -> Any:
    if base is None:
        table: Any = tomlkit.item(_sane_default(desired))
    elif keep_style and isinstance(base, Table):
        table = copy.deepcopy(base)
    else:
        table = tomlkit.item(_plain(base))
    _fix_runtime(table, binary, version)
    return table


def _fix_runtime(table: Any, binary: str, version: int) -> bool:
    changed = False
    rtype = table.get("runtime_type")
    if not isinstance(rtype, str) or not rtype:
        changed |= _set(table, "runtime_type", RUNC_V2)
    if "options" not in table:
        table["options"] = tomlkit.table()
        changed = True
    opts = table["options"]
    if not isinstance(opts, Mapping):
        raise ConfigError("containerd config: a runtime's `options` must be a table")
    for key in FORMATS[version].binary_keys:
        changed |= _set(opts, key, binary)
    return changed


def _place_like(runtimes: TableLike, name: str, sibling: Any) -> None:
    # tomlkit indents an inserted table relative to its parent; make it line up with its sibling instead.
    new = runtimes[name]
    if isinstance(new, Table) and isinstance(sibling, Table):
        new.trivia.indent = sibling.trivia.indent
        # The base's header comment describes the base, not the copy.
        new.trivia.comment = ""
        new.trivia.comment_ws = ""


def _missing_keys(table: Mapping[str, Any], binary: str, version: int) -> dict[str, Any]:
    """The keys an existing runtime table lacks to run ``binary`` (nothing it already says is changed)."""
    missing: dict[str, Any] = {}
    rtype = table.get("runtime_type")
    if not isinstance(rtype, str) or not rtype:
        missing["runtime_type"] = RUNC_V2
    opts = table.get("options")
    opts = opts if isinstance(opts, Mapping) else {}
    want = dict.fromkeys(FORMATS[version].binary_keys, binary)
    missing_opts = {k: v for k, v in want.items() if k not in opts}
    if missing_opts:
        missing["options"] = missing_opts
    return missing


def _add_missing(doc: TOMLDocument | Table, runtime_keys: tuple[str, ...], missing: Mapping[str, Any]) -> None:
    table = _ensure(doc, runtime_keys)
    for key, value in missing.items():
        if isinstance(value, Mapping):
            sub = _ensure(table, (key,))
            for k, v in value.items():
                _set(sub, k, v)
        else:
            _set(table, key, value)


def _apply(doc: TOMLDocument | Table, cri_keys: tuple[str, ...], version: int, desired: Desired,
           base_cri: Any, keep_style: bool, keep_existing: bool = False) -> tuple[Previous, tuple[str, ...]]:
    """Apply ``desired`` to the CRI table at ``cri_keys`` of ``doc``; base runtimes come from ``base_cri``.

    ``keep_existing`` (drop-in mode): a runtime ``base_cri`` already defines is kept as it is; only keys it
    lacks are written (containerd 2 merges the drop-in over the root table, so anything else would
    override the node's own settings such as ``base_runtime_spec`` or ``SystemdCgroup``). Returns what was
    replaced and the names of the runtimes kept that way.
    """
    existing_cri = _get(doc, cri_keys)
    prev_default = _get(existing_cri, ("containerd", "default_runtime_name"))
    prev_cdi = _get(existing_cri, ("enable_cdi",))
    existing_runtimes = _runtime_tables(existing_cri)
    base_runtimes = _runtime_tables(base_cri)
    added: list[str] = []
    kept: list[str] = []
    wanted = desired.runtimes()
    for name, binary in wanted.items():
        in_doc = isinstance(existing_runtimes, Mapping) and isinstance(existing_runtimes.get(name), Mapping)
        in_base = isinstance(base_runtimes, Mapping) and isinstance(base_runtimes.get(name), Mapping)
        if keep_existing and (in_doc or in_base):
            table = existing_runtimes[name] if in_doc else base_runtimes[name]
            missing = _missing_keys(table, binary, version)
            if missing:
                _add_missing(doc, (*cri_keys, "containerd", "runtimes", name), missing)
            kept.append(name)
            continue
        if in_doc:
            _fix_runtime(existing_runtimes[name], binary, version)
            continue
        base_name, base = _pick_base(base_cri, set(wanted))
        runtimes = _ensure(doc, (*cri_keys, "containerd", "runtimes"))
        runtimes[name] = _new_runtime(base, desired, binary, version, keep_style)
        if keep_style and base_name is not None and base_name in runtimes:
            _place_like(runtimes, name, runtimes[base_name])
        added.append(name)
    # containerd's built-in `runc` runtime exists only while the config names no runtimes at all; once we
    # add one, the previous default (`runc` when unset) needs its own table or pods without a runtime
    # class stop starting.
    old_default = _str_or_none(_get(base_cri, ("containerd", "default_runtime_name"))) or "runc"
    has_old_default = isinstance(base_runtimes, Mapping) and isinstance(base_runtimes.get(old_default), Mapping)
    if old_default == "runc" and not has_old_default and added:
        runtimes = _ensure(doc, (*cri_keys, "containerd", "runtimes"))
        if "runc" not in runtimes:
            runtimes["runc"] = tomlkit.item(_sane_default(desired))
            added.append("runc")
    if desired.set_as_default and not (keep_existing and old_default == desired.runtime_name):
        _set(_ensure(doc, (*cri_keys, "containerd")), "default_runtime_name", desired.runtime_name)
    if desired.enable_cdi and needs_enable_cdi(desired.containerd_version, _get(base_cri, ("enable_cdi",))) \
            and not (keep_existing and _get(base_cri, ("enable_cdi",)) is True):
        _set(_ensure(doc, cri_keys), "enable_cdi", True)
    prev = Previous(
        default_runtime_name=str(prev_default) if isinstance(prev_default, str) else None,
        enable_cdi=bool(prev_cdi) if isinstance(prev_cdi, bool) else None,
        added_runtimes=tuple(added),
    )
    return prev, tuple(kept)


# ------------------------------------------------------------------------------------------- rendering
def _open_for_edit(text: str, desired: Desired, source: str) -> tuple[TOMLDocument, int, tuple[str, ...]]:
    """The config to edit (a new one in the version for the installed containerd when ``text`` is blank),
    its version and the key path of its CRI table."""
    doc = parse(text, source)
    if not text.strip():
        doc = tomlkit.document()
        doc["version"] = new_file_version(desired.containerd_version)
    version = config_version(doc, source)
    return doc, version, cri_path(version)


def render(old_text: str | None, desired: Desired, *, source: str = "config.toml") -> str:
    """In-place mode: the whole containerd config with the nvidia runtime(s) wired in."""
    return render_with_previous(old_text, desired, source=source)[0]


def render_with_previous(
    old_text: str | None, desired: Desired, *, source: str = "config.toml"
) -> tuple[str, Previous]:
    doc, version, keys = _open_for_edit(old_text or "", desired, source)
    prev, _ = _apply(doc, keys, version, desired, _get(doc, keys), keep_style=True)
    out = tomlkit.dumps(doc)
    _verify(out, desired, source)
    return out, prev


def import_covered(imports: list[str], dropin: str, root_dir: str) -> bool:
    """Whether one of ``imports`` (globs, relative to ``root_dir``) already names ``dropin``."""
    for entry in imports:
        pattern = entry if posixpath.isabs(entry) else posixpath.join(root_dir, entry)
        if fnmatch.fnmatchcase(dropin, posixpath.normpath(pattern)):
            return True
    return False


def render_dropin(
    root_text: str | None,
    desired: Desired,
    *,
    dropin_path: str = DEFAULT_DROPIN,
    root_path: str = "/etc/containerd/config.toml",
) -> DropinRender:
    """Drop-in mode: a generated drop-in file plus the root file with ``imports`` naming it.

    ``dropin_path`` and ``root_path`` are host paths; the import written into the root is ``dropin_path``.
    """
    text = root_text or ""
    doc, version, keys = _open_for_edit(text, desired, root_path)
    root_cri = _get(doc, keys)

    # The root file: only `imports` changes.
    imports_item = doc.get("imports")
    if imports_item is not None and not isinstance(_plain(imports_item), list):
        raise ConfigError(f"{root_path}: `imports` must be a list of paths", subject=root_path)
    imports = [str(x) for x in _plain(imports_item)] if imports_item is not None else []
    added_import: str | None = None
    if not import_covered(imports, dropin_path, posixpath.dirname(root_path)):
        if imports_item is None:
            doc["imports"] = [dropin_path]
        else:
            doc["imports"].append(dropin_path)
        added_import = dropin_path
    new_root = tomlkit.dumps(doc) if added_import is not None else text

    # The drop-in: fully generated from the root's current state.
    drop = tomlkit.document()
    drop.add(tomlkit.comment(DROPIN_HEADER.splitlines()[0][2:]))
    drop.add(tomlkit.comment(DROPIN_HEADER.splitlines()[1][2:]))
    drop["version"] = version
    if not merges_plugins(desired.containerd_version, version) and isinstance(root_cri, Mapping):
        # containerd < 2.0 replaces the whole plugin table from an import: carry all of it.
        cri_table = _ensure(drop, keys[:-1])
        cri_table[keys[-1]] = tomlkit.item(_plain(root_cri))
    prev, kept = _apply(drop, keys, version, desired, root_cri, keep_style=False, keep_existing=True)
    prev = Previous(
        default_runtime_name=_str_or_none(_get(root_cri, ("containerd", "default_runtime_name"))),
        enable_cdi=_bool_or_none(_get(root_cri, ("enable_cdi",))),
        added_runtimes=prev.added_runtimes,
    )
    drop_cri = _get(drop, keys)
    root_plain = _plain(root_cri) if isinstance(root_cri, Mapping) else {}
    needed = bool(_plain(drop_cri)) if drop_cri is not None else False
    if needed and not merges_plugins(desired.containerd_version, version):
        needed = _plain(drop_cri) != root_plain
    drop_text = tomlkit.dumps(drop)
    if not needed:
        return DropinRender(text, "", None, prev, kept, needed=False)
    _verify(drop_text, desired, dropin_path, base=root_plain)
    return DropinRender(new_root, drop_text, added_import, prev, kept)


def _str_or_none(v: Any) -> str | None:
    return str(v) if isinstance(v, str) else None


def _bool_or_none(v: Any) -> bool | None:
    return bool(v) if isinstance(v, bool) else None


def _verify(text: str, desired: Desired, source: str, base: Mapping[str, Any] | None = None) -> None:
    """The rendered file names every wanted runtime with its binary; a runtime ``base`` (the root's CRI table,
    drop-in mode) already defines counts as long as it has some binary."""
    view = view_of(text, source)
    base_runtimes = _get(base or {}, ("containerd", "runtimes")) or {}
    for name, binary in desired.runtimes().items():
        if isinstance(base_runtimes.get(name), Mapping):
            continue
        if view.binary_of(name) != binary:
            raise RuntimeConfigError(f"{source}: rendering did not produce runtime {name!r} (internal error)")
    base_default = _get(base or {}, ("containerd", "default_runtime_name"))
    if desired.set_as_default and view.default_runtime != desired.runtime_name \
            and base_default != desired.runtime_name:
        raise RuntimeConfigError(f"{source}: rendering did not set the default runtime (internal error)")


# ------------------------------------------------------------------------------------ removal and views
def render_remove(text: str, previous: Previous, *, source: str = "config.toml") -> str:
    """Undo a render on a file that was edited since: drop the added runtimes, restore the old default/CDI."""
    doc = parse(text, source)
    version = config_version(doc, source)
    cri: Any = _get(doc, cri_path(version))
    if not isinstance(cri, MutableMapping):
        return text
    runtimes: Any = _runtime_tables(cri)
    for name in previous.added_runtimes:
        if isinstance(runtimes, MutableMapping) and name in runtimes:
            del runtimes[name]
    containerd: Any = _get(cri, ("containerd",))
    if isinstance(containerd, MutableMapping) and containerd.get("default_runtime_name") in previous.added_runtimes:
        if previous.default_runtime_name is None:
            del containerd["default_runtime_name"]
        else:
            _set(containerd, "default_runtime_name", previous.default_runtime_name)
    if "enable_cdi" in cri and previous.enable_cdi is not True:
        if previous.enable_cdi is None:
            del cri["enable_cdi"]
        else:
            _set(cri, "enable_cdi", previous.enable_cdi)
    return tomlkit.dumps(doc)


def remove_import(text: str, entry: str, *, source: str = "config.toml") -> str:
    """The root config without one ``imports`` entry (the rest untouched)."""
    doc = parse(text, source)
    imports = doc.get("imports")
    if not isinstance(imports, list) or entry not in [str(x) for x in imports]:
        return text
    idx = [str(x) for x in imports].index(entry)
    del imports[idx]
    return tomlkit.dumps(doc)


def view_of(text: str, source: str = "config.toml") -> RuntimeView:
    """What a single config document says about runtimes."""
    doc = parse(text, source)
    version = config_version(doc, source)
    return _view(doc.unwrap(), version)


def _view(plain: Mapping[str, Any], version: int, containerd_version: Version | None = None) -> RuntimeView:
    cri = _get(plain, cri_path(version)) or {}
    runtimes = _get(cri, ("containerd", "runtimes")) or {}
    default = _get(cri, ("containerd", "default_runtime_name"))
    imports = plain.get("imports") or []
    return RuntimeView(
        version=version,
        default_runtime=default if isinstance(default, str) and default else "runc",
        runtimes={str(k): dict(v) for k, v in runtimes.items() if isinstance(v, Mapping)},
        enable_cdi=cdi_enabled(cri.get("enable_cdi"), containerd_version, version),
        imports=tuple(str(i) for i in imports),
    )


def _deep_merge(into: dict[str, Any], other: Mapping[str, Any]) -> None:
    for k, v in other.items():
        if isinstance(v, Mapping) and isinstance(into.get(k), dict):
            _deep_merge(into[k], v)
        else:
            into[k] = copy.deepcopy(v) if not isinstance(v, Mapping) else _to_dict(v)


def _to_dict(m: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _to_dict(v) if isinstance(v, Mapping) else copy.deepcopy(v) for k, v in m.items()}


def merged_view(root_text: str, imported: list[tuple[str, str]], containerd_version: Version | None) -> RuntimeView:
    """The effective runtimes after containerd loads ``root_text`` and the ``imported`` (path, text) files."""
    root = parse(root_text, "config.toml").unwrap() if root_text.strip() else {}
    version = config_version(root)
    merged = _to_dict(root)
    deep = merges_plugins(containerd_version, version)
    for path, text in imported:
        plain = parse(text, path).unwrap()
        plugins = plain.get("plugins") or {}
        target = merged.setdefault("plugins", {})
        for name, table in plugins.items():
            if deep and isinstance(target.get(name), dict) and isinstance(table, Mapping):
                _deep_merge(target[name], table)
            else:
                target[name] = _to_dict(table) if isinstance(table, Mapping) else table
    view = _view(merged, version, containerd_version)
    return RuntimeView(view.version, view.default_runtime, view.runtimes, view.enable_cdi, view.imports)


def iter_keys(plain: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every leaf (path, value) of a plain TOML mapping; used to check that untouched keys stay put."""
    for k, v in plain.items():
        if isinstance(v, Mapping):
            yield from iter_keys(v, (*prefix, k))
        else:
            yield (*prefix, k), v
