"""The NVML session under every GPU port: init/shutdown, handles, and NVML failures turned into errors.

The NVML module is injected — the real ``pynvml`` or ``nodeagent.simulator.SimulatedNvml`` — and called by
function name, so the same code runs on both. Failures become ``nodeagent.errors`` classes naming the GPU
(``raise ... from``); pynvml's ``NVMLLibraryMismatchError`` (a driver older than pynvml, without the
versioned symbol; not an ``NVMLError``) becomes one clear error instead of a traceback.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from types import TracebackType
from typing import Any

from nodeagent.errors import (
    GpuBusyError,
    GpuLostError,
    InsufficientResourcesError,
    NvmlError,
    NvmlNotFoundError,
    NvmlPermissionError,
    ResetRequiredError,
)
from nodeagent.gpu.ports import GpuResetter
from nodeagent.gpu.reset import NvidiaSmiResetter
from nodeagent.hostpaths import HostPaths

log = logging.getLogger(__name__)

NOT_FOUND_MESSAGE = (
    "NVML library not found (libnvidia-ml.so.1); is the NVIDIA driver installed? Try --simulate dgx-h100"
)
DRIVER_NOT_LOADED_MESSAGE = "NVIDIA driver not loaded (NVML cannot reach it); is the nvidia kernel module loaded?"

# NVML return codes used here (same values as pynvml's NVML_ERROR_*)
SUCCESS = 0
INVALID_ARGUMENT = 2
NOT_SUPPORTED = 3
NO_PERMISSION = 4
NOT_FOUND = 6
DRIVER_NOT_LOADED = 9
TIMEOUT = 10
LIBRARY_NOT_FOUND = 12
FUNCTION_NOT_FOUND = 13
GPU_IS_LOST = 15
RESET_REQUIRED = 16
IN_USE = 19
INSUFFICIENT_RESOURCES = 23
NOT_READY = 27
INVALID_STATE = 29
NO_ID = 0xFFFFFFFF
FEATURE_DISABLED = 0  # nvmlEnableState_t
FEATURE_ENABLED = 1

# answers that mean "this GPU / driver has no such thing" rather than a failure
_ABSENT = (NOT_SUPPORTED, NOT_FOUND, FUNCTION_NOT_FOUND, INVALID_ARGUMENT, INVALID_STATE)


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def as_int(value: Any) -> int:
    """An NVML answer as int: pynvml returns some values as ctypes objects (``c_uint``)."""
    if isinstance(value, ctypes._SimpleCData):
        return int(value.value)
    return int(value)


class _NeverRaised(Exception):
    """Stands in for pynvml's NVMLLibraryMismatchError where the installed pynvml has none."""


def _code_of(e: Any) -> int:
    """The NVML return code of a pynvml ``NVMLError`` (its ``value``)."""
    return int(e.value or 0)


class NvmlSession:
    """NVML initialised once, shared by the port implementations that derive from it.

    ``nvml`` is the pynvml module or a simulator providing the same names. ``resetter`` resets one GPU
    (see ``GpuResetter``). ``nvmlInit`` runs in the constructor; ``close()`` (or ``with``) shuts NVML down.
    """

    def __init__(self, nvml: Any, paths: HostPaths | None = None, resetter: GpuResetter | None = None) -> None:
        self.nvml = nvml
        self.paths = paths or HostPaths()
        self.resetter: GpuResetter = resetter if resetter is not None else NvidiaSmiResetter(self.label, self.subject)
        self._handles: dict[int, Any] = {}
        self._uuids: dict[int, str] = {}
        self._closed = False
        try:  # nvidia-ml-py releases before this class never raise it
            self._mismatch: type[Exception] = nvml.NVMLLibraryMismatchError
        except AttributeError:
            self._mismatch = _NeverRaised
        self._restricted: set[str] = set()  # facts the caller lacked the privilege to read
        # where GPU UUIDs name the same devices across adapters: the driver's are unique; a simulator's only
        # within one sim-state file (set by the factory), None for an in-memory simulation
        self.fault_domain: str | None = "nvml"
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as e:
            raise self._convert(e, "nvmlInit", None) from e

    # --- lifecycle ----------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._before_close()
        with contextlib.suppress(Exception):
            self.nvml.nvmlShutdown()

    def _before_close(self) -> None:
        """Release what a port holds (the event set) before NVML shuts down."""

    def __enter__(self) -> NvmlSession:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # --- error conversion ---------------------------------------------------------------------
    def label(self, index: int | None) -> str:
        if index is None:
            return "NVML"
        uuid = self._uuids.get(index)
        return f"GPU {index} ({uuid})" if uuid else f"GPU {index}"

    def subject(self, index: int) -> str:
        return self._uuids.get(index, str(index))

    def _convert(self, e: Any, fn: str, index: int | None) -> NvmlError:
        code = _code_of(e)
        subject = self._uuids.get(index, str(index)) if index is not None else None
        if code == LIBRARY_NOT_FOUND:
            return NvmlNotFoundError(NOT_FOUND_MESSAGE, code=code)
        if code == DRIVER_NOT_LOADED:
            return NvmlNotFoundError(DRIVER_NOT_LOADED_MESSAGE, code=code)
        where = self.label(index)
        msg = f"{where}: {fn} failed: {e}"
        if code == GPU_IS_LOST:
            return GpuLostError(f"{where} is lost (fell off the bus): {fn} failed", subject=subject, code=code)
        if code == IN_USE:
            return GpuBusyError(f"{where} is in use: {fn} failed: {e}", subject=subject, code=code)
        if code == INSUFFICIENT_RESOURCES:
            return InsufficientResourcesError(msg, subject=subject, code=code)
        if code == RESET_REQUIRED:
            return ResetRequiredError(f"{where}: {fn}: a GPU reset is required and not possible here; "
                                      "reboot the host", subject=subject, code=code)
        if code == NO_PERMISSION:
            return NvmlPermissionError(f"{where}: {fn} needs root (NVML: insufficient permissions)",
                                       subject=subject, code=code)
        return NvmlError(msg, subject=subject, code=code, retryable=code in (TIMEOUT, NOT_READY))

    def _mismatch_error(self, e: Exception, fn: str, index: int | None) -> NvmlError:
        return NvmlError(
            f"{self.label(index)}: {fn}: the NVIDIA driver's NVML library is older than this nvidia-ml-py "
            f"(no versioned symbol for it); upgrade the driver or install an older nvidia-ml-py ({e})",
            subject=self._uuids.get(index, str(index)) if index is not None else None,
            code=FUNCTION_NOT_FOUND,
        )

    def _call(self, fn: str, *args: Any, gpu: int | None = None) -> Any:
        try:
            return getattr(self.nvml, fn)(*args)
        except self.nvml.NVMLError as e:
            raise self._convert(e, fn, gpu) from e
        except self._mismatch as e:
            raise self._mismatch_error(e, fn, gpu) from e

    def _try(self, fn: str, *args: Any, gpu: int | None = None, fact: str = "") -> Any:
        """Like ``_call`` but None for answers that mean "not here": not supported/found, no such
        function, a driver too old for it; and, naming ``fact`` as needing root, no permission."""
        try:
            func = getattr(self.nvml, fn)
        except AttributeError:  # a pynvml (or simulator) without this function
            return None
        try:
            return func(*args)
        except self._mismatch as e:
            log.debug("%s: %s unavailable on this driver: %s", self.label(gpu), fn, e)
            return None
        except self.nvml.NVMLError as e:
            code = _code_of(e)
            if code in _ABSENT:
                return None
            if code == NO_PERMISSION and fact:
                self._restricted.add(fact)
                return None
            raise self._convert(e, fn, gpu) from e

    def _handle(self, index: int) -> Any:
        h = self._handles.get(index)
        if h is None:
            h = self._call("nvmlDeviceGetHandleByIndex", index, gpu=index)
            self._handles[index] = h
        return h

    def _persistence(self, handle: Any, gpu: int | None = None) -> bool | None:
        """The GPU's persistence mode (nvmlDeviceGetPersistenceMode); None where NVML does not report it."""
        got = self._try("nvmlDeviceGetPersistenceMode", handle, gpu=gpu)
        return None if got is None else as_int(got) == FEATURE_ENABLED

    def _set_persistence(self, handle: Any, enabled: bool, gpu: int | None = None) -> None:
        self._call("nvmlDeviceSetPersistenceMode", handle, FEATURE_ENABLED if enabled else FEATURE_DISABLED, gpu=gpu)

    def _forget_handle(self, index: int) -> None:
        self._handles.pop(index, None)

    @property
    def restricted_facts(self) -> tuple[str, ...]:
        """Facts the discoveries so far could not read without root (empty when everything was read)."""
        return tuple(sorted(self._restricted))
