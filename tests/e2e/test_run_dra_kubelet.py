"""The ``nodeagent run`` daemon with plane "dra", driven end to end by the kubelet's own DRA code.

The daemon runs under a sandbox ``--root R`` and registers its DRA endpoint as the kubelet sees the host
(``/var/lib/kubelet/plugins/gpu.nodeagent.io/dra.sock``). The dra-harness (the kubelet's plugin watcher and
DRA manager) stands for a kubelet whose host filesystem is R (``--host-root``): it finds the registration
socket in R's ``plugins_registry`` and dials the endpoint under R. No scheduler runs: the test writes the
claim's allocation and reservation itself, as kube-scheduler would. Runs once per Kubernetes release (its
kube-apiserver and the harness built from its kubelet).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from nodeagent.kube.client import KubeClient, connect
from tests.e2e._agent import eventually, node_root, running_agent
from tests.e2e.test_run_dra import DRIVER, dra_node, remove_node, slice_devices, uuid_of
from tests.integration._releases import release_binary, shared_release_apiserver
from tests.integration.test_dra_kubelet import CLAIMS, create_allocated_claim
from tests.peers.apiserver import KubeApiServer
from tests.peers.cdicheck import run_cdi_check
from tests.peers.draharness import Pod, running_dra_harness

pytestmark = pytest.mark.peers

release_server = shared_release_apiserver  # the API server of each release, shared with other modules


def stream_objects(text: str) -> list[dict[str, Any]]:
    """The JSON objects of a device metadata file, in order."""
    decoder, out, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        obj, i = decoder.raw_decode(text, i)
        out.append(obj)
    return out


def claims_checkpoint(root: Path) -> dict[str, Any]:
    claims: dict[str, Any] = json.loads((root / "var/lib/nodeagent/dra-claims.json").read_text())["claims"]
    return claims


def test_daemon_prepares_through_the_kubelet_dra_manager_and_keeps_the_claim_across_a_restart(
    tmp_path: Path, release_server: KubeApiServer
) -> None:
    kube_apiserver = release_server
    harness = release_binary(kube_apiserver.version, "dra-harness")
    node = "e2e-dra-kubelet"
    _, args = dra_node(tmp_path, kube_apiserver, node, "dra")
    kube = KubeClient(connect(kube_apiserver.kubeconfig))
    claim_names: list[str] = []
    try:
        with node_root() as root:
            registry = root / "var/lib/kubelet/plugins_registry"
            cdi_dir = root / "var/run/cdi"
            (tmp_path / "first").mkdir()
            with running_agent(tmp_path / "first", root, args) as agent:
                agent.wait_notify("READY=1", timeout=20)
                devices = eventually(lambda: slice_devices(kube_apiserver, node), 20, "ResourceSlices of the node")
                device = "gpu-3"
                assert device in devices, sorted(devices)
                gpu_uuid = uuid_of(devices[device])
                with running_dra_harness(kube_apiserver.kubeconfig, registry, node, binary=harness,
                                        host_root=root) as h:
                    h.wait_registered(DRIVER, timeout=20)

                    # prepare: the per-claim CDI spec under R/var/run/cdi, resolved by the CDI library, and the
                    # claim's device metadata (KEP-5304) mounted where the released library puts it
                    pod = Pod("default", "e2e-dra-a", str(uuid.uuid4()), {}, {"main": ["gpu"]})
                    uid = create_allocated_claim(kube, node, [("gpu", device)], pod)
                    claim_names += list(pod.claims)
                    claim_name = next(iter(pod.claims.values()))
                    cdi = h.prepare(pod)
                    ids = [f"{DRIVER}/claim={uid}-{device}", f"{DRIVER}/metadata={uid}_gpu"]
                    assert cdi == {"main": ids}, cdi
                    spec_file = cdi_dir / f"{DRIVER}-claim_{uid}.json"
                    spec = json.loads(spec_file.read_text())
                    assert spec["kind"] == f"{DRIVER}/claim"
                    assert [d["name"] for d in spec["devices"]] == [f"{uid}-{device}"]
                    out = run_cdi_check([cdi_dir], [ids])
                    assert not any(out["errors"].values()), out["errors"]
                    [inj] = out["injections"]
                    assert inj["unresolved"] == [] and not inj.get("error"), inj
                    assert f"NVIDIA_VISIBLE_DEVICES={gpu_uuid}" in (inj["spec"]["process"].get("env") or []), inj
                    assert claims_checkpoint(root)[uid]["state"] == "prepared"
                    inside = (f"/var/run/kubernetes.io/dra-device-attributes/resourceclaims/{claim_name}/gpu/"
                              f"{DRIVER}-metadata.json")
                    [mount] = [m for m in inj["spec"].get("mounts") or [] if m["destination"] == inside]
                    assert mount["options"] == ["ro", "bind"], mount
                    metadata_file = Path(mount["source"])
                    assert metadata_file.is_relative_to(root / "var/lib/kubelet/plugins"), mount
                    [beta, alpha] = stream_objects(metadata_file.read_text())
                    assert (beta["apiVersion"], alpha["apiVersion"]) == ("metadata.resource.k8s.io/v1beta1",
                                                                         "metadata.resource.k8s.io/v1alpha1")
                    assert beta["metadata"] == {"name": claim_name, "namespace": "default", "uid": uid,
                                                "generation": 1}
                    [request] = beta["requests"]
                    [dev] = request["devices"]
                    assert (request["name"], dev["driver"], dev["pool"], dev["name"]) == ("gpu", DRIVER, node, device)
                    assert dev["attributes"]["uuid"] == {"string": gpu_uuid}
                    published = devices[device]["attributes"]
                    for key in ("productName", "resource.kubernetes.io/pciBusID", "driverVersion"):
                        assert dev["attributes"][key] == published[key], (key, dev["attributes"])
                    assert dev["attributes"]["memory"]["int"] > 0

                    # unprepare removes the spec, the metadata and the record
                    h.unprepare(pod)
                    assert not spec_file.exists()
                    assert not metadata_file.exists()
                    assert not (cdi_dir / f"{DRIVER}_metadata_{uid}_gpu.json").exists()
                    assert claims_checkpoint(root) == {}
                    gone = run_cdi_check([cdi_dir], [ids])
                    assert gone["injections"][0]["unresolved"] == ids

                    # a second claim stays prepared while the daemon restarts
                    kept = Pod("default", "e2e-dra-b", str(uuid.uuid4()), {}, {"main": ["gpu"]})
                    kept_uid = create_allocated_claim(kube, node, [("gpu", device)], kept)
                    claim_names += list(kept.claims)
                    kept_cdi = h.prepare(kept)
                    assert kept_cdi == {"main": [f"{DRIVER}/claim={kept_uid}-{device}",
                                                 f"{DRIVER}/metadata={kept_uid}_gpu"]}, kept_cdi
                code, _ = agent.stop()
                assert code == 0, agent.log()
                first_log = agent.log()
            kept_name = next(iter(kept.claims))
            assert first_log.count(f"prepared claim default/{kept_name} ") == 1, first_log
            kept_file = cdi_dir / f"{DRIVER}-claim_{kept_uid}.json"
            before = kept_file.stat()
            record = claims_checkpoint(root)[kept_uid]
            assert record["state"] == "prepared"

            # the restarted daemon answers from its checkpoint: a kubelet without DRA state of its own (a
            # fresh harness) asks NodePrepareResources again and gets the same CDI IDs, nothing rewritten
            (tmp_path / "second").mkdir()
            with running_agent(tmp_path / "second", root, args) as agent:
                agent.wait_notify("READY=1", timeout=20)
                with running_dra_harness(kube_apiserver.kubeconfig, registry, node, binary=harness,
                                        host_root=root) as h:
                    h.wait_registered(DRIVER, timeout=20)
                    assert h.prepare(kept) == kept_cdi
                    after = kept_file.stat()
                    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
                    assert claims_checkpoint(root) == {kept_uid: record}
                    assert "prepared claim" not in agent.log(), agent.log()
                    out = run_cdi_check([cdi_dir], [kept_cdi["main"]])
                    assert out["injections"][0]["unresolved"] == [], out

                    h.unprepare(kept)
                    assert not kept_file.exists()
                    assert claims_checkpoint(root) == {}
                    assert f"unprepared claim default/{kept_name} " in agent.log()
                code, _ = agent.stop()
                assert code == 0, agent.log()
    finally:
        kube.close()
        for name in claim_names:
            kube_apiserver.request("DELETE", f"{CLAIMS}/{name}")
        remove_node(kube_apiserver, node)
