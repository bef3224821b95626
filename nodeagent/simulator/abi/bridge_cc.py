"""The stand-in library's confidential-computing entry points (nvml.h "Confidential Computing"), answered
by the simulator's ``nvml_cc`` calls into the caller's structs (pynvml's layouts of nvml.h).
``nvmlSystemGetConfComputeSettings`` checks the caller's version field (``nvmlSystemConfComputeSettings_v1``)
and answers ARGUMENT_VERSION_MISMATCH for any other, as the driver does."""

from __future__ import annotations

from collections.abc import Callable

import pynvml

from nodeagent.simulator.abi.cmem import (
    ARGUMENT_VERSION_MISMATCH,
    SUCCESS,
    _get_uint,
    _h,
    _need,
    _struct_out,
    _uint_out,
)
from nodeagent.simulator.nvml import SimulatedNvml


def functions(sim: Callable[[], SimulatedNvml]) -> dict[str, Callable[..., int]]:
    """The CC entry points, answering from ``sim()``."""

    def nvmlSystemGetConfComputeState(out: int) -> int:
        return _struct_out(out, pynvml.c_nvmlConfComputeSystemState_t, sim().nvmlSystemGetConfComputeState())

    def nvmlSystemGetConfComputeCapabilities(out: int) -> int:
        return _struct_out(out, pynvml.c_nvmlConfComputeSystemCaps_t, sim().nvmlSystemGetConfComputeCapabilities())

    def nvmlSystemGetConfComputeSettings(out: int) -> int:
        if _get_uint(_need(out)) != pynvml.nvmlSystemConfComputeSettings_v1:
            return ARGUMENT_VERSION_MISMATCH
        return int(sim().nvmlSystemGetConfComputeSettings(pynvml.c_nvmlSystemConfComputeSettings_v1_t.from_address(out)))

    def nvmlDeviceGetConfComputeMemSizeInfo(dev: int, out: int) -> int:
        return _struct_out(out, pynvml.c_nvmlConfComputeMemSizeInfo_t,
                           sim().nvmlDeviceGetConfComputeMemSizeInfo(_h(dev)))

    def nvmlSystemGetConfComputeGpusReadyState(out: int) -> int:
        return _uint_out(_need(out), sim().nvmlSystemGetConfComputeGpusReadyState())

    def nvmlSystemSetConfComputeGpusReadyState(state: int) -> int:
        sim().nvmlSystemSetConfComputeGpusReadyState(state)
        return SUCCESS

    return {f.__name__: f for f in (nvmlSystemGetConfComputeState, nvmlSystemGetConfComputeCapabilities,
                                    nvmlSystemGetConfComputeSettings, nvmlDeviceGetConfComputeMemSizeInfo,
                                    nvmlSystemGetConfComputeGpusReadyState, nvmlSystemSetConfComputeGpusReadyState)}
