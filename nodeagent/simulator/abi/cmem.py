"""Memory helpers of the NVML ABI stand-in: the C caller's pointers (as integers) read and written with
ctypes, the ``nvmlReturn_t`` codes the bridge answers, and the error that carries one out of a helper."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

SUCCESS = 0
UNINITIALIZED = 1
INVALID_ARGUMENT = 2
NOT_FOUND = 6
INSUFFICIENT_SIZE = 7
DRIVER_NOT_LOADED = 9
ARGUMENT_VERSION_MISMATCH = 25
UNKNOWN = 999
NOT_SERVED = -1
_MAX_INSTANCES = 8  # more GPU/compute instances of one profile than any GPU offers


class _Error(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


# --- memory helpers ---------------------------------------------------------------------------------
def _need(ptr: int) -> int:
    if not ptr:
        raise _Error(INVALID_ARGUMENT)
    return ptr


def _plain(value: Any) -> int:
    # some simulator answers are ctypes values, as pynvml's own are (nvmlDeviceIsMigDeviceHandle: c_uint)
    return int(value.value if isinstance(value, ctypes._SimpleCData) else value)


def _put_uint(ptr: int, value: Any) -> None:
    ctypes.c_uint.from_address(_need(ptr)).value = _plain(value)


def _put_int(ptr: int, value: Any) -> None:
    ctypes.c_int.from_address(_need(ptr)).value = _plain(value)


def _put_ull(ptr: int, value: Any) -> None:
    ctypes.c_ulonglong.from_address(_need(ptr)).value = _plain(value)


def _put_handle(ptr: int, handle: Any) -> None:
    ctypes.c_void_p.from_address(_need(ptr)).value = _addr(handle)


def _put_str(ptr: int, length: int, value: str | bytes) -> None:
    data = value.encode() if isinstance(value, str) else value
    _need(ptr)
    if len(data) + 1 > length:
        raise _Error(INSUFFICIENT_SIZE)
    ctypes.memmove(ptr, data + b"\0", len(data) + 1)


def _get_str(ptr: int) -> bytes:
    return ctypes.string_at(_need(ptr))


def _get_uint(ptr: int) -> int:
    return int(ctypes.c_uint.from_address(_need(ptr)).value)


def _addr(handle: Any) -> int:
    return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)


def _h(value: int) -> Any:
    return ctypes.c_void_p(value)


def _fill(src: Any, dst: Any) -> None:
    """Copy the fields ``dst`` (a struct in the caller's memory) shares with ``src`` (a pynvml answer)."""
    if type(src) is type(dst):  # same layout: one copy instead of a field-by-field walk
        versioned = dst._fields_[0][0] == "version"
        version = ctypes.c_uint.from_address(ctypes.addressof(dst)).value if versioned else 0
        ctypes.memmove(ctypes.addressof(dst), ctypes.addressof(src), ctypes.sizeof(dst))
        if versioned:  # the caller's struct keeps the version it asked for
            ctypes.c_uint.from_address(ctypes.addressof(dst)).value = version
        return
    for field in dst._fields_:
        name = field[0]
        if name != "version" and hasattr(src, name):
            setattr(dst, name, getattr(src, name))


def _version(ptr: int) -> int:
    return _get_uint(ptr) >> 24


def _handle_out(out: int, answer: Callable[[], Any]) -> int:
    """A call that answers one handle: ``out`` must be given before the simulator is asked (a create call
    with nowhere to put its handle creates nothing)."""
    _need(out)
    _put_handle(out, answer())
    return SUCCESS


def _uint_out(out: int, value: int) -> int:
    _put_uint(out, value)
    return SUCCESS


def _struct_out(out: int, struct: Any, value: Any) -> int:
    """The simulator's answer ``value`` into the caller's ``struct`` at ``out``."""
    _fill(value, struct.from_address(_need(out)))
    return SUCCESS


def _fill_versioned(out: int, structs: dict[int, Any], answer: Callable[[], Any]) -> int:
    """A ``..._v`` call: the caller's struct at ``out`` says its version (top byte of its first field);
    fill it with the simulator's ``answer()`` in that layout. Version 3 adds ``capabilities`` (none here)."""
    version = _version(out)
    struct = structs.get(version)
    if struct is None:
        return ARGUMENT_VERSION_MISMATCH
    dst = struct.from_address(out)
    _fill(answer(), dst)
    if version == 3:
        dst.capabilities = 0
    return SUCCESS


def _put_handles(out: int, count: int, handle_type: Any, query: Callable[[Any, Any], object]) -> int:
    """An instance list: ``query(array, n)`` fills a local array of ``handle_type`` and ``n``; the handles go
    to the caller's array at ``out`` (needed unless there are none) and their number to ``count``."""
    _need(count)
    array = (handle_type * _MAX_INSTANCES)()
    n = ctypes.c_uint(0)
    query(array, n)
    if n.value and not out:
        return INVALID_ARGUMENT
    for i in range(n.value):
        _put_handle(out + i * ctypes.sizeof(ctypes.c_void_p), array[i])
    _put_uint(count, n.value)
    return SUCCESS
