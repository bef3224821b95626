"""The driver persistence mode on the simulator, as nvml.h documents nvmlDeviceGet/SetPersistenceMode: read by
anyone, set by root only (NO_PERMISSION otherwise), NVML_FEATURE_DISABLED/ENABLED only, effective at once and
gone at the next reboot (the driver starts with it disabled; the host's nvidia-persistenced enables it again);
GPU_IS_LOST on a lost GPU. The adapter's inventory carries it, and ``sim inject persistence`` sets it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pynvml
import pytest
import yaml

from nodeagent.errors import InputError
from nodeagent.gpu.nvml import NvmlAdapter
from nodeagent.simulator import inject
from nodeagent.simulator.machine import load_machine, parse_machine
from nodeagent.simulator.nvml import SimulatedNvml
from nodeagent.simulator.state import SimStore

ENABLED, DISABLED = pynvml.NVML_FEATURE_ENABLED, pynvml.NVML_FEATURE_DISABLED


def _sim(store: SimStore, privileged: bool = True) -> SimulatedNvml:
    nvml = SimulatedNvml(store, privileged=privileged)
    nvml.nvmlInit()
    return nvml


def _code(call: object) -> int:
    with pytest.raises(pynvml.NVMLError) as e:
        call()  # type: ignore[operator]
    return int(e.value.value)


def test_get_set_and_reboot_on_a_host_with_nvidia_persistenced(tmp_path: Path) -> None:
    store = SimStore(load_machine("dgx-a100-80gb"), tmp_path / "s.json")
    nvml = _sim(store)
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(8)]
    assert [nvml.nvmlDeviceGetPersistenceMode(h) for h in handles] == [ENABLED] * 8  # the daemon enabled them
    nvml.nvmlDeviceSetPersistenceMode(handles[2], DISABLED)
    assert nvml.nvmlDeviceGetPersistenceMode(handles[2]) == DISABLED  # at once, seen by any other reader:
    assert _sim(SimStore(load_machine("dgx-a100-80gb"), tmp_path / "s.json")).nvmlDeviceGetPersistenceMode(
        handles[2]) == DISABLED
    assert _code(lambda: nvml.nvmlDeviceSetPersistenceMode(handles[2], 2)) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    unprivileged = _sim(store, privileged=False)
    assert unprivileged.nvmlDeviceGetPersistenceMode(handles[2]) == DISABLED  # reading needs no root
    assert _code(lambda: unprivileged.nvmlDeviceSetPersistenceMode(handles[2], ENABLED)) == \
        pynvml.NVML_ERROR_NO_PERMISSION
    inject.inject_lost(store, 5)
    assert _code(lambda: nvml.nvmlDeviceGetPersistenceMode(handles[5])) == pynvml.NVML_ERROR_GPU_IS_LOST
    assert _code(lambda: nvml.nvmlDeviceSetPersistenceMode(handles[5], ENABLED)) == pynvml.NVML_ERROR_GPU_IS_LOST
    nvml.simReboot()  # not persistent across reboots: the boot state again
    assert [nvml.nvmlDeviceGetPersistenceMode(h) for h in handles] == [ENABLED] * 8


def test_without_nvidia_persistenced_the_drivers_default_is_disabled_after_each_boot(tmp_path: Path) -> None:
    from importlib import resources

    doc = yaml.safe_load((resources.files("nodeagent.simulator") / "machines" / "t4x1.yaml").read_text())
    machine = parse_machine("t4x1", {**doc, "persistenced": False})
    assert not machine.persistenced
    store = SimStore(machine)
    nvml = _sim(store)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetPersistenceMode(h) == DISABLED
    nvml.nvmlDeviceSetPersistenceMode(h, ENABLED)  # nvidia-smi -pm 1
    assert nvml.nvmlDeviceGetPersistenceMode(h) == ENABLED
    nvml.simReboot()
    assert nvml.nvmlDeviceGetPersistenceMode(h) == DISABLED
    with pytest.raises(InputError, match="persistenced must be true or false"):
        parse_machine("t4x1", {**doc, "persistenced": "yes"})


def test_a_mig_device_handle_is_not_a_gpu_for_persistence(tmp_path: Path) -> None:
    store = SimStore(load_machine("dgx-h100"))
    inject.write_mig_layout(store, 0, ["3g.40gb"])
    nvml = _sim(store)
    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(nvml.nvmlDeviceGetHandleByIndex(0), 0)
    assert _code(lambda: nvml.nvmlDeviceGetPersistenceMode(mig)) == pynvml.NVML_ERROR_INVALID_ARGUMENT


def test_the_inventory_carries_it_and_inject_sets_it(tmp_path: Path) -> None:
    state = tmp_path / "s.json"
    store = SimStore(load_machine("l4x2"), state)
    adapter = NvmlAdapter(_sim(store))
    assert [g.persistence_mode for g in adapter.discover().gpus] == [True, True]
    inject.set_persistence_mode(store, 1, False)
    assert [g.persistence_mode for g in adapter.discover().gpus] == [True, False]
    inject.set_persistence_mode(store, None, False)  # every GPU, as nvidia-smi -pm 0 without -i
    assert [g.persistence_mode for g in adapter.discover().gpus] == [False, False]
    with pytest.raises(InputError):
        inject.set_persistence_mode(store, 7, True)
    r = subprocess.run([sys.executable, "-m", "nodeagent", "sim", "inject", "persistence", "--sim-state", str(state),
                        "--gpu", "0", "enabled"], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0 and r.stdout == "GPU 0: persistence mode enabled\n", r.stderr
    assert [g["persistence_mode"] for g in json.loads(state.read_text())["gpus"]] == [1, 0]
    assert [g.persistence_mode for g in adapter.discover().gpus] == [True, False]
    adapter.close()
