"""The CC-mode switch: read the mode through NVML, refuse what the node cannot do, switch every GPU through
the configured tool (NVIDIA's gpu-admin-tools ``nvidia_gpu_tools.py`` on a host that has it; the
simulator's stand-in under ``--simulate``), reset each GPU through the GPU resetter, verify.

A switch is done in rounds (``plan.steps``): the tool sets every GPU, then every GPU is reset. A failure
runs the rounds back to the mode the node had (best effort, resetting again) and says what failed and
whether the undo did too. The tool runs bounded in time and output (``hostcommands.run_bounded``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Protocol

from nodeagent import fileio
from nodeagent.ccmode.plan import (
    CC_LABEL,
    CC_STATE_LABEL,
    CPU_CAPS,
    OFF,
    TEE_FILES,
    CcReading,
    ToolStep,
    parse_mode,
    refusal,
    restore_steps,
    state_labels,
    steps,
    tee_of,
)
from nodeagent.errors import ConfigError, GpuBusyError, NodeAgentError, OperationError
from nodeagent.gpu.inventory import GpuProcess, Inventory
from nodeagent.hostcommands import run_bounded
from nodeagent.hostpaths import HostPaths

log = logging.getLogger(__name__)

TOOL_TIMEOUT_S = 120.0


class CcGpus(Protocol):
    """What the switch needs of the NVML adapter."""

    def discover(self) -> Inventory: ...

    def processes(self, index: int) -> tuple[GpuProcess, ...]: ...

    def reset_gpu(self, index: int) -> None: ...

    def cc_system(self) -> dict[str, int] | None: ...

    def cc_memory_kib(self, index: int) -> tuple[int, int] | None: ...


def reading_of(system: Mapping[str, int] | None) -> CcReading | None:
    if system is None:
        return None
    ready = system.get("ready", -1)
    return CcReading(environment=system["environment"], feature=system["feature"], devtools=system["devtools"],
                     multi_gpu=system.get("multi_gpu", 0), cpu_caps=system.get("cpu_caps", 0),
                     gpus_capable=system.get("gpus_caps", 0) == 1, ready=None if ready < 0 else ready)


def bdf_of(bus_id: str) -> str:
    domain, _, rest = bus_id.lower().partition(":")
    return f"{int(domain, 16):04x}:{rest}"


class CcSwitch:
    """The ``labelswitch.Switch`` of ``nvidia.com/cc.mode``. ``tool``: the argv prefix of the switching tool
    (None: none installed, every change is refused saying so); ``tool_env``: its environment."""

    name = "CcMode"
    desired_label = CC_LABEL
    state_label = CC_STATE_LABEL

    def __init__(self, paths: HostPaths, gpus: CcGpus, tool: Sequence[str] | None,
                 tool_env: Mapping[str, str] | None = None, tool_timeout_s: float = TOOL_TIMEOUT_S) -> None:
        self.paths = paths
        self.gpu = gpus
        self.tool = list(tool) if tool else None
        self.tool_env = dict(tool_env or {})
        self.tool_timeout_s = tool_timeout_s

    # -- reading --------------------------------------------------------------------------------
    def reading(self) -> CcReading | None:
        return reading_of(self.gpu.cc_system())

    def tee(self) -> str | None:
        return tee_of({p: fileio.read_text(self.paths(p), root=self.paths) for p in TEE_FILES})

    def describe(self) -> str:
        """One line for ``doctor``: mode, environment, CPU, protected memory."""
        r = self.reading()
        if r is None:
            return "the driver reports no confidential-computing state"
        mem = []
        for g in self.gpu.discover().gpus:
            kib = self.gpu.cc_memory_kib(g.index)
            if kib is not None:
                mem.append(f"GPU {g.index} {kib[0] // 1024} MiB protected")
        env = {0: "unavailable", 1: "simulated", 2: "production"}.get(r.environment, str(r.environment))
        return (f"mode {r.mode}, environment {env}, GPUs {'' if r.gpus_capable else 'not '}capable, "
                f"CPU {CPU_CAPS.get(r.cpu_caps, r.cpu_caps)}, TEE enabled in KVM: {self.tee() or 'none'}"
                + (f", {', '.join(mem)}" if mem else ""))

    # -- the Switch protocol --------------------------------------------------------------------
    def parse(self, value: str) -> str:
        return parse_mode(value)

    def current(self) -> str | None:
        r = self.reading()
        return OFF if r is None else r.mode  # a driver or GPU without CC is in no other mode

    def gpus(self) -> frozenset[int]:
        return frozenset(g.index for g in self.gpu.discover().gpus)

    def state_labels(self, applied: str | None) -> Mapping[str, str | None]:
        return state_labels(applied)

    def apply(self, wanted: str) -> str:
        reading = self.reading()
        inventory = self.gpu.discover()
        not_capable = [] if reading is not None and reading.gpus_capable else [str(g.index) for g in inventory.gpus]
        why = refusal(wanted, self.tee(), not_capable)
        if why:
            raise ConfigError(why, subject=CC_LABEL)
        if self.tool is None:
            raise OperationError(f"{CC_LABEL}={wanted}: no CC-mode tool is installed (NVIDIA gpu-admin-tools' "
                                 "nvidia_gpu_tools.py); nothing was changed", subject=CC_LABEL)
        busy = [f"GPU {g.index}: " + ", ".join(f"pid {p.pid} ({p.name})" for p in procs)
                for g in inventory.gpus if (procs := self.gpu.processes(g.index))]
        if busy:
            raise GpuBusyError("GPUs run processes: " + "; ".join(busy) + "; nothing was changed", subject=CC_LABEL)
        before = OFF if reading is None else reading.mode
        indices = {bdf_of(g.pci_bus_id): g.index for g in inventory.gpus}
        try:
            self._run(before, wanted, indices)
            after = self.current()
            if after != wanted:
                raise OperationError(f"after the switch and reset NVML reports mode {after}, not {wanted}",
                                     subject=CC_LABEL)
        except NodeAgentError as e:
            try:
                self._rounds(restore_steps(before, sorted(indices)), indices)
                back = self.current()
                undo = (f"the GPUs are back in mode {before}" if back == before
                        else f"the GPUs read mode {back} after putting them back to {before}")
            except NodeAgentError as ue:
                undo = f"putting the GPUs back to mode {before} failed too: {ue}"
            raise OperationError(f"switching to CC mode {wanted} failed: {e}; {undo}", subject=CC_LABEL) from e
        return f"CC mode {before} → {wanted} on GPU(s) {', '.join(str(i) for i in sorted(indices.values()))}"

    def _run(self, current: str, wanted: str, indices: Mapping[str, int]) -> None:
        self._rounds(steps(current, wanted, sorted(indices)), indices)

    def _rounds(self, rounds: list[list[ToolStep]], indices: Mapping[str, int]) -> None:
        """Each round: the tool for every GPU, then a reset of every GPU (a mode takes effect at the reset)."""
        assert self.tool is not None
        for round_ in rounds:
            for step in round_:
                ran = run_bounded([*self.tool, *step.argv()], timeout=self.tool_timeout_s,
                                  env=self.tool_env or None, keep_tail=True)
                if ran.returncode != 0:
                    tail = (ran.stderr or ran.stdout).strip().splitlines()
                    detail = tail[-1] if tail else (ran.problem or f"exit {ran.returncode}")
                    raise OperationError(f"{' '.join(step.argv())}: {detail}", subject=step.bdf)
            for step in round_:
                self.gpu.reset_gpu(indices[step.bdf])
