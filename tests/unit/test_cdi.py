"""The CDI spec generator, its host facts and the writer (no Go peer; see tests/integration for that)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from nodeagent.cdi import simhost
from nodeagent.cdi.host import CdiError, HostFacts, collect, parse_mig_minors, parse_proc_devices
from nodeagent.cdi.spec import generate, render, required_version
from nodeagent.cdi.writer import CdiWriter, cdi_step
from nodeagent.cli import cli
from nodeagent.gpu.inventory import Inventory
from nodeagent.hostpaths import HostPaths
from tests.cdi_host import apply_layout, layouts, make_host
from tests.unit._dp_inventories import gpu, mig_device


def _names(spec: dict) -> list[str]:  # type: ignore[type-arg]
    return [d["name"] for d in spec["devices"]]


def _nodes(spec: dict, name: str) -> list[str]:  # type: ignore[type-arg]
    dev = next(d for d in spec["devices"] if d["name"] == name)
    return [n["path"] for n in dev["containerEdits"]["deviceNodes"]]


def test_parse_mig_minors() -> None:
    text = "config 1\nmonitor 2\ngpu0/gi1/access 21\ngpu0/gi1/ci0/access 22\n\ngpu3/gi13/ci7/access 999\n"
    assert parse_mig_minors(text) == {(0, 1, None): 21, (0, 1, 0): 22, (3, 13, 7): 999}


@pytest.mark.parametrize("bad", ["gpu0/gi1/access", "gpu0/gi1/access x", "gpuX/gi1/access 3", "config"])
def test_parse_mig_minors_names_the_bad_line(bad: str) -> None:
    with pytest.raises(CdiError) as e:
        parse_mig_minors(f"config 1\n{bad}\n", "/x/mig-minors")
    assert str(e.value) == f"/x/mig-minors:2: cannot parse {bad!r}"


def test_parse_proc_devices_reads_character_devices_only() -> None:
    text = "Character devices:\n195 nvidia-frontend\n508 nvidia-uvm\n\nBlock devices:\n259 nvidia-uvm\n"
    assert parse_proc_devices(text) == {"nvidia-frontend": 195, "nvidia-uvm": 508}


def test_sim_mig_minors_table_matches_the_driver_numbering() -> None:
    table = parse_mig_minors(simhost.mig_minors_text([0, 1]))
    assert table[(0, 0, None)] == 3 and table[(0, 0, 0)] == 4 and table[(0, 0, 7)] == 11
    assert table[(0, 1, None)] == 12 and table[(1, 0, None)] == 3 + 135
    assert len(table) == 2 * 15 * 9


def _host_inventory(tmp_path: Path) -> tuple[HostPaths, Inventory]:
    migs = (mig_device(1, 3), mig_device(1, 5, "3g.40gb"))
    inv = Inventory("550.54.15", 12040, (gpu(0), gpu(1, mig=migs)))
    paths = HostPaths(tmp_path)
    simhost.materialise(paths, inv)
    simhost.make_driver_root(paths, inv.driver_version)
    return paths, inv


def test_generate_names_nodes_env_mounts_hooks(tmp_path: Path) -> None:
    paths, inv = _host_inventory(tmp_path)
    spec = generate(inv, collect(paths, inv))
    assert spec is not None
    g0, g1 = inv.gpus
    m0, m1 = g1.mig_devices
    assert _names(spec) == ["0", g0.uuid, "1", g1.uuid, "1:0", m0.uuid, "1:1", m1.uuid, "all"]
    assert spec["kind"] == "nvidia.com/gpu" and spec["cdiVersion"] == "0.5.0"
    assert _nodes(spec, "0") == ["/dev/nvidia0"]
    gi3, ci3 = simhost.gi_minor(1, 3), simhost.ci_minor(1, 3, 0)
    assert _nodes(spec, "1:0") == _nodes(spec, m0.uuid) == [
        "/dev/nvidia1", f"/dev/nvidia-caps/nvidia-cap{gi3}", f"/dev/nvidia-caps/nvidia-cap{ci3}"]
    assert set(_nodes(spec, "all")) == {p for d in spec["devices"][:-1] for p in _nodes(spec, d["name"])}
    node = spec["devices"][0]["containerEdits"]["deviceNodes"][0]
    # a stand-in file: numbers from /proc/devices, the host path under the root
    assert node == {"path": "/dev/nvidia0", "hostPath": str(tmp_path / "dev/nvidia0"), "type": "c", "major": 195,
                    "minor": 0}
    edits = spec["containerEdits"]
    assert edits["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
    assert [n["path"] for n in edits["deviceNodes"]] == [
        "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset"]
    cap = next(n for n in spec["devices"][4]["containerEdits"]["deviceNodes"] if "caps" in n["path"])
    assert cap["major"] == simhost.SIM_CAPS_MAJOR
    mounts = {m["containerPath"]: m for m in edits["mounts"]}
    lib = "/usr/lib/x86_64-linux-gnu"
    assert f"{lib}/libcuda.so.550.54.15" in mounts and f"{lib}/libnvidia-ml.so.550.54.15" in mounts
    assert f"{lib}/libnvidia-ml.so.470.82.01" not in mounts and f"{lib}/libcuda.so.1" not in mounts
    assert "/usr/bin/nvidia-smi" in mounts and "/lib/firmware/nvidia/550.54.15/gsp_ga10x.bin" in mounts
    assert all(m["options"][:1] == ["ro"] for m in mounts.values())
    assert mounts["/usr/bin/nvidia-smi"]["hostPath"] == str(tmp_path / "usr/bin/nvidia-smi")
    hook = str(tmp_path / "usr/bin/nvidia-cdi-hook")
    assert edits["hooks"] == [
        {"hookName": "createContainer", "path": hook,
         "args": ["nvidia-cdi-hook", "create-symlinks", "--link", f"libcuda.so.1::{lib}/libcuda.so"]},
        {"hookName": "createContainer", "path": hook, "args": ["nvidia-cdi-hook", "update-ldcache", "--folder", lib]},
    ]


def test_absent_control_nodes_and_hook_are_left_out(tmp_path: Path) -> None:
    paths, inv = _host_inventory(tmp_path)
    (tmp_path / "dev/nvidia-modeset").unlink()
    (tmp_path / "usr/bin/nvidia-cdi-hook").unlink()
    spec = generate(inv, collect(paths, inv))
    assert spec is not None
    assert "/dev/nvidia-modeset" not in [n["path"] for n in spec["containerEdits"]["deviceNodes"]]
    assert "hooks" not in spec["containerEdits"]


def test_real_character_devices_are_left_for_the_runtime_to_stat(tmp_path: Path) -> None:
    """On a real host the runtime reads type and numbers from the node itself (as nvidia-ctk's specs do)."""
    inv = Inventory("550.54.15", 12040, (gpu(0),))
    (tmp_path / "dev").mkdir()
    # real character devices inside the root (a symlink to the host's /dev/null would be re-rooted)
    os.mknod(tmp_path / "dev/nvidia0", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    os.mknod(tmp_path / "dev/nvidiactl", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    spec = generate(inv, collect(HostPaths(tmp_path), inv))
    assert spec is not None
    assert spec["devices"][0]["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidia0", "hostPath": str(tmp_path / "dev/nvidia0")}]
    assert spec["containerEdits"]["deviceNodes"] == [{"path": "/dev/nvidiactl", "hostPath": str(tmp_path / "dev/nvidiactl")}]
    assert "mounts" not in spec["containerEdits"]


def test_root_mounted_from_the_node_publishes_the_nodes_own_paths(tmp_path: Path) -> None:
    """``--root /host --root-on-host /`` (the DaemonSet): the facts are read under the root, but the spec names
    the paths the node's runtime sees; a real character device then needs no hostPath at all."""
    inv = Inventory("550.54.15", 12040, (gpu(0),))
    simhost.make_driver_root(HostPaths(tmp_path), inv.driver_version)
    (tmp_path / "dev").mkdir()
    os.mknod(tmp_path / "dev/nvidia0", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    os.mknod(tmp_path / "dev/nvidiactl", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/devices").write_text("Character devices:\n195 nvidia-frontend\n510 nvidia-uvm\n")
    (tmp_path / "dev/nvidia-uvm").write_text("")  # a stand-in: numbers written, host path still the node's
    spec = generate(inv, collect(HostPaths(tmp_path, "/"), inv))
    assert spec is not None
    assert spec["devices"][0]["containerEdits"]["deviceNodes"] == [{"path": "/dev/nvidia0"}]
    edits = spec["containerEdits"]
    assert edits["deviceNodes"] == [{"path": "/dev/nvidiactl"},
                                    {"path": "/dev/nvidia-uvm", "type": "c", "major": 510, "minor": 0}]
    assert not [m for m in edits["mounts"] if m["hostPath"] != m["containerPath"]], edits["mounts"]
    assert all(h["path"] == "/usr/bin/nvidia-cdi-hook" for h in edits["hooks"])
    assert str(tmp_path) not in render(spec)
    # elsewhere on the node (a root mounted at /mnt/node on the host): moved, not stripped
    moved = generate(inv, collect(HostPaths(tmp_path, "/mnt/node/"), inv))
    assert moved is not None
    assert moved["devices"][0]["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidia0", "hostPath": "/mnt/node/dev/nvidia0"}]


def test_published_paths_refuse_what_is_not_under_the_root(tmp_path: Path) -> None:
    from nodeagent.hostpaths import HostPathError

    paths = HostPaths(tmp_path, "/")
    assert paths.publish("/run/nodeagent/mps/x/pipe") == "/run/nodeagent/mps/x/pipe"
    assert paths.published(tmp_path) == "/"
    assert HostPaths(tmp_path).publish("/dev/shm") == str(tmp_path / "dev/shm")
    assert HostPaths(Path("/"), "/host").publish("/dev/shm") == "/host/dev/shm"
    with pytest.raises(HostPathError, match="not under the root"):
        paths.published("/etc/passwd")
    with pytest.raises(HostPathError, match="absolute"):
        HostPaths(tmp_path, "relative/dir")
    with pytest.raises(HostPathError, match="climbs above"):
        HostPaths(tmp_path, "/../x")


def test_cli_root_on_host_must_be_absolute(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["--root", str(tmp_path), "--root-on-host", "host", "cdi", "show"])
    assert result.exit_code == 2 and "--root-on-host" in result.output, result.output


def test_required_version_is_the_lowest_that_allows_the_content() -> None:
    base = {"kind": "nvidia.com/gpu", "devices": [{"name": "GPU-x", "containerEdits": {}}], "containerEdits": {}}
    assert required_version(base) == "0.3.0"
    mounts = {"mounts": [{"hostPath": "/a", "containerPath": "/a", "type": "bind"}]}
    assert required_version({**base, "containerEdits": mounts}) == "0.4.0"
    host_path = {"deviceNodes": [{"path": "/dev/x", "hostPath": "/r/dev/x"}]}
    assert required_version({**base, "containerEdits": host_path}) == "0.5.0"
    assert required_version({**base, "devices": [{"name": "0", "containerEdits": {}}]}) == "0.5.0"
    assert required_version({**base, "annotations": {"a": "b"}}) == "0.6.0"
    assert required_version({**base, "kind": "nvidia.com/gpu.x"}) == "0.6.0"


def test_uuid_only_spec_on_a_real_root_declares_0_3_0() -> None:
    inv = Inventory("550.54.15", 12040, (gpu(0),))
    from nodeagent.cdi.host import NodeFact

    facts = HostFacts(nodes={"/dev/nvidia0": NodeFact("/dev/nvidia0", "/dev/nvidia0")})
    spec = generate(inv, facts)
    assert spec is not None
    spec["devices"] = [d for d in spec["devices"] if not d["name"][0].isdigit()]
    assert required_version(spec) == "0.3.0"
    assert yaml.safe_load(render(spec)) == spec


def test_no_gpu_no_spec() -> None:
    assert generate(Inventory("550.54.15", 12040, ()), HostFacts()) is None


def test_mig_device_without_a_mig_minors_entry_fails_and_leaves_the_file(tmp_path: Path) -> None:
    paths, inv = _host_inventory(tmp_path)
    writer = CdiWriter(paths)
    assert writer.write(Inventory(inv.driver_version, 12040, inv.gpus[:1])).action == "written"
    before = Path(writer.file).read_bytes()
    (tmp_path / "proc/driver/nvidia-caps/mig-minors").write_text("config 1\nmonitor 2\n")
    with pytest.raises(CdiError, match=r"mig-minors has no entry gpu1/gi3/access"):
        writer.write(inv)
    assert Path(writer.file).read_bytes() == before
    result = cdi_step(paths, inv)
    assert result.outcome == "failed" and "gpu1/gi3/access" in result.message


def test_writer_zero_diff_writes_nothing_and_vanished_mig_entries_go(tmp_path: Path) -> None:
    host = make_host(tmp_path, "dgx-a100-40gb")
    writer = CdiWriter(host.paths)
    inv = apply_layout(host, {0: ["1g.5gb"] * 7})
    first = writer.write(inv)
    assert first.action == "written"
    target = Path(first.path)
    st = target.stat()
    assert oct(st.st_mode & 0o777) == "0o644"
    again = writer.write(host.discover())
    assert again.action == "unchanged" and not again.changed
    st2 = target.stat()
    assert (st2.st_ino, st2.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    assert not [p for p in target.parent.iterdir() if p.name != target.name]  # no temp or backup files
    old_uuids = [m.uuid for m in inv.gpu(0).mig_devices]
    inv2 = apply_layout(host, {0: ["7g.40gb"]})
    assert writer.refresh(inv2)
    text = target.read_text()
    assert not any(u in text for u in old_uuids)
    assert 'name: "0:1"' not in text
    assert 'name: "0:0"' in text
    assert inv2.gpu(0).mig_devices[0].uuid in text


def test_writer_removes_the_spec_when_no_gpu_is_left(tmp_path: Path) -> None:
    paths, inv = _host_inventory(tmp_path)
    writer = CdiWriter(paths)
    writer.write(inv)
    empty = Inventory(inv.driver_version, inv.cuda_driver_version, ())
    assert writer.write(empty).action == "removed"
    assert not Path(writer.file).exists()
    assert writer.write(empty).action == "absent"
    assert cdi_step(paths, empty).outcome == "unchanged"


def test_driver_change_rewrites_mounts(tmp_path: Path) -> None:
    paths, inv = _host_inventory(tmp_path)
    writer = CdiWriter(paths)
    writer.write(inv)
    simhost.make_driver_root(paths, "570.86.10")
    newer = Inventory("570.86.10", 12080, inv.gpus)
    assert cdi_step(paths, newer).outcome == "changed"
    text = Path(writer.file).read_text()
    assert "libcuda.so.570.86.10" in text and "550.54.15" not in text
    assert cdi_step(paths, newer).outcome == "unchanged"


def test_driver_root_is_resolved_under_the_root(tmp_path: Path) -> None:
    paths, inv = _host_inventory(tmp_path)
    simhost.make_driver_root(paths, inv.driver_version, driver_root="/run/nvidia/driver", hook=False)
    spec = generate(inv, collect(paths, inv, "/run/nvidia/driver"))
    assert spec is not None
    m = {x["containerPath"]: x["hostPath"] for x in spec["containerEdits"]["mounts"]}
    lib = "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15"
    assert m[lib] == str(tmp_path / "run/nvidia/driver" / lib.lstrip("/"))


def test_cli_generate_show_check(tmp_path: Path) -> None:
    root, state = tmp_path / "root", tmp_path / "root" / "sim.json"
    runner = CliRunner()
    base = ["--root", str(root), "cdi"]
    sim = ["--sim-state", str(state), "--simulate", "dgx-h100"]
    r = runner.invoke(cli, [*base, "generate", *sim, "--sim-host-files"], standalone_mode=False)
    assert r.exit_code == 0, r.output
    spec_file = root / "var/run/cdi/nvidia.yaml"
    assert r.stdout.strip() == f"wrote {spec_file} (17 device names)"
    r = runner.invoke(cli, [*base, "generate", *sim], standalone_mode=False)
    assert r.stdout.strip() == f"{spec_file} is up to date (17 device names)"
    r = runner.invoke(cli, [*base, "show", "--check", *sim])
    assert r.exit_code == 0 and "current: matches the GPUs" in r.output and "nvidia.com/gpu=all" in r.output
    r = runner.invoke(cli, ["sim", "mig", "--sim-state", str(state), "--gpu", "2", "3g.40gb", "3g.40gb"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(cli, [*base, "show", "--check", *sim])
    assert r.exit_code == 1 and "STALE" in r.output
    r = runner.invoke(cli, [*base, "generate", *sim, "--sim-host-files"], standalone_mode=False)
    assert r.stdout.strip() == f"wrote {spec_file} (21 device names)"
    r = runner.invoke(cli, [*base, "generate", *sim, "--stdout"], standalone_mode=False)
    assert yaml.safe_load(r.stdout)["cdiVersion"] == "0.5.0"


@pytest.mark.parametrize("machine", ["dgx-h100", "a30x4", "t4x1"])
def test_rendered_yaml_reads_back_as_the_spec(tmp_path: Path, machine: str) -> None:
    host = make_host(tmp_path, machine)
    inv = host.discover()
    spec = generate(inv, collect(host.paths, inv))
    assert spec is not None
    spec["containerEdits"]["env"].append('A="quoted" \\ back\nslash: ü')
    spec["containerEdits"]["empty"] = []
    assert yaml.safe_load(render(spec)) == spec


def test_on_inventory_runs_refresh_off_the_event_loop(tmp_path: Path) -> None:
    import asyncio

    paths, inv = _host_inventory(tmp_path)
    writer = CdiWriter(paths)

    async def go() -> tuple[bool, bool]:
        return await writer.on_inventory(inv), await writer.on_inventory(inv)

    assert asyncio.run(go()) == (True, False)
    assert writer.last is not None and writer.last.action == "unchanged"


def test_sim_host_files_follow_the_inventory_on_each_write(tmp_path: Path) -> None:
    """With the simulator, the writer lays out /proc and /dev itself (no driver does it)."""
    migs = (mig_device(0, 3), mig_device(0, 5))
    inv = Inventory("550.54.15", 12040, (gpu(0, mig=migs), gpu(1)))
    writer = CdiWriter(HostPaths(tmp_path), sim_host_files=True)
    assert writer.write(inv).action == "written"
    caps = sorted(p.name for p in (tmp_path / "dev/nvidia-caps").iterdir())
    assert caps == sorted(f"nvidia-cap{n}" for n in (30, 31, 48, 49))
    fewer = Inventory("550.54.15", 12040, (gpu(0, mig=migs[:1]), gpu(1)))
    assert writer.write(fewer).action == "written"
    assert sorted(p.name for p in (tmp_path / "dev/nvidia-caps").iterdir()) == ["nvidia-cap30", "nvidia-cap31"]
    assert not (tmp_path / "proc/driver/nvidia/capabilities/gpu0/mig/gi5").exists()


def test_linked_tool_is_mounted_but_library_links_are_not(tmp_path: Path) -> None:
    paths, inv = _host_inventory(tmp_path)
    smi = tmp_path / "usr/bin/nvidia-smi"
    real = tmp_path / "opt/nvidia/nvidia-smi"
    real.parent.mkdir(parents=True)
    smi.rename(real)
    smi.symlink_to("/opt/nvidia/nvidia-smi")  # the node's path: followed inside the root, as a chroot would
    spec = generate(inv, collect(paths, inv))
    assert spec is not None
    mounts = {m["containerPath"]: m["hostPath"] for m in spec["containerEdits"]["mounts"]}
    assert mounts["/usr/bin/nvidia-smi"] == str(real)
    assert "/usr/lib/x86_64-linux-gnu/libcuda.so.1" not in mounts


def test_overlapping_refreshes_from_threads_are_serialised(tmp_path: Path) -> None:
    """A rediscovery and a MIG apply may refresh at the same time (two threads): every call ends with a
    whole spec for one of the inventories, none fails half-way through laying out the simulated host."""
    import threading

    host = make_host(tmp_path, "dgx-h100")
    plain = host.discover()
    mig = apply_layout(host, layouts("dgx-h100")["all-smallest"])
    writer = CdiWriter(host.paths, sim_host_files=True)
    errors: list[BaseException] = []

    def hammer(inv: Inventory) -> None:
        try:
            for _ in range(15):
                writer.refresh(inv)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=hammer, args=(inv,)) for inv in (plain, mig, plain, mig)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    writer.refresh(mig)
    names = set(writer.last.devices) if writer.last else set()
    assert {f"nvidia.com/gpu={g}:{n}" for g in range(8) for n in range(7)} <= names


def test_same_writer_sees_driver_root_changes_without_a_version_change(tmp_path: Path) -> None:
    """The writer keeps the driver root's listing between refreshes; a library, tool or hook that appears
    (same driver version) changes its directory and is in the next refresh."""
    paths, inv = _host_inventory(tmp_path)
    writer = CdiWriter(paths)
    assert writer.write(inv).action == "written"
    assert writer.write(inv).action == "unchanged"
    libdir = paths("/usr/lib/x86_64-linux-gnu")
    (libdir / "libnvidia-encode.so.550.54.15").write_text("fake\n")
    assert writer.write(inv).action == "written"
    assert "libnvidia-encode.so.550.54.15" in Path(writer.file).read_text()
    paths("/usr/bin/nvidia-cdi-hook").unlink()
    assert writer.write(inv).action == "written"
    assert "nvidia-cdi-hook" not in Path(writer.file).read_text()


def test_writer_rewrites_a_spec_edited_behind_its_back(tmp_path: Path) -> None:
    """Unchanged GPUs and host skip the rendering only while the file still holds what was written."""
    paths, inv = _host_inventory(tmp_path)
    writer = CdiWriter(paths)
    writer.write(inv)
    good = Path(writer.file).read_bytes()
    Path(writer.file).write_text("edited\n")
    assert writer.write(inv).action == "written"
    assert Path(writer.file).read_bytes() == good
    Path(writer.file).unlink()
    assert writer.write(inv).action == "written"


def test_mig_change_reads_new_device_nodes_with_the_driver_listing_kept(tmp_path: Path) -> None:
    host = make_host(tmp_path, "dgx-h100")
    writer = CdiWriter(host.paths)
    writer.write(apply_layout(host, {0: ["1g.10gb"] * 7}))
    inv = apply_layout(host, {0: ["3g.40gb", "3g.40gb"]})
    assert writer.write(inv).action == "written"
    spec = yaml.safe_load(Path(writer.file).read_text())
    fresh = generate(inv, collect(host.paths, inv))
    assert spec == fresh


def test_driver_root_listed_once_while_its_directories_stay_put(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import nodeagent.cdi.host as host_module
    import nodeagent.cdi.writer as writer_module

    paths, inv = _host_inventory(tmp_path)
    for d, _, _ in os.walk(tmp_path):  # settled directories: last changed a minute ago
        os.utime(d, ns=(os.stat(d).st_atime_ns, os.stat(d).st_mtime_ns - 60_000_000_000))
    calls: list[str] = []
    real = host_module.collect_driver

    def counting(*args: object, **kwargs: object) -> object:
        calls.append("listed")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(writer_module, "collect_driver", counting)
    writer = CdiWriter(paths)
    writer.write(inv)
    writer.write(inv)
    writer.write(Inventory(inv.driver_version, inv.cuda_driver_version, inv.gpus[:1]))
    assert calls == ["listed"]
    (paths("/usr/lib/x86_64-linux-gnu") / "libnvidia-encode.so.550.54.15").write_text("fake\n")
    assert writer.write(inv).action == "written" and calls == ["listed", "listed"]
