"""The ``HealthEvents`` port over NVML: XID/ECC events, the lost-GPU probe, and the recovery action.

After an XID the driver may ask for a recovery (field ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``, 230): a GPU
reset, a node reboot, a drain. ``recovery_action`` reads it; the health monitor keeps such a GPU
unhealthy until the driver reports "none" again.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from typing import Any

from nodeagent.errors import GpuLostError, NvmlError
from nodeagent.gpu.nvml_session import NO_ID, SUCCESS, TIMEOUT, NvmlSession, as_int, text
from nodeagent.gpu.ports import RECOVERY_NONE, GpuEvent, GpuResetter
from nodeagent.hostpaths import HostPaths

log = logging.getLogger(__name__)

_XID_EVENT = 0x8
_ECC_SINGLE_EVENT = 0x1
_ECC_DOUBLE_EVENT = 0x2
_WATCHED_EVENTS = _XID_EVENT | _ECC_DOUBLE_EVENT | _ECC_SINGLE_EVENT
FI_GPU_RECOVERY_ACTION = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION


class NvmlHealthEvents(NvmlSession):
    """Blocking event waits (call from a thread), the per-GPU health probe and recovery action."""

    def __init__(self, nvml: Any, paths: HostPaths | None = None, resetter: GpuResetter | None = None) -> None:
        self._event_set: Any = None
        self._events_lock = threading.Lock()
        super().__init__(nvml, paths, resetter)

    def _before_close(self) -> None:
        with contextlib.suppress(Exception):
            if self._event_set is not None:
                self.nvml.nvmlEventSetFree(self._event_set)
        super()._before_close()

    def gpu_healthy(self, index: int) -> bool:
        """False when the GPU no longer answers (lost); other NVML errors count as healthy-but-odd."""
        try:
            self._call("nvmlDeviceGetMemoryInfo", self._handle(index), gpu=index)
        except GpuLostError:
            return False
        except NvmlError as e:
            log.debug("health probe of GPU %d: %s", index, e)
        return True

    def gpu_uuid(self, index: int) -> str:
        uuid = text(self._call("nvmlDeviceGetUUID", self._handle(index), gpu=index))
        self._uuids[index] = uuid
        return uuid

    def recovery_action(self, index: int) -> int:
        """The driver's ``nvmlDeviceGpuRecoveryAction_t`` for the GPU; ``RECOVERY_NONE`` when it needs
        none or the driver does not report the field (older drivers)."""
        values = self._try("nvmlDeviceGetFieldValues", self._handle(index), [FI_GPU_RECOVERY_ACTION], gpu=index)
        if values is None or len(values) == 0 or int(values[0].nvmlReturn) != SUCCESS:
            return RECOVERY_NONE
        return int(values[0].value.uiVal)

    def _ensure_event_set(self) -> Any:
        if self._event_set is None:
            es = self._call("nvmlEventSetCreate")
            for index in range(int(self._call("nvmlDeviceGetCount"))):
                h = self._handle(index)
                try:
                    supported = as_int(self._call("nvmlDeviceGetSupportedEventTypes", h, gpu=index))
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
                    if int(e.value or 0) == TIMEOUT:
                        break
                    raise self._convert(e, "nvmlEventSetWait_v2", None) from e
                except self._mismatch as e:
                    raise self._mismatch_error(e, "nvmlEventSetWait_v2", None) from e
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
            gi_id=None if gi == NO_ID else gi,
            ci_id=None if ci == NO_ID else ci,
        )


def _same_handle(a: Any, b: Any) -> bool:
    try:
        return bool(ctypes.cast(a, ctypes.c_void_p).value == ctypes.cast(b, ctypes.c_void_p).value)
    except (TypeError, ctypes.ArgumentError):
        return False
