"""Loading small YAML config documents with bounded cost, and quoting bad values in bounded space.

Config files are small; a document that is not is refused before it is parsed. YAML aliases (``*a``) are
refused outright: neither NVIDIA's plugin config nor mig-parted's config needs them, and an alias of an
alias of a list expands exponentially (a few hundred bytes can become gigabytes once loaded). Nesting is
capped too, so a deeply nested document is one error line instead of a RecursionError.
"""

from __future__ import annotations

from typing import Any

import yaml

from nodeagent.errors import ConfigError

MAX_DOCUMENT_BYTES = 1 << 20  # 1 MiB: the largest real config is a few KiB
MAX_DEPTH = 32
MAX_SHOWN = 60  # characters of a bad value quoted in an error line
MAX_INT_CHARS = 64  # characters of one integer (a count, an index, a PCI ID)


class BoundedYamlError(ValueError):
    """The document is too large, too deep or uses an alias; the message is one line."""


class _NoAliasLoader(yaml.SafeLoader):
    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()  # type: ignore[no-untyped-call]
            mark = event.start_mark
            raise BoundedYamlError(
                f"YAML aliases are not accepted (alias *{shown(event.anchor)} at line {mark.line + 1}, "
                f"column {mark.column + 1}); write the value out"
            )
        depth = getattr(self, "_depth", 0)
        if depth >= MAX_DEPTH:
            mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
            raise BoundedYamlError(f"nested more than {MAX_DEPTH} levels deep at line {mark.line + 1}")
        self._depth = depth + 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth = depth


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> Any:
    # Python refuses to convert more than 4300 digits (a ValueError deep in the constructor); no config
    # number needs more than a few digits
    if len(node.value) > MAX_INT_CHARS:
        mark = node.start_mark
        raise BoundedYamlError(f"an integer of {len(node.value)} characters at line {mark.line + 1}, column "
                               f"{mark.column + 1}; at most {MAX_INT_CHARS} are accepted")
    return yaml.SafeLoader.construct_yaml_int(loader, node)


_NoAliasLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)


def load(text: str) -> Any:
    """``yaml.safe_load`` without aliases, with size and depth caps.

    Raises ``BoundedYamlError`` for a refused document and ``yaml.YAMLError`` for a malformed one.
    """
    size = len(text.encode("utf-8", errors="replace"))
    if size > MAX_DOCUMENT_BYTES:
        raise BoundedYamlError(f"document is {size} bytes, more than the {MAX_DOCUMENT_BYTES} accepted")
    loader = _NoAliasLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def load_document(text: str, source: str) -> Any:
    """``load`` for a named config document: a refused or malformed one is one ``ConfigError`` naming
    ``source`` (and the line and column of malformed YAML)."""
    try:
        return load(text)
    except BoundedYamlError as e:
        raise ConfigError(f"{source}: {e}", subject=source) from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{source}: not valid YAML{where}: {problem}", subject=source) from e


def shown(value: Any) -> str:
    """``repr(value)`` cut to ``MAX_SHOWN`` characters, so an error line never echoes an unbounded input."""
    if isinstance(value, list | dict | tuple | set) and len(value) > MAX_SHOWN:
        return f"<{type(value).__name__} of {len(value)} items>"
    if isinstance(value, str | bytes) and len(value) > MAX_SHOWN:
        value = value[:MAX_SHOWN]  # repr of the head only: a 3 MB value is never copied whole
        cut = True
    else:
        cut = False
    try:
        text = repr(value)
    except ValueError:  # an integer beyond Python's digit limit for int -> str
        return f"<integer of {value.bit_length()} bits>" if isinstance(value, int) else f"<{type(value).__name__}>"
    if cut or len(text) > MAX_SHOWN:
        return text[: MAX_SHOWN - 3] + "..."
    return text


def plain(value: Any) -> str:
    """``value`` as is when it is a short printable string (a key, a device reference), else ``shown``."""
    if isinstance(value, str) and value.isprintable() and len(value) <= MAX_SHOWN:
        return value
    return shown(value)
