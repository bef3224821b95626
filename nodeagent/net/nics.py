"""NICs of the host: link speed and RDMA capability, for bandwidth-aware placement labels.

Links come from netlink (pyroute2) on the real host; under a sandbox root (``--root``) they come from
``/sys/class/net`` of that root so tests can lay out any machine. Speeds are read from
``/sys/class/net/<if>/speed`` (Mb/s); RDMA devices from ``/sys/class/infiniband``. Read-only.

Import footprint: ``pyroute2/__init__.py`` imports every netlink family it supports (IPDB, NDB, nftables,
wireless, IPVS, ...: ~160 modules, ~10 MiB resident for good in a long-running daemon) although only the
rtnetlink ``IPRoute`` is used here. ``_iproute_class`` loads just ``pyroute2.iproute.linux`` (~4 MiB) by
registering the ``pyroute2`` package without running its ``__init__``; the first access to any other name
of the package runs the real ``__init__`` then (PEP 562), so code elsewhere that imports pyroute2 sees the
whole package. Where that layout does not exist (another pyroute2 release) the normal import is used.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import threading
import types
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


_import_lock = threading.Lock()
_LEAN_MODULE = "pyroute2.iproute.linux"


def _package_on_demand(name: str) -> types.ModuleType:
    """Register package ``name`` without executing its ``__init__``; any attribute that is not a submodule
    runs the real ``__init__`` in place first, so the package ends up exactly as a normal import makes it."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        raise ImportError(f"{name} is not an importable package")
    loader = spec.loader
    module = importlib.util.module_from_spec(spec)
    complete = threading.RLock()

    def __getattr__(attr: str) -> Any:
        if attr.startswith("__") and attr != "__version__":
            raise AttributeError(attr)
        if importlib.util.find_spec(f"{name}.{attr}") is not None:
            return importlib.import_module(f"{name}.{attr}")
        with complete:
            if module.__dict__.pop("__getattr__", None) is not None:
                loader.exec_module(module)
        return getattr(module, attr)

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    sys.modules[name] = module
    return module


def _iproute_class() -> Any:
    """pyroute2's ``IPRoute``, importing as little of pyroute2 as this release allows."""
    with _import_lock:
        lean = sys.modules.get(_LEAN_MODULE)
        if lean is None and "pyroute2" not in sys.modules:
            before = set(sys.modules)
            try:
                _package_on_demand("pyroute2")
                lean = importlib.import_module(_LEAN_MODULE)
                return lean.IPRoute
            except (ImportError, AttributeError) as e:
                log.debug("lean pyroute2 import failed (%s); importing the whole package", e)
                for mod in set(sys.modules) - before:
                    if mod == "pyroute2" or mod.startswith("pyroute2."):
                        del sys.modules[mod]
        if lean is not None and hasattr(lean, "IPRoute"):
            return lean.IPRoute
    from pyroute2 import IPRoute

    return IPRoute


def netlink_links() -> list[Link]:
    """Links of the current network namespace, from netlink."""
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
