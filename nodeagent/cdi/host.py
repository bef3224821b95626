"""The host facts a CDI spec needs, read under ``--root`` (I/O only; the spec itself is built in ``spec``).

* ``/proc/driver/nvidia-caps/mig-minors``: which ``/dev/nvidia-caps/nvidia-cap<N>`` grants access to a
  GPU instance (``gpu<minor>/gi<id>/access N``) or compute instance (``gpu<minor>/gi<id>/ci<id>/access N``);
* ``/dev``: which NVIDIA device nodes exist. A real character device is left for the runtime to stat (as
  ``nvidia-ctk`` does); a stand-in file (a simulated host) gets its type and numbers written into the
  spec, majors taken from ``/proc/devices``;
* the driver root: the driver's libraries (``lib*.so.<driver version>``), tools and firmware, mounted
  read-only into containers at the same path relative to the driver root;
* ``nvidia-cdi-hook``: when installed, containers get its ``create-symlinks`` and ``update-ldcache`` hooks.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from nodeagent import fileio
from nodeagent.errors import OperationError
from nodeagent.gpu.inventory import Inventory
from nodeagent.hostpaths import HostPaths

MIG_MINORS = "/proc/driver/nvidia-caps/mig-minors"
PROC_DEVICES = "/proc/devices"
NVIDIA_MAJOR = 195  # fixed major of /dev/nvidiactl, /dev/nvidia-modeset and /dev/nvidiaN
CONTROL_NODES: dict[str, tuple[str, int]] = {
    # container path -> (/proc/devices name of its major, minor)
    "/dev/nvidiactl": ("nvidia-frontend", 255),
    "/dev/nvidia-uvm": ("nvidia-uvm", 0),
    "/dev/nvidia-uvm-tools": ("nvidia-uvm", 1),
    "/dev/nvidia-modeset": ("nvidia-frontend", 254),
}
LIBRARY_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/lib/x86_64-linux-gnu",
    "/lib64",
)
_LIBRARY = re.compile(
    r"lib(nvidia-[A-Za-z0-9_.-]+|cuda|cudadebugger|nvcuvid|nvoptix|GLX_nvidia|EGL_nvidia|GLESv2_nvidia"
    r"|GLESv1_CM_nvidia)\.so\.(?P<version>[0-9.]+)"
)
BINARIES = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
)
BINARY_DIRS = ("/usr/bin", "/usr/local/bin", "/bin")
HOOK_CANDIDATES = (
    "/usr/bin/nvidia-cdi-hook",
    "/usr/local/bin/nvidia-cdi-hook",
    "/usr/local/nvidia/toolkit/nvidia-cdi-hook",
)
IPC_SOCKETS = ("/run/nvidia-persistenced/socket", "/run/nvidia-fabricmanager/socket")

_MIG_LINE = re.compile(r"gpu(?P<gpu>\d+)/gi(?P<gi>\d+)(?:/ci(?P<ci>\d+))?/access\s+(?P<minor>\d+)")


class CdiError(OperationError):
    """The CDI spec could not be built or written; the previous spec (if any) is left as it was."""


@dataclass(frozen=True)
class NodeFact:
    """A device node as the spec should name it."""

    path: str  # inside the container, e.g. /dev/nvidia0
    host_path: str  # where it is on this host (differs from path under --root)
    major: int | None = None  # set only for stand-in files (simulated hosts)
    minor: int | None = None


@dataclass(frozen=True)
class Mount:
    """A host path bind-mounted at ``container_path`` (the CDI spec's library, binary, firmware and socket
    mounts; the device plugin's volume-mounts device list)."""

    container_path: str
    host_path: str
    read_only: bool = True


@dataclass(frozen=True)
class HostFacts:
    """Everything besides the inventory that goes into the spec."""

    nodes: dict[str, NodeFact] = field(default_factory=dict)  # container path -> fact, existing nodes only
    mig_minors: dict[tuple[int, int, int | None], int] = field(default_factory=dict)  # (gpu, gi, ci|None)
    libraries: tuple[Mount, ...] = ()
    binaries: tuple[Mount, ...] = ()
    firmware: tuple[Mount, ...] = ()
    sockets: tuple[Mount, ...] = ()
    hook: str | None = None  # host path of nvidia-cdi-hook
    mig_minors_source: str = MIG_MINORS


def parse_mig_minors(text: str, source: str = MIG_MINORS) -> dict[tuple[int, int, int | None], int]:
    """``gpu0/gi1/access 12`` → ``{(0, 1, None): 12}``; ``gpu0/gi1/ci0/access 13`` → ``{(0, 1, 0): 13}``.

    ``config`` and ``monitor`` lines are accepted and ignored; any other line is an error naming it.
    """
    out: dict[tuple[int, int, int | None], int] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        m = _MIG_LINE.fullmatch(line)
        if m is None:
            parts = line.split()
            if len(parts) == 2 and parts[0] in ("config", "monitor") and parts[1].isdigit():
                continue
            raise CdiError(f"{source}:{lineno}: cannot parse {line!r}", subject=source)
        ci = None if m["ci"] is None else int(m["ci"])
        out[(int(m["gpu"]), int(m["gi"]), ci)] = int(m["minor"])
    return out


def parse_proc_devices(text: str) -> dict[str, int]:
    """Character-device majors by name from ``/proc/devices``."""
    majors: dict[str, int] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.endswith(":"):
            section = line
            continue
        parts = line.split()
        if section.startswith("Character") and len(parts) == 2 and parts[0].isdigit():
            majors.setdefault(parts[1], int(parts[0]))
    return majors


def _major_for(name: str, majors: dict[str, int]) -> int | None:
    if name == "nvidia-frontend":
        return majors.get("nvidia-frontend", majors.get("nvidia", NVIDIA_MAJOR))
    return majors.get(name)


class _Dirs:
    """Host directories resolved under the root once per collect (``paths()`` follows symlinks component
    by component under ``--root``, which is what a hundred device nodes per refresh would otherwise pay);
    an entry that is itself a symlink is resolved in full, so nothing leaves the root."""

    def __init__(self, paths: HostPaths) -> None:
        self._paths = paths
        self._dirs: dict[str, Path] = {}

    def published(self, host: Path) -> str:
        return self._paths.published(host)

    def __call__(self, path: str) -> Path:
        parent, _, name = path.rpartition("/")
        base = self._dirs.get(parent)
        if base is None:
            base = self._dirs[parent] = Path(os.path.abspath(self._paths(parent or "/")))
        host = base / name
        if os.path.islink(host):
            return Path(os.path.abspath(self._paths(path)))
        return host


def _node(dirs: _Dirs, path: str, major_name: str, minor: int, majors: dict[str, int], *,
          required: bool) -> NodeFact | None:
    """The fact for one node: a real character device as is; a stand-in file, or a missing node the
    spec must still name (``required``), with its numbers; ``None`` when absent and not required."""
    host = dirs(path)
    try:
        st: os.stat_result | None = os.stat(host)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISCHR(st.st_mode):
        return NodeFact(path, dirs.published(host))
    if st is None and not required:
        return None
    major = _major_for(major_name, majors)
    if major is None:
        return None
    return NodeFact(path, dirs.published(host), major, minor)


def _mounts_in(paths: HostPaths, base: Path, directories: tuple[str, ...], keep: re.Pattern[str] | None,
               names: tuple[str, ...], version: str) -> list[Mount]:
    out: list[Mount] = []
    seen: set[str] = set()
    for d in directories:
        host_dir = paths.within(base.joinpath(*PurePosixPath(d).parts[1:]))  # its links followed inside the root
        try:
            entries = sorted(os.scandir(host_dir), key=lambda e: e.name)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for e in entries:
            # Libraries: the versioned file itself (its .so.1 links are the loader's business); tools may
            # be links (alternatives), followed inside the root, whose target is what gets mounted.
            if keep is not None and e.is_symlink():
                continue
            target = paths.within(e.path) if e.is_symlink() else Path(e.path)
            if not target.is_file():
                continue
            if keep is not None:
                m = keep.fullmatch(e.name)
                if m is None or m["version"] != version:
                    continue
            elif e.name not in names:
                continue
            if e.name in seen:  # the first directory that has a file wins, as on the loader path
                continue
            seen.add(e.name)
            out.append(Mount(f"{d}/{e.name}", paths.published(target)))
    return out


@dataclass(frozen=True)
class DriverFacts:
    """What the driver root holds for one driver version: libraries, tools, firmware, IPC sockets, hook."""

    libraries: tuple[Mount, ...] = ()
    binaries: tuple[Mount, ...] = ()
    firmware: tuple[Mount, ...] = ()
    sockets: tuple[Mount, ...] = ()
    hook: str | None = None


def driver_key(paths: HostPaths, driver_version: str, driver_root: str = "/") -> tuple[object, ...]:
    """Changes whenever ``collect_driver`` could answer differently: the driver version and the
    modification times of every directory it lists or looks into (an added, removed or renamed library,
    tool, firmware file, socket or hook changes its directory's time); unique while one of them changed
    within the last second. A few stats instead of listing the library directories, which on a real host
    hold thousands of files."""
    root = paths(driver_root)
    dirs = [paths.within(root.joinpath(*PurePosixPath(d).parts[1:])) for d in (*LIBRARY_DIRS, *BINARY_DIRS)]
    dirs.append(paths.within(root.joinpath("lib", "firmware", "nvidia", driver_version)))
    dirs += [paths(posixpath.dirname(p)) for p in (*IPC_SOCKETS, *HOOK_CANDIDATES)]
    key: list[object] = [driver_version, driver_root]
    young = time.time_ns() - 1_000_000_000
    for d in dirs:
        try:
            mtime = os.stat(d).st_mtime_ns
        except OSError:
            key.append(None)
            continue
        if mtime > young:
            # directory times come from a coarse clock: a change within the last second may not show in
            # them yet, so such a directory is listed afresh (a key equal to no other)
            return (*key, object())
        key.append(mtime)
    return tuple(key)


def collect_driver(paths: HostPaths, driver_version: str, driver_root: str = "/") -> DriverFacts:
    """Read the driver root (under ``paths``) for ``driver_version``."""
    root = paths(driver_root)
    libraries = _mounts_in(paths, root, LIBRARY_DIRS, _LIBRARY, (), driver_version)
    binaries = _mounts_in(paths, root, BINARY_DIRS, None, BINARIES, driver_version)
    firmware: list[Mount] = []
    fw_dir = f"/lib/firmware/nvidia/{driver_version}"
    host_fw = paths.within(root.joinpath(*PurePosixPath(fw_dir).parts[1:]))
    if host_fw.is_dir():
        firmware = [Mount(f"{fw_dir}/{p.name}", paths.published(p)) for p in sorted(host_fw.iterdir())
                    if not p.is_symlink() and p.is_file()]
    sockets = [Mount(s, paths.publish(s)) for s in IPC_SOCKETS if paths(s).exists()]
    hook = next(
        (paths.publish(h) for h in HOOK_CANDIDATES if paths(h).is_file() and os.access(paths(h), os.X_OK)), None
    )
    return DriverFacts(tuple(libraries), tuple(binaries), tuple(firmware), tuple(sockets), hook)


def _read(path: Path) -> str:
    """A /proc file's text; bounded and never blocking; a missing file is ``FileNotFoundError``."""
    try:
        text = fileio.read_text(path)
    except fileio.UnreadableFileError as e:
        raise CdiError(str(e), subject=str(path)) from e
    if text is None:
        raise FileNotFoundError(str(path))
    return text


def collect(paths: HostPaths, inventory: Inventory, driver_root: str = "/",
            driver: DriverFacts | None = None) -> HostFacts:
    """Read the host facts the spec for ``inventory`` needs, under ``paths``; ``driver``: the driver
    root's facts when the caller already has them current (see ``driver_key``)."""
    majors: dict[str, int] = {}
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        majors = parse_proc_devices(_read(paths(PROC_DEVICES)))
    dirs = _Dirs(paths)
    nodes: dict[str, NodeFact] = {}
    for path, (major_name, minor) in CONTROL_NODES.items():
        fact = _node(dirs, path, major_name, minor, majors, required=False)
        if fact is not None:
            nodes[path] = fact
    for gpu in inventory.gpus:
        path = f"/dev/nvidia{gpu.minor_number}"
        fact = _node(dirs, path, "nvidia-frontend", gpu.minor_number, majors, required=True)
        if fact is not None:
            nodes[path] = fact

    minors_file = paths(MIG_MINORS)
    mig_minors: dict[tuple[int, int, int | None], int] = {}
    if any(g.mig_devices for g in inventory.gpus):
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            mig_minors = parse_mig_minors(_read(minors_file), str(minors_file))
    for gpu in inventory.gpus:
        for mig in gpu.mig_devices:
            keys: tuple[tuple[int, int, int | None], ...] = (
                (gpu.minor_number, mig.gi_id, None), (gpu.minor_number, mig.gi_id, mig.ci_id))
            for key in keys:
                cap = mig_minors.get(key)
                if cap is None:
                    continue
                path = f"/dev/nvidia-caps/nvidia-cap{cap}"
                fact = _node(dirs, path, "nvidia-caps", cap, majors, required=True)
                if fact is not None:
                    nodes[path] = fact

    if driver is None:
        driver = collect_driver(paths, inventory.driver_version, driver_root)
    return HostFacts(
        nodes=nodes,
        mig_minors=mig_minors,
        libraries=driver.libraries,
        binaries=driver.binaries,
        firmware=driver.firmware,
        sockets=driver.sockets,
        hook=driver.hook,
        mig_minors_source=str(minors_file),
    )
