"""Both switches end to end on the simulator: the workload switch through the simulated PCI tree under a
sandbox root (both directions, the audio function, persistence mode, the refusals, the undo of a failed
bind), and the CC switch through NVML, the ccadmin stand-in and the simulated GPU reset (both
directions, ppcie, the TEE and capability refusals, the undo of a failing tool)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nodeagent.ccmode.switch import CcSwitch
from nodeagent.errors import ConfigError, GpuBusyError, OperationError
from nodeagent.gpu.nvml import NvmlAdapter
from nodeagent.hostpaths import HostPaths
from nodeagent.nvmlsource import adapter_for_sim, cc_tool, pci_kernel
from nodeagent.simulator import inject
from nodeagent.simulator.open import open_sim
from nodeagent.simulator.state import SimStore
from nodeagent.vfio.names import parse_pci_ids, resource_name
from nodeagent.vfio.switch import VfioSwitch
from nodeagent.vfio.sysfs import PciSysfs


def _setup(tmp_path: Path, machine: str, state: bool = False) -> tuple[HostPaths, NvmlAdapter, SimStore, PciSysfs]:
    root = tmp_path / "root"
    root.mkdir()
    paths = HostPaths(root)
    state_file = tmp_path / "sim.json" if state else None
    nvml = open_sim(machine, state_file)
    adapter = adapter_for_sim(nvml, paths)
    sysfs = PciSysfs(paths, after_write=pci_kernel(paths, machine, state_file))
    sysfs.bind_wait_s = 0.3
    return paths, adapter, nvml.store, sysfs


def _drivers(sysfs: PciSysfs) -> dict[str, str | None]:
    return {f.bdf: f.driver for f in sysfs.functions()}


def test_workload_both_ways_with_audio_and_persistence(tmp_path: Path) -> None:
    paths, adapter, _, sysfs = _setup(tmp_path, "l40s-x4")
    sw = VfioSwitch(paths, adapter, sysfs)
    before = _drivers(sysfs)
    assert len(before) == 8 and set(before.values()) == {"nvidia", "snd_hda_intel"}
    assert sw.current() == "container"
    assert all(adapter.persistence_mode(i) for i in range(4))  # the host's nvidia-persistenced

    message = sw.apply("vm-passthrough")
    assert "with 4 auxiliary function(s)" in message and "persistence mode turned off on 4" in message
    assert set(_drivers(sysfs).values()) == {"vfio-pci"}
    assert sw.current() == "vm-passthrough"
    assert not any(adapter.persistence_mode(i) for i in range(4))
    groups = sorted(os.listdir(paths("/dev/vfio")))
    assert groups == ["20", "21", "22", "23", "vfio"]
    names = parse_pci_ids(paths("/usr/share/misc/pci.ids").read_text())
    assert resource_name(sysfs.function("0000:17:00.0").device, names) == "nvidia.com/AD102GL_L40S"
    # the kernel's view of the overrides: set to vfio-pci on every function
    assert paths("/sys/bus/pci/devices/0000:17:00.1/driver_override").read_text().strip() == "vfio-pci"

    message = sw.apply("container")
    assert "persistence mode turned on again on 4" in message
    assert _drivers(sysfs) == before
    assert all(adapter.persistence_mode(i) for i in range(4))
    assert os.listdir(paths("/dev/vfio")) == ["vfio"]
    assert paths("/sys/bus/pci/devices/0000:17:00.0/driver_override").read_text().strip() == "(null)"


def test_busy_gpu_refused_nothing_changed(tmp_path: Path) -> None:
    paths, adapter, store, sysfs = _setup(tmp_path, "l40s-x4")
    inject.inject_process(store, 2, 4242, "train.py")
    before = _drivers(sysfs)
    with pytest.raises(GpuBusyError, match=r"GPU 2: pid 4242 \(train.py\); nothing was changed"):
        VfioSwitch(paths, adapter, sysfs).apply("vm-passthrough")
    assert _drivers(sysfs) == before
    assert all(adapter.persistence_mode(i) for i in range(4))


def test_open_vfio_group_refuses_the_return(tmp_path: Path) -> None:
    paths, adapter, _, sysfs = _setup(tmp_path, "l40s-x4")
    sw = VfioSwitch(paths, adapter, sysfs)
    sw.apply("vm-passthrough")
    fd_dir = paths("/proc/777/fd")
    fd_dir.mkdir(parents=True)
    (fd_dir / "12").symlink_to("/dev/vfio/21")
    paths("/proc/777/comm").write_text("qemu-kvm\n")
    with pytest.raises(GpuBusyError, match=r"pid 777 \(qemu-kvm\) has /dev/vfio/21 open; nothing was changed"):
        sw.apply("container")
    assert sw.current() == "vm-passthrough"


def test_failed_bind_puts_everything_back(tmp_path: Path) -> None:
    paths, adapter, _, sysfs = _setup(tmp_path, "l40s-x4")
    before = _drivers(sysfs)
    # the third GPU refuses vfio-pci: its override names another driver the kernel then insists on
    real_write = sysfs.write

    def write(w):  # type: ignore[no-untyped-def]
        if w.path.endswith("0000:97:00.0/driver_override") and w.value == "vfio-pci":
            w = type(w)(w.path, "some-other-driver")
        real_write(w)

    sysfs.write = write  # type: ignore[method-assign]
    with pytest.raises(OperationError, match="every function is back on the driver it had") as e:
        VfioSwitch(paths, adapter, sysfs).apply("vm-passthrough")
    assert "0000:97:00.0 is on driver (none) after binding it to vfio-pci" in str(e.value)
    sysfs.write = real_write  # type: ignore[method-assign]
    assert _drivers(sysfs) == before
    assert all(adapter.persistence_mode(i) for i in range(4))
    assert paths("/var/lib/nodeagent/vfio-state.json").read_text() == "{}\n"  # nothing left to restore


def test_missing_vfio_driver_refused(tmp_path: Path) -> None:
    paths, adapter, _, sysfs = _setup(tmp_path, "l40s-x4")
    d = paths("/sys/bus/pci/drivers/vfio-pci")
    for f in d.iterdir():
        f.unlink()
    d.rmdir()
    with pytest.raises(OperationError, match="the vfio-pci driver is not loaded"):
        VfioSwitch(paths, adapter, sysfs).apply("vm-passthrough")


def _cc(tmp_path: Path, machine: str = "dgx-h100") -> tuple[HostPaths, NvmlAdapter, SimStore, CcSwitch]:
    paths, adapter, store, _ = _setup(tmp_path, machine, state=True)
    tool, env = cc_tool(paths, machine, tmp_path / "sim.json")
    return paths, adapter, store, CcSwitch(paths, adapter, tool, env)


def test_cc_on_and_back_through_tool_and_reset(tmp_path: Path) -> None:
    _, adapter, _, sw = _cc(tmp_path, "h100-nvl")  # 4 GPUs: the stand-in runs once per GPU and setting
    assert sw.current() == "off"
    mem0 = adapter.cc_memory_kib(0)
    assert mem0 is not None and mem0[0] == 0 and mem0[1] > 0  # off: nothing protected
    assert sw.apply("on") == "CC mode off → on on GPU(s) 0, 1, 2, 3"
    system = adapter.cc_system()
    assert system is not None and system["feature"] == 1 and system["environment"] == 2
    assert system["cpu_caps"] == 3 and system["gpus_caps"] == 1  # AMD SEV-SNP
    mem = adapter.cc_memory_kib(3)
    assert mem is not None and mem[0] > 0 and mem[1] == 0
    assert "mode on, environment production, GPUs capable, CPU AMD SEV-SNP" in sw.describe()
    assert sw.apply("ppcie").startswith("CC mode on → ppcie")
    system = adapter.cc_system()
    assert system is not None and system["multi_gpu"] == 1 and system["feature"] == 0
    assert sw.apply("off").startswith("CC mode ppcie → off")
    assert sw.current() == "off"


def test_cc_on_refused_without_tee(tmp_path: Path) -> None:
    paths, _, _, sw = _cc(tmp_path)
    paths("/sys/module/kvm_intel/parameters/tdx").write_text("N\n")
    with pytest.raises(ConfigError) as e:
        sw.apply("on")
    assert str(e.value).startswith("nvidia.com/cc.mode=on refused: the CPU has no TEE enabled")
    assert "\n" not in str(e.value)
    assert sw.current() == "off"
    assert sw.apply("off")  # off needs no TEE (already off: the tool has nothing to do)


def test_cc_refused_on_gpus_without_cc(tmp_path: Path) -> None:
    _, _, _, sw = _cc(tmp_path, "l40s-x4")
    assert sw.current() == "off"  # NVML: NOT_SUPPORTED
    with pytest.raises(ConfigError, match=r"GPU\(s\) 0, 1, 2, 3 are not capable of confidential computing"):
        sw.apply("on")


def test_cc_busy_and_failing_tool(tmp_path: Path) -> None:
    paths, adapter, store, sw = _cc(tmp_path, "h100-nvl")
    inject.inject_process(store, 3, 99, "cuda-app")
    with pytest.raises(GpuBusyError, match=r"GPU 3: pid 99 \(cuda-app\); nothing was changed"):
        sw.apply("on")
    inject.kill_process(store, 3)
    assert sw.tool is not None
    # the tool fails on the second GPU, after it set CC on (pending) on the first
    flaky = tmp_path / "flaky-tool"
    flaky.write_text("#!/bin/sh\n"
                     'case "$*" in *--set-cc-mode=on*--gpu-bdf=0000:18:00.0*) echo "register write failed" >&2; exit 1;; esac\n'
                     f'exec {" ".join(sw.tool)} "$@"\n')
    flaky.chmod(0o755)
    broken = CcSwitch(paths, adapter, [str(flaky)], sw.tool_env)
    with pytest.raises(OperationError) as e:
        broken.apply("on")
    assert str(e.value) == ("switching to CC mode on failed: --set-cc-mode=on --gpu-bdf=0000:18:00.0: register write "
                            "failed; the GPUs are back in mode off")
    assert sw.current() == "off"
    assert all(gs.get("cc_pending", "off") == "off" for gs in store.read()["gpus"])  # nothing left to apply
    none = CcSwitch(paths, adapter, None)
    with pytest.raises(OperationError, match="no CC-mode tool is installed"):
        none.apply("on")
