"""Small hand-built Inventories for the device-plugin unit tests (pure data, no simulator needed)."""

from __future__ import annotations

import itertools

from nodeagent.gpu.inventory import Gpu, Inventory, Link, LinkKind, MigDevice


def gpu(index: int, *, numa: int | None = 0, mig: tuple[MigDevice, ...] = (), name: str = "NVIDIA H100 80GB HBM3") -> Gpu:
    return Gpu(
        index=index,
        uuid=f"GPU-{index:08d}-0000-4000-8000-000000000000",
        name=name,
        pci_bus_id=f"00000000:{0x10 + index:02X}:00.0",
        pci_device_id=0x233010DE,
        memory_mib=81559,
        numa_node=numa,
        compute_major=9,
        compute_minor=0,
        minor_number=index,
        architecture="hopper",
        mig_capable=True,
        mig_current=bool(mig),
        mig_devices=mig,
    )


def mig_device(gpu_index: int, gi: int, profile: str = "1g.10gb", start: int | None = None) -> MigDevice:
    return MigDevice(
        gpu_index=gpu_index,
        gi_id=gi,
        ci_id=0,
        profile=profile,
        placement_start=gi if start is None else start,
        placement_size=1,
        memory_mib=9856,
        uuid=f"MIG-{gpu_index:04d}{gi:04d}-0000-4000-8000-000000000000",
    )


def nvswitch_box(n: int = 8, *, nvlinks: int = 18) -> Inventory:
    """Every pair on NVLink (DGX-style)."""
    gpus = tuple(gpu(i, numa=0 if i < n // 2 else 1) for i in range(n))
    links = tuple(Link(a, b, LinkKind.NVLINK, nvlinks) for a, b in itertools.combinations(range(n), 2))
    return Inventory(driver_version="550.54.15", cuda_driver_version=12040, gpus=gpus, links=links)


def paired_box() -> Inventory:
    """8 GPUs: NVLink bridges between (0,1) (2,3) (4,5) (6,7); PCIe otherwise, two NUMA nodes."""
    gpus = tuple(gpu(i, numa=0 if i < 4 else 1) for i in range(8))
    links: list[Link] = []
    for a, b in itertools.combinations(range(8), 2):
        if b == a + 1 and a % 2 == 0:
            links.append(Link(a, b, LinkKind.NVLINK, 4))
        elif (a < 4) == (b < 4):
            links.append(Link(a, b, LinkKind.SINGLE_SWITCH if b - a == 1 else LinkKind.HOST_BRIDGE))
        else:
            links.append(Link(a, b, LinkKind.CROSS_CPU))
    return Inventory(driver_version="550.54.15", cuda_driver_version=12040, gpus=gpus, links=tuple(links))


def mig_box(profile: str = "1g.10gb", per_gpu: int = 7, gpus_on: int = 2, gpus_off: int = 0) -> Inventory:
    """``gpus_on`` GPUs in MIG mode with ``per_gpu`` instances of ``profile``, then ``gpus_off`` plain GPUs."""
    gs = [gpu(i, numa=i % 2, mig=tuple(mig_device(i, gi + 1, profile, gi) for gi in range(per_gpu))) for i in range(gpus_on)]
    gs += [gpu(gpus_on + j, numa=None) for j in range(gpus_off)]
    return Inventory(driver_version="550.54.15", cuda_driver_version=12040, gpus=tuple(gs))
