"""The ``GpuDiscovery`` port over NVML: the node's GPUs as one ``Inventory``.

Profiles and placements come from NVML when it answers (MIG enabled); with MIG disabled NVML answers
NOT_SUPPORTED for profile queries and the built-in table for the product and driver fills in
(``gpu/profiles.py``). An unprivileged caller still gets everything NVML shows it; what needs root
(GPU instances and placements, processes on a MIG-enabled GPU) is named in ``restricted_facts``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import uuid
from typing import Any

from nodeagent import fileio
from nodeagent.errors import GpuLostError, NvmlPermissionError
from nodeagent.gpu.inventory import Fabric, GpuProcess, Inventory, Link, LinkKind, MigDevice, MigProfile
from nodeagent.gpu.inventory import Gpu as GpuInfo
from nodeagent.gpu.nvml_session import (
    _ABSENT,
    FUNCTION_NOT_FOUND,
    GPU_IS_LOST,
    NO_PERMISSION,
    NvmlSession,
    _code_of,
    as_int,
    text,
)
from nodeagent.gpu.ports import GpuResetter
from nodeagent.gpu.profiles import product_for_pci_device_id
from nodeagent.hostpaths import HostPaths

log = logging.getLogger(__name__)

_ARCHITECTURES = {5: "volta", 6: "turing", 7: "ampere", 8: "ada", 9: "hopper", 10: "blackwell"}
_TOPOLOGY_KINDS = {
    0: LinkKind.SAME_BOARD,
    10: LinkKind.SINGLE_SWITCH,
    20: LinkKind.MULTI_SWITCH,
    30: LinkKind.HOST_BRIDGE,
    40: LinkKind.SAME_CPU,
    50: LinkKind.CROSS_CPU,
}
MIB = 1024 * 1024
ARGUMENT_VERSION_MISMATCH = 25  # NVML_ERROR_ARGUMENT_VERSION_MISMATCH
# fabric-info structs of nvmlDeviceGetGpuFabricInfoV, newest first (pynvml's names)
_FABRIC_STRUCTS = ("c_nvmlGpuFabricInfo_v3_t", "c_nvmlGpuFabricInfo_v2_t")

FACT_PLACEMENTS = "MIG placements (nvmlDeviceGetGpuInstancePossiblePlacements)"
FACT_INSTANCES = "GPU instances and their placements (nvmlDeviceGetGpuInstances)"
FACT_PROCESSES = "processes on MIG-enabled GPUs (nvmlDeviceGetComputeRunningProcesses)"


class NvmlDiscovery(NvmlSession):
    """GPU identity, MIG state, profiles, MIG devices, processes and topology."""

    def __init__(self, nvml: Any, paths: HostPaths | None = None, resetter: GpuResetter | None = None) -> None:
        self._last: dict[int, GpuInfo] = {}
        self._driver_version = ""
        super().__init__(nvml, paths, resetter)

    def device_count(self) -> int:
        return int(self._call("nvmlDeviceGetCount"))

    def discover(self, *, partial: bool = False) -> Inventory:
        """Everything NVML knows about the node's GPUs, as one Inventory.

        An unprivileged caller cannot see MIG instances' placements or a MIG GPU's processes: then this
        raises ``NvmlPermissionError`` naming them (planning and applying need them), unless ``partial``
        asks for what can be read (``restricted_facts`` names the rest; unknown placements are -1)."""
        self._restricted.clear()
        driver = text(self._call("nvmlSystemGetDriverVersion"))
        self._driver_version = driver
        cuda = int(self._call("nvmlSystemGetCudaDriverVersion"))
        gpus = []
        for index in range(self.device_count()):
            try:
                gpu = self.describe_gpu(index)
            except GpuLostError:
                gpu = self._lost_gpu(index)
            gpus.append(gpu)
        inventory = Inventory(
            driver_version=driver, cuda_driver_version=cuda, gpus=tuple(gpus), links=self._links(gpus)
        )
        if self._restricted and not partial:
            raise NvmlPermissionError(
                "NVML shows these only to root: " + "; ".join(self.restricted_facts)
                + " (run as root; `nodeagent discover` shows the rest)",
                code=NO_PERMISSION,
            )
        return inventory

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
        uuid = text(self._call("nvmlDeviceGetUUID", h, gpu=index))
        self._uuids[index] = uuid
        pci = self._call("nvmlDeviceGetPciInfo", h, gpu=index)
        bus_id = text(pci.busId)
        mem = self._call("nvmlDeviceGetMemoryInfo", h, gpu=index)
        major, minor = self._call("nvmlDeviceGetCudaComputeCapability", h, gpu=index)
        arch = self._try("nvmlDeviceGetArchitecture", h, gpu=index)
        minor_number = self._try("nvmlDeviceGetMinorNumber", h, gpu=index)
        mig = self._try("nvmlDeviceGetMigMode", h, gpu=index)
        persistence = self._persistence(h, gpu=index)
        mig_capable = mig is not None
        current = bool(as_int(mig[0])) if mig else False
        pending = bool(as_int(mig[1])) if mig else False
        profiles = self._mig_profiles(index, int(pci.pciDeviceId)) if mig_capable else ()
        devices, bare = self._mig_devices(index, profiles) if current else ((), ())
        try:
            procs = self.processes(index)
        except NvmlPermissionError:
            self._restricted.add(FACT_PROCESSES)
            procs = ()
        gpu = GpuInfo(
            index=index,
            uuid=uuid,
            name=text(self._call("nvmlDeviceGetName", h, gpu=index)),
            pci_bus_id=bus_id,
            pci_device_id=int(pci.pciDeviceId),
            memory_mib=int(mem.total) // MIB,
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
            processes=procs,
            bare_gpu_instances=bare,
            persistence_mode=persistence,
            fabric=self.fabric(index),
        )
        self._last[index] = gpu
        return gpu

    def fabric(self, index: int) -> Fabric | None:
        """The GPU's NVLink fabric info: ``nvmlDeviceGetGpuFabricInfoV`` with the newest struct the driver
        takes (v3, else v2 on ARGUMENT_VERSION_MISMATCH), else the deprecated v1 call where the driver lacks
        the versioned one. None where NVML answers NOT_SUPPORTED (every GPU before Hopper)."""
        h = self._handle(index)
        versioned: Any = getattr(self.nvml, "nvmlDeviceGetGpuFabricInfoV", None)
        for struct_name in _FABRIC_STRUCTS if versioned is not None else ():
            struct = getattr(self.nvml, struct_name, None)
            if struct is None:
                continue
            info = struct()  # pynvml's constructor sets .version
            try:
                versioned(h, ctypes.byref(info))
            except self._mismatch:
                break
            except self.nvml.NVMLError as e:
                code = _code_of(e)
                if code == ARGUMENT_VERSION_MISMATCH:
                    continue
                if code == FUNCTION_NOT_FOUND:
                    break
                if code in _ABSENT:
                    return None
                raise self._convert(e, "nvmlDeviceGetGpuFabricInfoV", index) from e
            return _fabric_of(info, health_mask=int(info.healthMask),
                              summary=int(info.healthSummary) if hasattr(info, "healthSummary") else None)
        v1 = self.nvml.c_nvmlGpuFabricInfo_t()
        if self._try("nvmlDeviceGetGpuFabricInfo", h, ctypes.byref(v1), gpu=index) is None:
            return None
        return _fabric_of(v1, health_mask=None, summary=None)

    def _numa_node(self, index: int, bus_id: str) -> int | None:
        # sysfs names devices "0000:07:00.0" (4-digit domain, lower case); NVML says "00000000:07:00.0"
        sysfs = self.paths.sys_pci_devices / bus_id[-12:].lower() / "numa_node"
        try:
            value = int((fileio.read_text(sysfs, max_bytes=64, root=self.paths) or "").strip())
            return value if value >= 0 else None
        except (OSError, ValueError, fileio.UnreadableFileError):
            pass
        node = self._try("nvmlDeviceGetNumaNodeId", self._handle(index), gpu=index)
        return int(node) if node is not None and int(node) >= 0 else None

    def _driver(self) -> str:
        if not self._driver_version:
            self._driver_version = text(self._call("nvmlSystemGetDriverVersion"))
        return self._driver_version

    def _mig_profiles(self, index: int, pci_device_id: int) -> tuple[MigProfile, ...]:
        """The GPU's profiles as NVML reports them; NVML answers only with MIG enabled, so a GPU with MIG
        disabled gets its product's built-in table for this driver (none for an unknown product)."""
        h = self._handle(index)
        out: list[MigProfile] = []
        table = product_for_pci_device_id(pci_device_id)
        known_rows = {p.gi_profile_id: p for p in table.profiles} if table else {}
        for gi_index in range(int(self.nvml.NVML_GPU_INSTANCE_PROFILE_COUNT)):
            info = self._try("nvmlDeviceGetGpuInstanceProfileInfo", h, gi_index, gpu=index)
            if info is None or int(info.instanceCount) == 0:
                continue
            name = text(info.name).removeprefix("MIG ").strip()
            known = known_rows.get(gi_index)
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
            log.debug("GPU %d answers no MIG profile queries (MIG disabled); using the built-in table", index)
            rows = (s.profile for s in table.specs_for_driver(self._driver()))
            return tuple(sorted(rows, key=lambda p: p.gi_profile_id))  # NVML's enumeration order
        return tuple(out)

    def _placements(self, index: int, profile_id: int) -> tuple[tuple[int, ...], int]:
        h = self._handle(index)
        count = ctypes.c_uint(0)
        if self._try("nvmlDeviceGetGpuInstancePossiblePlacements", h, profile_id, None, ctypes.byref(count),
                     gpu=index, fact=FACT_PLACEMENTS) is None:
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
        by_name = {p.name: p for p in profiles}
        # every GPU instance, by profile
        gis: dict[int, tuple[MigProfile | None, int, int]] = {}  # gi id -> (profile, start, size)
        for prof in profiles:
            n = max(prof.instance_count, 1)
            array = (self.nvml.c_nvmlGpuInstance_t * n)()
            count = ctypes.c_uint(n)
            if self._try("nvmlDeviceGetGpuInstances", h, prof.id, array, ctypes.byref(count), gpu=index,
                         fact=FACT_INSTANCES) is None:
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
            if mh is None or not as_int(self._call("nvmlDeviceIsMigDeviceHandle", mh, gpu=index)):
                continue
            gi_id = int(self._call("nvmlDeviceGetGpuInstanceId", mh, gpu=index))
            ci_id = int(self._call("nvmlDeviceGetComputeInstanceId", mh, gpu=index))
            if gi_id not in gis:
                gi = self._try("nvmlDeviceGetGpuInstanceById", h, gi_id, gpu=index, fact=FACT_INSTANCES)
                if gi is not None:
                    info = self._call("nvmlGpuInstanceGetInfo", gi, gpu=index)
                    gis[gi_id] = (by_id.get(int(info.profileId)), int(info.placement.start),
                                  int(info.placement.size))
                else:  # unprivileged: the profile from the device name, the placement unknown (-1)
                    name = text(self._call("nvmlDeviceGetName", mh, gpu=index)).rpartition(" MIG ")[2]
                    known = by_name.get(name)
                    gis[gi_id] = (known, -1, known.placement_size if known else 0)
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
                    memory_mib=int(mem.total) // MIB,  # the device's own figure; may differ from its profile
                    uuid=text(self._call("nvmlDeviceGetUUID", mh, gpu=index)),
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
                    if int(e.value or 0) == GPU_IS_LOST:
                        raise self._convert(e, "nvmlDeviceGetNvLinkState", g.index) from e
                    if link == 0:
                        break  # no NVLink on this GPU
                    continue
                if not active:
                    continue
                remote = self._try("nvmlDeviceGetNvLinkRemotePciInfo", h, link, gpu=g.index)
                remote_bus = text(remote.busId).upper() if remote is not None else ""
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

    # --- processes ----------------------------------------------------------------------------
    def processes(self, index: int) -> tuple[GpuProcess, ...]:
        """Compute processes on the GPU (including those on its MIG devices); ``NvmlPermissionError`` for
        an unprivileged caller on a MIG-enabled GPU. NVML gives no process names: they come from /proc
        (the simulator adds its own)."""
        try:
            procs = self.nvml.nvmlDeviceGetComputeRunningProcesses(self._handle(index))
        except self._mismatch:  # a driver without the _v3 symbol: the _v2 form
            procs = self._call("nvmlDeviceGetComputeRunningProcesses_v2", self._handle(index), gpu=index)
        except self.nvml.NVMLError as e:
            raise self._convert(e, "nvmlDeviceGetComputeRunningProcesses", index) from e
        out = []
        for p in procs:
            pid = int(p.pid)
            fields = vars(p)
            name = fields.get("name") or self._process_name(pid)
            used = fields.get("usedGpuMemory")
            out.append(GpuProcess(pid=pid, name=str(name), used_memory_mib=int(used or 0) // MIB))
        return tuple(out)

    def _process_name(self, pid: int) -> str:
        try:
            return (fileio.read_text(self.paths.proc / str(pid) / "comm", max_bytes=4096,
                                              root=self.paths) or "").strip()
        except (OSError, fileio.UnreadableFileError):
            return ""


def _fabric_of(info: Any, *, health_mask: int | None, summary: int | None) -> Fabric:
    return Fabric(
        state=int(info.state),
        status=int(info.status),
        cluster_uuid=str(uuid.UUID(bytes=bytes(bytearray(info.clusterUuid)))),
        clique_id=int(info.cliqueId),
        health_mask=health_mask,
        health_summary=summary,
    )
