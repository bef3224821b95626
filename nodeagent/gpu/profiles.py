"""MIG GPU-instance profile tables per product (REFERENCE §3), as plain data.

Pure: no I/O, no pynvml import. The NVML profile constants are repeated here by value (tests check them
against pynvml) so planners can read the tables without loading NVML. The simulator serves these tables,
and the adapter falls back to them when a driver does not answer profile queries.
"""

from __future__ import annotations

from dataclasses import dataclass

from nodeagent.gpu.inventory import MigProfile

# NVML_GPU_INSTANCE_PROFILE_* (index passed to nvmlDeviceGetGpuInstanceProfileInfo)
GI_PROFILE_1_SLICE = 0x0
GI_PROFILE_2_SLICE = 0x1
GI_PROFILE_3_SLICE = 0x2
GI_PROFILE_4_SLICE = 0x3
GI_PROFILE_7_SLICE = 0x4
GI_PROFILE_8_SLICE = 0x5
GI_PROFILE_6_SLICE = 0x6
GI_PROFILE_1_SLICE_REV1 = 0x7  # 1 compute slice with media extensions (+me)
GI_PROFILE_2_SLICE_REV1 = 0x8  # 2 compute slices with media extensions (+me)
GI_PROFILE_1_SLICE_REV2 = 0x9  # 1 compute slice, double memory (1g.10gb on A100-40GB)
GI_PROFILE_COUNT = 0x12

# NVML_COMPUTE_INSTANCE_PROFILE_* for a compute instance covering the whole GI, by compute slices
CI_PROFILE_FOR_SLICES: dict[int, int] = {1: 0x0, 2: 0x1, 3: 0x2, 4: 0x3, 7: 0x4, 8: 0x5, 6: 0x6}


@dataclass(frozen=True)
class MigProduct:
    """One MIG-capable product: its slice geometry and GI profiles."""

    key: str  # "A100-40GB"
    memory_slices: int
    compute_slices: int
    profiles: tuple[MigProfile, ...]
    pci_device_ids: tuple[int, ...]

    @property
    def max_mig_devices(self) -> int:
        return self.compute_slices

    def profile(self, name: str) -> MigProfile | None:
        for p in self.profiles:
            if p.name == name:
                return p
        return None

    def profile_by_id(self, profile_id: int) -> MigProfile | None:
        for p in self.profiles:
            if p.id == profile_id:
                return p
        return None

    def profile_by_index(self, gi_profile_id: int) -> MigProfile | None:
        for p in self.profiles:
            if p.gi_profile_id == gi_profile_id:
                return p
        return None


def _p(
    name: str, index: int, pid: int, slices: int, mib: int, count: int, starts: tuple[int, ...], size: int
) -> MigProfile:
    return MigProfile(
        name=name,
        gi_profile_id=index,
        id=pid,
        slice_count=slices,
        memory_mib=mib,
        instance_count=count,
        placement_starts=starts,
        placement_size=size,
    )


_ALL7 = (0, 1, 2, 3, 4, 5, 6)


def _eighths(
    one: tuple[str, int], one_double: tuple[str, int], two: str, three_four: tuple[str, str, int], seven: tuple[str, int]
) -> tuple[MigProfile, ...]:
    """The 8-memory-slice / 7-compute-slice layout shared by A100 and H100/H200 (same ids, same placements)."""
    one_name, one_mib = one
    double_name, double_mib = one_double
    three_name, four_name, half_mib = three_four
    seven_name, seven_mib = seven
    return (
        _p(one_name, GI_PROFILE_1_SLICE, 19, 1, one_mib, 7, _ALL7, 1),
        _p(one_name + "+me", GI_PROFILE_1_SLICE_REV1, 20, 1, one_mib, 1, _ALL7, 1),
        _p(double_name, GI_PROFILE_1_SLICE_REV2, 15, 1, double_mib, 4, (0, 2, 4, 6), 2),
        _p(two, GI_PROFILE_2_SLICE, 14, 2, double_mib, 3, (0, 2, 4), 2),
        _p(three_name, GI_PROFILE_3_SLICE, 9, 3, half_mib, 2, (0, 4), 4),
        _p(four_name, GI_PROFILE_4_SLICE, 5, 4, half_mib, 1, (0,), 4),
        _p(seven_name, GI_PROFILE_7_SLICE, 0, 7, seven_mib, 1, (0,), 8),
    )


PRODUCTS: dict[str, MigProduct] = {
    p.key: p
    for p in (
        MigProduct(
            "A100-40GB",
            8,
            7,
            _eighths(("1g.5gb", 4864), ("1g.10gb", 9856), "2g.10gb", ("3g.20gb", "4g.20gb", 19968), ("7g.40gb", 40192)),
            (0x20B010DE, 0x20B110DE, 0x20F110DE, 0x20F610DE),
        ),
        MigProduct(
            "A100-80GB",
            8,
            7,
            _eighths(("1g.10gb", 9856), ("1g.20gb", 19968), "2g.20gb", ("3g.40gb", "4g.40gb", 40192), ("7g.80gb", 80384)),
            (0x20B210DE, 0x20B510DE, 0x20F310DE, 0x20F510DE),
        ),
        MigProduct(
            "H100-80GB",
            8,
            7,
            _eighths(("1g.10gb", 9856), ("1g.20gb", 19968), "2g.20gb", ("3g.40gb", "4g.40gb", 40192), ("7g.80gb", 80384)),
            (0x233010DE, 0x233110DE, 0x232210DE, 0x232410DE),
        ),
        MigProduct(
            "H200-141GB",
            8,
            7,
            _eighths(
                ("1g.18gb", 18432), ("1g.35gb", 35840), "2g.35gb", ("3g.71gb", "4g.71gb", 72704), ("7g.141gb", 144384)
            ),
            (0x233510DE, 0x233B10DE),
        ),
        MigProduct(
            "A30-24GB",
            4,
            4,
            (
                _p("1g.6gb", GI_PROFILE_1_SLICE, 14, 1, 5836, 4, (0, 1, 2, 3), 1),
                _p("1g.6gb+me", GI_PROFILE_1_SLICE_REV1, 21, 1, 5836, 1, (0, 1, 2, 3), 1),
                _p("2g.12gb", GI_PROFILE_2_SLICE, 5, 2, 11672, 2, (0, 2), 2),
                _p("2g.12gb+me", GI_PROFILE_2_SLICE_REV1, 6, 2, 11672, 1, (0, 2), 2),
                _p("4g.24gb", GI_PROFILE_4_SLICE, 0, 4, 23344, 1, (0,), 4),
            ),
            (0x20B710DE,),
        ),
    )
}


def product_for_pci_device_id(pci_device_id: int) -> MigProduct | None:
    """The MIG product for a combined PCI device/vendor id such as ``0x233010DE``; None if not MIG-capable."""
    for product in PRODUCTS.values():
        if pci_device_id in product.pci_device_ids:
            return product
    return None


def gpu_instance_id(product: MigProduct, start: int, size: int) -> int:
    """The GPU-instance id NVML-style drivers give an instance at ``start`` of ``size`` memory slices.

    Ids number the nodes of the binary slice tree: the whole GPU is 0, then halves, quarters, eighths.
    Instances that can coexist never overlap, so they never share an id.
    """
    first_at_level = product.memory_slices // size - 1
    return first_at_level + start // size
