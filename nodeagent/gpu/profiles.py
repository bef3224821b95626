"""MIG GPU-instance profile tables per product, as plain data (facts and sources: nodeagent/gpu/FACTS.md).

Pure: no I/O, no pynvml import. The NVML profile constants are repeated here by value (tests check them
against pynvml) so planners can read the tables without loading NVML. The simulator serves these tables,
and the adapter falls back to them when a driver does not answer profile queries.

Each row carries what ``nvidia-smi mig -lgip`` shows: memory (MiB, as NVML reports it), multiprocessors,
copy engines, decoders, encoders, JPEG and OFA engines. Memory is the driver's figure and moves a little
between driver releases; that is part of the table: ``MigProduct.memory_tolerance_mib`` says how far a
driver may differ and ``driver_memory`` pins the figures known to change with a driver release.
Rows whose figures are derived rather than measured say so (``measured=False``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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
GI_PROFILE_1_SLICE_GFX = 0xA  # graphics-capable (+gfx)
GI_PROFILE_2_SLICE_GFX = 0xB
GI_PROFILE_4_SLICE_GFX = 0xC
GI_PROFILE_1_SLICE_NO_ME = 0xD  # without media engines (-me)
GI_PROFILE_2_SLICE_NO_ME = 0xE
GI_PROFILE_1_SLICE_ALL_ME = 0xF  # with all media engines of the GPU (+me.all)
GI_PROFILE_2_SLICE_ALL_ME = 0x10
GI_PROFILE_3_SLICE_GFX = 0x11
GI_PROFILE_COUNT = 0x12

# NVML_COMPUTE_INSTANCE_PROFILE_* for a compute instance covering the whole GI, by compute slices
CI_PROFILE_FOR_SLICES: dict[int, int] = {1: 0x0, 2: 0x1, 3: 0x2, 4: 0x3, 7: 0x4, 8: 0x5, 6: 0x6}

GIB = 1024  # MiB


@dataclass(frozen=True)
class ProfileSpec:
    """One row of ``nvidia-smi mig -lgip``: the profile and its engines."""

    profile: MigProfile
    multiprocessors: int
    copy_engines: int
    decoders: int
    jpeg: int
    ofa: int
    encoders: int = 0
    measured: bool = True  # False: derived from the profile name and the product, not read off a driver
    min_driver: int = 0  # first driver branch (e.g. 525) that offers it; 0 = every MIG driver

    @property
    def name(self) -> str:
        return self.profile.name


@dataclass(frozen=True)
class MigProduct:
    """One MIG-capable product: its slice geometry and GI profiles."""

    key: str  # "A100-40GB"
    memory_slices: int
    compute_slices: int
    specs: tuple[ProfileSpec, ...]
    pci_device_ids: tuple[int, ...]
    total_memory_mib: int  # what nvmlDeviceGetMemoryInfo reports for the whole GPU
    memory_tolerance_mib: int = 11  # how far a driver's profile memory may differ from the table (0.01 GiB)
    driver_memory: tuple[tuple[int, str, int], ...] = ()  # (from driver branch, profile, MiB)

    @property
    def profiles(self) -> tuple[MigProfile, ...]:
        return tuple(s.profile for s in self.specs)

    @property
    def max_mig_devices(self) -> int:
        return self.compute_slices

    def profile(self, name: str) -> MigProfile | None:
        spec = self.spec(name)
        return None if spec is None else spec.profile

    def spec(self, name: str) -> ProfileSpec | None:
        for s in self.specs:
            if s.profile.name == name:
                return s
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

    def specs_for_driver(self, driver_version: str) -> tuple[ProfileSpec, ...]:
        """The rows a driver of that version offers, with that driver's memory figures."""
        branch = driver_branch(driver_version)
        out: list[ProfileSpec] = []
        for s in self.specs:
            if s.min_driver and branch < s.min_driver:
                continue
            mib = self.memory_mib(s.profile.name, driver_version)
            out.append(s if mib == s.profile.memory_mib else replace(s, profile=replace(s.profile, memory_mib=mib)))
        return tuple(out)

    def memory_mib(self, name: str, driver_version: str) -> int:
        """The profile's memory on that driver (the table's figure unless a driver release changed it)."""
        spec = self.spec(name)
        if spec is None:
            raise KeyError(name)
        branch = driver_branch(driver_version)
        mib = spec.profile.memory_mib
        for since, prof, value in sorted(self.driver_memory):
            if prof == name and branch >= since:
                mib = value
        return mib

    def memory_matches(self, name: str, mib: int, driver_version: str) -> bool:
        """``mib`` is what a driver of that version may report for the profile."""
        return abs(mib - self.memory_mib(name, driver_version)) <= self.memory_tolerance_mib


def driver_branch(driver_version: str) -> int:
    """``"550.127.05"`` → 550; 0 when unparsable."""
    head = driver_version.split(".", 1)[0]
    return int(head) if head.isdigit() else 0


def resource_name(profile: str) -> str:
    """The extended-resource name nodeagent and NVIDIA's device plugin (mixed strategy) give a profile:
    ``1g.24gb+gfx`` → ``nvidia.com/mig-1g.24gb.gfx`` (``+`` is not allowed in resource names)."""
    return "nvidia.com/mig-" + profile.replace("+", ".")


def _row(
    name: str, index: int, pid: int, slices: int, mib: int, count: int, starts: tuple[int, ...], size: int,
    sm: int, ce: int, dec: int, jpeg: int = 0, ofa: int = 0, *, measured: bool = True, min_driver: int = 0,
) -> ProfileSpec:
    return ProfileSpec(
        MigProfile(
            name=name,
            gi_profile_id=index,
            id=pid,
            slice_count=slices,
            memory_mib=mib,
            instance_count=count,
            placement_starts=starts,
            placement_size=size,
        ),
        multiprocessors=sm,
        copy_engines=ce,
        decoders=dec,
        jpeg=jpeg,
        ofa=ofa,
        measured=measured,
        min_driver=min_driver,
    )


_ALL7 = (0, 1, 2, 3, 4, 5, 6)


@dataclass(frozen=True)
class _Eighths:
    """Figures of the 8-memory-slice / 7-compute-slice layout (A100, H100, H200, B200 and kin): the seven
    profiles ``1g``, ``1g+me``, ``1g`` double memory, ``2g``, ``3g``, ``4g``, ``7g`` in that order."""

    names: tuple[str, str, str, str, str, str]  # 1g, 1g double, 2g, 3g, 4g, 7g
    memory: tuple[int, int, int, int, int, int]
    sm: tuple[int, int, int, int, int, int]
    ce: tuple[int, int, int, int, int, int]
    dec: tuple[int, int, int, int, int, int, int]  # also 1g+me (second)
    jpeg: tuple[int, int, int, int, int, int, int]
    ofa_7g: int = 1
    measured: bool = True
    double_min_driver: int = 0

    def rows(self) -> tuple[ProfileSpec, ...]:
        one, double, two, three, four, seven = self.names
        m, sm, ce, dec, jpeg = self.memory, self.sm, self.ce, self.dec, self.jpeg
        ms = self.measured
        return (
            _row(one, GI_PROFILE_1_SLICE, 19, 1, m[0], 7, _ALL7, 1, sm[0], ce[0], dec[0], jpeg[0], 0, measured=ms),
            _row(one + "+me", GI_PROFILE_1_SLICE_REV1, 20, 1, m[0], 1, _ALL7, 1, sm[0], ce[0], dec[1], jpeg[1], 1,
                 measured=ms),
            _row(double, GI_PROFILE_1_SLICE_REV2, 15, 1, m[1], 4, (0, 2, 4, 6), 2, sm[1], ce[1], dec[2], jpeg[2], 0,
                 min_driver=self.double_min_driver, measured=ms),
            _row(two, GI_PROFILE_2_SLICE, 14, 2, m[2], 3, (0, 2, 4), 2, sm[2], ce[2], dec[3], jpeg[3], 0, measured=ms),
            _row(three, GI_PROFILE_3_SLICE, 9, 3, m[3], 2, (0, 4), 4, sm[3], ce[3], dec[4], jpeg[4], 0, measured=ms),
            _row(four, GI_PROFILE_4_SLICE, 5, 4, m[4], 1, (0,), 4, sm[4], ce[4], dec[5], jpeg[5], 0, measured=ms),
            _row(seven, GI_PROFILE_7_SLICE, 0, 7, m[5], 1, (0,), 8, sm[5], ce[5], dec[6], jpeg[6], self.ofa_7g, measured=ms),
        )


_AMPERE_SM = (14, 14, 28, 42, 56, 98)
_AMPERE_CE = (1, 1, 2, 3, 4, 7)
_AMPERE_DEC = (0, 1, 1, 1, 2, 2, 5)
_AMPERE_JPEG = (0, 1, 0, 0, 0, 0, 1)
_HOPPER_SM = (16, 26, 32, 60, 64, 132)
_HOPPER_CE = (1, 1, 2, 3, 4, 8)
_HOPPER_DEC = (1, 1, 1, 2, 3, 4, 7)
_BLACKWELL_SM = (18, 18, 36, 54, 72, 148)  # 1g measured (18 SM); the rest scaled by compute slices
_BLACKWELL_CE = (2, 2, 4, 6, 8, 14)  # 1g measured (2 CE); the rest scaled


def _hopper(names: tuple[str, str, str, str, str, str], memory: tuple[int, int, int, int, int, int],
            *, measured: bool = True) -> tuple[ProfileSpec, ...]:
    return _Eighths(names, memory, _HOPPER_SM, _HOPPER_CE, _HOPPER_DEC, _HOPPER_DEC, measured=measured).rows()


def _blackwell(names: tuple[str, str, str, str, str, str], memory: tuple[int, int, int, int, int, int]
               ) -> tuple[ProfileSpec, ...]:
    return _Eighths(names, memory, _BLACKWELL_SM, _BLACKWELL_CE, _HOPPER_DEC, _HOPPER_DEC, measured=False).rows()


def _rtx_pro_6000() -> tuple[ProfileSpec, ...]:
    """RTX PRO 6000 Blackwell: 4 memory and 4 compute slices, 46 SMs each; graphics (+gfx), no-media (-me)
    and all-media (+me.all) variants of the compute profiles."""
    q, h, w = 24192, 48640, 97280  # memory of 1, 2 and 4 slices (derived)
    one, two, four = (0, 1, 2, 3), (0, 2), (0,)
    return (
        _row("1g.24gb", GI_PROFILE_1_SLICE, 14, 1, q, 4, one, 1, 46, 1, 1, 1, 0),
        _row("1g.24gb+me", GI_PROFILE_1_SLICE_REV1, 21, 1, q, 1, one, 1, 46, 1, 1, 1, 1),
        _row("1g.24gb+gfx", GI_PROFILE_1_SLICE_GFX, 47, 1, q, 4, one, 1, 46, 1, 1, 1, 0),
        _row("1g.24gb-me", GI_PROFILE_1_SLICE_NO_ME, 67, 1, q, 4, one, 1, 46, 1, 0, 0, 0, measured=False),
        _row("1g.24gb+me.all", GI_PROFILE_1_SLICE_ALL_ME, 65, 1, q, 1, one, 1, 46, 1, 4, 4, 1),
        _row("2g.48gb", GI_PROFILE_2_SLICE, 5, 2, h, 2, two, 2, 92, 2, 2, 2, 0),
        _row("2g.48gb+gfx", GI_PROFILE_2_SLICE_GFX, 35, 2, h, 2, two, 2, 92, 2, 2, 2, 0, measured=False),
        _row("2g.48gb-me", GI_PROFILE_2_SLICE_NO_ME, 66, 2, h, 2, two, 2, 92, 2, 0, 0, 0, measured=False),
        _row("2g.48gb+me.all", GI_PROFILE_2_SLICE_ALL_ME, 64, 2, h, 1, two, 2, 92, 2, 4, 4, 1, measured=False),
        _row("4g.96gb", GI_PROFILE_4_SLICE, 0, 4, w, 1, four, 4, 184, 4, 4, 4, 1),
        _row("4g.96gb+gfx", GI_PROFILE_4_SLICE_GFX, 32, 4, w, 1, four, 4, 184, 4, 4, 4, 1, measured=False),
    )


def _a30() -> tuple[ProfileSpec, ...]:
    one, two = (0, 1, 2, 3), (0, 2)
    return (
        _row("1g.6gb", GI_PROFILE_1_SLICE, 14, 1, 5952, 4, one, 1, 14, 1, 1, 0, 0),
        _row("1g.6gb+me", GI_PROFILE_1_SLICE_REV1, 21, 1, 5952, 1, one, 1, 14, 1, 1, 1, 1),
        _row("2g.12gb", GI_PROFILE_2_SLICE, 5, 2, 11968, 2, two, 2, 28, 2, 2, 0, 0),
        _row("2g.12gb+me", GI_PROFILE_2_SLICE_REV1, 6, 2, 11968, 1, two, 2, 28, 2, 2, 1, 1),
        _row("4g.24gb", GI_PROFILE_4_SLICE, 0, 4, 24064, 1, (0,), 4, 56, 4, 4, 1, 1),
    )


def _g(gib: float) -> int:
    return round(gib * GIB)


_H100 = (0x233010DE, 0x233110DE, 0x232210DE, 0x232410DE)
_96GB_NAMES = ("1g.12gb", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb")
_96GB_MEMORY = (_g(11.0), _g(22.0), _g(22.0), _g(47.25), _g(47.25), _g(95.0))  # derived (H100 NVL figures)

PRODUCTS: dict[str, MigProduct] = {
    p.key: p
    for p in (
        MigProduct(
            "A100-40GB", 8, 7,
            _Eighths(("1g.5gb", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"),
                     (4864, 9856, 9856, 19968, 19968, 40192), _AMPERE_SM, _AMPERE_CE, _AMPERE_DEC,
                     _AMPERE_JPEG).rows(),
            (0x20B010DE, 0x20B110DE, 0x20F110DE, 0x20F610DE),
            total_memory_mib=40960,
        ),
        MigProduct(
            "A100-80GB", 8, 7,
            _Eighths(("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
                     (9728, 19968, 19968, 40192, 40192, 80896), _AMPERE_SM, _AMPERE_CE, _AMPERE_DEC,
                     _AMPERE_JPEG, double_min_driver=525).rows(),
            (0x20B210DE, 0x20B510DE, 0x20F310DE, 0x20F510DE),
            total_memory_mib=81920,
        ),
        MigProduct(
            "H100-80GB", 8, 7,
            _hopper(("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
                    (9984, 20096, 20096, 40448, 40448, 81152)),
            _H100, total_memory_mib=81559,
        ),
        MigProduct(
            "H200-141GB", 8, 7,
            _hopper(("1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"),
                    (16384, 33024, 33024, 71168, 71168, 143104)),
            (0x233510DE, 0x233B10DE), total_memory_mib=143771,
        ),
        MigProduct("A30-24GB", 4, 4, _a30(), (0x20B710DE,), total_memory_mib=24576),
        MigProduct(
            "H100-NVL", 8, 7,
            _hopper(("1g.12gb", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb"),
                    (11008, 22144, 22144, 47488, 47488, 95360)),
            (0x232110DE, 0x233A10DE), total_memory_mib=95830,
        ),
        MigProduct("H100-96GB", 8, 7, _hopper(_96GB_NAMES, _96GB_MEMORY, measured=False),
                   (0x233D10DE, 0x234210DE), total_memory_mib=97871),
        MigProduct("H20", 8, 7, _hopper(_96GB_NAMES, _96GB_MEMORY, measured=False), (0x232910DE,),
                   total_memory_mib=97871),
        MigProduct(
            "GH200-144GB", 8, 7,
            _hopper(("1g.18gb", "1g.36gb", "2g.36gb", "3g.72gb", "4g.72gb", "7g.144gb"),
                    (17920, 36096, 36096, _g(70.5), _g(70.5), _g(141.0)), measured=False),
            (0x234810DE,), total_memory_mib=146432,
        ),
        MigProduct(
            "B200", 8, 7,
            _blackwell(("1g.23gb", "1g.45gb", "2g.45gb", "3g.90gb", "4g.90gb", "7g.180gb"),
                       (_g(22.0), 45312, 45312, _g(88.5), _g(88.5), _g(177.0))),
            (0x290110DE,), total_memory_mib=183359,
            # 1g.23gb is 22.00 GiB on one driver release and 20.50 GiB on a later one
            driver_memory=((575, "1g.23gb", _g(20.5)), (575, "1g.23gb+me", _g(20.5))),
        ),
        MigProduct(
            "GB200", 8, 7,
            _blackwell(("1g.23gb", "1g.47gb", "2g.47gb", "3g.93gb", "4g.93gb", "7g.186gb"),
                       (_g(22.5), _g(46.0), _g(46.0), _g(91.5), _g(91.5), _g(183.0))),
            (0x294110DE,), total_memory_mib=189471,
        ),
        MigProduct(
            "B300", 8, 7,
            _blackwell(("1g.34gb", "1g.67gb", "2g.67gb", "3g.135gb", "4g.135gb", "7g.269gb"),
                       (_g(33.5), _g(66.5), _g(66.5), _g(134.0), _g(134.0), _g(268.0))),
            (0x318210DE,), total_memory_mib=_g(270.0),
        ),
        MigProduct(
            "GB300", 8, 7,
            _blackwell(("1g.35gb", "1g.70gb", "2g.70gb", "3g.139gb", "4g.139gb", "7g.278gb"),
                       (_g(34.5), _g(69.0), _g(69.0), _g(138.0), _g(138.0), _g(277.0))),
            (0x31C210DE,), total_memory_mib=_g(278.0),
        ),
        MigProduct("RTX-PRO-6000", 4, 4, _rtx_pro_6000(), (0x2BB510DE,), total_memory_mib=97887),
    )
}

# GPUs without MIG that the simulator models (nvmlDeviceGetMigMode answers NOT_SUPPORTED)
NON_MIG_PCI_DEVICE_IDS: dict[str, int] = {
    "L40S": 0x26B910DE,
    "L40": 0x26B510DE,
    "L4": 0x27B810DE,
    "A10": 0x223610DE,
    "T4": 0x1EB810DE,
}


def product_for_pci_device_id(pci_device_id: int) -> MigProduct | None:
    """The MIG product for a combined PCI device/vendor id such as ``0x233010DE``; None if not MIG-capable."""
    for product in PRODUCTS.values():
        if pci_device_id in product.pci_device_ids:
            return product
    return None


def gpu_instance_id(product: MigProduct, start: int, size: int) -> int:
    """The GPU-instance id of the node of the binary memory-slice tree at ``start`` of ``size`` slices:
    the whole GPU is 0, then halves, quarters, eighths. Instances that can coexist never overlap, so they
    never share a node. Drivers number one-slice instances in other orders too (see the simulator); code
    outside the simulator must never key on these ids."""
    first_at_level = product.memory_slices // size - 1
    return first_at_level + start // size
