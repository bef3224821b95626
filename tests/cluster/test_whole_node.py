"""The README's Kubernetes section, run as written on a real single-node cluster (tests/peers/cluster.py):
the manifests applied with the release's kubectl, the agent from its own image (built from
packaging/kubernetes/Containerfile), the real kubelet serving GPU pods through it.

The tests run in file order on one cluster: first on one installation of the agent from the plain manifests
(module fixture ``agent``), which test_kubectl_delete_leaves_the_node_clean deletes; then the README's Helm
lines install, upgrade and uninstall the chart (the block "Helm" at the end).

The agent's image is never imported into this cluster's containerd: the README's push of the image's manifest
list runs into a registry on 127.0.0.1 (module fixture ``registry``, Debian's docker-registry), which stands
for the README's ``registry.example.com``, and containerd pulls the image from it when the README's lines
deploy the DaemonSet with that name."""

from __future__ import annotations

import json
import os
import re
import shlex
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.oci_image import archive_image
from tests.peers.cluster import GPU_COUNT, MANIFESTS, Cluster
from tests.peers.registry import INDEX_TYPES, Registry, running_registry

pytestmark = pytest.mark.timeout(600)

README_SECTION = "## Kubernetes"
README_REGISTRY = "registry.example.com"  # the README's name of the registry the nodes pull from
RESOURCE = "nvidia.com/gpu"
# the agent's image comes from the registry below, pulled by containerd (tests/cluster/conftest.py)
CLUSTER_IMPORTS = ("pause", "base")


def readme_blocks() -> list[list[list[str]]]:
    """The README's Kubernetes section: each ``sh`` block as its command lines, each line split as sh would."""
    from tests.peers.cluster import REPO

    section = (REPO / "README.md").read_text().split(README_SECTION, 1)[1].split("\n## ", 1)[0]
    return [[shlex.split(line) for line in block.replace("\\\n", " ").strip().splitlines() if line.strip()]
            for block in re.findall(r"```sh\n(.*?)```", section, flags=re.S)]


def readme_args(command: list[str], cluster: Cluster, registry: str) -> list[str]:
    """A README line's arguments after its program, for this cluster: its node's name for ``<gpu-node>`` and
    ``registry`` for the README's registry."""
    return [a.replace("<gpu-node>", cluster.node_name).replace(README_REGISTRY, registry) for a in command[1:]]


def imported_registry(cluster: Cluster) -> str:
    """Where the README's image name leads to the agent's image a cluster imported from its archive
    (``docker.io/library`` for ``docker.io/library/nodeagent:0.1.0``): for the modules that import it."""
    registry, name = cluster.images["agent"].rsplit("/", 1)
    assert name == "nodeagent:0.1.0" and "agent" in cluster.imported, (cluster.images, cluster.imported)
    return registry


def readme_manifest_commands() -> list[list[str]]:
    """The shell lines of the README's "Without Helm" block (kubectl apply ..., kubectl set image ...,
    kubectl label node ...)."""
    block = next(b for b in readme_blocks() if b[0][:3] == ["kubectl", "apply", "-f"])
    assert [c[:3] for c in block] == [["kubectl", "apply", "-f"], ["kubectl", "set", "image"],
                                      ["kubectl", "label", "node"]], block
    return block


def agent_pods(cluster: Cluster) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cluster.get_json(
        "pods", "-n", "nodeagent", "-l", "app.kubernetes.io/name=nodeagent")["items"]
    return items


def running_agent(cluster: Cluster) -> dict[str, Any] | None:
    for pod in agent_pods(cluster):
        statuses = pod.get("status", {}).get("containerStatuses", [])
        if (pod["metadata"].get("deletionTimestamp") is None and statuses
                and all(s.get("ready") for s in statuses)):
            return pod
    return None


def allocatable(cluster: Cluster, resource: str = RESOURCE) -> int:
    return int(cluster.node().get("status", {}).get("allocatable", {}).get(resource, "0"))


ARCHIVES = {"amd64": "NODEAGENT_AGENT_IMAGE", "arm64": "NODEAGENT_AGENT_IMAGE_ARM64"}


def _archive(var: str) -> str:
    value = os.environ.get(var, "")
    if not Path(value).is_file():
        pytest.fail(f"{var} is not set or not a file ({value!r}): run `bash tests/testbin/setup.sh` (step "
                    "nodeagent_peers_agent_image_multiarch)", pytrace=False)
    return value


@pytest.fixture(scope="module")
def registry() -> Iterator[Registry]:
    """A registry on 127.0.0.1 holding the agent's image as the README pushes it for amd64 and arm64 nodes: its
    ``buildah manifest push --all`` line run as printed (the registry's address for registry.example.com) on
    the manifest list its ``buildah build --platform ... --manifest`` line makes, here of the amd64 and arm64
    images the setup built from the same Containerfile (the build is the setup's: no registry, no base image
    pulled)."""
    block = next(b for b in readme_blocks() if any(c[:3] == ["buildah", "manifest", "push"] for c in b))
    assert [c[:2] for c in block] == [["buildah", "build"], ["buildah", "manifest"]], block
    build, push = block
    assert build[build.index("--platform") + 1] == "linux/amd64,linux/arm64", build
    with running_registry() as reg:
        start = time.monotonic()
        name = build[build.index("--manifest") + 1].replace(README_REGISTRY, reg.host)
        reg.buildah("manifest", "create", name)
        for var in ARCHIVES.values():
            reg.buildah("manifest", "add", name, f"oci-archive:{_archive(var)}")
        listed = time.monotonic()
        args = [a.replace(README_REGISTRY, reg.host) for a in push[1:]]
        # the README's line, told that this registry speaks plain HTTP: buildah 1.28's `manifest push` does not
        # take `insecure` from registries.conf as its `push` does (a real registry.example.com has TLS)
        args.insert(args.index("push") + 1, "--tls-verify=false")
        reg.buildah(*args)
        print(f"the agent's manifest list: made in {listed - start:.1f}s, pushed in {time.monotonic() - listed:.1f}s")
        yield reg


@pytest.fixture(scope="module")
def agent(cluster: Cluster, registry: Registry) -> Iterator[dict[str, Any]]:
    """The README's lines run verbatim (with the cluster's node name and the registry's address), the agent
    Running and ready: its image pulled from the registry."""
    commands = readme_manifest_commands()
    start = time.monotonic()
    for command in commands:
        cluster.kubectl(*readme_args(command, cluster, registry.host))
    pod = cluster.wait_for("the agent pod Running and ready", lambda: running_agent(cluster), timeout=180)
    cluster.wait_for(f"allocatable {RESOURCE}: {GPU_COUNT}", lambda: allocatable(cluster) == GPU_COUNT, timeout=60)
    pod["readyAfter"] = time.monotonic() - start
    yield pod


def test_readme_manifests_make_the_node_gpu_ready(cluster: Cluster, agent: dict[str, Any]) -> None:
    node = cluster.node()
    assert node["status"]["allocatable"][RESOURCE] == str(GPU_COUNT)
    assert node["status"]["capacity"][RESOURCE] == str(GPU_COUNT)
    labels = node["metadata"]["labels"]
    assert labels["nvidia.com/gpu.count"] == str(GPU_COUNT)
    assert "H100" in labels["nvidia.com/gpu.product"], labels
    assert labels["nodeagent.io/gpu"] == "true"
    kinds = ("nodeagent.io/GPUReady", "nodeagent.io/GPUHealthy", "nodeagent.io/RuntimeReady")

    def conditions_of_the_agent() -> dict[str, Any] | None:
        # written by their own component, after the first publish: not necessarily with allocatable
        found = {c["type"]: c for c in cluster.node()["status"]["conditions"]}
        return found if all(found.get(k, {}).get("status") == "True" for k in kinds) else None

    try:
        conditions = cluster.wait_for("the nodeagent.io conditions True", conditions_of_the_agent, timeout=60)
    except Exception:
        print(json.dumps(cluster.node()["status"]["conditions"], indent=1))
        print(cluster.kubectl("logs", "-n", "nodeagent", agent["metadata"]["name"], "-c", "nodeagent").stdout[-20000:])
        raise
    for kind in kinds:
        assert conditions[kind]["status"] == "True", conditions[kind]
    # the init container (bootstrap) ran to completion before the agent started
    init = agent["status"]["initContainerStatuses"]
    assert [s["name"] for s in init] == ["bootstrap"]
    assert init[0]["state"]["terminated"]["exitCode"] == 0, init
    # ... at the first attempt, and it restarted the node's containerd to load the nvidia runtime (from a pod
    # without hostNetwork: the listener is found by the socket's peer credentials, not /proc/net/unix)
    assert init[0]["restartCount"] == 0, init
    assert cluster.containerd_restarts >= 1
    # one GPU object per card, written by the agent
    gpus = cluster.get_json("gpus")["items"]
    assert sorted(g["spec"]["index"] for g in gpus) == list(range(GPU_COUNT))



def test_containerd_pulled_the_agent_image_from_the_registry(
        cluster: Cluster, registry: Registry, agent: dict[str, Any]) -> None:
    """Both containers of the agent's pod run the image the README pushed, by the name the README's `kubectl set
    image` gave them; containerd resolved that name in the registry (plain HTTP on 127.0.0.1, without any
    registry configuration), took the amd64 image of the manifest list and fetched its layers from there: nothing
    of the agent's image was imported, and nothing of the arm64 image was fetched."""
    name = f"{registry.host}/nodeagent:0.1.0"
    containers = agent["spec"]["initContainers"] + agent["spec"]["containers"]
    assert [(c["name"], c["image"]) for c in containers] == [("bootstrap", name), ("nodeagent", name)]
    digest, index = registry.manifest("nodeagent", "0.1.0")
    assert index["mediaType"] in INDEX_TYPES, index
    platforms = {(m["platform"]["os"], m["platform"]["architecture"]): m["digest"] for m in index["manifests"]}
    assert set(platforms) == {("linux", "amd64"), ("linux", "arm64")}, index
    statuses = agent["status"]["initContainerStatuses"] + agent["status"]["containerStatuses"]
    assert {s["imageID"] for s in statuses} == {f"{registry.host}/nodeagent@{digest}"}, statuses
    # containerd holds the image by the pushed name and the manifest list's digest, and never got the imported one
    images = {line.split()[0]: line.split()[2] for line in cluster.ctr("images", "ls").stdout.splitlines()[1:]}
    assert images.get(name) == digest, images
    assert cluster.images["agent"] not in images and "agent" not in cluster.imported, images
    # what containerd fetched: the amd64 image's manifest, config and every layer the Debian base image (imported)
    # did not already bring; nothing of the arm64 image
    amd64 = registry.manifest("nodeagent", platforms["linux", "amd64"])[1]
    arm64 = registry.manifest("nodeagent", platforms["linux", "arm64"])[1]
    amd64_blobs = {amd64["config"]["digest"], *(layer["digest"] for layer in amd64["layers"])}
    arm64_blobs = {arm64["config"]["digest"], *(layer["digest"] for layer in arm64["layers"])} - amd64_blobs
    fetched = {r.path.rsplit("/", 1)[1] for r in registry.requests()
               if r.agent.startswith("containerd/") and r.method == "GET" and r.status in (200, 206)}
    base = set(layer["digest"] for layer in archive_image(os.environ["NODEAGENT_BASE_IMAGE"])[0]["layers"])
    assert platforms["linux", "amd64"] in fetched, sorted(fetched)
    assert amd64_blobs - base <= fetched, (sorted(amd64_blobs - base - fetched), sorted(fetched))
    assert len(amd64_blobs - base) >= 2, amd64  # the config and the agent's own layers at least
    assert not fetched & (arm64_blobs | {platforms["linux", "arm64"]}), sorted(fetched & arm64_blobs)


def test_agent_writes_with_its_own_service_account_token(cluster: Cluster, agent: dict[str, Any]) -> None:
    assert agent["spec"]["serviceAccountName"] == "nodeagent"
    writes, _ = cluster.apiserver.audit_writes()
    node_writes = [w for w in writes if w.resource == "nodes" and w.name == cluster.node_name
                   and w.user == "system:serviceaccount:nodeagent:nodeagent"]
    assert node_writes, "the agent never wrote its Node with its service account"
    assert all(w.code < 300 for w in node_writes), node_writes
    # the admission policy is in force: the same token may not touch another Node
    policy = cluster.get_json("validatingadmissionpolicybinding", "nodeagent-own-node")
    assert policy["spec"]["policyName"] == "nodeagent-own-node"


def _gpu_pod(name: str, count: int, command: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "main", "image": "docker.io/library/debian:bookworm-slim", "imagePullPolicy": "Never",
        "command": ["/bin/sh", "-c", command],
    }
    if count:
        container["resources"] = {"limits": {RESOURCE: count}}
    spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [container], **(extra or {})}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"}, "spec": spec}


def run_pod(cluster: Cluster, pod: dict[str, Any], timeout: float = 90) -> tuple[dict[str, Any], str]:
    """Create ``pod``, wait until it ends; (its final object, its log)."""
    name = pod["metadata"]["name"]
    cluster.kubectl("apply", "-f", "-", input_text=json.dumps(pod))

    def ended() -> dict[str, Any] | None:
        obj = cluster.get_json("pod", name)
        return obj if obj["status"].get("phase") in ("Succeeded", "Failed") else None

    obj = cluster.wait_for(f"pod {name} ended", ended, timeout=timeout)
    log = cluster.kubectl("logs", name).stdout
    return obj, log


PROBE = ("ls /dev | grep -E '^nvidia[0-9]+$' | sort | tr '\\n' ' '; echo; "
         "echo \"env=$NVIDIA_VISIBLE_DEVICES\"; ls /dev/nvidiactl 2>&1; "
         # alive until the test has asked the kubelet's PodResources API, at most 60 s
         "i=0; while [ ! -e /tmp/done ] && [ $i -lt 120 ]; do sleep 0.5; i=$((i+1)); done")


def pod_devices(name: str, resource: str = RESOURCE) -> list[str]:
    """The device IDs the kubelet's PodResources API says pod ``name`` (namespace default) holds."""
    from nodeagent.kube.podresources import PodResourcesClient
    from tests.peers.cluster import KUBELET_DIR

    client = PodResourcesClient(KUBELET_DIR / "pod-resources" / "kubelet.sock")
    try:
        return sorted(d for a in client.list() if a.namespace == "default" and a.pod == name
                      and a.resource == resource for d in a.device_ids)
    finally:
        client.close()


def run_probe(cluster: Cluster, pod: dict[str, Any], resource: str = RESOURCE) -> tuple[dict[str, Any], str, list[str]]:
    """Start ``pod`` (running PROBE), read what the kubelet says it holds while it runs, let it end; (its
    final object, its log, its device IDs)."""
    name = pod["metadata"]["name"]
    cluster.kubectl("apply", "-f", "-", input_text=json.dumps(pod))
    cluster.wait_for(f"pod {name} Running", lambda: cluster.get_json("pod", name)["status"].get("phase") in (
        "Running", "Succeeded", "Failed"), timeout=90)
    devices = pod_devices(name, resource)
    cluster.kubectl("exec", name, "--", "touch", "/tmp/done")

    def ended() -> dict[str, Any] | None:
        obj = cluster.get_json("pod", name)
        return obj if obj["status"].get("phase") in ("Succeeded", "Failed") else None

    obj = cluster.wait_for(f"pod {name} ended", ended, timeout=90)
    log = cluster.kubectl("logs", name).stdout
    cluster.kubectl("delete", "pod", name, "--wait=true")
    return obj, log, devices


def test_pod_with_two_gpus_gets_them_by_the_default_envvar_strategy(cluster: Cluster, agent: dict[str, Any]) -> None:
    """The default ``deviceListStrategy: envvar`` names the GPUs in NVIDIA_VISIBLE_DEVICES for NVIDIA's
    container runtime to inject; the agent adds no device node itself (this node has no NVIDIA runtime, so
    the container has none: the cdi-cri test below gets them from containerd)."""
    obj, log, devices = run_probe(cluster, _gpu_pod("two-gpus", 2, PROBE))
    assert obj["status"]["phase"] == "Succeeded", (obj["status"], log)
    terminated = obj["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 0, terminated
    lines = log.splitlines()
    uuids = lines[1].removeprefix("env=").split(",")
    assert len(uuids) == 2 and all(u.startswith("GPU-") for u in uuids), log
    # what the kubelet gave the pod (PodResources) is what the container was told
    assert sorted(uuids) == devices, (uuids, devices)
    assert lines[0].split() == [], log  # no GPU device node without a runtime that injects them


def _sleeper(name: str, count: int) -> dict[str, Any]:
    return _gpu_pod(name, count, "sleep 3600", {"terminationGracePeriodSeconds": 0})


def _wait_running(cluster: Cluster, name: str) -> dict[str, Any]:
    def running() -> dict[str, Any] | None:
        obj = cluster.get_json("pod", name)
        return obj if obj["status"].get("phase") == "Running" else None

    result: dict[str, Any] = cluster.wait_for(f"pod {name} Running", running, timeout=90)
    return result


def _visible(cluster: Cluster, name: str) -> list[str]:
    out = cluster.kubectl("exec", name, "--", "sh", "-c", "echo $NVIDIA_VISIBLE_DEVICES; ls /dev").stdout
    lines = out.splitlines()
    return sorted(lines[0].split(",")) + sorted(n for n in lines[1:] if re.fullmatch(r"nvidia[0-9]+", n))


# --- GPU remediation (docs/remediation.md) ---
# Remediation turned on through the agent's ConfigMap, the packaged controller Deployment evicting for it under
# its own service account; two GPU pods, one of them under a PodDisruptionBudget. The class's fixture puts the
# packaged ConfigMap back (the agent restarted with it), the simulated GPUs back and the controller gone, so what
# follows sees the agent as the README's lines installed it.

# one reset per GPU within the hour: the second fault needing a reset quarantines the GPU
REMEDIATION_CONFIG = "[remediation]\nenabled = true\neviction_grace = 1.0\nmax_resets = 1\n"
REMEDIATION_EVENTS = ("GPURemediationStarted", "GPURemediationStep", "GPURemediated", "NodeRebootRequired",
                      "GPUApplicationRestartAdvised", "GPUQuarantined", "GPURemediationRolledBack")
REMEDIATION_RECORD = "/var/lib/nodeagent/remediation.json"  # the agent's state record, on the node


def _record() -> dict[str, Any]:
    """The remediation state record the agent keeps on the node (runs in flight, resets, quarantined GPUs)."""
    from pathlib import Path

    path = Path(REMEDIATION_RECORD)
    record: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    return record


def _controller_manifests(registry: Registry) -> list[dict[str, Any]]:
    """packaging/kubernetes/remediation-controller.yaml with the image the registry holds and one replica (the
    leader-elected second one only waits)."""
    import yaml

    docs = [d for d in yaml.safe_load_all((MANIFESTS / "remediation-controller.yaml").read_text()) if d]
    for d in docs:
        if d["kind"] == "Deployment":
            d["spec"]["replicas"] = 1
            for c in d["spec"]["template"]["spec"]["containers"]:
                c["image"] = f"{registry.host}/nodeagent:0.1.0"
    return docs


def _remediation_configmap() -> dict[str, Any]:
    configmap = _packaged_configmap()
    configmap["data"]["config.toml"] += REMEDIATION_CONFIG
    return configmap


def _node_events(cluster: Cluster) -> list[dict[str, Any]]:
    """The remediation's Events about the Node, oldest first."""
    items = cluster.get_json("events", "-A", "--field-selector",
                             f"involvedObject.kind=Node,involvedObject.name={cluster.node_name}")["items"]
    return sorted((e for e in items if e["reason"] in REMEDIATION_EVENTS),
                  key=lambda e: (e.get("eventTime") or e.get("lastTimestamp") or "", e["metadata"]["name"]))


def _condition(cluster: Cluster, kind: str) -> dict[str, Any]:
    found: dict[str, Any] = {c["type"]: c for c in cluster.node()["status"]["conditions"]}.get(kind, {})
    return found


def _eviction_results(cluster: Cluster) -> dict[str, Any]:
    value = cluster.node()["metadata"].get("annotations", {}).get("nodeagent.io/eviction-results", "{}")
    results: dict[str, Any] = json.loads(value)
    return results


def _container(cluster: Cluster, name: str) -> tuple[str, str, int]:
    """A pod's UID, its container's ID and restart count: unchanged when it was never disturbed."""
    pod = cluster.get_json("pod", name)
    status = pod["status"]["containerStatuses"][0]
    return pod["metadata"]["uid"], status["containerID"], status["restartCount"]


@pytest.fixture(scope="class")
def remediation(cluster: Cluster, agent: dict[str, Any], registry: Registry) -> Iterator[dict[int, str]]:
    """Remediation on: the controller Deployment applied, the ConfigMap with ``[remediation]``, the agent
    restarted with it; GPU index → UUID. After the class: no pod or budget of it, the simulated GPUs back, the
    packaged ConfigMap and the agent restarted with it (allocatable 8 again), no controller."""
    began = time.monotonic()
    controller = {"apiVersion": "v1", "kind": "List", "items": _controller_manifests(registry)}
    cluster.kubectl("apply", "-f", "-", input_text=json.dumps(controller))
    _restart_agent_with(cluster, _remediation_configmap(), f"remediation on, allocatable {GPU_COUNT}",
                        lambda: allocatable(cluster) == GPU_COUNT)
    cluster.wait_for("the remediation controller Running and ready", lambda: any(
        all(s.get("ready") for s in p["status"].get("containerStatuses", [{}])) and p["status"].get("containerStatuses")
        for p in cluster.get_json("pods", "-n", "nodeagent", "-l",
                                  "app.kubernetes.io/name=nodeagent-remediation")["items"]), timeout=120)
    print(f"remediation on (controller ready, agent restarted) in {time.monotonic() - began:.1f}s")
    yield {g["spec"]["index"]: g["spec"]["uuid"] for g in cluster.get_json("gpus")["items"]}
    began = time.monotonic()
    from nodeagent.simulator import inject
    from nodeagent.simulator.state import SimStore
    from tests.peers.cluster import MACHINE, SIM_STATE

    cluster.kubectl("delete", "pod", "remed-held", "remed-other", "remed-seven", "--ignore-not-found", "--wait=true")
    cluster.kubectl("delete", "pdb", "remed-held", "--ignore-not-found")
    inject.recover(SimStore.open(MACHINE, SIM_STATE))
    from pathlib import Path

    Path(REMEDIATION_RECORD).unlink(missing_ok=True)  # no reset history or quarantine for what follows
    _restart_agent_with(cluster, _packaged_configmap(), f"the packaged config again, allocatable {GPU_COUNT}",
                        lambda: allocatable(cluster) == GPU_COUNT)
    cluster.kubectl("delete", "-f", "-", "--ignore-not-found", "--wait=false", input_text=json.dumps(controller))
    print(f"remediation off again (packaged config, agent restarted) in {time.monotonic() - began:.1f}s")


@pytest.mark.usefixtures("remediation")
class TestRemediation:
    """XID 48 on the GPU of a pod under a PodDisruptionBudget (the agent killed while the budget holds the
    eviction back), XID 13, XID 79, a second reset of the first GPU (quarantine), in this order."""

    def test_xid48_budget_holds_the_pod_agent_killed_then_only_its_pod_leaves_and_the_gpu_comes_back(
            self, cluster: Cluster, remediation: dict[int, str]) -> None:
        from nodeagent.simulator import inject
        from nodeagent.simulator.state import SimStore
        from tests.peers.cluster import MACHINE, SIM_STATE

        index_of = {u: i for i, u in remediation.items()}
        held = _sleeper("remed-held", 1)
        held["metadata"]["labels"] = {"app": "remed-held"}
        budget = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                  "metadata": {"name": "remed-held", "namespace": "default"},
                  "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "remed-held"}}}}
        for obj in (budget, held, _sleeper("remed-other", 1)):
            cluster.kubectl("apply", "-f", "-", input_text=json.dumps(obj))
        _wait_running(cluster, "remed-held")
        _wait_running(cluster, "remed-other")
        (held_uuid,), (other_uuid,) = pod_devices("remed-held"), pod_devices("remed-other")
        # what the container was told is what the kubelet says it holds
        assert _visible(cluster, "remed-held") == [held_uuid] and _visible(cluster, "remed-other") == [other_uuid]
        gpu = index_of[held_uuid]
        other_before = _container(cluster, "remed-other")
        held_before = _container(cluster, "remed-held")
        cluster.wait_for("the budget in force (0 disruptions allowed)", lambda: cluster.get_json(
            "pdb", "remed-held").get("status", {}).get("currentHealthy") == 1, timeout=30)

        fault = time.monotonic()
        # the driver asks for a GPU reset with the XID (field 230): a successor agent, which never saw the XID,
        # knows from NVML that the reset is still needed
        inject.inject_xid(SimStore.open(MACHINE, SIM_STATE), gpu, 48, None, recovery_action=1)
        cluster.wait_for(f"allocatable drops to {GPU_COUNT - 1} after XID 48 on GPU {gpu}",
                         lambda: allocatable(cluster) == GPU_COUNT - 1, timeout=60, poll=0.2)
        # the budget refuses: the controller says so, the pod stays, the GPU stays out
        cluster.wait_for("the controller's outcome for the pod: blocked", lambda: _eviction_results(cluster).get(
            "default/remed-held", {}).get("result") == "blocked", timeout=30, poll=0.3)
        condition = _condition(cluster, "nodeagent.io/GPURemediation")
        assert condition["status"] == "True" and condition["reason"] == "InProgress", condition
        assert held_uuid in condition["message"] and "reset-gpu" in condition["message"], condition
        assert _container(cluster, "remed-held") == held_before
        assert allocatable(cluster) == GPU_COUNT - 1

        # the agent killed in the middle of the run: the record on the node says the GPU is withdrawn and the
        # eviction not done; the successor reads it, holds the GPU out again and finishes the plan
        run = _record()["runs"][held_uuid]
        assert "withdraw" in run["done"] and "evict" not in run["done"] and "reset" not in run["done"], run

        def request() -> dict[str, Any]:
            found: dict[str, Any] = json.loads(cluster.node()["metadata"].get("annotations", {}).get(
                "nodeagent.io/eviction-requests", "{}")).get("default/remed-held", {})
            return found

        first_deadline = request()["deadline"]
        killed = time.monotonic()
        old = running_agent(cluster)
        assert old is not None
        cluster.kubectl("delete", "pod", "-n", "nodeagent", old["metadata"]["name"], "--wait=false")
        seen: set[int] = set()

        def successor_holds_it() -> bool:  # its own request: a later deadline than the first agent's
            seen.add(allocatable(cluster))
            new = running_agent(cluster)
            return (new is not None and new["metadata"]["name"] != old["metadata"]["name"]
                    and request().get("deadline", 0) > first_deadline)

        cluster.wait_for("the successor agent asks for the eviction again", successor_holds_it, timeout=120, poll=0.3)
        successor_in = time.monotonic() - killed
        # what the Node's allocatable showed meanwhile (0 while no plugin serves; 8 would be the GPU offered in
        # the moment between the new plugin's registration and the successor's hold)
        print(f"allocatable while the agent was replaced: {sorted(seen)}")
        assert _container(cluster, "remed-held") == held_before  # the budget still holds the pod
        assert held_uuid in _record()["runs"]

        # the budget relaxed: that pod alone is evicted, the GPU reset and offered again
        relaxed = time.monotonic()
        cluster.kubectl("patch", "pdb", "remed-held", "--type", "merge", "-p", '{"spec":{"minAvailable":0}}')
        cluster.wait_for(f"GPU {gpu} back: allocatable {GPU_COUNT}", lambda: allocatable(cluster) == GPU_COUNT,
                         timeout=90, poll=0.2)
        back = time.monotonic()
        gone = cluster.kubectl("get", "pod", "remed-held", "--ignore-not-found", "-o", "name").stdout.strip()
        assert gone == "", gone
        assert _container(cluster, "remed-other") == other_before  # the same container, never restarted
        assert _wait_running(cluster, "remed-other")["status"]["phase"] == "Running"
        messages = [(e["reason"], e["message"]) for e in _node_events(cluster)]
        steps = [m for r, m in messages if r == "GPURemediationStep"]
        for step in ("withdraw", "evict", "stop-users", "persistence-off", "reset", "verify", "restore", "offer"):
            assert any(f": {step} done in" in m and held_uuid in m for m in steps), (step, messages)
        assert not any(other_uuid in m for _, m in messages), messages
        print("the pipeline's steps:", "; ".join(m.split(": ", 1)[1] for m in steps if held_uuid in m))
        assert any(r == "GPURemediated" and held_uuid in m for r, m in messages), messages
        condition = _condition(cluster, "nodeagent.io/GPURemediation")
        assert condition["status"] == "False" and condition["reason"] == "Idle", condition
        # the simulated driver was reset: the XID's recovery need is gone and NVML calls it healthy
        state = SimStore.open(MACHINE, SIM_STATE).read()["gpus"][gpu]
        assert not state.get("lost") and state.get("recovery_action", 0) == 0, state
        # the successor consumed the run the first agent recorded; the reset is in the history
        record = _record()
        assert record["runs"] == {} and len(record["resets"].get(held_uuid, [])) == 1, record
        print(json.dumps({"remediation_xid48_fault_to_allocatable_s": round(back - fault, 1),
                          "remediation_budget_relaxed_to_allocatable_s": round(back - relaxed, 1),
                          "remediation_agent_killed_to_successor_asking_s": round(successor_in, 1),
                          "pods_disturbed": 1}))

    def test_xid13_only_tells_the_pod(self, cluster: Cluster, remediation: dict[int, str]) -> None:
        from nodeagent.simulator import inject
        from nodeagent.simulator.state import SimStore
        from tests.peers.cluster import MACHINE, SIM_STATE

        (uuid,) = pod_devices("remed-other")
        before = _container(cluster, "remed-other")
        gpu = {u: i for i, u in remediation.items()}[uuid]
        inject.inject_xid(SimStore.open(MACHINE, SIM_STATE), gpu, 13, None)
        advised = cluster.wait_for("the event GPUApplicationRestartAdvised", lambda: [
            e for e in _node_events(cluster) if e["reason"] == "GPUApplicationRestartAdvised"], timeout=30)
        assert uuid in advised[-1]["message"] and "default/remed-other" in advised[-1]["message"], advised
        assert allocatable(cluster) == GPU_COUNT
        assert _container(cluster, "remed-other") == before
        assert "default/remed-other" not in _eviction_results(cluster)
        assert not [e for e in _node_events(cluster) if e["reason"] == "GPURemediationStarted" and uuid in e["message"]]

    def test_xid79_reboot_required_and_the_gpu_stays_out(self, cluster: Cluster, remediation: dict[int, str]) -> None:
        from nodeagent.simulator import inject
        from nodeagent.simulator.state import SimStore
        from tests.peers.cluster import MACHINE, SIM_STATE

        cluster.kubectl("delete", "pod", "remed-other", "--wait=true")
        gpu = 6
        inject.inject_lost(SimStore.open(MACHINE, SIM_STATE), gpu)  # falls off the bus: XID 79
        condition = cluster.wait_for("the RebootRequired condition", lambda: (lambda c: c if c.get("status") == "True"
                                     else None)(_condition(cluster, "nodeagent.io/RebootRequired")), timeout=60)
        assert condition["reason"] == "NodeRebootRequired" and remediation[gpu] in condition["message"], condition
        assert any(e["reason"] == "NodeRebootRequired" and remediation[gpu] in e["message"]
                   for e in _node_events(cluster))
        cluster.wait_for(f"allocatable {GPU_COUNT - 1}", lambda: allocatable(cluster) == GPU_COUNT - 1, timeout=30)
        # a pod asking for every allocatable GPU gets all but the one that fell off the bus
        cluster.kubectl("apply", "-f", "-", input_text=json.dumps(_sleeper("remed-seven", GPU_COUNT - 1)))
        _wait_running(cluster, "remed-seven")
        got = pod_devices("remed-seven")
        assert len(got) == GPU_COUNT - 1 and remediation[gpu] not in got, (got, remediation[gpu])
        cluster.kubectl("delete", "pod", "remed-seven", "--wait=true")
        assert allocatable(cluster) == GPU_COUNT - 1  # still out: nothing brings it back before a reboot
        # the way back (docs/remediation.md): the node rebooted, here the simulated GPU back on the bus and the
        # agent started again; the new agent finds nothing needing a reboot and clears the condition
        inject.recover(SimStore.open(MACHINE, SIM_STATE), gpu)
        _restart_agent_with(cluster, _remediation_configmap(), f"after the reboot: allocatable {GPU_COUNT} and no reboot required",
                            lambda: allocatable(cluster) == GPU_COUNT and _condition(
                                cluster, "nodeagent.io/RebootRequired").get("status") == "False")
        assert _condition(cluster, "nodeagent.io/RebootRequired")["reason"] == "NotRequired"

    def test_a_second_reset_within_the_window_quarantines_the_gpu(
            self, cluster: Cluster, remediation: dict[int, str]) -> None:
        from pathlib import Path

        from nodeagent.simulator import inject
        from nodeagent.simulator.state import SimStore
        from tests.peers.cluster import MACHINE, SIM_STATE

        (uuid,) = _record()["resets"]  # the GPU the first test reset (max_resets = 1)
        gpu = {u: i for i, u in remediation.items()}[uuid]
        began = time.monotonic()
        inject.inject_xid(SimStore.open(MACHINE, SIM_STATE), gpu, 48, None, recovery_action=1)
        condition = cluster.wait_for("the RebootRequired condition: GPUQuarantined", lambda: (
            lambda c: c if c.get("reason") == "GPUQuarantined" else None)(
                _condition(cluster, "nodeagent.io/RebootRequired")), timeout=60, poll=0.3)
        assert condition["status"] == "True" and uuid in condition["message"], condition
        cluster.wait_for(f"allocatable {GPU_COUNT - 1}", lambda: allocatable(cluster) == GPU_COUNT - 1, timeout=30,
                         poll=0.3)
        quarantined_in = time.monotonic() - began
        assert any(e["reason"] == "GPUQuarantined" and uuid in e["message"] for e in _node_events(cluster))
        record = _record()
        assert uuid in record["quarantined"] and len(record["resets"][uuid]) == 1, record  # not reset again
        # no reset ran: the driver still asks for one
        assert SimStore.open(MACHINE, SIM_STATE).read()["gpus"][gpu]["recovery_action"] == 1
        # the way back docs/remediation.md gives an operator: the GPU repaired, its entry removed, the agent
        # restarted; nothing needs a reboot any more
        inject.recover(SimStore.open(MACHINE, SIM_STATE), gpu)
        record["quarantined"].pop(uuid)
        Path(REMEDIATION_RECORD).write_text(json.dumps(record))
        _restart_agent_with(cluster, _remediation_configmap(), f"out of quarantine: allocatable {GPU_COUNT}",
                            lambda: allocatable(cluster) == GPU_COUNT and _condition(
                                cluster, "nodeagent.io/RebootRequired").get("status") == "False")
        print(json.dumps({"remediation_quarantine_fault_to_withdrawn_s": round(quarantined_in, 1),
                          "remediation_quarantine_total_s": round(time.monotonic() - began, 1)}))


def test_agent_pod_deleted_comes_back_and_running_pods_keep_their_devices(
        cluster: Cluster, agent: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-f", "-", input_text=json.dumps(_sleeper("holder", 1)))
    _wait_running(cluster, "holder")
    before = _visible(cluster, "holder")
    held = pod_devices("holder")
    assert before == held and len(held) == 1, (before, held)
    old = running_agent(cluster)
    assert old is not None
    cluster.kubectl("delete", "pod", "-n", "nodeagent", old["metadata"]["name"], "--wait=false")
    start = time.monotonic()
    zero_since: float | None = None
    longest_zero = 0.0

    def back() -> dict[str, Any] | None:
        nonlocal zero_since, longest_zero
        now = time.monotonic()
        if allocatable(cluster) == 0:
            zero_since = now if zero_since is None else zero_since
            longest_zero = max(longest_zero, now - zero_since)
        else:
            zero_since = None
        pod = running_agent(cluster)
        if pod is None or pod["metadata"]["name"] == old["metadata"]["name"]:
            return None
        return pod if allocatable(cluster) == GPU_COUNT else None

    new = cluster.wait_for("a new agent pod with allocatable 8", back, timeout=180, poll=0.3)
    restarted_in = time.monotonic() - start
    assert new["metadata"]["name"] != old["metadata"]["name"]
    # allocatable never stayed at 0 longer than the restart itself
    assert longest_zero <= restarted_in, (longest_zero, restarted_in)
    # the running pod still has its devices, the same ones
    assert _wait_running(cluster, "holder")["status"]["phase"] == "Running"
    assert _visible(cluster, "holder") == before
    assert pod_devices("holder") == held
    cluster.kubectl("delete", "pod", "holder", "--wait=true")


def _registrations(cluster: Cluster) -> int:
    """How often the running agent has registered nvidia.com/gpu with the kubelet (its JSON log)."""
    pod = running_agent(cluster)
    if pod is None:
        return -1
    try:
        log = cluster.kubectl("logs", "-n", "nodeagent", pod["metadata"]["name"], "-c", "nodeagent").stdout
    except RuntimeError:  # the logs come through the kubelet, which may be restarting
        return -1
    return sum(1 for line in log.splitlines() if f"registered {RESOURCE} with the kubelet" in line)


def test_kubelet_restart_the_agent_registers_again(cluster: Cluster, agent: dict[str, Any]) -> None:
    before = _registrations(cluster)
    assert before >= 1
    cluster.restart_kubelet()
    # the new kubelet knows the plugin only from a new Register call of the same agent process
    cluster.wait_for("the agent registers again after the kubelet restarted",
                     lambda: _registrations(cluster) > before, timeout=120)
    cluster.wait_for("allocatable 8 after the kubelet restarted", lambda: allocatable(cluster) == GPU_COUNT
                     and running_agent(cluster) is not None, timeout=120)
    obj, log, devices = run_probe(cluster, _gpu_pod("after-restart", 1, PROBE))
    assert obj["status"]["phase"] == "Succeeded", (obj["status"], log)
    assert len(devices) == 1 and f"env={devices[0]}" in log.splitlines(), (devices, log)


DEVICE_PLUGIN_CONFIG = """version: v1
flags:
  plugin:
    deviceListStrategy: cdi-cri
sharing:
  timeSlicing:
    resources:
      - name: nvidia.com/gpu
        replicas: 2
"""


def test_cdi_cri_with_time_slicing_containerd_injects_the_devices(cluster: Cluster, agent: dict[str, Any]) -> None:
    """``deviceListStrategy: cdi-cri`` and two time-slicing replicas per GPU, through the ConfigMap: the kubelet
    passes the CDI names, containerd injects the device nodes from nodeagent's spec, the pod sees exactly the
    GPUs of its replicas."""
    import yaml

    configmap = yaml.safe_load((MANIFESTS / "configmap.yaml").read_text())
    configmap["data"]["config.toml"] += '[device_plugin]\nconfig = "/etc/nodeagent/device-plugin.yaml"\n'
    configmap["data"]["device-plugin.yaml"] = DEVICE_PLUGIN_CONFIG
    _restart_agent_with(cluster, configmap, f"allocatable {2 * GPU_COUNT} ({GPU_COUNT} GPUs x 2 replicas)",
                        lambda: allocatable(cluster) == 2 * GPU_COUNT)
    obj, log, devices = run_probe(cluster, _gpu_pod("cdi-two", 2, PROBE))
    assert obj["status"]["phase"] == "Succeeded", (obj["status"], log)
    assert len(devices) == 2 and all("::" in d for d in devices), devices
    gpus = {g["spec"]["uuid"]: g["spec"]["path"] for g in cluster.get_json("gpus")["items"]}
    want = sorted({gpus[d.split("::")[0]].rsplit("/", 1)[1] for d in devices})
    lines = log.splitlines()
    assert lines[0].split() == want, (log, devices)
    assert lines[1] == "env=void", log  # cdi-cri names no devices in the environment
    # the spec's control nodes, found through the DaemonSet's /host/dev and named by the node's own paths
    # (--root-on-host /), reached the container too
    assert lines[2] == "/dev/nvidiactl", log
    from tests.peers.cluster import CDI_DIR

    specs = "".join(p.read_text() for p in CDI_DIR.glob("*.yaml"))
    assert "/dev/nvidia-uvm" in specs and "/host/" not in specs, specs[:4000]


# --- MPS ---
# NVIDIA's device-plugin config with ``sharing.mps`` through the ConfigMap: the agent runs the driver's
# nvidia-cuda-mps-control (here the simulator's stand-in installed as the node's /usr/bin program, found by
# the agent under /host) with its pipe directory on the node, and a pod asking for a replica gets that
# directory, CUDA_MPS_PIPE_DIRECTORY and the node's /dev/shm, which the agent's container shares.

MPS_REPLICAS = 4
MPS_CONFIG = f"""version: v1
flags:
  plugin:
    deviceListStrategy: cdi-cri
sharing:
  mps:
    resources:
      - name: nvidia.com/gpu
        replicas: {MPS_REPLICAS}
"""
MPS_PIPE = "/run/nodeagent/mps/nvidia.com_gpu/pipe"  # the node's path: the agent's /host/run/nodeagent/...
MPS_SHM_PROBE = "nodeagent-mps-probe"


def _restart_agent_with(cluster: Cluster, configmap: dict[str, Any], what: str, check: Any,
                        sys_path: str | None = None) -> dict[str, Any]:
    """Apply ``configmap``, delete the agent's pod (its new pod mounts the new files), wait for ``check``; with
    ``sys_path`` the DaemonSet's ``sys`` volume (the node's /sys in the agent's container) is that host
    directory from then on (the simulated PCI tree of the VFIO test, writable as the packaged
    daemonset-vfio.patch.yaml makes it; or /sys again, read-only as daemonset.yaml has it)."""
    cluster.kubectl("apply", "-f", "-", input_text=json.dumps(configmap))
    old = running_agent(cluster)
    assert old is not None
    if sys_path is not None and _agent_sys(cluster) != sys_path:
        volume = {"name": "sys", "hostPath": {"path": sys_path, "type": "Directory"}}
        if sys_path == "/sys":
            # back to the plain manifest: read-only, no /usr/share
            patch: dict[str, Any] = {"spec": {"template": {"spec": {
                "containers": [{"name": "nodeagent", "volumeMounts": [
                    {"name": "sys", "mountPath": "/host/sys", "readOnly": True},
                    {"$patch": "delete", "mountPath": "/host/usr/share"}]}],
                "volumes": [volume, {"$patch": "delete", "name": "usr-share"}]}}}}
        else:
            import yaml

            # the packaged patch (the one kubectl line of docs/vfio-cc.md), with the simulated tree as the volume:
            # one template change, one rollout
            patch = yaml.safe_load(VFIO_PATCH.read_text())
            patch["spec"]["template"]["spec"]["volumes"].append(volume)
        cluster.kubectl("patch", "daemonset", "-n", "nodeagent", "nodeagent", "--type", "strategic", "-p",
                        json.dumps(patch))
    cluster.kubectl("delete", "pod", "-n", "nodeagent", old["metadata"]["name"], "--ignore-not-found", "--wait=true")

    def sys_of(pod: dict[str, Any]) -> str:
        path: str = next(v["hostPath"]["path"] for v in pod["spec"]["volumes"] if v["name"] == "sys")
        return path

    def restarted() -> dict[str, Any] | None:
        pod = running_agent(cluster)
        if pod is None or pod["metadata"]["name"] == old["metadata"]["name"]:
            return None
        # the DaemonSet controller may still make a pod of the template before the patch (its pod and DaemonSet
        # informers are not ordered): only a pod of the patched one counts, it replaces the other one itself
        if sys_path is not None and sys_of(pod) != sys_path:
            return None
        return pod if check() else None

    pod: dict[str, Any] = cluster.wait_for(what, restarted, timeout=180)
    return pod


def _agent_sys(cluster: Cluster) -> str:
    """The host directory the agent's DaemonSet mounts as the node's /sys."""
    ds = cluster.get_json("daemonset", "-n", "nodeagent", "nodeagent")
    path: str = next(v["hostPath"]["path"] for v in ds["spec"]["template"]["spec"]["volumes"] if v["name"] == "sys")
    return path


def _mps_control_processes() -> dict[int, int]:
    """pid -> parent pid of every control daemon of the stand-in on this host (the agent's pod shares the
    host's PID namespace)."""
    from pathlib import Path

    found: dict[int, int] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if b"nodeagent.simulator.mps_control" in argv and b"-f" in argv:
            found[int(proc.name)] = ppid
    return found


def _ask_mps_daemon(pipe: str, *commands: str) -> list[str]:
    """Send control commands to the daemon listening in ``pipe`` (the node's path), as its client does."""
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(f"{pipe}/control")
        with sock.makefile("rw", encoding="utf-8", newline="\n") as f:
            answers = []
            for command in commands:
                f.write(command + "\n")
                f.flush()
                answers.append(f.readline().strip())
    return answers


def test_mps_pod_gets_the_agents_control_daemon(cluster: Cluster, agent: dict[str, Any]) -> None:
    import os
    import stat
    from pathlib import Path

    import yaml

    from nodeagent.simulator.state import SimStore
    from tests.peers.cluster import MACHINE, SIM_STATE

    original = yaml.safe_load((MANIFESTS / "configmap.yaml").read_text())
    configmap = yaml.safe_load((MANIFESTS / "configmap.yaml").read_text())
    configmap["data"]["config.toml"] += '[device_plugin]\nconfig = "/etc/nodeagent/device-plugin.yaml"\n'
    configmap["data"]["device-plugin.yaml"] = MPS_CONFIG
    shared = GPU_COUNT * MPS_REPLICAS
    agent_pod = _restart_agent_with(cluster, configmap, f"allocatable {shared} ({GPU_COUNT} GPUs x {MPS_REPLICAS})",
                                    lambda: allocatable(cluster) == shared)
    labels = cluster.wait_for("the MPS labels", lambda: (lambda ls: ls if ls.get("nvidia.com/mps.capable") == "true"
                                                          else None)(cluster.node()["metadata"]["labels"]), timeout=60)
    assert labels["nvidia.com/gpu.sharing-strategy"] == "mps", labels
    assert labels["nvidia.com/gpu.product"].endswith("-SHARED"), labels
    assert labels["nvidia.com/gpu.replicas"] == str(MPS_REPLICAS), labels

    # the agent's control daemon runs on the node, its child, listening in the node's pipe directory with
    # the defaults NVIDIA's plugin sets (100 / replicas % of the threads, memory / replicas pinned per GPU)
    control = Path(MPS_PIPE) / "control"
    assert stat.S_ISSOCK(control.stat().st_mode), control
    daemons = _mps_control_processes()
    assert len(daemons) == 1, daemons
    (daemon_pid, parent), = daemons.items()
    parent_argv = Path(f"/proc/{parent}/cmdline").read_bytes().split(b"\0")
    assert any(a.endswith(b"/nodeagent") for a in parent_argv) and b"run" in parent_argv, parent_argv
    threads, pinned = _ask_mps_daemon(MPS_PIPE, "get_default_active_thread_percentage",
                                      "get_default_device_pinned_mem_limit 0")
    assert float(threads) == 100 // MPS_REPLICAS, threads
    assert pinned == f"{int(labels['nvidia.com/gpu.memory']) // MPS_REPLICAS}M", (pinned, labels)
    # the simulated driver shows its server on every GPU it serves, as the real one does, and the agent put
    # them in compute mode EXCLUSIVE_PROCESS (3) through NVML before the daemon started
    gpus = SimStore.open(MACHINE, SIM_STATE).read()["gpus"]
    assert all(any(p["pid"] == daemon_pid and p["name"] == "nvidia-cuda-mps-server" for p in g["processes"])
               for g in gpus), [g["processes"] for g in gpus]
    assert [g.get("compute_mode", 0) for g in gpus] == [3] * GPU_COUNT, gpus

    pod = _gpu_pod("mps-client", 1, "sleep 3600", {"terminationGracePeriodSeconds": 0})
    cluster.kubectl("apply", "-f", "-", input_text=json.dumps(pod))
    _wait_running(cluster, "mps-client")
    try:
        devices = pod_devices("mps-client")
        assert len(devices) == 1 and "::" in devices[0], devices
        out = cluster.kubectl("exec", "mps-client", "--", "sh", "-c",
                              'echo "$CUDA_MPS_PIPE_DIRECTORY"; [ -S "$CUDA_MPS_PIPE_DIRECTORY/control" ] && '
                              'stat -c %i "$CUDA_MPS_PIPE_DIRECTORY/control"; ls /dev | grep -E "^nvidia[0-9]+$"; '
                              f"echo from-the-pod > /dev/shm/{MPS_SHM_PROBE}").stdout.splitlines()
        assert out[0] == MPS_PIPE, out
        # the pod's control socket is the node's, the one the daemon listens on (same inode)
        assert int(out[1]) == control.stat().st_ino, (out, control.stat())
        assert len(out[2:]) == 1, out  # one GPU's device node, from nodeagent's CDI spec
        # /dev/shm is the node's, and the agent's container (where the daemon runs) has the same
        shm = Path("/dev/shm") / MPS_SHM_PROBE
        assert shm.read_text() == "from-the-pod\n"
        seen = cluster.kubectl("exec", "-n", "nodeagent", agent_pod["metadata"]["name"], "-c", "nodeagent", "--",
                               "cat", f"/dev/shm/{MPS_SHM_PROBE}").stdout
        assert seen == "from-the-pod\n", seen
    finally:
        Path("/dev/shm", MPS_SHM_PROBE).unlink(missing_ok=True)
        cluster.kubectl("delete", "pod", "mps-client", "--wait=true")

    # the ConfigMap back as the README installs it: the agent's exit quits its daemon and restores the GPUs'
    # compute mode, nothing is left
    _restart_agent_with(cluster, original, f"allocatable {GPU_COUNT} again", lambda: allocatable(cluster) == GPU_COUNT)
    assert not _mps_control_processes()
    assert not os.path.exists(control)
    gpus = SimStore.open(MACHINE, SIM_STATE).read()["gpus"]
    assert not [p for g in gpus for p in g["processes"] if p["name"] == "nvidia-cuda-mps-server"], gpus
    assert [g.get("compute_mode", 0) for g in gpus] == [0] * GPU_COUNT, gpus  # DEFAULT again


# --- MIG by label, DRA plane ---
# Both reconfigure the agent through its ConfigMap (a mig-parted file beside config.toml, then the DRA plane);
# the class's fixture puts the packaged ConfigMap back and MIG off at the end, so what follows sees the
# agent as the README's lines installed it.

MIG_CONFIG_FILE = """version: v1
mig-configs:
  all-disabled:
    - devices: all
      mig-enabled: false
  all-1g.10gb:
    - devices: all
      mig-enabled: true
      mig-devices:
        1g.10gb: 7
"""
MIG_RESOURCE = "nvidia.com/mig-1g.10gb"
MIG_STATE_LABEL = "nvidia.com/mig.config.state"
DRA_DRIVER = "gpu.nodeagent.io"


def _packaged_configmap() -> dict[str, Any]:
    import yaml

    configmap: dict[str, Any] = yaml.safe_load((MANIFESTS / "configmap.yaml").read_text())
    return configmap


def _mig_state(cluster: Cluster) -> str | None:
    state: str | None = cluster.node()["metadata"]["labels"].get(MIG_STATE_LABEL)
    return state


def _sim_mig_modes() -> list[bool]:
    """MIG mode of every simulated GPU as the driver stand-in holds it (the host's state file)."""
    from nodeagent.simulator.state import SimStore
    from tests.peers.cluster import MACHINE, SIM_STATE

    return [g["mig_current"] for g in SimStore.open(MACHINE, SIM_STATE).read()["gpus"]]


def _gpu_objects(cluster: Cluster) -> dict[int, dict[str, Any]]:
    return {g["spec"]["index"]: g for g in cluster.get_json("gpus")["items"]}


def _node_slices(cluster: Cluster) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cluster.get_json("resourceslices", "--field-selector",
                                                  f"spec.nodeName={cluster.node_name}")["items"]
    return items


def _mig_off(cluster: Cluster) -> None:
    """Every GPU out of MIG mode through the label, and no other config asked for (an agent restarted with
    another value on the Node applies it at its start)."""
    asked = cluster.node()["metadata"]["labels"].get("nvidia.com/mig.config")
    if any(_sim_mig_modes()) or asked not in (None, "all-disabled"):
        cluster.kubectl("label", "node", cluster.node_name, "nvidia.com/mig.config=all-disabled", "--overwrite")
        cluster.wait_for("MIG off on every GPU", lambda: not any(_sim_mig_modes())
                         and _mig_state(cluster) == "success", timeout=120)


# --- VFIO passthrough by label (docs/vfio-cc.md) ---
# The agent with ``[vfio] enabled`` and, as the node's /sys, the simulated machine's PCI tree
# (tests/peers/simpci.py: the host's own sysfs is never written), whose kernel runs while the test needs it
# and keeps the VFIO device nodes on the host's /dev/vfio, as the cluster keeps /dev/nvidia*.

VFIO_CONFIG = "[vfio]\nenabled = true\n"
VFIO_RESOURCE = "nvidia.com/GH100_H100_SXM5_80GB"  # the sandbox plugin's name of the H100 SXM5 (pci.ids)
WORKLOAD_LABEL = "nvidia.com/gpu.workload.config"
WORKLOAD_STATE = "nvidia.com/gpu.workload.config.state"
PCI_IDS = Path("/usr/share/misc/pci.ids")  # the node's database, which the VFIO patch mounts at /host/usr/share
VFIO_PATCH = MANIFESTS / "daemonset-vfio.patch.yaml"  # the writable /sys (and /usr/share) of [vfio]
_SIM_PCI: dict[int, Any] = {}


def _sim_pci(cluster: Cluster) -> Any:
    """The cluster's simulated PCI tree (laid out once, in its work directory) and the node's pci.ids."""
    from tests.peers.cluster import MACHINE, SIM_STATE
    from tests.peers.simpci import SimPciKernel

    kernel = _SIM_PCI.get(id(cluster))
    if kernel is None or not kernel.root.is_dir():  # none yet, or another cluster's (gone)
        kernel = SimPciKernel(cluster.workdir / "sim-pci", MACHINE, SIM_STATE)
        kernel.lay_out()
        cluster._host.write(PCI_IDS, kernel.pci_ids(), 0o644)  # removed with the cluster's other host files
        _SIM_PCI[id(cluster)] = kernel
    return kernel


def _node_condition(cluster: Cluster, kind: str) -> dict[str, Any]:
    found: dict[str, Any] = next((c for c in cluster.node()["status"].get("conditions", [])
                                  if c["type"] == f"nodeagent.io/{kind}"), {})
    return found


@pytest.fixture(scope="class")
def packaged_config_after(cluster: Cluster, agent: dict[str, Any], registry: Registry) -> Iterator[None]:
    """After the class: no DeviceClass of the DRA test left, MIG off, the packaged ConfigMap, the agent
    restarted with it (allocatable 8 again; with the DRA role still bound it deletes its leftover slices), then
    no DRA role."""
    yield
    cluster.kubectl("delete", "pod", "mig-holder", "mig-one", "mig-a", "mig-b", "dra-one", "--ignore-not-found",
                    "--wait=true")
    # the remediation the MIG test turned on: its controller and its reset history gone
    cluster.kubectl("delete", "-f", "-", "--ignore-not-found", "--wait=false", input_text=json.dumps(
        {"apiVersion": "v1", "kind": "List", "items": _controller_manifests(registry)}))
    Path(REMEDIATION_RECORD).unlink(missing_ok=True)
    cluster.kubectl("delete", "resourceclaimtemplate", "one-gpu", "--ignore-not-found")
    cluster.kubectl("delete", "-f", "packaging/kubernetes/deviceclass.yaml", "--ignore-not-found")
    _mig_off(cluster)
    had_slices = bool(_node_slices(cluster))  # left by the DRA test (not when only other tests of the class ran)
    t0 = time.monotonic()
    pod = _restart_agent_with(cluster, _packaged_configmap(), f"the packaged config again, allocatable {GPU_COUNT}",
                              lambda: allocatable(cluster) == GPU_COUNT, sys_path="/sys")
    # the agent leaves its ResourceSlices when it exits (a restarted agent serves them on); restarted without
    # DRA it deletes them itself at its start, with its own token (the kubelet would only after the driver has
    # stayed unregistered for 30 s, its DRA manager's wiping delay)
    cluster.wait_for("no ResourceSlice of the node once the DRA plane is gone", lambda: not _node_slices(cluster),
                     timeout=60)
    gone = time.monotonic() - t0
    if had_slices:
        # the agent logs the deletion once the API answered it: the log may be a moment behind what the API shows
        said = f"DRA ResourceSlice(s) of {cluster.node_name} left by an earlier run (plane is device-plugin)"
        cluster.wait_for("the agent's log line on the slices it deleted", lambda: said in cluster.kubectl(
            "logs", "-n", "nodeagent", pod["metadata"]["name"]).stdout, timeout=30)
        print(json.dumps({"dra_slices_gone_after_the_agent_restart_s": round(gone, 1)}))
    # back to what the README's lines installed: no DRA role
    cluster.kubectl("delete", "-f", "packaging/kubernetes/rbac-dra.yaml", "--ignore-not-found")


@pytest.mark.usefixtures("packaged_config_after")
class TestMigByLabelAndDraPlane:

    def test_mig_label_changes_the_free_gpus_and_waits_for_the_pod_on_its_gpu(
            self, cluster: Cluster, agent: dict[str, Any], registry: Registry) -> None:
        """``nvidia.com/mig.config`` set while a pod holds one GPU: the seven free GPUs are reconfigured at
        once, the held one only after its pod ended; then a pod asking for a MIG device (mixed strategy)
        gets exactly one. Remediation is on in the same config: XID 48 on a MIG GPU (below)."""
        controller = {"apiVersion": "v1", "kind": "List", "items": _controller_manifests(registry)}
        cluster.kubectl("apply", "-f", "-", input_text=json.dumps(controller))  # it evicts for the remediation
        configmap = _packaged_configmap()
        configmap["data"]["config.toml"] += ('[mig]\nconfig_file = "/etc/nodeagent/mig-config.yaml"\n'
                                             "release_timeout = 120\n"
                                             '[device_plugin]\nconfig = "/etc/nodeagent/device-plugin.yaml"\n'
                                             + REMEDIATION_CONFIG
                                             + VFIO_CONFIG)  # for the VFIO test that follows: one restart
        configmap["data"]["mig-config.yaml"] = MIG_CONFIG_FILE
        configmap["data"]["device-plugin.yaml"] = "version: v1\nflags:\n  migStrategy: mixed\n"
        _restart_agent_with(cluster, configmap, f"the agent with a MIG config file, allocatable {GPU_COUNT}",
                            lambda: allocatable(cluster) == GPU_COUNT, sys_path=str(_sim_pci(cluster).sys))
        cluster.kubectl("apply", "-f", "-", input_text=json.dumps(_sleeper("mig-holder", 1)))
        _wait_running(cluster, "mig-holder")
        held = pod_devices("mig-holder")
        index_of = {g["spec"]["uuid"]: i for i, g in _gpu_objects(cluster).items()}
        assert len(held) == 1, held
        busy = index_of[held[0]]
        free = [i for i in range(GPU_COUNT) if i != busy]

        cluster.kubectl("label", "node", cluster.node_name, "nvidia.com/mig.config=all-1g.10gb", "--overwrite")

        def free_ones_changed() -> bool:
            gpus = _gpu_objects(cluster)
            return (all(gpus[i].get("status", {}).get("migEnabled") for i in free)
                    and allocatable(cluster, MIG_RESOURCE) == 7 * len(free))

        try:
            cluster.wait_for("the seven free GPUs in MIG mode with 7 x 1g.10gb each", free_ones_changed, timeout=90)
        except AssertionError:
            print(cluster.kubectl("logs", "-n", "nodeagent", running_agent(cluster)["metadata"]["name"],  # type: ignore[index]
                                  "-c", "nodeagent").stdout[-8000:])
            raise
        # the held GPU is left alone while its pod runs: its mode, its GPU object, its pod's device
        modes = _sim_mig_modes()
        assert [i for i in range(GPU_COUNT) if modes[i]] == free, modes
        assert not _gpu_objects(cluster)[busy].get("status", {}).get("migEnabled"), _gpu_objects(cluster)[busy]
        assert _mig_state(cluster) == "pending"
        assert _wait_running(cluster, "mig-holder")["status"]["phase"] == "Running"
        assert pod_devices("mig-holder") == held
        events = cluster.get_json("events", "--field-selector", f"involvedObject.name={cluster.node_name}")["items"]
        waiting = [e["message"] for e in events if e["reason"] == "MigWaitingForPods"]
        assert any(f"GPU {busy} is held by pod default/mig-holder" in m for m in waiting), waiting

        cluster.kubectl("delete", "pod", "mig-holder", "--wait=true")
        cluster.wait_for(f"{MIG_STATE_LABEL}=success once the holder is gone",
                         lambda: _mig_state(cluster) == "success", timeout=90)
        assert all(_sim_mig_modes())
        cluster.wait_for(f"allocatable {MIG_RESOURCE}: {7 * GPU_COUNT}",
                         lambda: allocatable(cluster, MIG_RESOURCE) == 7 * GPU_COUNT, timeout=60)
        assert allocatable(cluster) == 0  # mixed strategy: a GPU in MIG mode is no nvidia.com/gpu

        pod = _gpu_pod("mig-one", 0, PROBE)
        pod["spec"]["containers"][0]["resources"] = {"limits": {MIG_RESOURCE: 1}}
        obj, log, devices = run_probe(cluster, pod, resource=MIG_RESOURCE)
        assert obj["status"]["phase"] == "Succeeded", (obj["status"], log)
        assert len(devices) == 1 and devices[0].startswith("MIG-"), devices
        assert log.splitlines()[1] == f"env={devices[0]}", (log, devices)
        self._xid48_on_a_mig_gpu(cluster)

    @staticmethod
    def _xid48_on_a_mig_gpu(cluster: Cluster) -> None:
        """Remediation of a GPU in MIG mode (docs/remediation.md), on the MIG layout above: two pods on
        instances of two GPUs; XID 48 on the first pod's GPU withdraws all its instances (allocatable drops by
        7), evicts that pod alone, resets the GPU, lays its instances out again (the same profiles at the same
        placements) and offers them again; the other pod keeps its UID and container."""
        from nodeagent.simulator import inject
        from nodeagent.simulator.open import open_sim
        from nodeagent.simulator.state import SimStore
        from tests.peers.cluster import MACHINE, SIM_STATE

        began = time.monotonic()
        for name in ("mig-a", "mig-b"):
            pod = _sleeper(name, 0)
            pod["spec"]["containers"][0]["resources"] = {"limits": {MIG_RESOURCE: 1}}
            cluster.kubectl("apply", "-f", "-", input_text=json.dumps(pod))
        for name in ("mig-a", "mig-b"):
            _wait_running(cluster, name)
        sim = open_sim(MACHINE, SIM_STATE)
        sim.nvmlInit()

        def parent(mig_uuid: str) -> int:
            gpu: int = sim.nvmlDeviceGetIndex(sim.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
                sim.nvmlDeviceGetHandleByUUID(mig_uuid)))
            return gpu

        (dev_a,), (dev_b,) = pod_devices("mig-a", MIG_RESOURCE), pod_devices("mig-b", MIG_RESOURCE)
        gpu, other = parent(dev_a), parent(dev_b)
        assert gpu != other, (dev_a, dev_b)  # the plugin spreads MIG devices over their parent GPUs

        def layout(i: int) -> list[tuple[int, int, int]]:
            gis = SimStore.open(MACHINE, SIM_STATE).read()["gpus"][i]["gis"]
            return sorted((g["profile_id"], g["start"], g["size"]) for g in gis)

        before = layout(gpu)
        assert len(before) == 7, before
        b_before = _container(cluster, "mig-b")
        fault = time.monotonic()
        inject.inject_xid(SimStore.open(MACHINE, SIM_STATE), gpu, 48, None, recovery_action=1)
        cluster.wait_for(f"allocatable {MIG_RESOURCE} drops by GPU {gpu}'s 7 instances after XID 48",
                         lambda: allocatable(cluster, MIG_RESOURCE) == 7 * (GPU_COUNT - 1), timeout=60, poll=0.2)
        cluster.wait_for(f"allocatable {MIG_RESOURCE} back to {7 * GPU_COUNT}",
                         lambda: allocatable(cluster, MIG_RESOURCE) == 7 * GPU_COUNT, timeout=90, poll=0.2)
        back = time.monotonic()
        gone = cluster.kubectl("get", "pod", "mig-a", "--ignore-not-found", "-o", "name").stdout.strip()
        assert gone == "", gone
        assert _container(cluster, "mig-b") == b_before  # the pod on the other GPU never noticed
        assert layout(gpu) == before  # the same profiles at the same placements after the reset
        state = SimStore.open(MACHINE, SIM_STATE).read()["gpus"][gpu]
        assert state["mig_current"] and state.get("recovery_action", 0) == 0, state
        messages = [(e["reason"], e["message"]) for e in _node_events(cluster)]
        uuid = _gpu_objects(cluster)[gpu]["spec"]["uuid"]
        assert any(r == "GPURemediated" and uuid in m for r, m in messages), messages
        cluster.kubectl("delete", "pod", "mig-b", "--wait=true")
        print(json.dumps({"remediation_mig_xid48_fault_to_allocatable_s": round(back - fault, 1),
                          "remediation_mig_phase_s": round(time.monotonic() - began, 1), "pods_disturbed": 1}))


    def test_vm_passthrough_label_gives_a_pod_its_vfio_group_and_container_gives_the_gpus_back(
            self, cluster: Cluster, agent: dict[str, Any]) -> None:
        """``nvidia.com/gpu.workload.config=vm-passthrough``: the agent binds every GPU to vfio-pci through the
        node's sysfs, serves them as the sandbox plugin's resource, GPUReady says the node is in passthrough,
        and a pod asking for one GPU gets ``/dev/vfio/vfio``, its GPU's ``/dev/vfio/<group>`` and
        ``PCI_RESOURCE_…`` naming its bus id; ``container`` gives the GPUs back as ``nvidia.com/gpu``."""
        start = time.monotonic()
        kernel = _sim_pci(cluster)
        _mig_off(cluster)  # whole GPUs (the DRA test that follows wants them so too)
        config = cluster.get_json("configmap", "-n", "nodeagent", "nodeagent-config")["data"]["config.toml"]
        if "[vfio]" not in config or _agent_sys(cluster) != str(kernel.sys):  # run on its own (-k)
            configmap = _packaged_configmap()
            configmap["data"]["config.toml"] += VFIO_CONFIG
            _restart_agent_with(cluster, configmap, f"the agent with [vfio], allocatable {GPU_COUNT}",
                                lambda: allocatable(cluster) == GPU_COUNT, sys_path=str(kernel.sys))
        ready = time.monotonic()
        gpus = {bdf: f for bdf, f in kernel.tree.functions.items() if f.gpu is not None}

        def state() -> str | None:
            value: str | None = cluster.node()["metadata"]["labels"].get(WORKLOAD_STATE)
            return value

        with kernel.running():
            try:
                cluster.kubectl("label", "node", cluster.node_name, f"{WORKLOAD_LABEL}=vm-passthrough", "--overwrite")
                try:
                    cluster.wait_for(f"vm-passthrough applied, {VFIO_RESOURCE} {GPU_COUNT}, {RESOURCE} 0",
                                     lambda: state() == "vm-passthrough" and allocatable(cluster, VFIO_RESOURCE)
                                     == GPU_COUNT and allocatable(cluster) == 0, timeout=90)
                except AssertionError:
                    print(state(), cluster.node()["status"]["allocatable"])
                    print(cluster.kubectl("logs", "-n", "nodeagent", running_agent(cluster)["metadata"]["name"],  # type: ignore[index]
                                          "-c", "nodeagent").stdout[-8000:])
                    raise
                switched = time.monotonic()
                assert {kernel.tree.driver_of(b) for b in gpus} == {"vfio-pci"}
                condition = cluster.wait_for("GPUReady VfioPassthrough", lambda: (lambda c: c if c.get(
                    "reason") == "VfioPassthrough" else None)(_node_condition(cluster, "GPUReady")), timeout=30)
                assert condition["status"] == "True", condition
                assert condition["message"].startswith(f"{GPU_COUNT} GPU(s) bound to vfio-pci"), condition

                env = "PCI_RESOURCE_" + VFIO_RESOURCE.upper().replace("/", "_").replace(".", "_")
                pod = _gpu_pod("vm-one", 0, f"ls /dev/vfio | sort | tr '\\n' ' '; echo; echo \"pci=${env}\"")
                pod["spec"]["containers"][0]["resources"] = {"limits": {VFIO_RESOURCE: 1}}
                obj, log = run_pod(cluster, pod)
                cluster.kubectl("delete", "pod", "vm-one", "--wait=true")
                assert obj["status"]["phase"] == "Succeeded", (obj["status"], log)
                listing, pci = log.splitlines()[:2]
                bdf = pci.removeprefix("pci=")
                assert bdf in gpus, (log, sorted(gpus))
                assert listing.split() == sorted([str(gpus[bdf].group), "vfio"]), log  # its own group only
                used = time.monotonic()
            finally:
                cluster.kubectl("label", "node", cluster.node_name, f"{WORKLOAD_LABEL}=container", "--overwrite")
                cluster.wait_for(f"container applied, {RESOURCE} {GPU_COUNT} again, {VFIO_RESOURCE} 0",
                                 lambda: state() == "container" and allocatable(cluster) == GPU_COUNT
                                 and allocatable(cluster, VFIO_RESOURCE) == 0, timeout=90)
        assert {kernel.tree.driver_of(b) for b in gpus} == {"nvidia"}
        cluster.wait_for("GPUReady AllGpusReady", lambda: _node_condition(cluster, "GPUReady").get("reason")
                         == "AllGpusReady", timeout=30)
        done = time.monotonic()
        print(json.dumps({"vfio_restart_s": round(ready - start, 1), "vfio_switch_s": round(switched - ready, 1),
                          "vfio_pod_s": round(used - switched, 1), "vfio_back_s": round(done - used, 1)}))

    def test_dra_plane_pod_with_a_claim_template_gets_its_gpu_and_the_claim_goes_with_it(
            self, cluster: Cluster, agent: dict[str, Any]) -> None:
        """``plane = "dra"``: the node's GPUs in ResourceSlices, a pod with a ResourceClaimTemplate of the
        packaged DeviceClass starts, containerd injects the claim's CDI device (the pod sees its GPU's device
        node, no other), and the claim is deleted with the pod."""
        from nodeagent.dra.devices import device_gpu_index
        from nodeagent.kube.podresources import PodResourcesClient
        from tests.peers.cluster import CDI_DIR, KUBELET_DIR

        _mig_off(cluster)  # whole GPUs, for the whole-GPU DeviceClass
        configmap = _packaged_configmap()
        configmap["data"]["config.toml"] += '[device_plugin]\nplane = "dra"\n'

        def whole_gpus_published() -> bool:
            devices = [d for s in _node_slices(cluster) if s["spec"]["driver"] == DRA_DRIVER
                       for d in s["spec"]["devices"]]
            return sum(1 for d in devices if d["attributes"]["type"]["string"] == "gpu") == GPU_COUNT

        # what the README adds for the DRA plane: the agent's DRA role, then the DeviceClasses
        cluster.kubectl("apply", "-f", "packaging/kubernetes/rbac-dra.yaml")
        _restart_agent_with(cluster, configmap, f"the DRA plane: {GPU_COUNT} GPUs in the node's ResourceSlices",
                            whole_gpus_published)
        cluster.kubectl("apply", "-f", "packaging/kubernetes/deviceclass.yaml")
        template = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                    "metadata": {"name": "one-gpu", "namespace": "default"},
                    "spec": {"spec": {"devices": {"requests": [
                        {"name": "gpu", "exactly": {"deviceClassName": "gpu.nodeagent.io"}}]}}}}
        cluster.kubectl("apply", "-f", "-", input_text=json.dumps(template))
        pod = _gpu_pod("dra-one", 0, PROBE, {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]})
        pod["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
        cluster.kubectl("apply", "-f", "-", input_text=json.dumps(pod))
        try:
            running = cluster.wait_for("pod dra-one Running", lambda: cluster.get_json("pod", "dra-one")
                                       if cluster.get_json("pod", "dra-one")["status"].get("phase") in (
                                           "Running", "Succeeded", "Failed") else None, timeout=90)
        except AssertionError:
            print(json.dumps(cluster.get_json("pod", "dra-one")["status"], indent=1))
            print(cluster.kubectl("get", "resourceclaims", "-o", "yaml").stdout)
            print(json.dumps(_node_slices(cluster), indent=1)[:6000])
            print(cluster.log_tail("kube-scheduler", 40))
            raise
        claim_name = running["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
        claim = cluster.get_json("resourceclaim", claim_name)
        results = claim["status"]["allocation"]["devices"]["results"]
        assert [(r["driver"], r["pool"]) for r in results] == [(DRA_DRIVER, cluster.node_name)], results
        gpu = device_gpu_index(results[0]["device"])
        assert gpu is not None, results
        # the kubelet's PodResources names the same device for the pod's container
        client = PodResourcesClient(KUBELET_DIR / "pod-resources" / "kubelet.sock")
        try:
            _, uses = client.list_with_claims()
        finally:
            client.close()
        used = sorted(d for u in uses if u.pod == "dra-one" for d in u.devices)
        assert used == [(DRA_DRIVER, cluster.node_name, results[0]["device"])], used
        # the claim's own CDI spec, written by the agent when the kubelet prepared the claim
        spec = CDI_DIR / f"{DRA_DRIVER}-claim_{claim['metadata']['uid']}.json"
        assert spec.is_file(), sorted(p.name for p in CDI_DIR.iterdir())

        # and its device status, written with the agent pod's own token under rbac-dra.yaml and the policy
        def device_status() -> list[dict[str, Any]] | None:
            found: list[dict[str, Any]] = cluster.get_json("resourceclaim", claim_name)["status"].get("devices") or []
            return found or None

        written = cluster.wait_for("the claim's status.devices written by the agent", device_status, timeout=30)
        assert [(e["driver"], e["pool"], e["device"]) for e in written] == [
            (DRA_DRIVER, cluster.node_name, results[0]["device"])], written
        # the claim's device metadata (KEP-5304), read inside the container at the released library's path
        inside = "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpu/gpu/gpu.nodeagent.io-metadata.json"
        first, _ = json.JSONDecoder().raw_decode(cluster.kubectl("exec", "dra-one", "--", "cat", inside).stdout)
        assert (first["apiVersion"], first["metadata"]["name"], first["podClaimName"]) == (
            "metadata.resource.k8s.io/v1beta1", claim_name, "gpu"), first
        [meta_dev] = first["requests"][0]["devices"]
        assert meta_dev["name"] == results[0]["device"], first
        assert meta_dev["attributes"]["uuid"] == {"string": _gpu_objects(cluster)[gpu]["spec"]["uuid"]}, first
        cluster.kubectl("exec", "dra-one", "--", "touch", "/tmp/done")

        def ended() -> dict[str, Any] | None:
            obj = cluster.get_json("pod", "dra-one")
            return obj if obj["status"].get("phase") in ("Succeeded", "Failed") else None

        obj = cluster.wait_for("pod dra-one ended", ended, timeout=90)
        log = cluster.kubectl("logs", "dra-one").stdout
        assert obj["status"]["phase"] == "Succeeded", (obj["status"], log)
        path = _gpu_objects(cluster)[gpu]["spec"]["path"]
        lines = log.splitlines()
        assert lines[0].split() == [path.rsplit("/", 1)[1]], (log, results)  # its GPU's node, no other
        assert lines[1] == f"env={_gpu_objects(cluster)[gpu]['spec']['uuid']}", log
        assert lines[2] == "/dev/nvidiactl", log

        cluster.kubectl("delete", "pod", "dra-one", "--wait=true")
        cluster.wait_for(f"claim {claim_name} deleted with its pod", lambda: cluster.kubectl(
            "get", "resourceclaim", claim_name, check=False).returncode != 0, timeout=60)
        cluster.wait_for("the claim unprepared: its CDI spec removed", lambda: not spec.exists(), timeout=60)


def test_kubectl_delete_leaves_the_node_clean(cluster: Cluster, agent: dict[str, Any]) -> None:
    from tests.peers.cluster import CONTAINERD_CONFIG, KUBELET_DIR

    apply = readme_manifest_commands()[0]
    cluster.kubectl("delete", "--wait=true", *apply[2:], timeout=180)
    cluster.wait_for("the agent pods gone", lambda: not agent_pods(cluster), timeout=120)
    sockets = sorted(p.name for p in (KUBELET_DIR / "device-plugins").glob("*.sock"))
    assert sockets == ["kubelet.sock"], sockets
    dra = KUBELET_DIR / "plugins_registry"
    assert not [p for p in dra.glob("*nodeagent*")], list(dra.iterdir())
    cluster.wait_for("allocatable nvidia.com/gpu 0 once the plugin is gone", lambda: allocatable(cluster) == 0,
                     timeout=60)
    # the containerd wiring of the init container stays (docs/kubernetes.md: "Removing nodeagent")
    assert 'nvidia' in CONTAINERD_CONFIG.read_text() or any(
        p.name.endswith(".toml") for p in CONTAINERD_CONFIG.parent.glob("conf.d/*"))


# --- Helm ---
# The README's Helm lines on the same cluster, once the plain installation above is deleted (or on a fresh
# cluster when only these tests run): install, an upgrade that changes the device-plugin config, uninstall.

CHART = "packaging/helm/nodeagent"
TIME_SLICING = """version: v1
sharing:
  timeSlicing:
    resources:
      - name: nvidia.com/gpu
        replicas: 2
"""


def readme_helm_commands() -> list[list[str]]:
    """The shell lines of the README's Helm block (kubectl create namespace ..., helm install ..., ...)."""
    return next(b for b in readme_blocks() if any(c[:2] == ["helm", "install"] for c in b))


@pytest.fixture(scope="module")
def helm(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """``helm(*args)``: the suite's helm against the cluster, from the repository's directory, with a private
    home (no repositories, plugins or cache of the machine's user); its stdout."""
    import subprocess

    from tests.peers._resolve import peer_binary
    from tests.peers.cluster import REPO

    binary = peer_binary("NODEAGENT_HELM", "nodeagent_peers_helm", "helm (helm.sh/helm/v3)")
    home = tmp_path_factory.mktemp("helm-home")
    env = {"HOME": str(home), "HELM_CACHE_HOME": str(home / "cache"), "HELM_CONFIG_HOME": str(home / "config"),
           "HELM_DATA_HOME": str(home / "data"), "PATH": "/usr/bin:/bin"}

    def run(*args: str) -> str:
        proc = subprocess.run([str(binary), *args, "--kubeconfig", str(cluster.apiserver.kubeconfig)],
                              capture_output=True, text=True, timeout=300, check=False, env=env, cwd=REPO)
        assert proc.returncode == 0, f"helm {' '.join(args)}: {proc.stdout}{proc.stderr}"
        return proc.stdout

    return run


def _image_values(cluster: Cluster, registry: Registry) -> list[str]:
    """The README's `helm install` values that name the image (``--set image.repository=... --set
    image.tag=...``), for the registry: an upgrade keeps them."""
    (install,) = [c for c in readme_helm_commands() if c[:2] == ["helm", "install"]]
    args = readme_args(install, cluster, registry.host)
    values = [args[i:i + 2] for i, a in enumerate(args) if a == "--set" and args[i + 1].startswith("image.")]
    assert [v[1].split("=", 1)[0] for v in values] == ["image.repository", "image.tag"], install
    return [a for v in values for a in v]


def _daemonset(cluster: Cluster) -> dict[str, Any]:
    return cluster.get_json("daemonset", "-n", "nodeagent", "nodeagent")


def test_helm_install_makes_the_node_gpu_ready(cluster: Cluster, registry: Registry, helm: Callable[..., str]) -> None:
    """The README's Helm lines as written (the registry's address for registry.example.com); the node label is
    removed first, so the README's own label line is what schedules the agent."""
    commands = readme_helm_commands()
    assert [c[0] for c in commands] == ["kubectl", "kubectl", "helm", "kubectl"], commands
    cluster.kubectl("label", "node", cluster.node_name, "nodeagent.io/gpu-")
    assert agent_pods(cluster) == [] and allocatable(cluster) == 0
    start = time.monotonic()
    for command in commands:
        args = readme_args(command, cluster, registry.host)
        if command[0] == "helm":
            out = helm(*args)
            assert "STATUS: deployed" in out and "REVISION: 1" in out, out
        else:
            cluster.kubectl(*args)
    pod = cluster.wait_for("the agent pod of the release Running and ready", lambda: running_agent(cluster),
                           timeout=180)
    cluster.wait_for(f"allocatable {RESOURCE}: {GPU_COUNT}", lambda: allocatable(cluster) == GPU_COUNT, timeout=60)
    print(f"helm install: the node shows {GPU_COUNT} GPUs after {time.monotonic() - start:.1f}s")
    daemonset = _daemonset(cluster)
    assert daemonset["metadata"]["annotations"]["meta.helm.sh/release-name"] == "nodeagent"
    name = f"{registry.host}/nodeagent:0.1.0"
    assert [c["image"] for c in pod["spec"]["initContainers"] + pod["spec"]["containers"]] == [name, name]
    assert pod["metadata"]["ownerReferences"][0]["uid"] == daemonset["metadata"]["uid"]
    # the agent wrote its GPU objects again (the plain installation's CRD went with its files)
    cluster.wait_for("one GPU object per card", lambda: len(cluster.get_json("gpus")["items"]) == GPU_COUNT,
                     timeout=60)


def test_helm_upgrade_with_time_slicing_rolls_the_agent(
        cluster: Cluster, registry: Registry, helm: Callable[..., str]) -> None:
    """A new devicePlugin.config changes the pods' checksum/config: the upgrade replaces the agent pod and the
    Node's allocatable follows the new config (two replicas per GPU)."""
    old = running_agent(cluster)
    assert old is not None and allocatable(cluster) == GPU_COUNT
    old_checksum = _daemonset(cluster)["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    start = time.monotonic()
    out = helm("upgrade", "nodeagent", CHART, "--namespace", "nodeagent", *_image_values(cluster, registry),
               "--set-string", f"devicePlugin.config={TIME_SLICING}")
    assert "REVISION: 2" in out, out
    assert _daemonset(cluster)["spec"]["template"]["metadata"]["annotations"]["checksum/config"] != old_checksum
    config = cluster.get_json("configmap", "-n", "nodeagent", "nodeagent-config")["data"]
    assert config["device-plugin.yaml"] == TIME_SLICING

    def rolled() -> dict[str, Any] | None:
        pod = running_agent(cluster)
        if pod is None or pod["metadata"]["uid"] == old["metadata"]["uid"]:
            return None
        return pod if allocatable(cluster) == 2 * GPU_COUNT else None

    new = cluster.wait_for(f"a new agent pod and allocatable {2 * GPU_COUNT}", rolled, timeout=180)
    print(f"helm upgrade: rolled and {2 * GPU_COUNT} replicas allocatable after {time.monotonic() - start:.1f}s")
    assert [p["metadata"]["uid"] for p in agent_pods(cluster)] == [new["metadata"]["uid"]]


def test_helm_uninstall_leaves_no_agent_and_no_socket(cluster: Cluster, helm: Callable[..., str]) -> None:
    from tests.peers.cluster import KUBELET_DIR

    helm("uninstall", "nodeagent", "--namespace", "nodeagent", "--wait", "--timeout", "120s")
    cluster.wait_for("the agent pods gone", lambda: not agent_pods(cluster), timeout=120)
    sockets = sorted(p.name for p in (KUBELET_DIR / "device-plugins").glob("*.sock"))
    assert sockets == ["kubelet.sock"], sockets
    assert not list((KUBELET_DIR / "plugins_registry").glob("*nodeagent*"))
    cluster.wait_for("allocatable nvidia.com/gpu 0 once the plugin is gone", lambda: allocatable(cluster) == 0,
                     timeout=60)
    for kind in ("daemonset", "configmap", "serviceaccount"):
        names = cluster.kubectl("get", kind, "-n", "nodeagent", "-o", "name").stdout.split()
        assert not [n for n in names if "nodeagent" in n and "kube-root-ca" not in n], (kind, names)
    # helm never deletes the CRDs it installed: the GPU objects' type outlives the release
    cluster.get_json("crd", "gpus.nodeagent.io")
    # the namespace the README's lines created is not the release's
    cluster.kubectl("delete", "namespace", "nodeagent", "--wait=false")
