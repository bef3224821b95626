"""Every simulated machine through the real entry point: ``discover``, and for each MIG machine every
generated standard config (``all-disabled``, ``all-enabled``, ``all-balanced``, ``all-<profile>``, as the
GPU Operator's default mig-parted config has them) planned, applied, asserted and exported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from nodeagent.cli import main
from nodeagent.gpu.profiles import PRODUCTS
from nodeagent.mig.spec import label_safe
from nodeagent.simulator.machine import load_machine, machine_names

MIG_MACHINES = [m for m in machine_names() if any(g.mig_product for g in load_machine(m).gpus)]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    out = capsys.readouterr()
    return int(e.value.code or 0), out.out, out.err


@pytest.mark.parametrize("machine", machine_names())
def test_discover_every_machine(machine: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "--root", str(tmp_path), "discover", "--simulate", machine, "--json")
    assert code == 0, err
    doc = json.loads(out)
    spec = load_machine(machine)
    assert [g["name"] for g in doc["gpus"]] == [g.name for g in spec.gpus]
    for g, s in zip(doc["gpus"], spec.gpus, strict=True):
        assert g["mig_capable"] == (s.mig_product is not None)
        if s.mig_product is not None:
            assert {p["name"] for p in g["mig_profiles"]} <= {p.name for p in s.mig_product.profiles}
            assert max(p["memory_mib"] for p in g["mig_profiles"]) <= g["memory_mib"]


@pytest.mark.parametrize("machine", MIG_MACHINES)
def test_generated_configs_plan_apply_assert_export(machine: str, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--root", str(tmp_path / "root")]
    sim = ["--simulate", machine, "--sim-state", str(tmp_path / "root" / "sim.json")]
    spec = load_machine(machine)
    product = next(g.mig_product for g in spec.gpus if g.mig_product is not None)
    offered = {s.name for s in product.specs_for_driver(spec.driver_version)}
    names = ["all-disabled", "all-enabled", "all-balanced", *sorted(f"all-{label_safe(p)}" for p in offered)]
    for name in names:
        code, out, err = run(capsys, *base, "mig", "plan", *sim, "-c", name)
        assert code == 0, (name, err)
        code, out, err = run(capsys, *base, "mig", "apply", *sim, "-c", name)
        if spec.passthrough and code == 3:  # a VM: a MIG mode change needs a reboot, then apply again
            assert "needs a reboot" in err and "error" not in err, err
            assert f"run `nodeagent sim reboot --sim-state {tmp_path / 'root' / 'sim.json'}`" in err, err
            assert run(capsys, *base, "sim", "reboot", *sim)[0] == 0
            code, out, err = run(capsys, *base, "mig", "apply", *sim, "-c", name)
        assert code == 0, (name, err)
        code, out, err = run(capsys, *base, "mig", "assert", *sim, "-c", name)
        assert code == 0, (name, out, err)
        code, out, err = run(capsys, *base, "mig", "export", *sim)
        assert code == 0, (name, err)
        exported = yaml.safe_load(out)["mig-configs"]["current"]
        if name.startswith("all-") and name not in ("all-disabled", "all-enabled", "all-balanced"):
            profile = next(p for p in offered if f"all-{label_safe(p)}" == name)
            count = product.profile(profile).instance_count  # type: ignore[union-attr]
            mig_gpus = [e for e in exported if e["mig-enabled"]]
            assert mig_gpus and all(e["mig-devices"] == {profile: count} for e in mig_gpus), (name, exported)


def test_every_mig_product_has_a_machine() -> None:
    products = {g.mig_product.key for m in machine_names() for g in load_machine(m).gpus if g.mig_product}
    assert products == set(PRODUCTS)


@pytest.mark.parametrize("machine", [m for m in MIG_MACHINES if m != "mixed"])  # one product per machine
def test_labels_for_every_profile_under_all_three_strategies(machine: str) -> None:
    """Each profile laid out uniformly on every GPU: gpu.* and mig-* labels as NVIDIA's labelers give
    them, for every profile of every table."""
    from nodeagent.kube.labels import SharingFacts, desired_labels
    from nodeagent.nvmlsource import open_nvml
    from nodeagent.simulator import inject

    spec = load_machine(machine)
    product = next(g.mig_product for g in spec.gpus if g.mig_product is not None)
    with open_nvml(machine) as nvml:
        store = nvml.nvml.store
        for row in product.specs_for_driver(spec.driver_version):
            p = row.profile
            for g in spec.gpus:
                inject.write_mig_layout(store, g.index, [p.name] * p.instance_count)
            inv = nvml.discover()
            n_gpus, n_devs = len(spec.gpus), len(spec.gpus) * p.instance_count
            model = spec.gpus[0].name.replace(" ", "-")
            safe = label_safe(p.name)
            none = desired_labels(inv, SharingFacts(mig_strategy="none"))
            assert none["nvidia.com/gpu.count"] == str(n_gpus)
            single = desired_labels(inv, SharingFacts(mig_strategy="single"))
            assert single["nvidia.com/gpu.count"] == str(n_devs), p.name
            assert single["nvidia.com/gpu.product"] == f"{model}-MIG-{safe}"
            # memory labels carry a MIG device's own figure (as gpu-feature-discovery reads it), which
            # the driver may report a little above the profile's
            device_mib = {str(d.memory_mib) for g in inv.gpus for d in g.mig_devices}
            assert single["nvidia.com/gpu.memory"] in device_mib
            assert all(0 <= int(m) - p.memory_mib <= 256 for m in device_mib)
            mixed = desired_labels(inv, SharingFacts(mig_strategy="mixed"))
            assert mixed[f"nvidia.com/mig-{safe}.count"] == str(n_devs)
            assert mixed[f"nvidia.com/mig-{safe}.memory"] in device_mib
            assert mixed[f"nvidia.com/mig-{safe}.slices.gi"] == str(p.slice_count)


@pytest.mark.parametrize("machine", [m for m in MIG_MACHINES if m != "mixed"])
def test_device_plugin_resources_under_all_three_strategies(machine: str) -> None:
    """The device plugin's resources for a mixed layout (the smallest and the largest profile): mixed
    advertises ``nvidia.com/mig-<profile>`` (``+`` as ``.``), single refuses two profiles in one line,
    none advertises whole GPUs."""
    from nodeagent.errors import ConfigError
    from nodeagent.gpu.profiles import resource_name
    from nodeagent.nvmlsource import open_nvml
    from nodeagent.sharing.devices import base_resources
    from nodeagent.sharing.spec import parse_plugin_config
    from nodeagent.simulator import inject

    spec = load_machine(machine)
    product = next(g.mig_product for g in spec.gpus if g.mig_product is not None)
    rows = product.specs_for_driver(spec.driver_version)
    small = next(r.profile for r in rows if "+" in r.name) if machine == "rtx-pro-6000" else rows[0].profile
    nvml = open_nvml(machine)
    for g in spec.gpus:
        inject.write_mig_layout(nvml.nvml.store, g.index, [small.name])
    inv = nvml.discover()

    def resources(strategy: str) -> dict[str, int]:
        cfg = parse_plugin_config(f"version: v1\nflags:\n  migStrategy: {strategy}\n", source="<test>")
        return {k: len(v) for k, v in base_resources(inv, cfg).items()}

    n = len(spec.gpus)
    assert resources("none") == {"nvidia.com/gpu": n}
    assert resources("single") == {"nvidia.com/gpu": n}
    assert resources("mixed") == {resource_name(small.name): n}
    largest = max((r.profile for r in rows), key=lambda p: p.slice_count)
    inject.write_mig_layout(nvml.nvml.store, 0, [largest.name])
    inv = nvml.discover()
    nvml.close()
    want = {resource_name(small.name): n - 1, resource_name(largest.name): 1}
    assert resources("mixed") == {k: v for k, v in want.items() if v}
    if largest.name != small.name and n > 1:  # two profiles on the node
        with pytest.raises(ConfigError, match="must all have one profile"):
            resources("single")
