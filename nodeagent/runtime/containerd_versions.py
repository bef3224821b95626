"""What each containerd version does with its config: the one table nodeagent's editor reads.

Two kinds of version meet here. A config file says its format in ``version`` (missing means 1); the
installed containerd (``containerd --version``) decides how imports merge and whether CDI is on. A new
config format or a new containerd release is one row below.

Facts (containerd):
- ``version`` 2 is read from 1.3 on, 3 from 2.0, 4 from 2.3.
- The CRI runtime settings live in ``plugins.cri`` (v1), ``plugins."io.containerd.grpc.v1.cri"`` (v2) or
  ``plugins."io.containerd.cri.v1.runtime"`` (v3, v4); runtimes in ``<cri>.containerd.runtimes.<name>``,
  the default in ``<cri>.containerd.default_runtime_name`` (``runc`` when unset), CDI in ``<cri>.enable_cdi``.
- ``imports`` pulls in more files. Up to 1.7 an imported plugin table REPLACES the root's table of the same
  plugin, so a drop-in must carry the whole CRI table; from 2.0 plugin tables are merged key by key, so a
  drop-in carries only what changes.
- A file newer than the installed containerd reads: 2.x refuses to start ("failed to load TOML from ...:
  expected containerd config version equal to or less than `3`, got `4`"); 1.x starts and ignores the
  plugin tables it does not know (a version-3 file's ``io.containerd.cri.v1.runtime``: 1.6's ``config dump``
  shows version 2 and ``default_runtime_name = "runc"``), so none of its CRI settings apply.
- CDI: up to 1.7 only with ``enable_cdi = true``; 2.0 turned it on by default (only an explicit ``false``
  turns it off); 2.4 removed the key (CDI always on; a version-4 file with it gets an "unknown key"
  warning).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nodeagent.boundedyaml import shown
from nodeagent.errors import ConfigError

Version = tuple[int, int, int]


@dataclass(frozen=True)
class ConfigFormat:
    """One value of a config file's ``version``."""

    cri_path: tuple[str, ...]  # the CRI plugin table that holds ``containerd.runtimes``
    binary_keys: tuple[str, ...]  # the runtime ``options`` keys that name its binary


class Cdi(enum.Enum):
    OPT_IN = "on with enable_cdi = true"
    DEFAULT_ON = "on unless enable_cdi = false"
    ALWAYS = "always on, the key is gone"


@dataclass(frozen=True)
class Release:
    """A containerd release, from ``since`` on until the next row."""

    since: Version
    config_version: int  # the newest format it reads without migrating (a new file is written in it)
    imports_merge: bool  # imported plugin tables merge key by key (False: they replace the root's)
    cdi: Cdi


_CRI_V1 = ("plugins", "cri")
_CRI_V2 = ("plugins", "io.containerd.grpc.v1.cri")
_CRI_V3 = ("plugins", "io.containerd.cri.v1.runtime")

FORMATS: dict[int, ConfigFormat] = {
    1: ConfigFormat(_CRI_V1, ("BinaryName", "Runtime")),
    2: ConfigFormat(_CRI_V2, ("BinaryName",)),
    3: ConfigFormat(_CRI_V3, ("BinaryName",)),
    4: ConfigFormat(_CRI_V3, ("BinaryName",)),
}

# Oldest first. The first row also stands for older and unknown releases.
RELEASES: tuple[Release, ...] = (
    Release((1, 3, 0), config_version=2, imports_merge=False, cdi=Cdi.OPT_IN),
    Release((2, 0, 0), config_version=3, imports_merge=True, cdi=Cdi.DEFAULT_ON),
    Release((2, 3, 0), config_version=4, imports_merge=True, cdi=Cdi.DEFAULT_ON),
    Release((2, 4, 0), config_version=4, imports_merge=True, cdi=Cdi.ALWAYS),
)


def release(containerd_version: Version | None) -> Release:
    """The row of an installed containerd (the oldest row when unknown or older)."""
    found = RELEASES[0]
    for row in RELEASES:
        if containerd_version is not None and containerd_version >= row.since:
            found = row
    return found


def _release_reading(config_ver: int) -> Release:
    """The oldest release that reads a file of ``config_ver``: what a file says when the binary is unknown."""
    return next((row for row in RELEASES if row.config_version >= config_ver), RELEASES[-1])


def cri_path(version: int) -> tuple[str, ...]:
    """Key path of the CRI plugin table that holds ``containerd.runtimes`` for a config version."""
    return FORMATS[version].cri_path


def known(raw: Any) -> bool:
    """Whether ``raw`` (a file's ``version`` value) is a config format this table knows."""
    return not isinstance(raw, bool) and isinstance(raw, int) and raw in FORMATS


def config_version(doc: Mapping[str, Any], source: str = "config.toml") -> int:
    raw = doc.get("version", 1)
    if not known(raw):
        raise ConfigError(
            f"{source}: unsupported containerd config version {shown(raw)} ({min(FORMATS)}-{max(FORMATS)} known)",
            subject=source,
        )
    return int(raw)


def parse_containerd_version(output: str) -> Version | None:
    """The version in ``containerd --version`` output (``containerd github.com/... v1.7.2 <rev>``)."""
    m = re.search(r"(?:^|\s)v?(\d+)\.(\d+)\.(\d+)", output)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def _row(containerd_version: Version | None, config_ver: int) -> Release:
    return release(containerd_version) if containerd_version is not None else _release_reading(config_ver)


def merges_plugins(containerd_version: Version | None, config_ver: int) -> bool:
    """Whether imports merge plugin tables key by key instead of replacing them (the installed containerd
    says; when it is unknown, the file's version does)."""
    return _row(containerd_version, config_ver).imports_merge


def cdi_enabled(enable_cdi: Any, containerd_version: Version | None, config_ver: int) -> bool:
    """Whether containerd runs with CDI on, given the CRI table's ``enable_cdi`` value (None when unset)."""
    cdi = _row(containerd_version, config_ver).cdi
    if cdi is Cdi.ALWAYS:
        return True
    if cdi is Cdi.DEFAULT_ON:
        return enable_cdi is not False
    return enable_cdi is True


def needs_enable_cdi(containerd_version: Version | None, enable_cdi: Any) -> bool:
    """Whether CDI must be switched on by writing ``enable_cdi = true`` over the present value (None when
    unset). With the release unknown the key is written: the oldest row asks for it and later ones accept it."""
    cdi = release(containerd_version).cdi
    if cdi is Cdi.OPT_IN:
        return True
    if cdi is Cdi.ALWAYS:
        return False
    return enable_cdi is False


def new_file_version(containerd_version: Version | None) -> int:
    """Config version for a new file: the newest the installed containerd reads without migrating it."""
    return release(containerd_version).config_version


def load_problem(containerd_version: Version | None, config_ver: int) -> tuple[str, str]:
    """Why the installed containerd does not take a file of format ``config_ver``, and what to do; ("", "")
    when it does, or when the installed release is unknown."""
    if containerd_version is None:
        return "", ""
    row = release(containerd_version)
    if config_ver <= row.config_version:
        return "", ""
    named = ".".join(map(str, containerd_version))
    upgrade = ".".join(map(str, _release_reading(config_ver).since[:2]))
    fix = f"write the file in version {row.config_version}, or upgrade containerd to {upgrade} or later"
    if containerd_version >= (2, 0, 0):
        return (f"containerd {named} does not start with a version-{config_ver} config (it reads up to version "
                f"{row.config_version})", fix)
    return (f"containerd {named} ignores the plugin tables of a version-{config_ver} config (it reads up to "
            f"version {row.config_version}): none of its CRI settings apply, the nvidia runtime among them", fix)
