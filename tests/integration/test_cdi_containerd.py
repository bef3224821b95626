"""containerd 2.4 injects nodeagent's CDI devices: a container created through CRI (as the kubelet does) with
the device plugin's names, in the CreateContainer CDIDevices field and in the cdi.k8s.io annotation form,
gets the device nodes, environment, mounts and hooks of nodeagent's spec in its OCI runtime spec; one created
with a DRA claim's device-metadata name gets the metadata file bind-mounted read-only at its KEP-5304 path.

The pod sandbox runs a static pause binary from an OCI image archive written by the test and imported with
``ctr`` (no registry); the sandbox uses the host network, so no CNI is needed.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from nodeagent.cdi import simhost
from nodeagent.cdi.writer import CdiWriter
from nodeagent.deviceplugin.allocate import container_allocation
from nodeagent.dra.devices import build_devices
from nodeagent.dra.metadata import ClaimMetadata, group_requests
from nodeagent.sharing.devices import build_resources
from nodeagent.sharing.spec import parse_plugin_config
from tests.cdi_host import apply_layout, make_host
from tests.oci_image import write_image
from tests.peers.cdicheck import containerd2_shim_binary, pause_binary, run_cri_cdi
from tests.peers.containerd2 import Containerd2

IMAGE = "nodeagent.test/pause:1"
PLUGIN = """version: v1
flags:
  migStrategy: mixed
  plugin:
    deviceListStrategy: [cdi-cri, cdi-annotations]
    deviceIDStrategy: {ids}
"""


def _config(path: Path, spec_dir: Path) -> Path:
    path.write_text(f'''version = 3
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "native"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{IMAGE}"
[plugins."io.containerd.cri.v1.runtime"]
  restrict_oom_score_adj = true
  cdi_spec_dirs = ["{spec_dir}"]
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      runtime_path = "{containerd2_shim_binary()}"
''')
    return path


def _check(spec: dict[str, Any], want_nodes: set[str], root: Path, driver_version: str) -> None:
    devices = {d["path"]: d for d in spec["linux"]["devices"]}
    assert set(devices) == want_nodes | {"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools",
                                         "/dev/nvidia-modeset"}
    assert all(d["type"] == "c" for d in devices.values())
    allowed = {(r.get("major"), r.get("minor")) for r in spec["linux"]["resources"]["devices"] if r["allow"]}
    assert {(d["major"], d["minor"]) for d in devices.values()} <= allowed  # the device cgroup lets them in
    assert "NVIDIA_VISIBLE_DEVICES=void" in spec["process"]["env"]
    mounts = {m["destination"]: m for m in spec["mounts"]}
    lib = f"/usr/lib/x86_64-linux-gnu/libcuda.so.{driver_version}"
    assert mounts[lib]["source"] == str(root / lib.lstrip("/")) and "ro" in mounts[lib]["options"]
    assert mounts["/usr/bin/nvidia-smi"]["source"] == str(root / "usr/bin/nvidia-smi")
    hooks = spec["hooks"]["createContainer"]
    assert [h["args"][1] for h in hooks] == ["create-symlinks", "update-ldcache"]
    assert hooks[0]["path"] == str(root / "usr/bin/nvidia-cdi-hook")


def test_containerd_creates_containers_with_nodeagent_cdi_devices(containerd2: Containerd2, tmp_path: Path) -> None:
    host = make_host(tmp_path / "host", "dgx-h100")
    inv = apply_layout(host, {0: ["3g.40gb", "3g.40gb"], 1: ["1g.10gb"] * 7})
    assert CdiWriter(host.paths).write(inv).action == "written"

    archive = tmp_path / "pause.tar"
    write_image(archive, IMAGE, {"/pause": (pause_binary().read_bytes(), 0o755)}, ["/pause"])
    running = containerd2.start(_config(tmp_path / "config.toml", host.spec_dir))
    assert running.cri_error is None
    subprocess.run(["ctr", "--address", str(running.address), "-n", "k8s.io", "images", "import",
                    "--snapshotter", "native", str(archive)], check=True, capture_output=True, timeout=120)

    g0, g1, g2 = inv.gpu(0), inv.gpu(1), inv.gpu(2)
    mig0 = sorted(g0.mig_devices, key=lambda m: m.gi_id)[1]
    mig1 = sorted(g1.mig_devices, key=lambda m: m.gi_id)[4]

    def caps(minor: int, m: Any) -> set[str]:
        return {f"/dev/nvidia-caps/nvidia-cap{simhost.gi_minor(minor, m.gi_id)}",
                f"/dev/nvidia-caps/nvidia-cap{simhost.ci_minor(minor, m.gi_id, m.ci_id)}"}

    for ids in ("uuid", "index"):
        config = parse_plugin_config(PLUGIN.format(ids=ids))
        resources = build_resources(inv, config)
        flags = config.flags.plugin
        r3g, r1g, rgpu = (resources["nvidia.com/mig-3g.40gb"], resources["nvidia.com/mig-1g.10gb"],
                          resources["nvidia.com/gpu"])
        pick = [next(d.id for d in r3g.devices if d.physical.mig == mig0),
                next(d.id for d in r1g.devices if d.physical.mig == mig1),
                next(d.id for d in rgpu.devices if d.physical.gpu.index == 2)]
        allocs = [container_allocation(r, flags, [i]) for r, i in zip((r3g, r1g, rgpu), pick, strict=True)]
        cdi = [n for a in allocs for n in a.cdi_devices]
        want = {f"/dev/nvidia{g0.minor_number}", f"/dev/nvidia{g1.minor_number}", f"/dev/nvidia{g2.minor_number}"}
        want |= caps(g0.minor_number, mig0) | caps(g1.minor_number, mig1)

        by_field = run_cri_cdi(running.address, IMAGE, cdi_devices=cdi)
        _check(by_field, want, host.root, inv.driver_version)

        annotations = {k: v for a in allocs for k, v in a.annotations.items()}
        assert len(annotations) == 3
        by_annotation = run_cri_cdi(running.address, IMAGE, annotations=annotations)
        _check(by_annotation, want, host.root, inv.driver_version)

    # a DRA claim's device metadata (KEP-5304): containerd resolves its CDI name from the spec the driver
    # wrote beside the node-wide one and bind-mounts the file, read-only, where a pod's container reads it
    dev = next(d for d in build_devices(inv) if d.gpu_index == 2)
    meta = ClaimMetadata("gpu.nodeagent.io", host.paths("/var/lib/kubelet/plugins/gpu.nodeagent.io/dra-device-metadata"),
                         host.spec_dir, root=host.paths, published=host.paths.published)
    meta.write("default", "train", "c1a1m", "gpu", group_requests([(("gpu",), "node-a", dev)]))
    spec = run_cri_cdi(running.address, IMAGE, cdi_devices=["gpu.nodeagent.io/metadata=c1a1m_gpu"])
    inside = "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpu/gpu/gpu.nodeagent.io-metadata.json"
    [mount] = [m for m in spec["mounts"] if m["destination"] == inside]
    assert {"ro", "bind"} <= set(mount["options"]), mount
    assert mount["source"] == str(meta.file("default", "train", "gpu")), mount
    first, _ = json.JSONDecoder().raw_decode(Path(mount["source"]).read_text())
    [device] = first["requests"][0]["devices"]
    assert device["attributes"]["uuid"] == {"string": g2.uuid} and first["podClaimName"] == "gpu", first
