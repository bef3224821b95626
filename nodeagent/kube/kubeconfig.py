"""A kubeconfig file checked before the kubernetes client reads it (pure apart from reading the file).

The client's loader parses the file with an unbounded ``yaml.safe_load`` and indexes whatever it finds:
``hello``, a list, an unhashable key or a 100,000-deep document end in a ``TypeError`` or a
``RecursionError``. Here the file is read like every other config (a regular file, at most
``MAX_BYTES``), parsed with the bounded loader (no aliases, no deep nesting, one document) and its shape
checked, so each problem is one ``ConfigError`` line naming the file and the entry. Keys nodeagent does not
know are left to the client (kubectl's format grows); the ones the client reads must have the type it
expects.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nodeagent import fileio
from nodeagent.boundedyaml import MAX_DOCUMENT_BYTES, load_document, plain, shown
from nodeagent.errors import ConfigError

MAX_BYTES = MAX_DOCUMENT_BYTES  # a kubeconfig with embedded certificates is a few KiB

_STR, _BOOL, _MAP, _LIST = "a string", "true or false", "a mapping", "a list"
_STR_LIST = "a list of strings"

# the fields of each entry the client reads, and the type it expects of them
_FIELDS: Mapping[str, Mapping[str, str]] = {
    "cluster": {
        "server": _STR, "certificate-authority": _STR, "certificate-authority-data": _STR,
        "insecure-skip-tls-verify": _BOOL, "tls-server-name": _STR, "proxy-url": _STR,
    },
    "context": {"cluster": _STR, "user": _STR, "namespace": _STR},
    "user": {
        "client-certificate": _STR, "client-certificate-data": _STR, "client-key": _STR,
        "client-key-data": _STR, "token": _STR, "tokenFile": _STR, "username": _STR, "password": _STR,
        "exec": _MAP, "auth-provider": _MAP,
    },
    "exec": {"command": _STR, "args": _STR_LIST, "env": _LIST, "apiVersion": _STR},
    "auth-provider": {"name": _STR, "config": _MAP},
}
_NESTED = frozenset({"exec", "auth-provider"})  # the mappings of a user entry
_SECTIONS = (("clusters", "cluster"), ("contexts", "context"), ("users", "user"))


def read_kubeconfig(path: Path) -> dict[str, Any]:
    """The checked content of the kubeconfig at ``path``; ``ConfigError`` (one line naming it) otherwise."""
    where = f"kubeconfig {path}"
    try:
        text = fileio.read_text(path, max_bytes=MAX_BYTES)
    except ConfigError as e:  # not a regular file, too large, not UTF-8: the message starts with the path
        raise ConfigError(f"kubeconfig {e}", subject=str(path)) from e
    if text is None:
        raise ConfigError(f"{where}: not found", subject=str(path))
    return check_kubeconfig(load_document(text, where), where)


def check_kubeconfig(doc: Any, where: str) -> dict[str, Any]:
    """``doc`` when it has the shape the kubernetes client reads; ``ConfigError`` naming the entry else."""
    if doc is None:
        raise _error(where, "is empty")
    if not isinstance(doc, dict):
        raise _error(where, f"is {_kind(doc)}, not a mapping with clusters, contexts, users and current-context")
    _check_strings(doc, where)
    current = doc.get("current-context")
    if current is not None and not isinstance(current, str):
        raise _error(where, f"current-context must be a string, got {shown(current)}")
    for section, inner in _SECTIONS:
        items = doc.get(section)
        if items is None:
            continue
        if not isinstance(items, list):
            raise _error(where, f"{section} must be a list, got {_kind(items)}")
        for i, item in enumerate(items):
            here = f"{section}[{i}]"
            if not isinstance(item, dict):
                raise _error(where, f"{here} must be a mapping with 'name' and '{inner}', got {_kind(item)}")
            name = item.get("name")
            if not isinstance(name, str) or not name:
                raise _error(where, f"{here}: 'name' must be a non-empty string, got {shown(name)}")
            _check_fields(item.get(inner), inner, where, f"{here} ({plain(name)}).{inner}")
    return doc


def _check_fields(body: Any, kind: str, where: str, here: str) -> None:
    if body is None:
        return
    if not isinstance(body, dict):
        raise _error(where, f"{here} must be a mapping, got {_kind(body)}")
    for key, expected in _FIELDS[kind].items():
        value = body.get(key)
        if value is None:
            continue
        if not _is(value, expected):
            raise _error(where, f"{here}.{key} must be {expected}, got {shown(value)}")
        if kind == "user" and key in _NESTED:
            _check_fields(value, key, where, f"{here}.{key}")
    if kind == "exec":
        for i, item in enumerate(body.get("env") or []):
            if not isinstance(item, dict) or not isinstance(item.get("name"), str) \
                    or not isinstance(item.get("value"), str):
                raise _error(where, f"{here}.env[{i}] must be a mapping with a string 'name' and 'value', "
                                    f"got {shown(item)}")
    if kind == "auth-provider":
        for key, value in (body.get("config") or {}).items():
            if not isinstance(value, str):
                raise _error(where, f"{here}.config.{plain(key)} must be a string, got {shown(value)}")


def _check_strings(value: Any, where: str, trail: tuple[str, ...] = ()) -> None:
    """Every key a string, no string with a NUL byte (no path, URL, name or token holds one)."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise _error(where, f"{_place(trail)} has a key that is not a string: {shown(key)}")
            _check_strings(item, where, (*trail, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_strings(item, where, (*trail, f"[{i}]"))
    elif isinstance(value, str) and "\x00" in value:
        raise _error(where, f"{_place(trail)} holds a NUL byte: {shown(value)}")


def _place(trail: tuple[str, ...]) -> str:
    if not trail:
        return "the top level"
    return plain("".join(t if t.startswith("[") or i == 0 else "." + t for i, t in enumerate(trail)))


def _is(value: Any, expected: str) -> bool:
    if expected == _STR:
        return isinstance(value, str)
    if expected == _BOOL:
        return isinstance(value, bool)
    if expected == _MAP:
        return isinstance(value, dict)
    if expected == _STR_LIST:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    return isinstance(value, list)


def _kind(value: Any) -> str:
    if isinstance(value, str | int | float | bool):
        return f"the value {shown(value)}"
    if isinstance(value, list):
        return "a list"
    return "a mapping" if isinstance(value, dict) else f"a {type(value).__name__}"


def _error(where: str, what: str) -> ConfigError:
    return ConfigError(f"{where}: {what}", subject=where)
