"""NIC facts from a sandbox sysfs tree and from the real netlink socket."""

from __future__ import annotations

from pathlib import Path

from nodeagent.hostpaths import HostPaths
from nodeagent.net.nics import Nic, netlink_links, read_nics, summarize


def _nic(root: Path, name: str, *, speed: str | None, up: bool = True, physical: bool = True) -> None:
    d = root / "sys/class/net" / name
    d.mkdir(parents=True)
    (d / "operstate").write_text("up\n" if up else "down\n")
    if speed is not None:
        (d / "speed").write_text(speed + "\n")
    if physical:
        (d / "device").mkdir()


def test_sandbox_tree(tmp_path: Path) -> None:
    _nic(tmp_path, "lo", speed=None, physical=False)
    _nic(tmp_path, "eno1", speed="25000")
    _nic(tmp_path, "ib0", speed="200000")
    _nic(tmp_path, "ib1", speed="-1", up=False)  # down link: speed unknown
    _nic(tmp_path, "veth1", speed="400000", physical=False)  # virtual: never counts
    ib = tmp_path / "sys/class/infiniband"
    (ib / "mlx5_0/device/net/ib0").mkdir(parents=True)
    (ib / "mlx5_1/device/net/ib1").mkdir(parents=True)
    s = read_nics(HostPaths(tmp_path))
    assert s.fastest_nic_speed_mbps == 200000
    assert s.rdma_nics == 2
    by = {n.name: n for n in s.nics}
    assert "lo" not in by
    assert by["ib0"].rdma_devices == ("mlx5_0",)
    assert by["ib1"].speed_mbps is None


def test_empty_tree(tmp_path: Path) -> None:
    s = read_nics(HostPaths(tmp_path))
    assert (s.fastest_nic_speed_mbps, s.rdma_nics, s.nics) == (None, 0, ())


def test_summary_ignores_down_and_virtual() -> None:
    s = summarize([Nic("a", False, True, 100000), Nic("b", True, False, 400000), Nic("c", True, True, 10000)], [])
    assert s.fastest_nic_speed_mbps == 10000


def test_netlink_lists_loopback() -> None:
    links = netlink_links()
    assert any(link.loopback for link in links)
