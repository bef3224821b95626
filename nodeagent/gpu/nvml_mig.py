"""The ``MigAdministration`` port over NVML: MIG mode, GPU/compute instances, and the activating reset.

``nvmlDeviceSetMigMode`` returns an activation status, but what counts is the mode NVML reports afterwards:
like mig-parted, ``set_mig_mode`` re-reads ``nvmlDeviceGetMigMode`` (current vs pending) and never trusts
the status alone. An idle GPU on bare metal is current at once; a busy one keeps the new mode pending
(status IN_USE) until its next reset or reboot; a passthrough VM reports RESET_REQUIRED and only a reboot
helps (``ResetRequiredError``). Instances are addressed by the GPU-instance id NVML returns for them;
ids are the driver's choice and nothing here assumes how it numbers them.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging

from nodeagent.errors import InputError, NvmlError, ResetRequiredError
from nodeagent.gpu.inventory import MigDevice, MigProfile
from nodeagent.gpu.nvml_discovery import NvmlDiscovery
from nodeagent.gpu.nvml_session import IN_USE, RESET_REQUIRED, SUCCESS, as_int, text
from nodeagent.gpu.profiles import CI_PROFILE_FOR_SLICES

log = logging.getLogger(__name__)


class NvmlMigAdmin(NvmlDiscovery):
    """MIG changes (needs root: NVML answers NO_PERMISSION → ``NvmlPermissionError`` otherwise)."""

    def mig_mode(self, index: int) -> tuple[bool, bool]:
        """(current, pending) MIG mode of a GPU."""
        current, pending = self._call("nvmlDeviceGetMigMode", self._handle(index), gpu=index)
        return bool(as_int(current)), bool(as_int(pending))

    def set_mig_mode(self, index: int, enabled: bool) -> bool:
        """Request MIG on/off; True when the new mode is pending until a GPU reset or reboot (the GPU
        switches then), False when it is current now. ``ResetRequiredError`` when the driver says no reset
        is possible here (a passthrough VM): only a reboot makes it effective."""
        mode = self.nvml.NVML_DEVICE_MIG_ENABLE if enabled else self.nvml.NVML_DEVICE_MIG_DISABLE
        status = as_int(self._call("nvmlDeviceSetMigMode", self._handle(index), mode, gpu=index))
        current, pending = self.mig_mode(index)
        word = "on" if enabled else "off"
        if current == enabled:
            return False
        if pending != enabled:
            raise NvmlError(
                f"{self.label(index)}: MIG mode {word} was not accepted (NVML status {status}; "
                f"current {'on' if current else 'off'}, pending {'on' if pending else 'off'})",
                subject=self.subject(index),
                code=status,
            )
        if status == RESET_REQUIRED:
            raise ResetRequiredError(
                f"{self.label(index)}: MIG mode {word} is pending and no GPU reset is possible here "
                "(NVML: reset required); it switches when the host reboots",
                subject=self.subject(index),
                code=status,
            )
        reason = "processes are using it" if status == IN_USE else f"NVML status {status}"
        if status != SUCCESS:
            log.warning("%s: MIG mode %s is pending (%s); it switches at the next GPU reset or reboot",
                        self.label(index), word, reason)
        return True

    def reset_gpu(self, index: int) -> None:
        """GPU reset through the injected resetter: activates a pending MIG mode; drops all MIG instances.
        ``GpuBusyError`` while processes run, ``ResetRequiredError`` when no reset is possible here."""
        self._handle(index)  # the GPU must exist
        self.resetter.reset_gpu(index)
        self._forget_handle(index)  # handles may change after a reset

    def offered_profile(self, index: int, profile_name: str) -> MigProfile:
        """The GPU's profile of that name; InputError naming the offered ones if it has none."""
        pci = self._call("nvmlDeviceGetPciInfo", self._handle(index), gpu=index)
        profiles = self._mig_profiles(index, int(pci.pciDeviceId))
        for p in profiles:
            if p.name == profile_name:
                return p
        offered = ", ".join(p.name for p in profiles) or "none"
        raise InputError(
            f"MIG profile {profile_name!r} is not offered by {self.label(index)}; offered: {offered}",
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
                uuid = text(self._call("nvmlDeviceGetUUID", mh, gpu=index))
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
