"""The NVML adapter: the only code that calls NVML.

``NvmlAdapter`` receives the NVML module by injection — the real ``pynvml`` or
``nodeagent.gpu.sim.SimulatedNvml`` — and runs the same code on both. It turns NVML answers into the pure
``Inventory`` model and NVML failures into ``nodeagent.errors`` classes naming the GPU (``raise ... from``).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import subprocess
import threading
from types import TracebackType
from typing import Any

from nodeagent.errors import (
    GpuBusyError,
    GpuLostError,
    InputError,
    InsufficientResourcesError,
    NvmlError,
    NvmlNotFoundError,
)
from nodeagent.gpu.inventory import Gpu as GpuInfo
from nodeagent.gpu.inventory import GpuProcess, Inventory, Link, LinkKind, MigDevice, MigProfile
from nodeagent.gpu.profiles import CI_PROFILE_FOR_SLICES, product_for_pci_device_id
from nodeagent.hostpaths import HostPaths

log = logging.getLogger(__name__)

NOT_FOUND_MESSAGE = (
    "NVML library not found (libnvidia-ml.so.1); is the NVIDIA driver installed? Try --simulate dgx-h100"
)
DRIVER_NOT_LOADED_MESSAGE = "NVIDIA driver not loaded (NVML cannot reach it); is the nvidia kernel module loaded?"

# NVML return codes used here (same values as pynvml's NVML_ERROR_*)
_SUCCESS = 0
_INVALID_ARGUMENT = 2
_NOT_SUPPORTED = 3
_NOT_FOUND = 6
_DRIVER_NOT_LOADED = 9
_TIMEOUT = 10
_LIBRARY_NOT_FOUND = 12
_FUNCTION_NOT_FOUND = 13
_GPU_IS_LOST = 15
_RESET_REQUIRED = 16
_IN_USE = 19
_INSUFFICIENT_RESOURCES = 23
_NOT_READY = 27
_INVALID_STATE = 29
_NO_ID = 0xFFFFFFFF

_ARCHITECTURES = {5: "volta", 6: "turing", 7: "ampere", 8: "ada", 9: "hopper", 10: "blackwell"}
_TOPOLOGY_KINDS = {
    0: LinkKind.SAME_BOARD,
    10: LinkKind.SINGLE_SWITCH,
    20: LinkKind.MULTI_SWITCH,
    30: LinkKind.HOST_BRIDGE,
    40: LinkKind.SAME_CPU,
    50: LinkKind.CROSS_CPU,
}
_XID_EVENT = 0x8
_ECC_SINGLE_EVENT = 0x1
_ECC_DOUBLE_EVENT = 0x2
_WATCHED_EVENTS = _XID_EVENT | _ECC_DOUBLE_EVENT | _ECC_SINGLE_EVENT


@dataclasses.dataclass(frozen=True)
class GpuEvent:
    """One health-relevant NVML event."""

    gpu_index: int | None
    kind: str  # "xid" | "ecc-double" | "ecc-single" | "other"
    xid: int = 0  # XID code for kind "xid" (79 = fallen off the bus)
    event_type: int = 0  # raw nvmlEventType bits
    gi_id: int | None = None  # GPU instance the event is about, when NVML says
    ci_id: int | None = None


@dataclasses.dataclass(frozen=True)
class GpuMetrics:
    """Point-in-time readings of one GPU."""

    index: int
    utilisation_pct: int
    memory_used_mib: int
    memory_free_mib: int
    memory_total_mib: int
    temperature_c: int
    power_w: float


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlAdapter:
    """NVML for the rest of nodeagent. Methods are blocking; call them from a thread in async code.

    ``nvml`` is the pynvml module or a simulator providing the same names. ``nvmlInit`` runs in the
    constructor; ``close()`` (or ``with``) shuts NVML down.
    """

    def __init__(self, nvml: Any, paths: HostPaths | None = None) -> None:
        self.nvml = nvml
        self.paths = paths or HostPaths()
        self._handles: dict[int, Any] = {}
        self._uuids: dict[int, str] = {}
        self._last: dict[int, GpuInfo] = {}
        self._event_set: Any = None
        self._events_lock = threading.Lock()
        self._closed = False
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as e:
            raise self._convert(e, "nvmlInit", None) from e

    # --- lifecycle ----------------------------------------------------------------------------
    @property
    def simulated(self) -> bool:
        return hasattr(self.nvml, "simResetGpu")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            if self._event_set is not None:
                self.nvml.nvmlEventSetFree(self._event_set)
        with contextlib.suppress(Exception):
            self.nvml.nvmlShutdown()

    def __enter__(self) -> NvmlAdapter:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # --- error conversion ---------------------------------------------------------------------
    def _label(self, index: int | None) -> str:
        if index is None:
            return "NVML"
        uuid = self._uuids.get(index)
        return f"GPU {index} ({uuid})" if uuid else f"GPU {index}"

    def _convert(self, e: Exception, fn: str, index: int | None) -> NvmlError:
        code = int(getattr(e, "value", 0) or 0)
        subject = self._uuids.get(index, str(index)) if index is not None else None
        if code == _LIBRARY_NOT_FOUND:
            return NvmlNotFoundError(NOT_FOUND_MESSAGE, code=code)
        if code == _DRIVER_NOT_LOADED:
            return NvmlNotFoundError(DRIVER_NOT_LOADED_MESSAGE, code=code)
        where = self._label(index)
        msg = f"{where}: {fn} failed: {e}"
        if code == _GPU_IS_LOST:
            return GpuLostError(f"{where} is lost (fell off the bus): {fn} failed", subject=subject, code=code)
        if code == _IN_USE:
            return GpuBusyError(f"{where} is in use: {fn} failed: {e}", subject=subject, code=code)
        if code == _INSUFFICIENT_RESOURCES:
            return InsufficientResourcesError(msg, subject=subject, code=code)
        return NvmlError(msg, subject=subject, code=code, retryable=code in (_TIMEOUT, _NOT_READY))

    def _call(self, fn: str, *args: Any, gpu: int | None = None) -> Any:
        try:
            return getattr(self.nvml, fn)(*args)
        except self.nvml.NVMLError as e:
            raise self._convert(e, fn, gpu) from e

    def _try(self, fn: str, *args: Any, gpu: int | None = None) -> Any:
        """Like ``_call`` but None for answers that mean "not here": not supported/found, no such function."""
        func = getattr(self.nvml, fn, None)
        if func is None:
            return None
        try:
            return func(*args)
        except self.nvml.NVMLError as e:
            if int(getattr(e, "value", 0) or 0) in (
                _NOT_SUPPORTED,
                _NOT_FOUND,
                _FUNCTION_NOT_FOUND,
                _INVALID_ARGUMENT,
                _INVALID_STATE,
            ):
                return None
            raise self._convert(e, fn, gpu) from e

    def _handle(self, index: int) -> Any:
        h = self._handles.get(index)
        if h is None:
            h = self._call("nvmlDeviceGetHandleByIndex", index, gpu=index)
            self._handles[index] = h
        return h

    # --- discovery ----------------------------------------------------------------------------
    def device_count(self) -> int:
        return int(self._call("nvmlDeviceGetCount"))

    def discover(self) -> Inventory:
        """Everything NVML knows about the node's GPUs, as one Inventory."""
        driver = _text(self._call("nvmlSystemGetDriverVersion"))
        cuda = int(self._call("nvmlSystemGetCudaDriverVersion"))
        gpus = []
        for index in range(self.device_count()):
            try:
                gpu = self.describe_gpu(index)
            except GpuLostError:
                gpu = self._lost_gpu(index)
            gpus.append(gpu)
        return Inventory(
            driver_version=driver, cuda_driver_version=cuda, gpus=tuple(gpus), links=self._links(gpus)
        )

    def _lost_gpu(self, index: int) -> GpuInfo:
        last = self._last.get(index)
        if last is not None:
            return dataclasses.replace(last, lost=True, processes=(), mig_devices=(), bare_gpu_instances=())
        return GpuInfo(
            index=index,
            uuid=self._uuids.get(index, ""),
            name="unknown (lost)",
            pci_bus_id="",
            pci_device_id=0,
            memory_mib=0,
            numa_node=None,
            compute_major=0,
            compute_minor=0,
            minor_number=index,
            architecture="unknown",
            lost=True,
        )

    def describe_gpu(self, index: int) -> GpuInfo:
        """One GPU with its MIG state, profiles, MIG devices and processes."""
        h = self._handle(index)
        uuid = _text(self._call("nvmlDeviceGetUUID", h, gpu=index))
        self._uuids[index] = uuid
        pci = self._call("nvmlDeviceGetPciInfo", h, gpu=index)
        bus_id = _text(pci.busId)
        mem = self._call("nvmlDeviceGetMemoryInfo", h, gpu=index)
        major, minor = self._call("nvmlDeviceGetCudaComputeCapability", h, gpu=index)
        arch = self._try("nvmlDeviceGetArchitecture", h, gpu=index)
        minor_number = self._try("nvmlDeviceGetMinorNumber", h, gpu=index)
        mig = self._try("nvmlDeviceGetMigMode", h, gpu=index)
        mig_capable = mig is not None
        current = bool(mig[0]) if mig else False
        pending = bool(mig[1]) if mig else False
        profiles = self._mig_profiles(index, int(pci.pciDeviceId)) if mig_capable else ()
        devices, bare = self._mig_devices(index, profiles) if current else ((), ())
        gpu = GpuInfo(
            index=index,
            uuid=uuid,
            name=_text(self._call("nvmlDeviceGetName", h, gpu=index)),
            pci_bus_id=bus_id,
            pci_device_id=int(pci.pciDeviceId),
            memory_mib=int(mem.total) // (1024 * 1024),
            numa_node=self._numa_node(index, bus_id),
            compute_major=int(major),
            compute_minor=int(minor),
            minor_number=int(minor_number) if minor_number is not None else index,
            architecture=_ARCHITECTURES.get(int(arch), "unknown") if arch is not None else "unknown",
            mig_capable=mig_capable,
            mig_current=current,
            mig_pending=pending,
            mig_profiles=profiles,
            mig_devices=devices,
            processes=self.processes(index),
            bare_gpu_instances=bare,
        )
        self._last[index] = gpu
        return gpu

    def _numa_node(self, index: int, bus_id: str) -> int | None:
        # sysfs names devices "0000:07:00.0" (4-digit domain, lower case); NVML says "00000000:07:00.0"
        sysfs = self.paths.sys_pci_devices / bus_id[-12:].lower() / "numa_node"
        try:
            value = int(sysfs.read_text().strip())
            return value if value >= 0 else None
        except (OSError, ValueError):
            pass
        node = self._try("nvmlDeviceGetNumaNodeId", self._handle(index), gpu=index)
        return int(node) if node is not None and int(node) >= 0 else None

    def _mig_profiles(self, index: int, pci_device_id: int) -> tuple[MigProfile, ...]:
        h = self._handle(index)
        out: list[MigProfile] = []
        table = product_for_pci_device_id(pci_device_id)
        for gi_index in range(int(self.nvml.NVML_GPU_INSTANCE_PROFILE_COUNT)):
            info = self._try("nvmlDeviceGetGpuInstanceProfileInfo", h, gi_index, gpu=index)
            if info is None or int(info.instanceCount) == 0:
                continue
            name = _text(getattr(info, "name", b"")).removeprefix("MIG ").strip()
            known = table.profile_by_index(gi_index) if table else None
            if not name:
                name = known.name if known else f"profile-{int(info.id)}"
            starts, size = self._placements(index, int(info.id))
            if not starts and known is not None:
                starts, size = known.placement_starts, known.placement_size
            out.append(
                MigProfile(
                    name=name,
                    gi_profile_id=gi_index,
                    id=int(info.id),
                    slice_count=int(info.sliceCount),
                    memory_mib=int(info.memorySizeMB),
                    instance_count=int(info.instanceCount),
                    placement_starts=starts,
                    placement_size=size,
                )
            )
        if not out and table is not None:
            log.debug("GPU %d answers no MIG profile queries; using the built-in table", index)
            return table.profiles
        return tuple(out)

    def _placements(self, index: int, profile_id: int) -> tuple[tuple[int, ...], int]:
        h = self._handle(index)
        count = ctypes.c_uint(0)
        if self._try("nvmlDeviceGetGpuInstancePossiblePlacements", h, profile_id, None, ctypes.byref(count)) is None:
            return (), 0
        if count.value == 0:
            return (), 0
        array = (self.nvml.c_nvmlGpuInstancePlacement_t * count.value)()
        self._call("nvmlDeviceGetGpuInstancePossiblePlacements", h, profile_id, array, ctypes.byref(count), gpu=index)
        placements = [(int(array[i].start), int(array[i].size)) for i in range(count.value)]
        return tuple(s for s, _ in placements), placements[0][1]

    def _mig_devices(
        self, index: int, profiles: tuple[MigProfile, ...]
    ) -> tuple[tuple[MigDevice, ...], tuple[MigDevice, ...]]:
        h = self._handle(index)
        by_id = {p.id: p for p in profiles}
        # every GPU instance, by profile
        gis: dict[int, tuple[MigProfile | None, int, int]] = {}  # gi id -> (profile, start, size)
        for prof in profiles:
            n = max(prof.instance_count, 1)
            array = (self.nvml.c_nvmlGpuInstance_t * n)()
            count = ctypes.c_uint(n)
            if self._try("nvmlDeviceGetGpuInstances", h, prof.id, array, ctypes.byref(count), gpu=index) is None:
                continue
            for i in range(count.value):
                info = self._call("nvmlGpuInstanceGetInfo", array[i], gpu=index)
                gis[int(info.id)] = (by_id.get(int(info.profileId)), int(info.placement.start), int(info.placement.size))
        # every MIG device (GPU instance + compute instance) with its UUID
        devices: list[MigDevice] = []
        seen: set[int] = set()
        max_count = self._try("nvmlDeviceGetMaxMigDeviceCount", h, gpu=index) or 0
        for i in range(int(max_count)):
            mh = self._try("nvmlDeviceGetMigDeviceHandleByIndex", h, i, gpu=index)
            if mh is None:
                continue
            gi_id = int(self._call("nvmlDeviceGetGpuInstanceId", mh, gpu=index))
            ci_id = int(self._call("nvmlDeviceGetComputeInstanceId", mh, gpu=index))
            if gi_id not in gis:
                gi = self._call("nvmlDeviceGetGpuInstanceById", h, gi_id, gpu=index)
                info = self._call("nvmlGpuInstanceGetInfo", gi, gpu=index)
                gis[gi_id] = (by_id.get(int(info.profileId)), int(info.placement.start), int(info.placement.size))
            gprof, start, size = gis[gi_id]
            mem = self._call("nvmlDeviceGetMemoryInfo", mh, gpu=index)
            devices.append(
                MigDevice(
                    gpu_index=index,
                    gi_id=gi_id,
                    ci_id=ci_id,
                    profile=gprof.name if gprof else "unknown",
                    placement_start=start,
                    placement_size=size,
                    memory_mib=int(mem.total) // (1024 * 1024),
                    uuid=_text(self._call("nvmlDeviceGetUUID", mh, gpu=index)),
                )
            )
            seen.add(gi_id)
        bare = tuple(
            MigDevice(index, gi_id, -1, p.name if p else "unknown", start, size, p.memory_mib if p else 0, "")
            for gi_id, (p, start, size) in sorted(gis.items())
            if gi_id not in seen
        )
        devices.sort(key=lambda d: (d.placement_start, d.gi_id, d.ci_id))
        return tuple(devices), bare

    def _links(self, gpus: list[GpuInfo]) -> tuple[Link, ...]:
        alive = [g for g in gpus if not g.lost]
        by_bus = {g.pci_bus_id.upper(): g.index for g in alive}
        peer_links: dict[tuple[int, int], int] = {}
        switch_links: dict[int, int] = {}
        for g in alive:
            h = self._handle(g.index)
            for link in range(int(self.nvml.NVML_NVLINK_MAX_LINKS)):
                try:
                    active = self.nvml.nvmlDeviceGetNvLinkState(h, link)
                except self.nvml.NVMLError as e:
                    if int(getattr(e, "value", 0) or 0) == _GPU_IS_LOST:
                        raise self._convert(e, "nvmlDeviceGetNvLinkState", g.index) from e
                    if link == 0:
                        break  # no NVLink on this GPU
                    continue
                if not active:
                    continue
                remote = self._try("nvmlDeviceGetNvLinkRemotePciInfo", h, link, gpu=g.index)
                remote_bus = _text(remote.busId).upper() if remote is not None else ""
                peer = by_bus.get(remote_bus)
                if peer is not None:
                    key = (min(g.index, peer), max(g.index, peer))
                    peer_links[key] = peer_links.get(key, 0) + 1
                else:
                    kind = self._try("nvmlDeviceGetNvLinkRemoteDeviceType", h, link, gpu=g.index)
                    if kind is None or int(kind) == int(self.nvml.NVML_NVLINK_DEVICE_TYPE_SWITCH):
                        switch_links[g.index] = switch_links.get(g.index, 0) + 1
        links: list[Link] = []
        for i, a in enumerate(alive):
            for b in alive[i + 1 :]:
                # a direct link is counted from both ends
                nv = peer_links.get((a.index, b.index), 0) // 2
                nv += min(switch_links.get(a.index, 0), switch_links.get(b.index, 0))
                if nv:
                    links.append(Link(a.index, b.index, LinkKind.NVLINK, nv))
                    continue
                level = self._call(
                    "nvmlDeviceGetTopologyCommonAncestor", self._handle(a.index), self._handle(b.index), gpu=a.index
                )
                links.append(Link(a.index, b.index, _TOPOLOGY_KINDS.get(int(level), LinkKind.CROSS_CPU)))
        return tuple(links)

    # --- MIG changes --------------------------------------------------------------------------
    def mig_mode(self, index: int) -> tuple[bool, bool]:
        """(current, pending) MIG mode of a GPU."""
        current, pending = self._call("nvmlDeviceGetMigMode", self._handle(index), gpu=index)
        return bool(current), bool(pending)

    def set_mig_mode(self, index: int, enabled: bool) -> bool:
        """Request MIG on/off; True when the change waits for a GPU reset or reboot to take effect."""
        mode = self.nvml.NVML_DEVICE_MIG_ENABLE if enabled else self.nvml.NVML_DEVICE_MIG_DISABLE
        status = int(self._call("nvmlDeviceSetMigMode", self._handle(index), mode, gpu=index))
        if status == _IN_USE:
            raise GpuBusyError(
                f"{self._label(index)} is in use: MIG mode cannot change while processes run",
                subject=self._uuids.get(index, str(index)),
                code=status,
            )
        if status == _RESET_REQUIRED:
            return True
        if status != _SUCCESS:
            raise NvmlError(
                f"{self._label(index)}: MIG mode activation failed with NVML error {status}",
                subject=self._uuids.get(index, str(index)),
                code=status,
            )
        current, _pending = self.mig_mode(index)
        return current != enabled

    def reset_gpu(self, index: int) -> None:
        """GPU reset: applies a pending MIG mode on Ampere; drops all MIG instances."""
        h = self._handle(index)
        if self.simulated:
            self._call("simResetGpu", h, gpu=index)
        else:
            try:
                proc = subprocess.run(
                    ["nvidia-smi", "--gpu-reset", "-i", str(index)],
                    capture_output=True,
                    text=True,
                    timeout=120,
                    check=False,
                )
            except (OSError, subprocess.TimeoutExpired) as e:
                raise NvmlError(f"{self._label(index)}: nvidia-smi --gpu-reset failed: {e}") from e
            if proc.returncode != 0:
                out = (proc.stdout + proc.stderr).strip().splitlines()
                detail = out[-1] if out else f"exit {proc.returncode}"
                cls = GpuBusyError if "in use" in detail.lower() else NvmlError
                raise cls(f"{self._label(index)}: GPU reset failed: {detail}", subject=self._uuids.get(index))
        self._handles.pop(index, None)  # handles may change after a reset

    def offered_profile(self, index: int, profile_name: str) -> MigProfile:
        """The GPU's profile of that name; InputError naming the offered ones if it has none."""
        pci = self._call("nvmlDeviceGetPciInfo", self._handle(index), gpu=index)
        profiles = self._mig_profiles(index, int(pci.pciDeviceId))
        for p in profiles:
            if p.name == profile_name:
                return p
        offered = ", ".join(p.name for p in profiles) or "none"
        raise InputError(
            f"MIG profile {profile_name!r} is not offered by {self._label(index)}; offered: {offered}",
            subject=profile_name,
        )

    def remaining_capacity(self, index: int, profile_name: str) -> int:
        prof = self.offered_profile(index, profile_name)
        return int(self._call("nvmlDeviceGetGpuInstanceRemainingCapacity", self._handle(index), prof.id, gpu=index))

    def create_mig_device(self, index: int, profile_name: str, placement_start: int | None = None) -> MigDevice:
        """Create a GPU instance (at ``placement_start`` or where NVML chooses) with one compute instance
        covering it. If the compute instance cannot be created the GPU instance is removed again."""
        prof = self.offered_profile(index, profile_name)
        h = self._handle(index)
        if placement_start is None:
            gi = self._call("nvmlDeviceCreateGpuInstance", h, prof.id, gpu=index)
        else:
            placement = self.nvml.c_nvmlGpuInstancePlacement_t()
            placement.start = placement_start
            placement.size = prof.placement_size
            gi = self._call("nvmlDeviceCreateGpuInstanceWithPlacement", h, prof.id, ctypes.byref(placement), gpu=index)
        gi_info = self._call("nvmlGpuInstanceGetInfo", gi, gpu=index)
        gi_id = int(gi_info.id)
        try:
            ci_profile = CI_PROFILE_FOR_SLICES[prof.slice_count]
            ci_info = self._call(
                "nvmlGpuInstanceGetComputeInstanceProfileInfo",
                gi,
                ci_profile,
                self.nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
                gpu=index,
            )
            ci = self._call("nvmlGpuInstanceCreateComputeInstance", gi, int(ci_info.id), gpu=index)
            ci_id = int(self._call("nvmlComputeInstanceGetInfo", ci, gpu=index).id)
        except NvmlError:
            with contextlib.suppress(NvmlError):
                self._call("nvmlGpuInstanceDestroy", gi, gpu=index)
            raise
        uuid = ""
        mem_mib = prof.memory_mib
        for i in range(int(self._call("nvmlDeviceGetMaxMigDeviceCount", h, gpu=index))):
            mh = self._try("nvmlDeviceGetMigDeviceHandleByIndex", h, i, gpu=index)
            if mh is None:
                continue
            if (
                int(self._call("nvmlDeviceGetGpuInstanceId", mh, gpu=index)) == gi_id
                and int(self._call("nvmlDeviceGetComputeInstanceId", mh, gpu=index)) == ci_id
            ):
                uuid = _text(self._call("nvmlDeviceGetUUID", mh, gpu=index))
                mem_mib = int(self._call("nvmlDeviceGetMemoryInfo", mh, gpu=index).total) // (1024 * 1024)
                break
        return MigDevice(
            gpu_index=index,
            gi_id=gi_id,
            ci_id=ci_id,
            profile=prof.name,
            placement_start=int(gi_info.placement.start),
            placement_size=int(gi_info.placement.size),
            memory_mib=mem_mib,
            uuid=uuid,
        )

    def destroy_mig_device(self, index: int, gi_id: int) -> None:
        """Destroy a GPU instance and all its compute instances (GpuBusyError while processes use it)."""
        h = self._handle(index)
        gi = self._call("nvmlDeviceGetGpuInstanceById", h, gi_id, gpu=index)
        for ci_profile in sorted(set(CI_PROFILE_FOR_SLICES.values())):
            n = 8
            array = (self.nvml.c_nvmlComputeInstance_t * n)()
            count = ctypes.c_uint(n)
            if self._try("nvmlGpuInstanceGetComputeInstances", gi, ci_profile, array, ctypes.byref(count), gpu=index) is None:
                continue
            for i in range(count.value):
                self._call("nvmlComputeInstanceDestroy", array[i], gpu=index)
        self._call("nvmlGpuInstanceDestroy", gi, gpu=index)

    # --- runtime state ------------------------------------------------------------------------
    def processes(self, index: int) -> tuple[GpuProcess, ...]:
        """Compute processes on the GPU (including those on its MIG devices)."""
        procs = self._call("nvmlDeviceGetComputeRunningProcesses", self._handle(index), gpu=index)
        out = []
        for p in procs:
            pid = int(p.pid)
            name = getattr(p, "name", None) or self._process_name(pid)
            used = getattr(p, "usedGpuMemory", None)
            out.append(GpuProcess(pid=pid, name=str(name), used_memory_mib=int(used or 0) // (1024 * 1024)))
        return tuple(out)

    def _process_name(self, pid: int) -> str:
        try:
            return (self.paths.proc / str(pid) / "comm").read_text().strip()
        except OSError:
            return ""

    def gpu_healthy(self, index: int) -> bool:
        """False when the GPU no longer answers (lost); other NVML errors count as healthy-but-odd."""
        try:
            self._call("nvmlDeviceGetMemoryInfo", self._handle(index), gpu=index)
        except GpuLostError:
            return False
        except NvmlError as e:
            log.debug("health probe of GPU %d: %s", index, e)
        return True

    def metrics(self, index: int) -> GpuMetrics:
        h = self._handle(index)
        util = self._try("nvmlDeviceGetUtilizationRates", h, gpu=index)
        mem = self._call("nvmlDeviceGetMemoryInfo", h, gpu=index)
        temp = self._try("nvmlDeviceGetTemperature", h, self.nvml.NVML_TEMPERATURE_GPU, gpu=index)
        power = self._try("nvmlDeviceGetPowerUsage", h, gpu=index)
        mib = 1024 * 1024
        return GpuMetrics(
            index=index,
            utilisation_pct=int(util.gpu) if util is not None else 0,
            memory_used_mib=int(mem.used) // mib,
            memory_free_mib=int(mem.free) // mib,
            memory_total_mib=int(mem.total) // mib,
            temperature_c=int(temp or 0),
            power_w=round(int(power or 0) / 1000.0, 1),
        )

    # --- events -------------------------------------------------------------------------------
    def _ensure_event_set(self) -> Any:
        if self._event_set is None:
            es = self._call("nvmlEventSetCreate")
            for index in range(self.device_count()):
                h = self._handle(index)
                try:
                    supported = int(self._call("nvmlDeviceGetSupportedEventTypes", h, gpu=index))
                    wanted = supported & _WATCHED_EVENTS
                    if wanted:
                        self._call("nvmlDeviceRegisterEvents", h, wanted, es, gpu=index)
                except NvmlError as e:
                    log.warning("cannot watch events of GPU %d: %s", index, e)
            self._event_set = es
        return self._event_set

    def wait_events(self, timeout_ms: int) -> list[GpuEvent]:
        """Block up to ``timeout_ms`` for XID/ECC events; returns all that arrived (maybe none)."""
        with self._events_lock:
            es = self._ensure_event_set()
            events: list[GpuEvent] = []
            wait = timeout_ms
            while len(events) < 64:
                try:
                    data = self.nvml.nvmlEventSetWait_v2(es, wait)
                except self.nvml.NVMLError as e:
                    if int(getattr(e, "value", 0) or 0) == _TIMEOUT:
                        break
                    raise self._convert(e, "nvmlEventSetWait_v2", None) from e
                events.append(self._event(data))
                wait = 0  # drain what is already queued
            return events

    def _event(self, data: Any) -> GpuEvent:
        index: int | None
        try:
            index = int(self.nvml.nvmlDeviceGetIndex(data.device))
        except Exception:
            index = next((i for i, h in self._handles.items() if _same_handle(h, data.device)), None)
        et = int(data.eventType)
        kind = (
            "xid"
            if et & _XID_EVENT
            else "ecc-double"
            if et & _ECC_DOUBLE_EVENT
            else "ecc-single"
            if et & _ECC_SINGLE_EVENT
            else "other"
        )
        gi = int(data.gpuInstanceId)
        ci = int(data.computeInstanceId)
        return GpuEvent(
            gpu_index=index,
            kind=kind,
            xid=int(data.eventData) if kind == "xid" else 0,
            event_type=et,
            gi_id=None if gi == _NO_ID else gi,
            ci_id=None if ci == _NO_ID else ci,
        )


def _same_handle(a: Any, b: Any) -> bool:
    try:
        return bool(ctypes.cast(a, ctypes.c_void_p).value == ctypes.cast(b, ctypes.c_void_p).value)
    except (TypeError, ctypes.ArgumentError):
        return False
