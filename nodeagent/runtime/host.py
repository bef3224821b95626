"""Facts about the host that shape the containerd config: containerd's version and the cgroup driver.

Everything is read under the injectable host root, so tests point it at a temporary tree.
"""

from __future__ import annotations

import posixpath
import re
import subprocess

from nodeagent import fileio
from nodeagent.errors import ConfigError
from nodeagent.hostpaths import HostPaths
from nodeagent.runtime.containerd import Version, parse_containerd_version

CONTAINERD_BINARIES = ("/usr/bin/containerd", "/usr/local/bin/containerd", "/usr/sbin/containerd")
KUBELET_DIR = "/var/lib/kubelet"
KUBELET_CONFIG_NAME = "config.yaml"
# The kubelet config is read only for its cgroupDriver; real ones are a few KiB.
MAX_KUBELET_CONFIG_BYTES = 1 << 20


def containerd_version(paths: HostPaths, timeout: float = 10.0) -> Version | None:
    """``containerd --version`` of the first containerd binary under the root, or ``None``."""
    for host_path in CONTAINERD_BINARIES:
        try:
            binary = paths(host_path)
        except ConfigError:  # a link that loops or leaves the root: not a containerd of this root
            continue
        if not binary.is_file():
            continue
        try:
            out = subprocess.run(
                [str(binary), "--version"], capture_output=True, text=True, timeout=timeout, check=False
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        found = parse_containerd_version(out.stdout)
        if found is not None:
            return found
    return None


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
