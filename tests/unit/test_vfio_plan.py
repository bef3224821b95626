"""The pure parts of the workload switch: resource names from the PCI ID database, the sysfs write
sequence both ways and its undo, the workload a tree shows, the label values refused, the Allocate
answer."""

from __future__ import annotations

import pytest

from nodeagent.errors import ConfigError, InputError
from nodeagent.vfio.allocate import VfioDevice, vfio_allocation
from nodeagent.vfio.names import env_name, group_by_resource, name_part, parse_pci_ids, resource_name
from nodeagent.vfio.plan import (
    CONTAINER,
    VM_PASSTHROUGH,
    PciFunction,
    SysfsWrite,
    bind_writes,
    parse_workload,
    passthrough_set,
    release_writes,
    restore_writes,
    switch_writes,
    vfio_driver,
    workload_of,
)

PCI_IDS = """\
# comment
10de  NVIDIA Corporation
\t20b5  GA100 [A100 PCIe 80GB]
\t\t10de 1533  A100 PCIe 80GB
\t2330  GH100 [H100 SXM5 80GB]
\t26b9  AD102GL [L40S]
1002  Advanced Micro Devices, Inc. [AMD/ATI]
\t2330  Not ours
C 03  Display controller
\t00  VGA compatible controller
"""

GPU = PciFunction("0000:17:00.0", "10de", "26b9", "030000", "nvidia", "20")
AUDIO = PciFunction("0000:17:00.1", "10de", "22ba", "040300", "snd_hda_intel", "20")
NIC = PciFunction("0000:18:00.0", "15b3", "101d", "020000", "mlx5_core", "21")


def test_pci_ids_vendor_section_only() -> None:
    names = parse_pci_ids(PCI_IDS)
    assert names == {"20b5": "GA100 [A100 PCIe 80GB]", "2330": "GH100 [H100 SXM5 80GB]", "26b9": "AD102GL [L40S]"}


def test_resource_names_follow_the_sandbox_plugin_rule() -> None:
    names = parse_pci_ids(PCI_IDS)
    assert resource_name("2330", names) == "nvidia.com/GH100_H100_SXM5_80GB"
    assert resource_name("0x26B9", names) == "nvidia.com/AD102GL_L40S"
    assert name_part("GB100 [TS4 / B100]") == "GB100_TS4___B100"
    assert name_part("GK110B [GeForce GTX 780 Ti 3GB]") == "GK110B_GEFORCE_GTX_780_TI_3GB"
    assert resource_name("2901", names) == "nvidia.com/10DE_2901"  # not in the database: the ID itself
    assert env_name("nvidia.com/GH100_H100_SXM5_80GB") == "PCI_RESOURCE_NVIDIA_COM_GH100_H100_SXM5_80GB"
    assert group_by_resource([("0000:b8:00.0", "2330"), ("0000:18:00.0", "2330")], names) == {
        "nvidia.com/GH100_H100_SXM5_80GB": ["0000:18:00.0", "0000:b8:00.0"]}


def test_bind_sequence_is_vfio_managers() -> None:
    assert bind_writes(GPU, "vfio-pci") == [
        SysfsWrite("/sys/bus/pci/devices/0000:17:00.0/driver_override", "\n"),
        SysfsWrite("/sys/bus/pci/drivers/nvidia/unbind", "0000:17:00.0"),
        SysfsWrite("/sys/bus/pci/devices/0000:17:00.0/driver_override", "vfio-pci"),
        SysfsWrite("/sys/bus/pci/drivers/vfio-pci/bind", "0000:17:00.0"),
    ]
    unbound = PciFunction(GPU.bdf, "10de", "26b9", "030000", None)
    assert [w.path.rsplit("/", 1)[1] for w in bind_writes(unbound, "vfio-pci")] == [
        "driver_override", "driver_override", "bind"]
    assert bind_writes(PciFunction(GPU.bdf, "10de", "26b9", "030000", "vfio-pci"), "vfio-pci") == []


def test_release_sequence_returns_to_the_kernels_choice() -> None:
    on_vfio = PciFunction(GPU.bdf, "10de", "26b9", "030000", "vfio-pci", "20")
    assert release_writes(on_vfio) == [
        SysfsWrite("/sys/bus/pci/devices/0000:17:00.0/driver_override", "\n"),
        SysfsWrite("/sys/bus/pci/drivers/vfio-pci/unbind", "0000:17:00.0"),
        SysfsWrite("/sys/bus/pci/drivers_probe", "0000:17:00.0"),
    ]
    assert release_writes(GPU) == []  # not on VFIO: nothing to do


def test_restore_undoes_either_direction() -> None:
    # bound to vfio-pci by a failed switch: back to nvidia by the kernel's probe
    assert restore_writes(GPU, "vfio-pci")[-1] == SysfsWrite("/sys/bus/pci/drivers_probe", GPU.bdf)
    # a failed return: back onto vfio-pci
    was = PciFunction(GPU.bdf, "10de", "26b9", "030000", "vfio-pci")
    assert restore_writes(was, "nvidia")[-1] == SysfsWrite("/sys/bus/pci/drivers/vfio-pci/bind", GPU.bdf)
    # left unbound half-way: bound to its driver again
    assert restore_writes(GPU, None)[-2:] == [SysfsWrite("/sys/bus/pci/drivers/nvidia/bind", GPU.bdf),
                                              SysfsWrite(f"/sys/bus/pci/devices/{GPU.bdf}/driver_override", "\n")]
    assert restore_writes(GPU, "nvidia") == []


def test_passthrough_set_takes_the_gpus_slot_functions_only() -> None:
    assert passthrough_set([NIC, AUDIO, GPU]) == [GPU, AUDIO]
    writes = switch_writes([NIC, GPU, AUDIO], VM_PASSTHROUGH)
    assert {w.value for w in writes if w.path.endswith("/bind")} == {GPU.bdf, AUDIO.bdf}
    assert switch_writes([NIC, GPU, AUDIO], CONTAINER) == []


def test_workload_of_a_tree() -> None:
    vfio_gpu = PciFunction(GPU.bdf, "10de", "26b9", "030000", "vfio-pci")
    vfio_audio = PciFunction(AUDIO.bdf, "10de", "22ba", "040300", "vfio-pci")
    assert workload_of([GPU, AUDIO, NIC]) == CONTAINER
    assert workload_of([vfio_gpu, vfio_audio]) == VM_PASSTHROUGH
    assert workload_of([vfio_gpu, AUDIO]) is None  # half-way: mixed
    assert workload_of([NIC]) is None


def test_label_values() -> None:
    assert parse_workload("vm-passthrough") == VM_PASSTHROUGH
    with pytest.raises(ConfigError, match="vGPU is not served"):
        parse_workload("vm-vgpu")
    with pytest.raises(ConfigError, match=r"nvidia.com/gpu.workload.config has the value 'vm'"):
        parse_workload("vm")
    with pytest.raises(ConfigError, match="value ''"):
        parse_workload("")


def test_grace_variant_only_where_loaded() -> None:
    assert vfio_driver(["vfio-pci", "nvgrace_gpu_vfio_pci"], grace=True) == "nvgrace_gpu_vfio_pci"
    assert vfio_driver(["vfio-pci"], grace=True) == "vfio-pci"
    assert vfio_driver(["vfio-pci", "nvgrace_gpu_vfio_pci"], grace=False) == "vfio-pci"


def test_allocate_answer_like_the_sandbox_plugin() -> None:
    devices = {"0000:17:00.0": VfioDevice("0000:17:00.0", "20", "vfio0"),
               "0000:3d:00.0": VfioDevice("0000:3d:00.0", "21", "vfio1"),
               "0000:3d:00.1": VfioDevice("0000:3d:00.1", "21")}
    res = "nvidia.com/AD102GL_L40S"
    a = vfio_allocation(res, devices, ["0000:17:00.0", "0000:3d:00.0"])
    assert a.envs == {"PCI_RESOURCE_NVIDIA_COM_AD102GL_L40S": "0000:17:00.0,0000:3d:00.0"}
    assert [d[0] for d in a.devices] == ["/dev/vfio/vfio", "/dev/vfio/20", "/dev/vfio/21"]
    assert all(c == h for c, h in a.devices)
    b = vfio_allocation(res, devices, ["0000:3d:00.0"], iommufd=True)
    assert [d[0] for d in b.devices] == ["/dev/vfio/vfio", "/dev/vfio/21", "/dev/vfio/devices/vfio1", "/dev/iommu"]
    with pytest.raises(InputError, match=r"has no device 0000:99:00\.0"):
        vfio_allocation(res, devices, ["0000:99:00.0"])
