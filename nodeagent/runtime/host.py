"""Facts about the host that shape the containerd config: containerd's version and the cgroup driver.

Everything is read under the injectable host root, so tests point it at a temporary tree.
"""

from __future__ import annotations

import mmap
import os
import posixpath
import re
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path

from nodeagent import fileio
from nodeagent.errors import ConfigError
from nodeagent.hostpaths import KUBELET_DIR, HostPaths
from nodeagent.runtime.containerd_versions import Version, parse_containerd_version

CONTAINERD_BINARIES = ("/usr/bin/containerd", "/usr/local/bin/containerd", "/usr/sbin/containerd")
KUBELET_CONFIG_NAME = "config.yaml"
# The kubelet config is read only for its cgroupDriver; real ones are a few KiB.
MAX_KUBELET_CONFIG_BYTES = 1 << 20


def containerd_version(paths: HostPaths, timeout: float = 10.0) -> Version | None:
    """The version of the first containerd binary under the root, or ``None``.

    On the host itself (root ``/``) the binary answers ``containerd --version``. Under any other root
    nothing from the root is executed (it may be an image or another machine's disk): the version comes
    from the root's package database (dpkg: ``containerd``, ``containerd.io``) or from the Go build
    information inside the binary (a containerd built as a Go module records its module version).
    """
    if paths.root != Path("/"):
        return _packaged_version(paths) or _first_binary(paths, _module_version)
    return _first_binary(paths, lambda binary: _answered_version(binary, timeout))


def _first_binary(paths: HostPaths, probe: Callable[[Path], Version | None]) -> Version | None:
    for host_path in CONTAINERD_BINARIES:
        try:
            binary = paths(host_path)
        except ConfigError:  # a link that loops or leaves the root: not a containerd of this root
            continue
        if not binary.is_file():
            continue
        found = probe(binary)
        if found is not None:
            return found
    return None


def _answered_version(binary: Path, timeout: float) -> Version | None:
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=timeout,
                             check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_containerd_version(out.stdout)


_DPKG_STATUS = "/var/lib/dpkg/status"
_DPKG_PACKAGES = ("containerd", "containerd.io")
MAX_DPKG_STATUS_BYTES = 64 << 20
_RELEASE = re.compile(r"(?:\d+:)?v?(\d+)\.(\d+)(?:\.(\d+))?")


def _packaged_version(paths: HostPaths) -> Version | None:
    """containerd's version as the root's dpkg database records it (``Version: 1.6.20~ds1-1+deb12u3``)."""
    try:
        data = fileio.read_regular(paths(_DPKG_STATUS), max_bytes=MAX_DPKG_STATUS_BYTES)
    except ConfigError:
        return None
    for stanza in (data or b"").decode("utf-8", "replace").split("\n\n"):
        fields = dict(line.split(": ", 1) for line in stanza.splitlines() if ": " in line and line[:1] != " ")
        if fields.get("Package") in _DPKG_PACKAGES and fields.get("Status", "").endswith(" installed"):
            m = _RELEASE.match(fields.get("Version", ""))
            if m:
                return int(m[1]), int(m[2]), int(m[3] or 0)
    return None


_BUILDINFO_MAGIC = b"\xff Go buildinf:"
_CONTAINERD_MODULES = ("github.com/containerd/containerd", "github.com/containerd/containerd/v2")
MAX_BINARY_BYTES = 512 << 20


def _module_version(binary: Path) -> Version | None:
    """containerd's module version from the Go build information of ``binary`` (the data ``go version -m``
    prints: ``mod``/``dep`` lines with path, version and sum), read, never run. ``None`` for a binary built
    outside module mode (Debian's) or without that information."""
    try:
        fd = os.open(binary, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not 0 < st.st_size <= MAX_BINARY_BYTES:
            return None
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as data:
            at = data.find(_BUILDINFO_MAGIC)
            if at < 0 or at + 32 > len(data) or not data[at + 15] & 0x2:  # Go >= 1.18: strings inline
                return None
            info = _buildinfo_strings(bytes(data[at + 32:at + 32 + (1 << 20)]))
    except (OSError, ValueError):
        return None
    for line in info.splitlines():
        fields = line.split("\t")
        if len(fields) >= 3 and fields[0] in ("mod", "dep") and fields[1] in _CONTAINERD_MODULES:
            m = _RELEASE.fullmatch(fields[2].split("-", 1)[0].split("+", 1)[0])
            if m:
                return int(m[1]), int(m[2]), int(m[3] or 0)
    return None


def _buildinfo_strings(blob: bytes) -> str:
    """The module information: the second of two uvarint-length-prefixed strings (the first is the Go
    version)."""
    pos = 0
    text = ""
    for _ in range(2):
        length, shift = 0, 0
        while True:
            if pos >= len(blob) or shift > 28:
                raise ValueError("truncated build information")
            byte = blob[pos]
            pos += 1
            length |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        text = blob[pos:pos + length].decode("latin-1")
        pos += length
    return text


def systemd_cgroup(paths: HostPaths, kubelet_dir: str = KUBELET_DIR) -> bool:
    """Whether containers should use the systemd cgroup driver on this node.

    The kubelet's own ``cgroupDriver`` (``config.yaml`` in the kubelet's directory, the agent config's
    ``[kubelet] dir``) decides when that file exists (the two must agree); otherwise a host booted with
    systemd (``/run/systemd/system``) uses the systemd driver, as kubeadm does.
    """
    try:
        data = fileio.read_regular(paths(posixpath.join(kubelet_dir, KUBELET_CONFIG_NAME)),
                                   max_bytes=MAX_KUBELET_CONFIG_BYTES)
        text = (data or b"").decode("utf-8")
    except (ConfigError, UnicodeDecodeError):
        text = ""
    m = re.search(r"(?m)^cgroupDriver:\s*[\"']?(\w+)", text)
    if m:
        return m.group(1) == "systemd"
    return paths("/run/systemd/system").is_dir()


def cgroup_v2(paths: HostPaths) -> bool:
    """Whether the unified cgroup hierarchy (cgroup v2) is mounted."""
    return paths("/sys/fs/cgroup/cgroup.controllers").is_file()
