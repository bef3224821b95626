"""nodeagent's CDI spec against the CDI reference library (pkg/cdi v1.1.1, driven by tests/testbin/cdi-check).

On every simulated machine and several MIG layouts: the library loads the spec without errors, lists
exactly the names nodeagent meant, and every CDI name the device plugin hands out (cdi-cri and
cdi-annotations; uuid and index device IDs; mixed and single MIG strategies) injects the expected
device nodes, environment, mounts and hooks into an OCI spec. After a MIG change the vanished MIG
devices no longer resolve and the new ones do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from nodeagent.cdi import simhost
from nodeagent.cdi.writer import CdiWriter
from nodeagent.deviceplugin.allocate import container_allocation
from nodeagent.gpu.inventory import Gpu, Inventory, MigDevice
from nodeagent.sharing.devices import PhysicalDevice, build_resources
from nodeagent.sharing.spec import parse_plugin_config
from tests.cdi_host import SimHost, all_machine_layouts, apply_layout, layouts, make_host
from tests.peers.cdicheck import run_cdi_check

CONFIG = """version: v1
flags:
  migStrategy: {mig}
  plugin:
    deviceListStrategy: [cdi-annotations, cdi-cri]
    deviceIDStrategy: {ids}
"""


def _expected_nodes(gpu: Gpu, mig: MigDevice | None) -> set[str]:
    nodes = {f"/dev/nvidia{gpu.minor_number}"}
    if mig is not None:
        nodes |= {
            f"/dev/nvidia-caps/nvidia-cap{simhost.gi_minor(gpu.minor_number, mig.gi_id)}",
            f"/dev/nvidia-caps/nvidia-cap{simhost.ci_minor(gpu.minor_number, mig.gi_id, mig.ci_id)}",
        }
    return nodes


def _plugin_requests(inv: Inventory) -> list[tuple[str, list[PhysicalDevice], tuple[str, ...], dict[str, str]]]:
    """(config label, physical devices, cdi_devices, annotations) for every advertised device alone and
    for every resource's devices all at once, under each MIG strategy and device-ID strategy that applies."""
    out = []
    mig_strategies = ["none", "mixed"]
    mig_on = [g for g in inv.gpus if g.mig_current]
    if mig_on and len(mig_on) == len(inv.gpus) and len({m.profile for g in mig_on for m in g.mig_devices}) == 1:
        mig_strategies.append("single")
    for mig in mig_strategies:
        for ids in ("uuid", "index"):
            config = parse_plugin_config(CONFIG.format(mig=mig, ids=ids))
            for resource in build_resources(inv, config).values():
                groups = [[d.id] for d in resource.devices] + [[d.id for d in resource.devices]]
                for g in groups:
                    a = container_allocation(resource, config.flags.plugin, g)
                    phys = [resource.by_id()[i].physical for i in g]
                    out.append((f"{mig}/{ids}/{resource.name}", phys, a.cdi_devices, a.annotations))
    return out


def _check_injection(inj: dict[str, Any], phys: list[PhysicalDevice], host: SimHost, version: str) -> None:
    assert inj["unresolved"] == [] and "error" not in inj, inj
    spec = inj["spec"]
    nodes = {d["path"] for d in spec["linux"]["devices"]}
    want: set[str] = {"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset"}
    for p in phys:
        want |= _expected_nodes(p.gpu, p.mig)
    assert nodes == want
    assert "NVIDIA_VISIBLE_DEVICES=void" in spec["process"]["env"]
    mounts = {m["destination"]: m["source"] for m in spec["mounts"]}
    lib = f"/usr/lib/x86_64-linux-gnu/libcuda.so.{version}"
    assert mounts[lib] == str(host.paths(lib))
    assert "/usr/bin/nvidia-smi" in mounts
    assert not any("470.82.01" in m for m in mounts)  # an older driver's library is never mounted
    hooks = spec["hooks"]["createContainer"]
    assert [h["args"][1] for h in hooks] == ["create-symlinks", "update-ldcache"]


@pytest.mark.parametrize(("machine", "layout"), all_machine_layouts())
def test_reference_library_accepts_spec_and_resolves_plugin_names(tmp_path: Path, machine: str, layout: str) -> None:
    host = make_host(tmp_path, machine)
    inv = apply_layout(host, layouts(machine)[layout])
    result = CdiWriter(host.paths).write(inv)
    assert result.action == "written"

    requests = _plugin_requests(inv)
    groups = [list(cdi) for _, _, cdi, _ in requests]
    annotations: dict[str, str] = {}
    for _, _, cdi, ann in requests:
        assert list(ann.values()) == [",".join(cdi)]
        annotations.update(ann)
    out = run_cdi_check([host.spec_dir], [*groups, ["nvidia.com/gpu=all"]], annotations)

    assert out["errors"] == {}
    assert sorted(out["devices"]) == sorted(result.devices)
    n_mig = sum(len(g.mig_devices) for g in inv.gpus)
    assert len(out["devices"]) == 2 * len(inv.gpus) + 2 * n_mig + 1
    injections = out["injections"]
    assert len(injections) == len(groups) + 1 + len(annotations)
    for (label, phys, _, _), inj in zip(requests, injections, strict=False):
        try:
            _check_injection(inj, phys, host, inv.driver_version)
        except AssertionError as e:
            raise AssertionError(f"{machine}/{layout} {label} {inj['devices']}: {e}") from e
    everything = [PhysicalDevice(g, None, "") for g in inv.gpus] + [
        PhysicalDevice(g, m, "") for g in inv.gpus for m in g.mig_devices
    ]
    _check_injection(injections[len(groups)], everything, host, inv.driver_version)
    by_names = {",".join(cdi): phys for _, phys, cdi, _ in requests}
    for inj in injections[len(groups) + 1:]:
        assert inj["annotation"] in annotations
        _check_injection(inj, by_names[",".join(inj["devices"])], host, inv.driver_version)


def test_mig_change_drops_vanished_devices_and_resolves_new_ones(tmp_path: Path) -> None:
    host = make_host(tmp_path, "dgx-h100")
    writer = CdiWriter(host.paths)
    before = apply_layout(host, {0: ["1g.10gb"] * 7, 1: ["3g.40gb", "3g.40gb"]})
    assert writer.refresh(before)
    old_mig = [m.uuid for g in before.gpus for m in g.mig_devices]
    after = apply_layout(host, {0: ["7g.80gb"], 1: ["2g.20gb", "1g.10gb"]})
    assert writer.refresh(after)
    assert not writer.refresh(after)  # nothing changed: nothing written
    new_mig = [m.uuid for g in after.gpus for m in g.mig_devices]
    assert not set(old_mig) & set(new_mig)

    groups = [[f"nvidia.com/gpu={u}"] for u in old_mig + new_mig] + [["nvidia.com/gpu=0:6"], ["nvidia.com/gpu=0:0"]]
    out = run_cdi_check([host.spec_dir], groups)
    assert out["errors"] == {}
    injections = out["injections"]
    for inj in injections[: len(old_mig)]:
        assert inj["unresolved"] == inj["devices"] and "unresolvable CDI devices" in inj["error"]
    for inj in injections[len(old_mig): len(old_mig) + len(new_mig)]:
        assert inj["unresolved"] == [] and "error" not in inj
    assert injections[-2]["unresolved"] == ["nvidia.com/gpu=0:6"]  # GPU 0 has one MIG device now
    gpu0 = after.gpu(0)
    assert {d["path"] for d in injections[-1]["spec"]["linux"]["devices"]} >= _expected_nodes(
        gpu0, gpu0.mig_devices[0]
    )


def test_library_rejects_a_spec_declaring_too_low_a_version(tmp_path: Path) -> None:
    """The version nodeagent declares is the lowest that works: one below is refused by the library."""
    host = make_host(tmp_path, "l4x2")
    writer = CdiWriter(host.paths)
    writer.write(host.discover())
    spec_file = Path(writer.file)
    text = spec_file.read_text()
    assert 'cdiVersion: "0.5.0"' in text
    spec_file.write_text(text.replace('cdiVersion: "0.5.0"', 'cdiVersion: "0.4.0"'))
    out = run_cdi_check([host.spec_dir], [["nvidia.com/gpu=0"]])
    assert list(out["errors"]) == [str(spec_file)]
    assert "0.5.0" in " ".join(out["errors"][str(spec_file)])
