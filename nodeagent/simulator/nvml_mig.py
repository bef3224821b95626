"""The simulated NVML's MIG calls: MIG mode, GPU- and compute-instance profiles, placements and
instances, and MIG device handles (part of ``nodeagent.simulator.nvml.SimulatedNvml``)."""

from __future__ import annotations

import ctypes
from typing import Any

import pynvml

from nodeagent.gpu.profiles import CI_PROFILE_FOR_SLICES, MigProduct
from nodeagent.simulator.nvml_base import (
    _CI,
    _DEV,
    _GI,
    _MIG,
    SimBase,
    _deref,
    _err,
    _key,
    _ptr,
    copy_gs,
    driver_gi_id,
)
from nodeagent.simulator.state import State


class MigCalls(SimBase):
    """MIG administration and MIG device handles as NVML answers them."""

    # --- MIG mode -----------------------------------------------------------------------------
    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:
        state = self._enter("nvmlDeviceGetMigMode")
        index = self._gpu(state, handle)[1]
        self._product(index, state, need_enabled=False)
        gs = state["gpus"][index]
        return [int(gs["mig_current"]), int(gs["mig_pending"])]

    def nvmlDeviceSetMigMode(self, handle: Any, mode: int) -> int:
        """Sets the pending mode and returns the activation status like NVML does on hardware.

        Bare metal, idle GPU: the driver resets it (Ampere) or switches at once (Hopper and later), the mode
        is current, status SUCCESS. Processes running, or another client holding the device (a monitoring
        agent, nvidia-persistenced; ``inject.hold_device``): the pending mode is set, status IN_USE — the
        GPU switches at its next reset or reboot. A passthrough VM cannot reset the GPU: pending set, status
        RESET_REQUIRED. Disabling MIG while GPU instances exist fails with IN_USE.
        """
        state = self._enter("nvmlDeviceSetMigMode")
        index = self._gpu(state, handle)[1]
        self._product(index, state, need_enabled=False)
        if mode not in (pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        want = bool(mode)
        with self.store.transaction() as st:
            gs = st["gpus"][index]
            if not want and gs["gis"]:
                raise _err(pynvml.NVML_ERROR_IN_USE)
            gs["mig_pending"] = want
            if gs["mig_current"] == want:
                return int(pynvml.NVML_SUCCESS)
            if gs["processes"] or gs.get("clients"):  # e.g. nvidia-persistenced or DCGM holding the device
                return int(pynvml.NVML_ERROR_IN_USE)
            if self.machine.passthrough and self._spec(index).mig_needs_reset:
                return int(pynvml.NVML_ERROR_RESET_REQUIRED)
            gs["mig_current"] = want
        return int(pynvml.NVML_SUCCESS)

    # --- GPU instance profiles ----------------------------------------------------------------
    def nvmlDeviceGetGpuInstanceProfileInfo(self, device: Any, profile: int, version: int = 2) -> Any:
        state = self._enter("nvmlDeviceGetGpuInstanceProfileInfo")
        index = self._gpu(state, device)[1]
        product = self._product(index, state)  # MIG disabled: NOT_SUPPORTED, as on hardware
        if not 0 <= profile < pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        prof = product.profile_by_index(profile)
        if prof is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        spec = self._profile_spec(index, state, prof.name)
        info = (
            pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
            if version == 2
            else pynvml.c_nvmlGpuInstanceProfileInfo_t()
        )
        info.id = prof.id
        info.isP2pSupported = 0
        info.sliceCount = prof.slice_count
        info.instanceCount = prof.instance_count
        info.multiprocessorCount = spec.multiprocessors
        info.copyEngineCount = spec.copy_engines
        info.decoderCount = spec.decoders
        info.jpegCount = spec.jpeg
        info.ofaCount = spec.ofa
        info.encoderCount = spec.encoders
        info.memorySizeMB = prof.memory_mib
        if version == 2:
            info.name = f"MIG {prof.name}".encode()
        return info

    nvmlDeviceGetGpuInstanceProfileInfoV = nvmlDeviceGetGpuInstanceProfileInfo

    def _profile_by_id(self, index: int, state: State, profile_id: int, *, need_enabled: bool) -> Any:
        prof = self._product(index, state, need_enabled=need_enabled).profile_by_id(profile_id)
        if prof is None:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return prof

    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, device: Any, profileId: int, placementsRef: Any, countRef: Any
    ) -> int:
        """The _v2 semantics: every placement of the profile, occupied or not, MIG on or off."""
        state = self._enter("nvmlDeviceGetGpuInstancePossiblePlacements")
        index = self._gpu(state, device)[1]
        prof = self._profile_by_id(index, state, profileId, need_enabled=False)
        count = _deref(countRef)
        if placementsRef is None:
            count.value = len(prof.placement_starts)
            return int(pynvml.NVML_SUCCESS)
        if count.value < len(prof.placement_starts):
            count.value = len(prof.placement_starts)
            raise _err(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        array = _deref(placementsRef)
        for i, start in enumerate(prof.placement_starts):
            array[i].start = start
            array[i].size = prof.placement_size
        count.value = len(prof.placement_starts)
        return int(pynvml.NVML_SUCCESS)

    @staticmethod
    def _occupied(gs: dict[str, Any]) -> set[int]:
        return {s for gi in gs["gis"] for s in range(gi["start"], gi["start"] + gi["size"])}

    def _fits(self, product: MigProduct, gs: dict[str, Any], prof: Any, start: int) -> bool:
        if start not in prof.placement_starts:
            return False
        if self._occupied(gs) & set(range(start, start + prof.placement_size)):
            return False
        if sum(1 for gi in gs["gis"] if gi["profile_id"] == prof.id) >= prof.instance_count:
            return False
        used_compute = 0
        for gi in gs["gis"]:
            other = product.profile_by_id(gi["profile_id"])
            used_compute += other.slice_count if other else 0
        return bool(used_compute + prof.slice_count <= product.compute_slices)

    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, device: Any, profileId: int) -> int:
        state = self._enter("nvmlDeviceGetGpuInstanceRemainingCapacity")
        index = self._gpu(state, device)[1]
        product = self._product(index, state)
        prof = self._profile_by_id(index, state, profileId, need_enabled=True)
        gs = copy_gs(state["gpus"][index])
        n = 0
        for start in prof.placement_starts:  # placements of one profile never overlap each other
            if self._fits(product, gs, prof, start):
                gs["gis"].append({"profile_id": prof.id, "start": start, "size": prof.placement_size})
                n += 1
        return n

    # --- GPU instances ------------------------------------------------------------------------
    def _create_gi(self, fname: str, device: Any, profile_id: int, start: int | None) -> Any:
        state = self._enter(fname)
        index = self._gpu(state, device)[1]
        product = self._product(index, state)
        prof = self._profile_by_id(index, state, profile_id, need_enabled=True)
        with self.store.transaction() as st:
            gs = st["gpus"][index]
            if start is None:
                # NVML picks the placement: like the driver in the MIG user guide's examples, the upper
                # half of the memory slices first, then the lower half, each from its lowest start
                half = product.memory_slices // 2
                order = sorted(prof.placement_starts, key=lambda s: (s < half, s))
                candidates = [s for s in order if self._fits(product, gs, prof, s)]
                if not candidates:
                    raise _err(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
                start = candidates[0]
            elif start not in prof.placement_starts:
                raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            elif not self._fits(product, gs, prof, start):
                raise _err(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
            gi_id = driver_gi_id(product, gs, start, prof.placement_size)
            st["serial"] += 1
            gs["gis"].append(
                {
                    "id": gi_id,
                    "profile_id": prof.id,
                    "start": start,
                    "size": prof.placement_size,
                    "serial": st["serial"],
                    "cis": [],
                }
            )
            gs["gis"].sort(key=lambda g: g["id"])
        return _ptr(_key(_GI, index, gi_id), pynvml.c_nvmlGpuInstance_t)

    def nvmlDeviceCreateGpuInstance(self, device: Any, profileId: int) -> Any:
        return self._create_gi("nvmlDeviceCreateGpuInstance", device, profileId, None)

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, device: Any, profileId: int, placement: Any) -> Any:
        p = _deref(placement)
        return self._create_gi("nvmlDeviceCreateGpuInstanceWithPlacement", device, profileId, int(p.start))

    def nvmlDeviceGetGpuInstances(
        self, device: Any, profileId: int, gpuInstancesRef: Any, countRef: Any
    ) -> int:
        state = self._enter("nvmlDeviceGetGpuInstances")
        index = self._gpu(state, device)[1]
        self._profile_by_id(index, state, profileId, need_enabled=True)
        found = [gi for gi in state["gpus"][index]["gis"] if gi["profile_id"] == profileId]
        count = _deref(countRef)
        array = _deref(gpuInstancesRef)
        if len(array) < len(found):
            raise _err(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, gi in enumerate(found):
            array[i] = _ptr(_key(_GI, index, gi["id"]), pynvml.c_nvmlGpuInstance_t)
        count.value = len(found)
        return int(pynvml.NVML_SUCCESS)

    def nvmlDeviceGetGpuInstanceById(self, device: Any, gpuInstanceId: int) -> Any:
        state = self._enter("nvmlDeviceGetGpuInstanceById")
        index = self._gpu(state, device)[1]
        self._product(index, state)
        self._find_gi(state["gpus"][index], gpuInstanceId)
        return _ptr(_key(_GI, index, gpuInstanceId), pynvml.c_nvmlGpuInstance_t)

    def nvmlGpuInstanceGetInfo(self, gpuInstance: Any) -> Any:
        state = self._enter("nvmlGpuInstanceGetInfo")
        _, index, gi_id, _ = self._gpu(state, gpuInstance, (_GI,))
        gi = self._find_gi(state["gpus"][index], gi_id)
        info = pynvml.c_nvmlGpuInstanceInfo_t()
        info.device = _ptr(_key(_DEV, index), pynvml.c_nvmlDevice_t)
        info.id = gi["id"]
        info.profileId = gi["profile_id"]
        info.placement.start = gi["start"]
        info.placement.size = gi["size"]
        return info

    def nvmlGpuInstanceDestroy(self, gpuInstance: Any) -> int:
        state = self._enter("nvmlGpuInstanceDestroy")
        _, index, gi_id, _ = self._gpu(state, gpuInstance, (_GI,))
        with self.store.transaction() as st:
            gs = st["gpus"][index]
            gi = self._find_gi(gs, gi_id)
            if gi["cis"] or any(p.get("gi_id") == gi_id for p in gs["processes"]):
                raise _err(pynvml.NVML_ERROR_IN_USE)
            gs["gis"].remove(gi)
        return int(pynvml.NVML_SUCCESS)

    # --- compute instances --------------------------------------------------------------------
    def _gi_profile(self, state: State, index: int, gi_id: int) -> Any:
        gi = self._find_gi(state["gpus"][index], gi_id)
        return self._profile_by_id(index, state, gi["profile_id"], need_enabled=True)

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, device: Any, profile: int, engProfile: int, version: int = 2
    ) -> Any:
        state = self._enter("nvmlGpuInstanceGetComputeInstanceProfileInfo")
        _, index, gi_id, _ = self._gpu(state, device, (_GI,))
        gi_prof = self._gi_profile(state, index, gi_id)
        if engProfile != pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        slices = {v: k for k, v in CI_PROFILE_FOR_SLICES.items()}.get(profile)
        if slices is None or slices > gi_prof.slice_count:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        info = (
            pynvml.c_nvmlComputeInstanceProfileInfo_v2_t()
            if version == 2
            else pynvml.c_nvmlComputeInstanceProfileInfo_t()
        )
        info.id = profile
        info.sliceCount = slices
        info.instanceCount = gi_prof.slice_count // slices
        gi_spec = self._profile_spec(index, state, gi_prof.name)
        info.multiprocessorCount = gi_spec.multiprocessors * slices // gi_prof.slice_count
        if version == 2:
            suffix = "" if slices == gi_prof.slice_count else f"c.{gi_prof.name}"
            info.name = (f"MIG {gi_prof.name}" if not suffix else f"MIG {slices}{suffix}").encode()
        return info

    nvmlGpuInstanceGetComputeInstanceProfileInfoV = nvmlGpuInstanceGetComputeInstanceProfileInfo

    def nvmlGpuInstanceGetComputeInstanceRemainingCapacity(self, gpuInstance: Any, profileId: int) -> int:
        state = self._enter("nvmlGpuInstanceGetComputeInstanceRemainingCapacity")
        _, index, gi_id, _ = self._gpu(state, gpuInstance, (_GI,))
        gi_prof = self._gi_profile(state, index, gi_id)
        gi = self._find_gi(state["gpus"][index], gi_id)
        slices = {v: k for k, v in CI_PROFILE_FOR_SLICES.items()}.get(profileId)
        if slices is None or slices > gi_prof.slice_count:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        used = sum(ci["slices"] for ci in gi["cis"])
        return int((gi_prof.slice_count - used) // slices)

    def nvmlGpuInstanceCreateComputeInstance(self, gpuInstance: Any, profileId: int) -> Any:
        state = self._enter("nvmlGpuInstanceCreateComputeInstance")
        _, index, gi_id, _ = self._gpu(state, gpuInstance, (_GI,))
        gi_prof = self._gi_profile(state, index, gi_id)
        slices = {v: k for k, v in CI_PROFILE_FOR_SLICES.items()}.get(profileId)
        if slices is None or slices > gi_prof.slice_count:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        with self.store.transaction() as st:
            gi = self._find_gi(st["gpus"][index], gi_id)
            used = sum(ci["slices"] for ci in gi["cis"])
            if used + slices > gi_prof.slice_count:
                raise _err(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
            taken = {ci["id"] for ci in gi["cis"]}
            ci_id = min(i for i in range(8) if i not in taken)
            st["serial"] += 1
            gi["cis"].append(
                {
                    "id": ci_id,
                    "profile_id": profileId,
                    "slices": slices,
                    "start": used,
                    "serial": st["serial"],
                }
            )
        return _ptr(_key(_CI, index, gi_id, ci_id), pynvml.c_nvmlComputeInstance_t)

    def nvmlGpuInstanceGetComputeInstances(
        self, gpuInstance: Any, profileId: int, computeInstancesRef: Any, countRef: Any
    ) -> int:
        state = self._enter("nvmlGpuInstanceGetComputeInstances")
        _, index, gi_id, _ = self._gpu(state, gpuInstance, (_GI,))
        gi = self._find_gi(state["gpus"][index], gi_id)
        found = [ci for ci in gi["cis"] if ci["profile_id"] == profileId]
        count = _deref(countRef)
        array = _deref(computeInstancesRef)
        if len(array) < len(found):
            raise _err(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, ci in enumerate(found):
            array[i] = _ptr(_key(_CI, index, gi_id, ci["id"]), pynvml.c_nvmlComputeInstance_t)
        count.value = len(found)
        return int(pynvml.NVML_SUCCESS)

    def nvmlGpuInstanceGetComputeInstanceById(self, gpuInstance: Any, computeInstanceId: int) -> Any:
        state = self._enter("nvmlGpuInstanceGetComputeInstanceById")
        _, index, gi_id, _ = self._gpu(state, gpuInstance, (_GI,))
        gi = self._find_gi(state["gpus"][index], gi_id)
        if not any(ci["id"] == computeInstanceId for ci in gi["cis"]):
            raise _err(pynvml.NVML_ERROR_NOT_FOUND)
        return _ptr(_key(_CI, index, gi_id, computeInstanceId), pynvml.c_nvmlComputeInstance_t)

    def nvmlComputeInstanceGetInfo(self, computeInstance: Any) -> Any:
        state = self._enter("nvmlComputeInstanceGetInfo")
        _, index, gi_id, ci_id = self._gpu(state, computeInstance, (_CI,))
        gi = self._find_gi(state["gpus"][index], gi_id)
        for ci in gi["cis"]:
            if ci["id"] == ci_id:
                info = pynvml.c_nvmlComputeInstanceInfo_t()
                info.device = _ptr(_key(_DEV, index), pynvml.c_nvmlDevice_t)
                info.gpuInstance = _ptr(_key(_GI, index, gi_id), pynvml.c_nvmlGpuInstance_t)
                info.id = ci_id
                info.profileId = ci["profile_id"]
                info.placement.start = ci["start"]
                info.placement.size = ci["slices"]
                return info
        raise _err(pynvml.NVML_ERROR_NOT_FOUND)

    nvmlComputeInstanceGetInfo_v2 = nvmlComputeInstanceGetInfo

    def nvmlComputeInstanceDestroy(self, computeInstance: Any) -> int:
        state = self._enter("nvmlComputeInstanceDestroy")
        _, index, gi_id, ci_id = self._gpu(state, computeInstance, (_CI,))
        with self.store.transaction() as st:
            gs = st["gpus"][index]
            gi = self._find_gi(gs, gi_id)
            if any(p.get("gi_id") == gi_id for p in gs["processes"]):
                raise _err(pynvml.NVML_ERROR_IN_USE)
            before = len(gi["cis"])
            gi["cis"] = [ci for ci in gi["cis"] if ci["id"] != ci_id]
            if len(gi["cis"]) == before:
                raise _err(pynvml.NVML_ERROR_NOT_FOUND)
        return int(pynvml.NVML_SUCCESS)

    # --- MIG device handles -------------------------------------------------------------------
    def nvmlDeviceGetMaxMigDeviceCount(self, device: Any) -> int:
        state = self._enter("nvmlDeviceGetMaxMigDeviceCount")
        index = self._gpu(state, device)[1]
        product = self._spec(index).mig_product
        return product.max_mig_devices if product and state["gpus"][index]["mig_current"] else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Any, index: int) -> Any:
        state = self._enter("nvmlDeviceGetMigDeviceHandleByIndex")
        gpu = self._gpu(state, device)[1]
        self._product(gpu, state, need_enabled=False)  # no MIG at all: NOT_SUPPORTED
        # MIG disabled: no MIG device at any index, NOT_FOUND as NVML says (go-nvlib skips that answer)
        pairs = self._mig_pairs(state["gpus"][gpu]) if state["gpus"][gpu]["mig_current"] else []
        if not 0 <= index < len(pairs):
            raise _err(pynvml.NVML_ERROR_NOT_FOUND)
        gi, ci = pairs[index]
        return _ptr(_key(_MIG, gpu, gi["id"], ci["id"]), pynvml.c_nvmlDevice_t)

    def nvmlDeviceIsMigDeviceHandle(self, device: Any) -> Any:
        """A ctypes ``c_uint``, as pynvml returns it (not a Python bool or int)."""
        state = self._enter("nvmlDeviceIsMigDeviceHandle")
        return ctypes.c_uint(int(self._gpu(state, device, (_DEV, _MIG))[0] == _MIG))

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice: Any) -> Any:
        state = self._enter("nvmlDeviceGetDeviceHandleFromMigDeviceHandle")
        index = self._gpu(state, migDevice, (_MIG,))[1]
        return _ptr(_key(_DEV, index), pynvml.c_nvmlDevice_t)

    def nvmlDeviceGetGpuInstanceId(self, device: Any) -> int:
        state = self._enter("nvmlDeviceGetGpuInstanceId")
        return self._gpu(state, device, (_MIG,))[2]

    def nvmlDeviceGetComputeInstanceId(self, device: Any) -> int:
        state = self._enter("nvmlDeviceGetComputeInstanceId")
        return self._gpu(state, device, (_MIG,))[3]
