"""Every host path nodeagent touches, resolved under one injectable root.

Tests and demos pass a temporary directory as root; on a real host the root is ``/``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath


@dataclass(frozen=True)
class HostPaths:
    """Resolves absolute host paths below ``root``."""

    root: Path = Path("/")

    def __call__(self, host_path: str | PurePosixPath) -> Path:
        """Map an absolute host path (``/etc/x``) to the path under the root."""
        p = PurePosixPath(host_path)
        if not p.is_absolute():
            raise ValueError(f"host path must be absolute: {host_path}")
        return self.root.joinpath(*p.parts[1:])

    def to_host(self, path: Path) -> str:
        """The host path for a path under the root (inverse of ``__call__``)."""
        rel = Path(path).resolve().relative_to(self.root.resolve())
        return "/" + str(rel) if str(rel) != "." else "/"

    # Well-known locations -------------------------------------------------------------------
    @property
    def kubelet_device_plugins(self) -> Path:
        return self("/var/lib/kubelet/device-plugins")

    @property
    def pod_resources_socket(self) -> Path:
        return self("/var/lib/kubelet/pod-resources/kubelet.sock")

    @property
    def sys_pci_devices(self) -> Path:
        return self("/sys/bus/pci/devices")

    @property
    def containerd_config(self) -> Path:
        return self("/etc/containerd/config.toml")

    @property
    def containerd_dropin_dir(self) -> Path:
        return self("/etc/containerd/conf.d")

    @property
    def nvidia_runtime_config(self) -> Path:
        return self("/etc/nvidia-container-runtime/config.toml")

    @property
    def agent_config(self) -> Path:
        return self("/etc/nodeagent/config.toml")

    @property
    def state_dir(self) -> Path:
        return self("/var/lib/nodeagent")

    @property
    def mig_state_dir(self) -> Path:
        """MIG state (``mig-state.json``): shared by ``nodeagent run``, ``bootstrap`` and ``mig apply``."""
        return self("/var/lib/nodeagent/mig")

    @property
    def run_dir(self) -> Path:
        return self("/run/nodeagent")

    @property
    def proc(self) -> Path:
        return self("/proc")
