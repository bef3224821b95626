"""CDI device names: one rule for the spec writer and the device plugin (pure).

Names follow ``nvidia-ctk cdi generate``: a GPU is ``"<index>"`` and ``"GPU-…"``, a MIG device is
``"<gpu index>:<n>"`` and ``"MIG-…"``, plus ``"all"``. ``n`` counts the GPU's MIG devices ordered by
(GPU instance, compute instance), the same order the device plugin's ``index`` device-ID strategy uses.
"""

from __future__ import annotations

from nodeagent.gpu.inventory import Gpu, MigDevice

CDI_VENDOR = "nvidia.com"
CDI_CLASS = "gpu"
CDI_KIND = f"{CDI_VENDOR}/{CDI_CLASS}"
ALL_DEVICES = "all"


def qualified_name(device: str) -> str:
    """``nvidia.com/gpu=<device>``: the form CRI ``CDIDevices`` and ``cdi.k8s.io/`` annotations carry."""
    return f"{CDI_KIND}={device}"


def ordered_mig_devices(gpu: Gpu) -> list[MigDevice]:
    """The GPU's MIG devices in naming order."""
    return sorted(gpu.mig_devices, key=lambda m: (m.gi_id, m.ci_id))


def gpu_names(gpu: Gpu) -> tuple[str, str]:
    """The two names of a whole GPU: index and UUID."""
    return str(gpu.index), gpu.uuid


def mig_names(gpu: Gpu, mig: MigDevice) -> tuple[str, str]:
    """The two names of a MIG device: ``<gpu index>:<n>`` and its MIG UUID."""
    return f"{gpu.index}:{ordered_mig_devices(gpu).index(mig)}", mig.uuid
