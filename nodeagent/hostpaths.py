"""Every host path nodeagent touches, resolved under one injectable root.

Tests and demos pass a temporary directory as root; on a real host the root is ``/``.

Under a root other than ``/`` every path stays inside the root, as if nodeagent ran chrooted there:

- a path whose ``..`` would climb above the root (``/../../x/config.toml``) is refused;
- a symlink met on the way is followed the way the kernel would follow it inside the root: an absolute
  target starts again at the root, a relative one continues from the link's directory, and ``..`` stops
  at the root. A ``--root /mnt/image`` run therefore reads and writes the image's files, never the
  build host's, whatever the image's links say. A loop of links is refused.

The root itself is made absolute (and its own symlinks resolved) once, when ``HostPaths`` is built, so
every path handed out is absolute (a gRPC ``unix://`` target built from it has no authority part).

Paths nodeagent *publishes* (the host paths of a CDI spec's device nodes and mounts, the mounts of an
``Allocate`` answer) are read by other programs of the node, the container runtime and the kubelet, which
see the node's files from where they run. ``on_host`` says where that is for the root: by default the
root itself (a sandbox: a runtime on this machine finds the stand-in files under it); ``/`` when the root
is the node's own filesystem mounted into nodeagent's container (the DaemonSet's ``--root /host
--root-on-host /``), so ``/host/dev/nvidia0`` is published as ``/dev/nvidia0``.
"""

from __future__ import annotations

import os
import posixpath
import shlex
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from nodeagent.errors import ConfigError

# The kubelet's root directory on a host (``[kubelet] dir`` may name another): device-plugins/,
# plugins_registry/, plugins/ and pod-resources/ live below it.
KUBELET_DIR = "/var/lib/kubelet"

# Like the kernel's MAXSYMLINKS: more links than this on one path is treated as a loop.
MAX_SYMLINKS = 40


class HostPathError(ConfigError, ValueError):
    """A host path that would leave the root (``..`` above it, a symlink loop) or is not absolute."""


def _absolute_root(root: Path | str) -> Path:
    return Path(os.path.realpath(os.path.abspath(root)))


@dataclass(frozen=True)
class HostPaths:
    """Resolves absolute host paths below ``root``."""

    root: Path = Path("/")
    on_host: str | None = None  # where the node's runtime and kubelet see the root; None: the root itself

    def __post_init__(self) -> None:
        absolute = _absolute_root(self.root)
        if absolute != self.root:
            object.__setattr__(self, "root", absolute)
        if self.on_host is not None:
            if not self.on_host.startswith("/") or "\0" in self.on_host:
                raise HostPathError(f"the root's place on the host must be an absolute path: {self.on_host!r}",
                                    subject=self.on_host)
            object.__setattr__(self, "on_host", "/" + "/".join(confined_parts(self.on_host)))

    def __call__(self, host_path: str | PurePosixPath) -> Path:
        """Map an absolute host path (``/etc/x``) to the path under the root (confined to it)."""
        text = str(host_path)
        if not text.startswith("/"):
            raise HostPathError(f"host path must be absolute: {host_path}", subject=text)
        if "\0" in text:
            raise HostPathError(f"host path contains a NUL byte: {host_path!r}", subject=text)
        parts = confined_parts(text)
        if str(self.root) == "/":
            return Path("/", *parts)
        return self.root.joinpath(*_resolve_inside(self.root, parts, text))

    @property
    def is_node_root(self) -> bool:
        """Whether the root is the node's own ``/``: the host's, or the node's root mounted into nodeagent's
        container (``--root-on-host /``). Only then does nodeagent execute a program of the node's driver;
        a sandbox root's files are never executed."""
        return str(self.root) == "/" or self.on_host == "/"

    def within(self, path: Path | str) -> Path:
        """A path under the root, resolved inside the root *now*: the chroot-style resolution ``__call__``
        does, applied again to a path that was built from a resolved directory and may have had components
        joined to it since (``paths.state_dir / "mig" / "mig-state.json"``), or whose links changed since it
        was resolved. Every open, listing, mkdir, rename, socket bind and directory handed to a child goes
        through this at the moment of use, so a link made under the root after the directory was resolved
        still cannot lead out of it. With the root ``/`` the path is returned as it is (the host's own
        resolution is the chroot's). A path that is not under the root is refused."""
        text = os.fspath(path)
        if "\0" in text:
            raise HostPathError(f"path contains a NUL byte: {text!r}", subject=text)
        if str(self.root) == "/":
            return Path(text)
        root = str(self.root)
        if not text.startswith("/"):
            text = os.path.join(os.getcwd(), text)
        if text != root and not text.startswith(root + "/"):
            raise HostPathError(f"{text} is not under the root {root}", subject=text)
        rest = text[len(root):]
        return self.root.joinpath(*_resolve_inside(self.root, rest.split("/"), "/" + rest.lstrip("/")))

    def to_host(self, path: Path) -> str:
        """The host path for a path under the root (inverse of ``__call__``)."""
        resolved = Path(os.path.realpath(path)) if str(self.root) == "/" else self.within(path)
        rel = resolved.relative_to(self.root)
        return "/" + str(rel) if str(rel) != "." else "/"

    def published(self, path: Path | str) -> str:
        """``path`` (a path under the root, as ``__call__`` gives it) as the node's container runtime and
        kubelet name it: unchanged by default, moved from the root to ``on_host`` when that is set."""
        text = os.path.abspath(path)
        if self.on_host is None:
            return text
        root = str(self.root)
        if root == "/":
            rel = text.lstrip("/")
        elif text == root or text.startswith(root + "/"):
            rel = text[len(root):].lstrip("/")
        else:
            raise HostPathError(f"{text} is not under the root {root}", subject=text)
        return posixpath.join(self.on_host, rel) if rel else self.on_host

    def shown(self, host_path: str) -> str:
        """An absolute host path under the root the way a message names it: joined to the root, its symlinks
        not followed (a ConfigMap volume's ``config.toml``, not the ``..2026_11_26_...`` directory it
        resolves to). Only for messages: files are opened through ``__call__``."""
        return str(self.root.joinpath(*confined_parts(host_path)))

    def publish(self, host_path: str) -> str:
        """The published name of an absolute host path (``published(self(host_path))``)."""
        return self.published(self(host_path))

    def command(self, subcommand: str) -> str:
        """A ``nodeagent`` command line for a hint, with ``--root`` when the root is not ``/`` (a hint run
        literally must act where the one who printed it acts, never on the host instead of a sandbox)."""
        root = "" if str(self.root) == "/" else f" --root {shlex.quote(str(self.root))}"
        return f"nodeagent{root} {subcommand}"

    # Well-known locations -------------------------------------------------------------------
    @property
    def pod_resources_socket(self) -> Path:
        return self(KUBELET_DIR + "/pod-resources/kubelet.sock")

    @property
    def sys_pci_devices(self) -> Path:
        return self("/sys/bus/pci/devices")

    @property
    def containerd_config(self) -> Path:
        return self("/etc/containerd/config.toml")

    @property
    def state_dir(self) -> Path:
        return self("/var/lib/nodeagent")

    @property
    def mig_state_dir(self) -> Path:
        """MIG state (``mig-state.json``): shared by ``nodeagent run``, ``bootstrap`` and ``mig apply``."""
        return self("/var/lib/nodeagent/mig")

    @property
    def proc(self) -> Path:
        return self("/proc")


def confined_parts(host_path: str) -> list[str]:
    """The components of an absolute host path with ``.`` and ``..`` applied; refuses ``..`` above ``/``."""
    parts: list[str] = []
    for part in host_path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if not parts:
                raise HostPathError(f"host path {host_path} climbs above the root with '..'",
                                    subject=host_path)
            parts.pop()
            continue
        parts.append(part)
    return parts


def _resolve_inside(root: Path, parts: list[str], original: str) -> list[str]:
    """Follow symlinks component by component as a chroot at ``root`` would; components that do not
    exist (yet) are kept as they are."""
    done: list[str] = []
    todo = list(reversed(parts))
    links = 0
    while todo:
        part = todo.pop()
        if part in ("", "."):
            continue
        if part == "..":
            if done:
                done.pop()
            continue
        candidate = root.joinpath(*done, part)
        try:
            target = os.readlink(candidate)
        except OSError:  # not a link, or not there (yet): a plain component
            done.append(part)
            continue
        links += 1
        if links > MAX_SYMLINKS:
            raise HostPathError(f"host path {original}: too many levels of symbolic links under {root}",
                                subject=original)
        if posixpath.isabs(target):
            done = []
        todo.extend(reversed(target.split("/")))
    return done
