"""NICs of the host: link speed and RDMA capability, for bandwidth-aware placement labels.

Links come from netlink (pyroute2) on the real host; under a sandbox root (``--root``) they come from
``/sys/class/net`` of that root so tests can lay out any machine. Speeds are read from
``/sys/class/net/<if>/speed`` (Mb/s); RDMA devices from ``/sys/class/infiniband``. Read-only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from nodeagent.hostpaths import HostPaths

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


def netlink_links() -> list[Link]:
    """Links of the current network namespace, from netlink."""
    from pyroute2 import IPRoute

    out: list[Link] = []
    with IPRoute() as ip:
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
        state = _read(d / "operstate")
        out.append(Link(d.name, state == "up", d.name == "lo"))
    return out


def _read(p: Path) -> str | None:
    try:
        return p.read_text().strip()
    except OSError:  # EINVAL for the speed of a down link, ENOENT for virtual ones
        return None


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
                links = netlink_links()
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
        sys_dir = paths("/sys/class/net") / link.name
        physical = (sys_dir / "device").exists()
        raw = _read(sys_dir / "speed")
        speed = int(raw) if raw is not None and raw.lstrip("-").isdigit() and int(raw) > 0 else None
        nics.append(Nic(link.name, link.up, physical, speed, tuple(netdev_rdma.get(link.name, ()))))
    return summarize(nics, rdma)
