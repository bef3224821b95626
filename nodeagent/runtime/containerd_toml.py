"""Reading a containerd config: text in, a tomlkit document out, or one ``ConfigError`` naming the spot.

Refused before anything is written: template languages that node images render into a config.toml,
files beyond the size and nesting bounds, invalid TOML, and keys of a type containerd itself refuses.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import tomlkit
from tomlkit.container import Container
from tomlkit.exceptions import ParseError, TOMLKitError
from tomlkit.items import AoT, Table
from tomlkit.toml_document import TOMLDocument

from nodeagent.boundedyaml import shown
from nodeagent.errors import ConfigError
from nodeagent.runtime.containerd_versions import cri_path, known

# Bounds on what nodeagent parses as a containerd config. Real configs are a few KiB and nest at most about
# eight levels (plugins.<cri>.containerd.runtimes.<name>.options.<key>); anything far beyond is refused
# with one line instead of exhausting memory or Python's recursion limit.
MAX_CONFIG_BYTES = 1 << 20
MAX_KEY_DEPTH = 32


@dataclass(frozen=True)
class Template:
    """A template language found in a file that should be TOML, and who generates files that way."""

    language: str
    generator: str
    hint: str


_K3S = Template(
    "Go template", "k3s/rke2",
    "k3s/rke2 add the nvidia runtime by themselves when /usr/bin/nvidia-container-runtime exists, or edit "
    "config.toml.tmpl by hand",
)
_GO = Template(
    "Go template", "AKS and other Go-templated node images",
    "edit the template the node image renders, or point --containerd-config at the rendered file",
)
_JINJA = Template(
    "Jinja2 template", "Kubespray/Ansible",
    "set the nvidia runtime in Kubespray's containerd_additional_runtimes and rerun the playbook",
)
_HANDLEBARS = Template(
    "handlebars template", "Bottlerocket",
    "Bottlerocket renders containerd's config from its settings API; use its NVIDIA variant instead",
)
_SHELL = Template(
    "template with shell variables", "MicroK8s",
    "MicroK8s renders containerd.toml from containerd-template.toml at each start; `microk8s enable nvidia` "
    "wires the runtime",
)


def detect_template(text: str, source: str) -> tuple[Template, int] | None:
    """The template language of ``text`` (and the first line that shows it), or ``None`` for plain TOML.

    Jinja2 has ``{%``/``{#`` blocks (Kubespray's ``*.j2``); handlebars has ``{{#if}}``/``{{/if}}`` blocks
    and dotted names without a leading dot (Bottlerocket's ``{{settings.x}}``); Go templates have
    ``{{ .Field }}``/``{{- ...}}`` actions (AKS's ``*.gtpl``, k3s/rke2's ``config.toml.tmpl``); MicroK8s's
    ``containerd-template.toml`` has whole values like ``"${RUNTIME}"`` filled in by its start script.
    """
    lines = text.splitlines()

    def first(pattern: str) -> int | None:
        rx = re.compile(pattern)
        return next((i for i, ln in enumerate(lines, 1) if rx.search(ln)), None)

    name = source.rsplit("/", 1)[-1]
    jinja = first(r"\{%|(?<!\{)\{#")
    if jinja is not None or name.endswith((".j2", ".jinja", ".jinja2")):
        return _JINJA, jinja or first(r"\{\{") or 1
    handlebars = first(r"\{\{\s*[#/^]|\{\{\s*else\s*\}\}|\{\{\{|\{\{\s*[A-Za-z_][\w-]*\.[\w.-]+\s*\}\}")
    if handlebars is not None:
        return _HANDLEBARS, handlebars
    action = first(r"\{\{")
    if action is None:
        shell = first(r"""=\s*["']\$\{[A-Z][A-Z0-9_]*\}""")
        if shell is not None:
            return _SHELL, shell
    if action is None and not name.endswith((".tmpl", ".gtpl", ".tpl")):
        return None
    if name.endswith(".tmpl") and name.startswith("config"):
        return _K3S, action or 1
    return _GO, action or 1


def template_error(found: tuple[Template, int], source: str) -> ConfigError:
    tmpl, line = found
    return ConfigError(
        f"{source}: line {line} is a {tmpl.language} ({tmpl.generator}), not TOML; nothing was written "
        f"({tmpl.hint})",
        subject=source,
    )


def _depth(plain: Mapping[str, Any]) -> int:
    deepest = 0
    stack: list[tuple[Any, int]] = [(plain, 0)]
    while stack:
        value, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > MAX_KEY_DEPTH:
            break
        if isinstance(value, Mapping):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
    return deepest


def parse(text: str, source: str = "config.toml") -> TOMLDocument:
    """Parse a containerd config; templates, oversized or too deeply nested files and invalid TOML raise
    ``ConfigError`` naming the spot."""
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{source}: {len(text)} characters, more than the {MAX_CONFIG_BYTES} nodeagent reads "
                          "as a containerd config; nothing was written", subject=source)
    found = detect_template(text, source)
    if found is not None:
        raise template_error(found, source)
    try:
        doc = tomlkit.parse(text)
        too_deep = _depth(doc.unwrap()) > MAX_KEY_DEPTH
    except ParseError as e:
        raise ConfigError(
            f"{source}: invalid TOML at line {e.line}, column {e.col}: {_parse_reason(e)}; nothing was written",
            subject=source,
        ) from e
    except TOMLKitError as e:
        raise ConfigError(f"{source}: invalid TOML: {e}; nothing was written", subject=source) from e
    except RecursionError:
        too_deep = True
    if too_deep:
        raise ConfigError(f"{source}: tables or arrays nested more than {MAX_KEY_DEPTH} levels deep; "
                          "nothing was written", subject=source)
    check_types(doc.unwrap(), source)
    if doc.as_string() != text:
        _repair_indents(doc, text)
    return doc


# Keys containerd decodes into typed fields: a value of another type makes containerd refuse the whole file
# ("Can't convert 5(int64) to string"), so nodeagent refuses it too, before writing anything.
_TOP_TYPES: dict[str, str] = {
    "version": "integer", "root": "string", "state": "string", "temp": "string", "oom_score": "integer",
    "imports": "list of strings", "required_plugins": "list of strings", "disabled_plugins": "list of strings",
    "plugins": "table of tables", "grpc": "table", "ttrpc": "table", "debug": "table", "metrics": "table",
    "cgroup": "table", "timeouts": "table", "proxy_plugins": "table of tables", "stream_processors": "table",
}
_CRI_TYPES: dict[str, str] = {"containerd": "table"}
_CRI_CONTAINERD_TYPES: dict[str, str] = {
    "default_runtime_name": "string", "snapshotter": "string", "runtimes": "table of tables",
}
_RUNTIME_TYPES: dict[str, str] = {
    "runtime_type": "string", "runtime_path": "string", "options": "table", "snapshotter": "string",
    "privileged_without_host_devices": "boolean", "base_runtime_spec": "string", "cni_conf_dir": "string",
    "pod_annotations": "list of strings", "container_annotations": "list of strings",
}


def _is(value: Any, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "list of strings":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if kind == "table of tables":
        return isinstance(value, Mapping) and all(isinstance(v, Mapping) for v in value.values())
    return isinstance(value, Mapping)


def _check_keys(table: Mapping[str, Any], types: Mapping[str, str], prefix: tuple[str, ...], source: str) -> None:
    for key, kind in types.items():
        if key not in table or _is(table[key], kind):
            continue
        path, value = (*prefix, key), table[key]
        if kind == "table of tables" and isinstance(value, Mapping):  # name the entry that is no table
            child = next(k for k, v in value.items() if not isinstance(v, Mapping))
            path, value, kind = (*path, child), value[child], "table"
        dotted = ".".join(_toml_key(k) for k in path)
        article = "an" if kind[0] in "aeiou" else "a"
        raise ConfigError(f"{source}: {dotted} must be {article} {kind}, not {shown(value)} (containerd refuses such a "
                          "file); nothing was written", subject=source)


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else '"' + key.replace('"', '\\"') + '"'


def check_types(plain: Mapping[str, Any], source: str = "config.toml") -> None:
    """``ConfigError`` naming the first key containerd would refuse for its type (``imports = [1, 2]``,
    ``default_runtime_name = 5``, ``plugins = [1, 2]``, a runtime that is not a table, ...)."""
    _check_keys(plain, _TOP_TYPES, (), source)
    raw = plain.get("version", 1)
    if not known(raw):
        return  # config_version names it
    keys = cri_path(raw)
    cri = _plain_at(plain, keys)
    if not isinstance(cri, Mapping):
        if cri is not None:
            raise ConfigError(f"{source}: {'.'.join(_toml_key(k) for k in keys)} must be a table, not "
                              f"{shown(cri)}; nothing was written", subject=source)
        return
    _check_keys(cri, _CRI_TYPES, keys, source)
    inner = cri.get("containerd")
    if not isinstance(inner, Mapping):
        return
    _check_keys(inner, _CRI_CONTAINERD_TYPES, (*keys, "containerd"), source)
    for name, runtime in (inner.get("runtimes") or {}).items():
        _check_keys(runtime, _RUNTIME_TYPES, (*keys, "containerd", "runtimes", name), source)


def _plain_at(plain: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    node: Any = plain
    for k in keys:
        if not isinstance(node, Mapping):
            return None
        node = node.get(k)
    return node


def _tables(c: Container) -> Iterator[Table]:
    for _, v in c.body:
        if isinstance(v, Table):
            yield v
            yield from _tables(v.value)
        elif isinstance(v, AoT):
            for t in v.body:
                yield from _tables(t.value)


def _repair_indents(doc: TOMLDocument, text: str) -> None:
    """Give every table header back its indentation from ``text``.

    tomlkit 0.13-0.15 does not render some parsed documents back byte for byte: a second indented table
    under an implicit parent (``[a]`` then ``  [a.b.x]`` and ``  [a.b.y]``: ``a.b`` never has a header)
    gets the parent's indent added again. Table headers are unique in TOML, so the source says what
    each header's indent was.
    """
    for t in _tables(doc):
        if t.is_super_table() or not t.display_name:
            continue
        m = re.search(r"(?m)^([ \t]*)\[[ \t]*" + re.escape(t.display_name) + r"[ \t]*\]", text)
        if m:
            t.trivia.indent = re.sub(r"[ \t]*$", m.group(1), t.trivia.indent, count=1)


def _parse_reason(e: ParseError) -> str:
    return re.sub(r"\s+at line \d+ col \d+$", "", str(e))
