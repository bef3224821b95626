"""Confidential-computing mode: label values, reading the mode from NVML's answers, the CPU's TEE and the
steps of a switch (pure).

``nvidia.com/cc.mode`` ∈ on, off, devtools, ppcie (protected PCIe across an NVSwitch system). The result
goes to ``nvidia.com/cc.mode.state`` (the applied mode, or ``failed``) and ``nvidia.com/cc.ready.state``
(``true`` for on/ppcie, ``false`` for off, empty otherwise), as NVIDIA's k8s-cc-manager writes them.

As cc-manager does, ``on`` (and ``devtools``, ``ppcie``) is refused unless the CPU has a TEE enabled in
KVM: ``/sys/module/kvm_intel/parameters/tdx`` or ``/sys/module/kvm_amd/parameters/sev_snp`` reading
``Y`` or ``1``; and any mode but ``off`` is refused while some GPU is not CC-capable.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from nodeagent.errors import ConfigError

CC_LABEL = "nvidia.com/cc.mode"
CC_STATE_LABEL = "nvidia.com/cc.mode.state"
CC_READY_LABEL = "nvidia.com/cc.ready.state"
ON, OFF, DEVTOOLS, PPCIE = "on", "off", "devtools", "ppcie"
MODES = (ON, OFF, DEVTOOLS, PPCIE)
FAILED = "failed"

TEE_FILES = {
    "/sys/module/kvm_intel/parameters/tdx": "Intel TDX",
    "/sys/module/kvm_amd/parameters/sev_snp": "AMD SEV-SNP",
}

# NVML values (nvml.h: nvmlConfComputeSystemState_t, nvmlSystemConfComputeSettings_t)
FEATURE_ENABLED = 1
DEVTOOLS_ON = 1
MULTIGPU_PROTECTED_PCIE = 1
CPU_CAPS = {0: "none", 1: "AMD SEV", 2: "Intel TDX", 3: "AMD SEV-SNP", 4: "AMD SNP vTOM"}


def parse_mode(value: str) -> str:
    if value in MODES:
        return value
    raise ConfigError(f"label {CC_LABEL} has the value {value!r}: use one of {', '.join(MODES)}", subject=CC_LABEL)


def state_labels(applied: str | None) -> dict[str, str | None]:
    """The labels reporting ``applied`` (None: the switch failed)."""
    if applied is None:
        return {CC_STATE_LABEL: FAILED, CC_READY_LABEL: ""}
    ready = "true" if applied in (ON, PPCIE) else "false" if applied == OFF else ""
    return {CC_STATE_LABEL: applied, CC_READY_LABEL: ready}


@dataclass(frozen=True)
class CcReading:
    """The system's CC state as NVML reports it."""

    environment: int  # 0 unavailable, 1 simulated, 2 production
    feature: int  # ccFeature
    devtools: int  # devToolsMode
    multi_gpu: int  # multiGpuMode (0 when the settings call is not there)
    cpu_caps: int
    gpus_capable: bool
    ready: int | None = None  # accepting client requests (None: unknown)

    @property
    def mode(self) -> str:
        if self.multi_gpu == MULTIGPU_PROTECTED_PCIE:
            return PPCIE
        if self.feature != FEATURE_ENABLED:
            return OFF
        return DEVTOOLS if self.devtools == DEVTOOLS_ON else ON


def tee_of(files: Mapping[str, str | None]) -> str | None:
    """The CPU TEE that KVM has enabled ("Intel TDX"), from the contents of ``TEE_FILES`` (None: no file /
    unreadable); None when none is."""
    for path, name in TEE_FILES.items():
        text = files.get(path)
        if text is not None and text.strip() in ("Y", "1"):
            return name
    return None


def refusal(mode: str, tee: str | None, not_capable: Sequence[str]) -> str | None:
    """Why ``mode`` cannot be applied on this node (one line), or None."""
    if mode == OFF:
        return None
    if not_capable:
        return (f"{CC_LABEL}={mode} refused: GPU(s) {', '.join(not_capable)} are not capable of confidential "
                "computing (only off applies)")
    if tee is None:
        return (f"{CC_LABEL}={mode} refused: the CPU has no TEE enabled (neither "
                f"{' nor '.join(p + '=Y' for p in TEE_FILES)})")
    return None


@dataclass(frozen=True)
class ToolStep:
    """One invocation of the switching tool for one GPU: ``--set-cc-mode=on`` / ``--set-ppcie-mode=off``."""

    bdf: str
    option: str  # "cc" or "ppcie"
    value: str  # on/off/devtools

    def argv(self) -> list[str]:
        return [f"--set-{self.option}-mode={self.value}", f"--gpu-bdf={self.bdf}"]


def steps(current: str, wanted: str, bdfs: Sequence[str]) -> list[list[ToolStep]]:
    """The rounds of a switch from ``current`` to ``wanted``: every GPU gets the round's setting, then every
    GPU is reset, before the next round. Leaving ppcie turns it off first (cc-manager's order); entering it
    turns CC off first."""
    rounds: list[list[ToolStep]] = []
    if current == wanted:
        return rounds
    if current == PPCIE:
        rounds.append([ToolStep(b, "ppcie", OFF) for b in bdfs])
        current = OFF
    if wanted == PPCIE:
        if current != OFF:
            rounds.append([ToolStep(b, "cc", OFF) for b in bdfs])
        rounds.append([ToolStep(b, "ppcie", ON) for b in bdfs])
    elif wanted != current:
        rounds.append([ToolStep(b, "cc", wanted) for b in bdfs])
    return rounds


def restore_steps(mode: str, bdfs: Sequence[str]) -> list[list[ToolStep]]:
    """The rounds that set every GPU to ``mode`` whatever a failed switch left set (pending or current):
    protected PCIe and CC each written explicitly."""
    if mode == PPCIE:
        return [[ToolStep(b, "cc", OFF) for b in bdfs], [ToolStep(b, "ppcie", ON) for b in bdfs]]
    return [[ToolStep(b, "ppcie", OFF) for b in bdfs], [ToolStep(b, "cc", mode) for b in bdfs]]
