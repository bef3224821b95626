"""Real peers for the tests: kube-apiserver + etcd, the kubelet's device manager, containerd.

Nothing here imitates a peer: the binaries are the upstream programs, built by tests/testbin/setup.sh
(sourced by tests/run.sh) into ``${NODEAGENT_CACHE:-~/.cache/nodeagent}/bin`` once per version, and
Debian's containerd/runc. A missing peer FAILS the test with what to install or build (never a skip).
Binaries come from NODEAGENT_KUBE_APISERVER, NODEAGENT_ETCD, NODEAGENT_KUBELET_HARNESS,
NODEAGENT_CONTAINERD; when unset (pytest run directly) the fixtures run setup.sh's functions themselves.
KUBEBUILDER_ASSETS (a directory with kube-apiserver and etcd) replaces the built pair.

Fixtures (registered by tests/conftest.py):

``kube_apiserver`` (session) -> ``KubeApiServer``
    etcd + kube-apiserver on free loopback ports, generated CA/serving/admin certs, RBAC on, the
    ServiceAccount admission plugin off (no controller-manager runs; no scheduler either). One server for
    the whole session: isolate tests by object names (e.g. a node name derived from the test name).
    ``.kubeconfig`` (Path, cluster-admin via client cert), ``.url``, ``.version``,
    ``.api_client()`` -> new ``kubernetes.client.ApiClient``, ``.get(path)`` -> (status, body),
    ``.log_tail()``.

``kubelet_harness`` (function) -> ``KubeletHarness``
    The kubelet's own ``devicemanager.ManagerImpl`` (k8s.io/kubernetes, see setup.sh for the version)
    serving ``kubelet.sock`` in ``.plugin_dir`` (a short temp dir; plugins put their sockets there and
    register with endpoint = socket file name). It also serves the kubelet PodResources v1 API
    (List/GetAllocatableResources/Get, from the manager's allocations) on ``.pod_resources_socket``.
    - ``.resources()`` -> {name: Resource(devices=(Device(id, health, numa),...), capacity, allocatable,
      registered)}; ``.resource(name)``.
    - ``.allocate(resource, count, pod=, namespace=, pod_uid=, container=)`` -> ``Allocation``
      (device_ids, envs, mounts, devices, annotations, cdi_devices): the kubelet path, i.e.
      GetPreferredAllocation when the plugin offers it, Allocate, then PreStartContainer when required.
      A plugin error raises ``HarnessError`` with ``.code`` (gRPC code name) and ``.message``.
    - ``.release(pod_uid)``: pod deleted, devices freed.
    - ``.restart()``: like a kubelet restart (stop, remove every socket in the directory, start; the
      allocation checkpoint survives).
    - ``.wait(resource, device=, health=, total=, healthy=, registered=, timeout=)`` -> (time seen,
      Resource): blocks until the state matches; the time is on the ``time.time()`` scale, so
      ``seen - t_injected`` is e.g. the XID -> Unhealthy latency (the harness samples every 2 ms).
    - ``.updates(resource=None, since=0)`` -> [Update(seq, time, resource)]: every observed change.
    - ``.plugin(socket, method, devices=, available=, must_include=, size=)``: one DevicePlugin call
      with explicit arguments (Allocate of chosen IDs, GetPreferredAllocation, PreStartContainer,
      GetDevicePluginOptions) -> response dict.
    - ``.call(cmd, **args)``: the raw JSON-line protocol (tests/testbin/peers/cmd/kubelet-harness).

``containerd`` (function) -> ``Containerd``
    ``.config_dump(path)`` -> effective config dict (``containerd --config path config dump``); raises
    ``ContainerdConfigError`` with containerd's message (line, column) on a bad file.
    ``.start(path)`` -> ``RunningContainerd``: containerd on a copy of the config with root, state, grpc
    and ttrpc sockets and the opt dir moved into a temp dir (relative ``imports`` made absolute); returns
    once booted with ``.runtimes`` ({handler: {"Type", "Options", ...}} as its CRI plugin loaded them),
    ``.default_runtime``, ``.cri_error`` (the CRI plugin's load error, if any), ``.address``,
    ``.ctr(*args)``, ``.log()``. Stopped at the end of the test. ``.version()``.

``containerd2`` (function) -> ``Containerd2`` (tests/peers/containerd2.py)
    containerd 2 built from github.com/containerd/containerd/v2 (NODEAGENT_CONTAINERD2; version in
    tests/testbin/containerd2/go.mod), for config versions 3 and 4: the ``containerd`` API, plus
    ``.cri_status(running)`` -> ``CriStatus`` (``.handlers``, ``.conditions``, ``.runtimes``,
    ``.default_runtime``) from the running CRI service's ``RuntimeService.Status`` (verbose), the call the
    kubelet makes, and ``.version_tuple()``.

``tests.peers.controlplane`` (used by tests/integration/test_dra_scheduling.py, module-scoped there)
    ``RELEASES`` (v1.34.4, v1.35.4, v1.36.3 and v1.37.2, each with its binaries and feature gates) and
    ``running_control_plane(release)`` -> ``ControlPlane``: its own etcd + kube-apiserver (``.apiserver``),
    kube-controller-manager running only ``resourceclaim-controller`` (from 1.37 also the device-taint
    eviction controller), and kube-scheduler, each waited for
    on /healthz. ``release.dra_harness()`` is that release's kubelet DRA harness (tests/peers/draharness.py).

Outside pytest: ``running_apiserver()``, ``running_harness()``, ``containerd_peer()`` context managers
(``containerd_peer(Containerd2)`` for containerd 2).
``tests.peers.sampleplugin.SampleDevicePlugin`` is a minimal Python device plugin (the project's generated
v1beta1 code) for exercising the harness: ``start()``, ``register()``, ``set_health(id, health)``,
``calls`` (what the kubelet called), ``preferred``/``pre_start_required``/``fail_allocate`` knobs.
"""

from tests.peers._resolve import PeerMissingError
from tests.peers.apiserver import KubeApiServer, running_apiserver, start_apiserver
from tests.peers.containerd import Containerd, ContainerdConfigError, RunningContainerd, containerd_peer
from tests.peers.harness import (
    Allocation,
    Device,
    HarnessError,
    KubeletHarness,
    Resource,
    Update,
    running_harness,
    start_harness,
)

__all__ = [
    "Allocation",
    "Containerd",
    "ContainerdConfigError",
    "Device",
    "HarnessError",
    "KubeApiServer",
    "KubeletHarness",
    "PeerMissingError",
    "Resource",
    "RunningContainerd",
    "Update",
    "containerd_peer",
    "running_apiserver",
    "running_harness",
    "start_apiserver",
    "start_harness",
]
