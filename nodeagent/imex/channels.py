"""IMEX channel device nodes and their CDI entries (the stable API for every path that hands out channels).

The NVIDIA kernel module registers the character device ``nvidia-caps-imex-channels`` (its major is on that
line of ``/proc/devices``) but makes no ``/dev`` node: nvidia-modprobe or an admin does, as
``/dev/nvidia-caps-imex-channels/channel<N>`` with minor N, mode 0666. ``ensure_channel`` does the same under
the ``HostPaths`` root: a real character device when the root is the node's own filesystem, a stand-in
file (as the simulator's other ``/dev`` entries) under a sandbox root, where the CDI entry then carries the
numbers. ``cdi_spec`` is the spec of kind ``nvidia.com/imex-channel`` whose devices are named by channel
number, as NVIDIA's device plugin names them (``nvidia.com/imex-channel=0``).

Use: ``ch = ensure_channel(paths, 0)`` → ``ch.path`` (in the container), ``ch.host_path`` (published),
``ch.major``, ``ch.minor``; ``cdi_device_node(ch)`` for a claim's own edits; ``cdi_spec([ch, ...])``.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from nodeagent import fileio
from nodeagent.cdi.host import PROC_DEVICES, parse_proc_devices
from nodeagent.errors import InputError, OperationError
from nodeagent.hostpaths import HostPaths

CHANNEL_DIR = "/dev/nvidia-caps-imex-channels"
PROC_DEVICES_NAME = "nvidia-caps-imex-channels"
# NVreg_ImexChannelCount defaults to 2048 (nv-reg.h); NVIDIA's DRA driver hard-codes the same number
DEFAULT_CHANNEL_COUNT = 2048
MAX_CHANNEL = (1 << 20) - 1  # the minor of a dev_t is 20 bits
CHANNEL_MODE = 0o666
CDI_VENDOR = "nvidia.com"
CDI_CLASS = "imex-channel"
CDI_KIND = f"{CDI_VENDOR}/{CDI_CLASS}"
SPEC_PATH = "/var/run/cdi/nvidia-imex-channels.yaml"


class ImexChannelError(OperationError):
    """A channel device could not be made or its major number is unknown."""


@dataclass(frozen=True)
class Channel:
    """One IMEX channel device: ``path`` inside containers, ``host_path`` as the node's runtime sees it."""

    number: int
    path: str
    host_path: str
    major: int
    minor: int


def channel_path(number: int) -> str:
    """``/dev/nvidia-caps-imex-channels/channel<N>`` (the path in the container and on the host)."""
    check_number(number)
    return f"{CHANNEL_DIR}/channel{number}"


def check_number(number: int) -> None:
    """One clear error for a channel number that is not 0..2^20-1."""
    if isinstance(number, bool) or not isinstance(number, int) or not 0 <= number <= MAX_CHANNEL:
        raise InputError(f"IMEX channel number must be an integer 0..{MAX_CHANNEL}, got {number!r}",
                         subject=str(number))


def qualified_name(number: int) -> str:
    """The CDI name of a channel: ``nvidia.com/imex-channel=<N>``."""
    check_number(number)
    return f"{CDI_KIND}={number}"


def channel_major(paths: HostPaths) -> int:
    """The major of ``nvidia-caps-imex-channels`` from ``/proc/devices`` under the root."""
    source = paths(PROC_DEVICES)
    try:
        text = fileio.read_text(source, root=paths, max_bytes=1 << 16)
    except (OSError, fileio.UnreadableFileError) as e:
        raise ImexChannelError(f"{source}: cannot read it: {e}", subject=str(source)) from e
    major = parse_proc_devices(text or "").get(PROC_DEVICES_NAME)
    if major is None:
        raise ImexChannelError(
            f"{source} has no character device {PROC_DEVICES_NAME!r}: the NVIDIA driver offers no IMEX "
            "channels (driver older than 550, or NVreg_ImexChannelCount=0)", subject=str(source))
    return major


def ensure_channel(paths: HostPaths, number: int, *, major: int | None = None) -> Channel:
    """Make ``channel<number>`` under the root unless it is there with the right numbers (idempotent).

    On the node's own root a character device (mode 0666, as nvidia-modprobe makes it); a wrong node in its
    place is replaced. Under a sandbox root a stand-in file, its numbers carried by the returned ``Channel``.
    """
    path = channel_path(number)
    if major is None:
        major = channel_major(paths)
    directory = fileio.makedirs(paths(CHANNEL_DIR), root=paths, mode=0o755)
    target = paths.within(directory) / f"channel{number}"  # the entry itself, a link in its place not followed
    try:
        st: os.stat_result | None = os.lstat(target)
    except FileNotFoundError:
        st = None
    try:
        if paths.is_node_root:
            wanted = os.makedev(major, number)
            if st is None or not stat.S_ISCHR(st.st_mode) or st.st_rdev != wanted:
                if st is not None:
                    os.unlink(target)
                os.mknod(target, stat.S_IFCHR | CHANNEL_MODE, wanted)
            if st is None or stat.S_IMODE(os.lstat(target).st_mode) != CHANNEL_MODE:
                os.chmod(target, CHANNEL_MODE)  # the umask took bits off mknod's mode
        elif st is None or not stat.S_ISREG(st.st_mode):
            if st is not None:
                os.unlink(target)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, CHANNEL_MODE)
            os.close(fd)
            os.chmod(target, CHANNEL_MODE)
    except OSError as e:
        raise ImexChannelError(f"cannot make IMEX channel {target}: {e.strerror or e}", subject=str(target)) from e
    return Channel(number=number, path=path, host_path=paths.published(target), major=major, minor=number)


def ensure_channels(paths: HostPaths, numbers: Iterable[int]) -> list[Channel]:
    """``ensure_channel`` for each number (the major read once)."""
    wanted = sorted(set(numbers))
    if not wanted:
        return []
    major = channel_major(paths)
    return [ensure_channel(paths, n, major=major) for n in wanted]


def existing_channel(paths: HostPaths, number: int) -> bool:
    """Whether the channel's node exists under the root: a character device on the node's root (what
    NVIDIA's device plugin checks), a stand-in file under a sandbox root."""
    try:
        st = os.stat(paths.within(paths(channel_path(number))))
    except OSError:
        return False
    return stat.S_ISCHR(st.st_mode) if paths.is_node_root else stat.S_ISREG(st.st_mode)


def cdi_device_node(channel: Channel) -> dict[str, Any]:
    """The CDI ``deviceNodes`` entry of a channel (type, numbers and mode always given, as NVIDIA's DRA
    driver writes them)."""
    entry: dict[str, Any] = {"path": channel.path}
    if channel.host_path != channel.path:
        entry["hostPath"] = channel.host_path
    entry.update({"type": "c", "major": channel.major, "minor": channel.minor, "fileMode": CHANNEL_MODE})
    return entry


def cdi_spec(channels: Iterable[Channel]) -> dict[str, Any] | None:
    """The spec of kind ``nvidia.com/imex-channel``: one device per channel, named by its number
    (``None`` without channels: a spec needs a device)."""
    devices = [{"name": str(ch.number), "containerEdits": {"deviceNodes": [cdi_device_node(ch)]}}
               for ch in sorted(channels, key=lambda c: c.number)]
    if not devices:
        return None
    return {"cdiVersion": "0.5.0", "kind": CDI_KIND, "devices": devices}
