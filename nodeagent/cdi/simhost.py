"""The host files a simulated machine would have, laid out under ``--root`` for the CDI spec to read.

``materialise`` writes what the NVIDIA kernel modules expose for the inventory's GPUs and MIG devices:
``/proc/devices`` majors, ``/proc/driver/nvidia-caps/mig-minors`` (the driver's fixed table),
``/proc/driver/nvidia/capabilities/gpu<N>/mig/gi<G>[/ci<C>]/access`` for the instances that exist, and
stand-in files (not device nodes) for ``/dev/nvidia*`` and ``/dev/nvidia-caps/nvidia-cap<N>``; cap
entries of instances that no longer exist are removed, as the driver does. ``make_driver_root`` lays out
a small fake driver (libraries, tools, firmware, optionally ``nvidia-cdi-hook``) for tests and demos.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from nodeagent import fileio
from nodeagent.gpu.inventory import Inventory
from nodeagent.hostpaths import HostPaths

SIM_UVM_MAJOR = 508
SIM_CAPS_MAJOR = 509
SIM_IMEX_CHANNELS_MAJOR = 511  # nvidia-caps-imex-channels: registered by every driver since 550
MAX_GPU_INSTANCES = 15
MAX_COMPUTE_INSTANCES = 8
# mig-minors numbering: config 1, monitor 2, then per GPU minor 15 GPU instances, each one access
# node followed by the access nodes of its 8 compute instances.
_FIRST = 3
_PER_GI = 1 + MAX_COMPUTE_INSTANCES
_PER_GPU = MAX_GPU_INSTANCES * _PER_GI

FAKE_LIBRARIES = (
    "libcuda.so",
    "libnvidia-ml.so",
    "libnvidia-ptxjitcompiler.so",
    "libnvidia-nvvm.so",
    "libnvidia-opencl.so",
    "libcudadebugger.so",
)
FAKE_BINARIES = ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control")
LIB_DIR = "/usr/lib/x86_64-linux-gnu"


def gi_minor(gpu_minor: int, gi: int) -> int:
    return _FIRST + gpu_minor * _PER_GPU + gi * _PER_GI


def ci_minor(gpu_minor: int, gi: int, ci: int) -> int:
    return gi_minor(gpu_minor, gi) + 1 + ci


def mig_minors_text(gpu_minors: list[int]) -> str:
    lines = ["config 1", "monitor 2"]
    for g in sorted(gpu_minors):
        for gi in range(MAX_GPU_INSTANCES):
            lines.append(f"gpu{g}/gi{gi}/access {gi_minor(g, gi)}")
            for ci in range(MAX_COMPUTE_INSTANCES):
                lines.append(f"gpu{g}/gi{gi}/ci{ci}/access {ci_minor(g, gi, ci)}")
    return "\n".join(lines) + "\n"


def _write(paths: HostPaths, path: Path, text: str, mode: int = 0o644) -> None:
    """Write ``path`` (under the root) unless it holds ``text``; every component is resolved inside the root
    as it is written, whatever links were made under it since the directory was named."""
    target = fileio.makedirs(path.parent, root=paths) / path.name
    target = paths.within(target)
    if fileio.read_text(target) != text:
        target.write_text(text)
    os.chmod(target, mode)


def _cap_text(minor: int) -> str:
    return f"DeviceFileMinor: {minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n"


@dataclass(frozen=True)
class SimHostFiles:
    """What ``materialise`` laid out (paths under the root)."""

    gpu_nodes: tuple[Path, ...]
    cap_nodes: tuple[Path, ...]


def materialise(paths: HostPaths, inventory: Inventory) -> SimHostFiles:
    """Lay out the ``/proc`` and ``/dev`` facts of ``inventory`` under ``paths`` (idempotent)."""
    _write(
        paths,
        paths("/proc/devices"),
        "Character devices:\n  1 mem\n  4 tty\n195 nvidia-frontend\n"
        f"{SIM_UVM_MAJOR} nvidia-uvm\n{SIM_CAPS_MAJOR} nvidia-caps\n"
        f"{SIM_IMEX_CHANNELS_MAJOR} nvidia-caps-imex-channels\n\nBlock devices:\n  8 sd\n",
    )
    minors = [g.minor_number for g in inventory.gpus]
    _write(paths, paths("/proc/driver/nvidia-caps/mig-minors"), mig_minors_text(minors), 0o444)
    caps_root = paths("/proc/driver/nvidia/capabilities")
    _write(paths, caps_root / "mig" / "config", _cap_text(1), 0o444)
    _write(paths, caps_root / "mig" / "monitor", _cap_text(2), 0o444)
    dev = paths("/dev")
    gpu_nodes: list[Path] = []
    for name in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset"):
        _write(paths, dev / name, "", 0o666)
    wanted_caps: set[str] = set()
    for g in inventory.gpus:
        node = dev / f"nvidia{g.minor_number}"
        _write(paths, node, "", 0o666)
        gpu_nodes.append(node)
        mig_dir = caps_root / f"gpu{g.minor_number}" / "mig"
        old = paths.within(mig_dir)
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        for m in g.mig_devices:
            gm, cm = gi_minor(g.minor_number, m.gi_id), ci_minor(g.minor_number, m.gi_id, m.ci_id)
            _write(paths, mig_dir / f"gi{m.gi_id}" / "access", _cap_text(gm), 0o444)
            _write(paths, mig_dir / f"gi{m.gi_id}" / f"ci{m.ci_id}" / "access", _cap_text(cm), 0o444)
            wanted_caps.update((f"nvidia-cap{gm}", f"nvidia-cap{cm}"))
    caps_dev = dev / "nvidia-caps"
    for p in fileio.makedirs(caps_dev, root=paths).iterdir():
        if p.name.startswith("nvidia-cap") and p.name not in wanted_caps:
            p.unlink()
    cap_nodes = []
    for name in sorted(wanted_caps):
        _write(paths, caps_dev / name, "", 0o400)
        cap_nodes.append(caps_dev / name)
    return SimHostFiles(tuple(gpu_nodes), tuple(cap_nodes))


def make_driver_root(paths: HostPaths, driver_version: str, *, driver_root: str = "/",
                     hook: bool = True) -> Path:
    """A fake driver under ``driver_root`` (resolved under ``paths``): versioned libraries with their
    ``.so.1`` links, an older library the spec must ignore, tools, GSP firmware, and with ``hook`` an
    ``nvidia-cdi-hook`` that does nothing (on the host's ``/usr/bin``). Returns the driver root's path."""
    root = paths(driver_root)
    libdir = root.joinpath(*PurePosixPath(LIB_DIR).parts[1:])
    for lib in FAKE_LIBRARIES:
        real = libdir / f"{lib}.{driver_version}"
        _write(paths, real, f"fake {lib} {driver_version}\n")
        link = paths.within(libdir) / f"{lib}.1"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(real.name)
    _write(paths, libdir / "libcuda.so.1.0.0-old", "not the driver's version\n")
    _write(paths, libdir / "libnvidia-ml.so.470.82.01", "an older driver's library\n")
    bindir = root / "usr" / "bin"
    for b in FAKE_BINARIES:
        _write(paths, bindir / b, f"#!/bin/sh\necho fake {b}\n", 0o755)
    _write(paths, root / "lib" / "firmware" / "nvidia" / driver_version / "gsp_ga10x.bin", "fake firmware\n")
    if hook:
        _write(paths, paths("/usr/bin/nvidia-cdi-hook"), "#!/bin/sh\nexit 0\n", 0o755)
    return root
