"""Facts about the host that shape the containerd config: containerd's version and the cgroup driver.

Everything is read under the injectable host root, so tests point it at a temporary tree.
"""

from __future__ import annotations

import re
import subprocess

from nodeagent.hostpaths import HostPaths
from nodeagent.runtime.containerd import Version, parse_containerd_version

CONTAINERD_BINARIES = ("/usr/bin/containerd", "/usr/local/bin/containerd", "/usr/sbin/containerd")
KUBELET_CONFIG = "/var/lib/kubelet/config.yaml"


def containerd_version(paths: HostPaths, timeout: float = 10.0) -> Version | None:
    """``containerd --version`` of the first containerd binary under the root, or ``None``."""
    for host_path in CONTAINERD_BINARIES:
        binary = paths(host_path)
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


def systemd_cgroup(paths: HostPaths) -> bool:
    """Whether containers should use the systemd cgroup driver on this node.

    The kubelet's own ``cgroupDriver`` decides when its config exists (the two must agree); otherwise
    a host booted with systemd (``/run/systemd/system``) uses the systemd driver, as kubeadm does.
    """
    kubelet = paths(KUBELET_CONFIG)
    try:
        text = kubelet.read_text()
    except (FileNotFoundError, NotADirectoryError, UnicodeDecodeError):
        text = ""
    m = re.search(r"(?m)^cgroupDriver:\s*[\"']?(\w+)", text)
    if m:
        return m.group(1) == "systemd"
    return paths("/run/systemd/system").is_dir()


def cgroup_v2(paths: HostPaths) -> bool:
    """Whether the unified cgroup hierarchy (cgroup v2) is mounted."""
    return paths("/sys/fs/cgroup/cgroup.controllers").is_file()
