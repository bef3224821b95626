"""Pure editor for nvidia-container-runtime's ``config.toml``: the leak guard.

With ``accept-nvidia-visible-devices-envvar-when-unprivileged = false`` an unprivileged pod that asked
for no GPU cannot get one by setting ``NVIDIA_VISIBLE_DEVICES`` itself; with
``accept-nvidia-visible-devices-as-volume-mounts = true`` the device plugin hands GPUs over as volume
mounts instead (the device plugin's volume-mounts device-list strategy). Everything else in the file keeps
its bytes.
"""

from __future__ import annotations

import re

import tomlkit
from tomlkit.exceptions import ParseError, TOMLKitError

from nodeagent.errors import ConfigError

ENVVAR_KEY = "accept-nvidia-visible-devices-envvar-when-unprivileged"
VOLUME_KEY = "accept-nvidia-visible-devices-as-volume-mounts"
LEAK_GUARD = {ENVVAR_KEY: False, VOLUME_KEY: True}


def _parse(text: str, source: str) -> tomlkit.TOMLDocument:
    try:
        return tomlkit.parse(text)
    except ParseError as e:
        reason = re.sub(r"\s+at line \d+ col \d+$", "", str(e))
        raise ConfigError(
            f"{source}: invalid TOML at line {e.line}, column {e.col}: {reason}; nothing was written", subject=source
        ) from e
    except TOMLKitError as e:
        raise ConfigError(f"{source}: invalid TOML: {e}; nothing was written", subject=source) from e


def render_leak_guard(old_text: str | None, *, source: str = "config.toml") -> str:
    """The toolkit config with both leak-guard switches set (top-level keys)."""
    text = old_text or ""
    doc = _parse(text, source)
    changed = False
    for key, value in LEAK_GUARD.items():
        current = doc.get(key)
        if current is None or bool(current) is not value or not isinstance(current, bool):
            doc[key] = value
            changed = True
    return tomlkit.dumps(doc) if changed else text


def leak_guard_on(text: str) -> bool:
    try:
        doc = tomlkit.parse(text)
    except ParseError:
        return False
    return all(doc.get(k) is v for k, v in LEAK_GUARD.items())


def restore_keys(text: str, original_text: str | None, *, source: str = "config.toml") -> str:
    """Put the two leak-guard keys back to what ``original_text`` said (absent keys are removed)."""
    doc = _parse(text, source)
    orig = _parse(original_text or "", f"{source} (recorded original)")
    changed = False
    for key in LEAK_GUARD:
        if key in orig:
            if doc.get(key) != orig[key]:
                doc[key] = orig[key]
                changed = True
        elif key in doc:
            del doc[key]
            changed = True
    return tomlkit.dumps(doc) if changed else text
