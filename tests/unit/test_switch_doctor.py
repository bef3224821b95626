"""What ``doctor`` says of the two label-driven switches from the Node's labels."""

from __future__ import annotations

from pathlib import Path

from nodeagent.doctor.findings import Report
from nodeagent.doctor.node import switch_findings


def _said(labels: dict[str, str]) -> list[tuple[str, str]]:
    report = Report()
    switch_findings(labels, report)
    return [(f.level, f.text) for f in report.findings]


def test_applied_failed_pending_and_absent() -> None:
    assert _said({}) == []
    assert _said({"nvidia.com/gpu.workload.config": "vm-passthrough",
                  "nvidia.com/gpu.workload.config.state": "vm-passthrough"}) == [
        ("ok", "nvidia.com/gpu.workload.config.state=vm-passthrough")]
    assert _said({"nvidia.com/cc.mode": "on", "nvidia.com/cc.mode.state": "failed"}) == [
        ("error", "nvidia.com/cc.mode=on failed (see the CcModeFailed Event on the Node)")]
    [(level, text)] = _said({"nvidia.com/cc.mode": "on", "nvidia.com/cc.mode.state": "off"})
    assert level == "warning" and text.startswith("nvidia.com/cc.mode=on is not applied (nvidia.com/cc.mode.state is off)")
    assert _said({"nvidia.com/cc.mode": "on", "nvidia.com/cc.mode.state": "on",
                  "nvidia.com/cc.ready.state": "true"}) == [
        ("ok", "nvidia.com/cc.mode.state=on, nvidia.com/cc.ready.state=true")]


def test_switch_components_are_opt_in_and_need_the_api() -> None:
    from nodeagent.config import AgentConfig, apply_overrides, parse_config
    from nodeagent.daemon import default_specs

    specs = {s.name: s for s in default_specs()}
    assert specs["vfio"].sections == frozenset({"vfio"}) and specs["cc"].sections == frozenset({"cc"})
    assert not AgentConfig().vfio.enabled and not AgentConfig().cc.enabled

    class Ctx:
        config = apply_overrides(AgentConfig(), {"vfio.enabled": True, "cc.enabled": True})
        kube = None

    assert specs["vfio"].build(Ctx()) is None  # type: ignore[arg-type]
    assert specs["cc"].build(Ctx()) is None  # type: ignore[arg-type]
    Ctx.config = AgentConfig()
    Ctx.kube = object()  # type: ignore[assignment]
    assert specs["vfio"].build(Ctx()) is None  # type: ignore[arg-type]
    cfg = parse_config('[cc]\nenabled = true\ntool = "/opt/gpu-admin-tools/nvidia_gpu_tools.py"\n', "c.toml")
    assert cfg.cc.tool == "/opt/gpu-admin-tools/nvidia_gpu_tools.py"


def test_doctor_in_vm_passthrough_finds_the_gpus_bound_for_vms(tmp_path: Path) -> None:
    """NVML finds no GPU while they are all on vfio-pci: doctor says where they are instead of "no GPU found"."""
    from nodeagent.config import AgentConfig
    from nodeagent.doctor.findings import Sources
    from nodeagent.doctor.gpus import check_gpus
    from nodeagent.gpu.inventory import Inventory
    from nodeagent.hostpaths import HostPaths
    from nodeagent.nvmlsource import pci_kernel
    from nodeagent.simulator.machine import load_machine
    from nodeagent.simulator.pcisysfs import SimPciTree
    from nodeagent.vfio.plan import SysfsWrite
    from nodeagent.vfio.sysfs import PciSysfs

    paths = HostPaths(tmp_path)
    kernel = pci_kernel(paths, "l40s-x4", None, None)
    sysfs = PciSysfs(paths, after_write=kernel)
    bdfs = sorted(f.bdf for f in sysfs.functions() if f.is_gpu)
    empty = Inventory(driver_version="", cuda_driver_version=0)

    def said() -> list[tuple[str, str]]:
        report = Report()
        src = Sources(paths=paths, config=AgentConfig(), discover=lambda: empty, command=lambda c: c)
        check_gpus(src, empty, report)
        return [(f.level, f.text) for f in report.findings]

    assert said() == [("warning", "no GPU found")]  # on nvidia, yet NVML (here: none) found nothing
    for bdf in bdfs:
        for w in (SysfsWrite(f"/sys/bus/pci/devices/{bdf}/driver_override", "vfio-pci"),
                  SysfsWrite("/sys/bus/pci/drivers/nvidia/unbind", bdf),
                  SysfsWrite("/sys/bus/pci/drivers/vfio-pci/bind", bdf)):
            sysfs.write(w)
    assert SimPciTree(paths, load_machine("l40s-x4")).driver_of(bdfs[0]) == "vfio-pci"
    assert said() == [("ok", f"no GPU on the nvidia driver: {len(bdfs)} GPU(s) bound to vfio-pci for virtual "
                             f"machines ({', '.join(bdfs)})")]
