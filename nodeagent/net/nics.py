"""NICs of the host: link speed and RDMA capability, for bandwidth-aware placement labels.

Links come from netlink (pyroute2) on the real host; under a sandbox root (``--root``) they come from
``/sys/class/net`` of that root so tests can lay out any machine. Speeds are read from
``/sys/class/net/<if>/speed`` (Mb/s); RDMA devices from ``/sys/class/infiniband``. Read-only.

Footprint: pyroute2 would stay resident in the daemon for good (``pyroute2/__init__.py`` imports every
netlink family it supports: ~160 modules, ~10 MiB) to answer a question asked once a minute. So
``netlink_links`` asks it in a short-lived child interpreter (``python -m nodeagent.net.nics links``, JSON
on stdout), and ``read_nics`` reuses the answer while ``/sys/class/net`` (names, operstate) looks the same,
for at most ``LINKS_MAX_AGE_S``. The child imports only ``pyroute2.iproute.linux`` (see
``nodeagent.lazyimport``), falling back to the whole package on other pyroute2 layouts.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodeagent import fileio
from nodeagent.hostpaths import HostPaths
from nodeagent.lazyimport import lean_import

log = logging.getLogger(__name__)

ARPHRD_LOOPBACK = 772


@dataclass(frozen=True)
class Link:
    name: str
    up: bool
    loopback: bool = False


@dataclass(frozen=True)
class Nic:
    name: str
    up: bool
    physical: bool  # backed by a device (not veth/bridge/tunnel)
    speed_mbps: int | None  # None when unknown or down
    rdma_devices: tuple[str, ...] = ()  # e.g. ("mlx5_0",)


@dataclass(frozen=True)
class NetSummary:
    fastest_nic_speed_mbps: int | None
    rdma_nics: int  # RDMA devices (one per port-bearing HCA function) under /sys/class/infiniband
    nics: tuple[Nic, ...] = ()


def summarize(nics: Iterable[Nic], rdma_devices: Iterable[str]) -> NetSummary:
    """Fastest up physical NIC and the RDMA device count (pure)."""
    nic_t = tuple(nics)
    speeds = [n.speed_mbps for n in nic_t if n.up and n.physical and n.speed_mbps and n.speed_mbps > 0]
    return NetSummary(
        fastest_nic_speed_mbps=max(speeds) if speeds else None,
        rdma_nics=len(set(rdma_devices)),
        nics=nic_t,
    )


def _iproute_class() -> Any:
    """pyroute2's ``IPRoute``, importing as little of pyroute2 as this release allows."""
    try:
        return lean_import("pyroute2", "iproute.linux").IPRoute
    except (ImportError, AttributeError):
        from pyroute2 import IPRoute

        return IPRoute


LINKS_MAX_AGE_S = 600.0  # a cached netlink answer is re-asked at least this often
LINK_QUERY_TIMEOUT_S = 20.0
_CHILD_MODULE = "nodeagent.net.nics"


def netlink_links() -> list[Link]:
    """Links of the current network namespace, from netlink (pyroute2 in a short-lived child process)."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", _CHILD_MODULE, "links"],
            capture_output=True, timeout=LINK_QUERY_TIMEOUT_S, check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise OSError(f"netlink query process failed: {e}") from e
    if proc.returncode != 0:
        lines = proc.stderr.decode(errors="replace").strip().splitlines()
        raise OSError(f"netlink query exited {proc.returncode}: {lines[-1] if lines else 'no output'}")
    try:
        rows = json.loads(proc.stdout)
        return [Link(str(name), bool(up), bool(loopback)) for name, up, loopback in rows]
    except (ValueError, TypeError) as e:
        raise OSError(f"netlink query answered nonsense: {e}") from e


@dataclass(frozen=True)
class _CachedLinks:
    fingerprint: tuple[Link, ...]
    at: float
    links: tuple[Link, ...]


_cache: dict[Path, _CachedLinks] = {}
_cache_lock = threading.Lock()


def cached_netlink_links(paths: HostPaths, *, max_age_s: float = LINKS_MAX_AGE_S) -> list[Link]:
    """``netlink_links``, asked again only when ``/sys/class/net`` changed or the answer is ``max_age_s`` old."""
    fingerprint = tuple(sysfs_links(paths))
    now = time.monotonic()
    with _cache_lock:
        hit = _cache.get(paths.root)
        if hit is not None and hit.fingerprint == fingerprint and now - hit.at < max_age_s:
            return list(hit.links)
        links = netlink_links()
        _cache[paths.root] = _CachedLinks(fingerprint, now, tuple(links))
        return links


def netlink_links_here() -> list[Link]:
    """Links of the current network namespace, from netlink in this process."""
    out: list[Link] = []
    with _iproute_class()() as ip:
        for msg in ip.get_links():
            name = msg.get_attr("IFLA_IFNAME")
            state = msg.get_attr("IFLA_OPERSTATE")
            out.append(Link(str(name), state == "UP", msg["ifi_type"] == ARPHRD_LOOPBACK))
    return out


def sysfs_links(paths: HostPaths) -> list[Link]:
    """Links as listed in ``/sys/class/net`` under the root (sandbox trees)."""
    base = paths("/sys/class/net")
    out: list[Link] = []
    if not base.is_dir():
        return out
    for d in sorted(base.iterdir()):
        state = _read(d / "operstate", paths)
        out.append(Link(d.name, state == "up", d.name == "lo"))
    return out


def _read(p: Path, paths: HostPaths) -> str | None:
    try:
        text = fileio.read_text(p, max_bytes=4096, root=paths)  # resolved inside the root (sysfs is links)
    except (OSError, fileio.UnreadableFileError):  # EINVAL for the speed of a down link
        return None
    return None if text is None else text.strip()  # None: ENOENT for virtual ones


def rdma_devices(paths: HostPaths) -> dict[str, tuple[str, ...]]:
    """RDMA device → the netdevs it drives (``/sys/class/infiniband/<dev>/device/net/*``)."""
    base = paths("/sys/class/infiniband")
    out: dict[str, tuple[str, ...]] = {}
    if not base.is_dir():
        return out
    for d in sorted(base.iterdir()):
        net = d / "device" / "net"
        out[d.name] = tuple(sorted(p.name for p in net.iterdir())) if net.is_dir() else ()
    return out


def read_nics(paths: HostPaths, links: list[Link] | None = None) -> NetSummary:
    """Read every NIC's facts; netlink on the real root, sysfs under a sandbox root."""
    if links is None:
        if paths.root == Path("/"):
            try:
                links = cached_netlink_links(paths)
            except OSError as e:
                log.warning("netlink unavailable (%s); reading /sys/class/net", e)
                links = sysfs_links(paths)
        else:
            links = sysfs_links(paths)
    rdma = rdma_devices(paths)
    netdev_rdma: dict[str, list[str]] = {}
    for dev, netdevs in rdma.items():
        for nd in netdevs:
            netdev_rdma.setdefault(nd, []).append(dev)
    nics: list[Nic] = []
    for link in links:
        if link.loopback:
            continue
        sys_dir = paths(f"/sys/class/net/{link.name}")
        physical = paths.within(sys_dir / "device").exists()
        raw = _read(sys_dir / "speed", paths)
        speed = int(raw) if raw is not None and raw.lstrip("-").isdigit() and int(raw) > 0 else None
        nics.append(Nic(link.name, link.up, physical, speed, tuple(netdev_rdma.get(link.name, ()))))
    return summarize(nics, rdma)


def _main(argv: list[str]) -> int:
    """The child side of ``netlink_links``: print the links as JSON rows ``[name, up, loopback]``."""
    if argv != ["links"]:
        print("usage: python -m nodeagent.net.nics links", file=sys.stderr)
        return 2
    json.dump([[link.name, link.up, link.loopback] for link in netlink_links_here()], sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
