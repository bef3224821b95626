"""packaging/helm/nodeagent judged by the real helm (tests/testbin/helm) and the real kube-apiserver: the chart
lints strictly, its default render is object for object packaging/kubernetes/*.yaml, every documented variant
renders and is accepted by server-side dry run, and the values schema refuses wrong types naming the value."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e._agent import REPO
from tests.e2e.test_kube_manifests import DRA_ORDER, MANIFESTS, ORDER
from tests.peers._resolve import peer_binary
from tests.peers.apiserver import KubeApiServer

if sys.version_info >= (3, 11):
    import tomllib
else:  # the backport of the same parser
    import tomli as tomllib

pytestmark = pytest.mark.peers

CHART = REPO / "packaging/helm/nodeagent"
RULES = REPO / "packaging/prometheus/nodeagent-rules.yaml"
Doc = dict[str, Any]

# Each documented variant: the --set arguments and what its render must show.
VARIANTS: dict[str, Sequence[str]] = {
    "plane-dra": ["plane=dra", "dra.extendedResourceDeviceClass=true"],
    "plane-both": ["plane=both", "config.agent.dra.gpus={0,1}"],
    "cdi": ["cdi.enabled=true", "deviceListStrategy=cdi-cri"],
    "mig-strategy": ["migStrategy=mixed"],
    "device-plugin-config": ["devicePlugin.config=version: v1\nflags:\n  migStrategy: single\n"],
    "kubelet-root-dir": ["hostPaths.kubeletRootDir=/var/snap/microk8s/common/var/lib/kubelet"],
    "monitoring": [
        "metrics.serviceMonitor.enabled=true",
        "metrics.serviceMonitor.additionalLabels.release=kps",
        "prometheusRule.enabled=true",
        "prometheusRule.additionalLabels.release=kps",
    ],
    "config-map-name": ["config.name=my-nodeagent-config"],
    "metrics-port": ["metrics.port=9500"],
    "no-rbac-no-policy": ["rbac.create=false", "admissionPolicy.enabled=false"],
    "imex": ["imex.enabled=true"],
    "vfio": ["vfio.enabled=true"],
    "fleet": ["fleet.enabled=true"],
    "nodefeature": ["nodeFeature.enabled=true"],
}


@pytest.fixture(scope="module")
def helm() -> Path:
    return peer_binary("NODEAGENT_HELM", "nodeagent_peers_helm", "helm (helm.sh/helm/v3)")


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # a private home: no repositories, plugins or cache of the machine's user take part
    env = {
        "HOME": "/nonexistent",
        "HELM_CACHE_HOME": "/nonexistent/cache",
        "HELM_CONFIG_HOME": "/nonexistent/config",
        "HELM_DATA_HOME": "/nonexistent/data",
        "PATH": "/usr/bin:/bin",
    }
    return subprocess.run(
        [str(helm), *args], capture_output=True, text=True, timeout=120, check=False, env=env
    )


def render(helm: Path, *sets: str, values: Path | None = None) -> list[Doc]:
    args = ["template", "nodeagent", str(CHART), "--namespace", "nodeagent", "--include-crds"]
    for s in sets:
        args += ["--set-string" if s.startswith("devicePlugin.config=") else "--set", s]
    if values is not None:
        args += ["--values", str(values)]
    proc = run_helm(helm, *args)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def plain_documents() -> list[Doc]:
    docs: list[Doc] = []
    for name in ORDER:
        docs += [d for d in yaml.safe_load_all((MANIFESTS / name).read_text()) if d]
    return docs


def key(doc: Doc) -> tuple[str, str, str, str]:
    meta = doc["metadata"]
    return doc["apiVersion"], doc["kind"], meta.get("namespace", ""), meta["name"]


def by_key(docs: list[Doc]) -> dict[tuple[str, str, str, str], Doc]:
    out = {key(d): d for d in docs}
    assert len(out) == len(docs), "two objects of the same kind and name"
    return out


def one(docs: list[Doc], kind: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, [key(d) for d in found]
    return found[0]


def test_lint_strict(helm: Path) -> None:
    proc = run_helm(helm, "lint", "--strict", str(CHART), "--namespace", "nodeagent")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout, proc.stdout
    for name, sets in VARIANTS.items():
        args = ["lint", "--strict", str(CHART), "--namespace", "nodeagent"]
        for s in sets:
            args += ["--set-string" if s.startswith("devicePlugin.config=") else "--set", s]
        proc = run_helm(helm, *args)
        assert proc.returncode == 0, (name, proc.stdout + proc.stderr)


def test_default_render_is_the_plain_manifests(helm: Path) -> None:
    """One source of truth: `helm template` with the defaults gives exactly the objects the README's kubectl
    lines apply (the Namespace aside: `helm install --create-namespace` makes it), field for field."""
    rendered = by_key(render(helm))
    plain = by_key([d for d in plain_documents() if d["kind"] != "Namespace"])
    assert sorted(rendered) == sorted(plain)
    for k, doc in plain.items():
        assert rendered[k] == doc, k
    # the chart ships the CRD and the alerts as files: the same bytes as the plain ones
    assert (CHART / "crds/gpu-crd.yaml").read_bytes() == (MANIFESTS / "gpu-crd.yaml").read_bytes()
    assert (CHART / "files/nodeagent-rules.yaml").read_bytes() == RULES.read_bytes()


def config_checksum(data: dict[str, str]) -> str:
    """What the chart's ``checksum/config`` is: sha256 of the ConfigMap's data as Go's json.Marshal writes it
    (keys sorted, no spaces, <, > and & escaped)."""
    import hashlib

    text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    for char, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"),
                          ("\u2029", "\\u2029")):
        text = text.replace(char, escaped)
    return hashlib.sha256(text.encode()).hexdigest()


def pod_checksum(docs: list[Doc]) -> str | None:
    annotations = one(docs, "DaemonSet")["spec"]["template"]["metadata"].get("annotations", {})
    value: str | None = annotations.get("checksum/config")
    return value


def test_a_changed_config_rolls_the_pods(helm: Path) -> None:
    """The pods carry a hash of the ConfigMap's data, so `helm upgrade` with another config rolls them: the
    plain DaemonSet's value is the hash of the plain ConfigMap, every variant's that of its own ConfigMap."""
    plain = plain_documents()
    default = one(plain, "ConfigMap")["data"]
    assert pod_checksum(plain) == config_checksum(default)
    escaped = "devicePlugin.config=version: v1  # <a> & b\nflags:\n  migStrategy: single\n"
    for name, sets in [*VARIANTS.items(), ("escaped", [escaped])]:
        docs = render(helm, *sets)
        if name == "config-map-name":
            # not the chart's ConfigMap: nothing to hash
            assert pod_checksum(docs) is None
            continue
        data = one(docs, "ConfigMap")["data"]
        assert pod_checksum(docs) == config_checksum(data), name
        assert (pod_checksum(docs) == pod_checksum(plain)) == (data == default), name


def test_dra_variants_render_the_plain_dra_role_and_device_classes(helm: Path) -> None:
    """What the README adds to the plain manifests for the DRA plane (rbac-dra.yaml, the DeviceClasses) is what
    the chart renders with plane dra or both, object for object, and never with the default plane."""
    for variant in ("plane-dra", "plane-both"):
        rendered = by_key(render(helm, *VARIANTS[variant]))
        names = [*DRA_ORDER, "deviceclass-extended-resource.yaml"] if variant == "plane-dra" else [*DRA_ORDER]
        for name in names:
            for doc in yaml.safe_load_all((MANIFESTS / name).read_text()):
                assert rendered[key(doc)] == doc, (variant, name)
    dra_role = {d["metadata"]["name"] for d in yaml.safe_load_all((MANIFESTS / "rbac-dra.yaml").read_text())}
    assert dra_role == {"nodeagent-dra"}
    default = render(helm)
    assert not [d for d in default if d["kind"] == "DeviceClass" or d["metadata"]["name"] in dra_role]
    # without DRA the only grant on resource.k8s.io is the slices' list (conflict detection): no writes, no claims
    granted = [r for d in default if d["kind"] == "ClusterRole" for r in d["rules"] if "resource.k8s.io" in r["apiGroups"]]
    assert granted == [{"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"], "verbs": ["list"]}], granted


def agent_config(docs: list[Doc]) -> tuple[str, dict[str, str]]:
    data: dict[str, str] = one(docs, "ConfigMap")["data"]
    return data["config.toml"], data


def test_variants_reach_the_agent_config(helm: Path) -> None:
    """What each variant sets is in config.toml (valid for the agent's own parser) or in the pod."""
    from nodeagent.config import parse_config
    from nodeagent.sharing.spec import parse_plugin_config

    cfg = {
        name: agent_config(render(helm, *sets))
        for name, sets in VARIANTS.items()
        if name not in ("config-map-name",)
    }
    parsed = {name: parse_config(text, f"{name}/config.toml") for name, (text, _) in cfg.items()}
    assert parsed["plane-dra"].device_plugin.plane == "dra"
    assert parsed["plane-both"].device_plugin.plane == "both" and list(parsed["plane-both"].dra.gpus) == [
        0,
        1,
    ]
    assert parsed["cdi"].runtime.cdi is True
    assert str(parsed["kubelet-root-dir"].kubelet.dir) == "/var/snap/microk8s/common/var/lib/kubelet"
    assert parsed["monitoring"] == parse_config(agent_config(render(helm))[0], "default")
    # the device-plugin config: built from the flags, or passed through byte for byte
    for name, expected in (("mig-strategy", "mixed"), ("device-plugin-config", "single"), ("cdi", "none")):
        text, data = cfg[name]
        assert tomllib.loads(text)["device_plugin"]["config"] == "/etc/nodeagent/device-plugin.yaml"
        plugin = parse_plugin_config(data["device-plugin.yaml"], source="device-plugin.yaml")
        assert plugin.flags.mig_strategy == expected, name
    assert (
        cfg["device-plugin-config"][1]["device-plugin.yaml"] == "version: v1\nflags:\n  migStrategy: single\n"
    )
    strategies = parse_plugin_config(cfg["cdi"][1]["device-plugin.yaml"]).flags.plugin.device_list_strategy
    assert strategies == ("cdi-cri",)
    assert "device-plugin.yaml" not in agent_config(render(helm))[1]
    # the kubelet directories follow the root directory, except the device-plugin one the kubelet keeps fixed
    pod = one(render(helm, *VARIANTS["kubelet-root-dir"]), "DaemonSet")["spec"]["template"]["spec"]
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert host["kubelet-device-plugins"] == "/var/lib/kubelet/device-plugins"
    assert host["kubelet-pod-resources"] == "/var/snap/microk8s/common/var/lib/kubelet/pod-resources"
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["kubelet-device-plugins"] == "/host/var/snap/microk8s/common/var/lib/kubelet/device-plugins"
    # the metrics port: where the agent listens is the pod's metrics port
    assert parsed["metrics-port"].metrics.address == "0.0.0.0:9500"
    container = one(render(helm, *VARIANTS["metrics-port"]), "DaemonSet")["spec"]["template"]["spec"][
        "containers"
    ][0]
    assert container["ports"] == [{"name": "metrics", "containerPort": 9500, "protocol": "TCP"}]
    # an existing ConfigMap: the chart makes none and mounts that one
    docs = render(helm, *VARIANTS["config-map-name"])
    assert not [d for d in docs if d["kind"] == "ConfigMap"]
    volumes = one(docs, "DaemonSet")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "config", "configMap": {"name": "my-nodeagent-config"}} in volumes
    docs = render(helm, *VARIANTS["no-rbac-no-policy"])
    assert {d["kind"] for d in docs} == {
        "CustomResourceDefinition",
        "ServiceAccount",
        "ConfigMap",
        "DaemonSet",
    }


def test_monitoring_variant(helm: Path) -> None:
    docs = render(helm, *VARIANTS["monitoring"])
    service, monitor, rule = one(docs, "Service"), one(docs, "ServiceMonitor"), one(docs, "PrometheusRule")
    pod = one(docs, "DaemonSet")["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    port = pod["spec"]["containers"][0]["ports"][0]
    assert (
        service["spec"]["ports"][0]["targetPort"] == port["name"] == monitor["spec"]["endpoints"][0]["port"]
    )
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["metadata"]["labels"]["release"] == rule["metadata"]["labels"]["release"] == "kps"
    # NodeagentDown watches the job the ServiceMonitor makes: the Service's name
    assert rule["spec"] == yaml.safe_load(RULES.read_text())
    down = next(r for g in rule["spec"]["groups"] for r in g["rules"] if r.get("alert") == "NodeagentDown")
    assert f'job="{service["metadata"]["name"]}"' in down["expr"]
    assert not [d for d in render(helm) if d["kind"] in ("Service", "ServiceMonitor", "PrometheusRule")]


def test_extra_objects(helm: Path, tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "extraObjects": [
                    {
                        "apiVersion": "v1",
                        "kind": "ConfigMap",
                        "metadata": {"name": "extra-map", "namespace": "nodeagent"},
                        "data": {"release": "{{ .Release.Name }}"},
                    },
                    "apiVersion: scheduling.k8s.io/v1\nkind: PriorityClass\nmetadata:\n  name: gpu-{{ .Release.Name }}\n"
                    "value: 1000\n",
                ]
            }
        )
    )
    docs = by_key(render(helm, values=values))
    assert docs[("v1", "ConfigMap", "nodeagent", "extra-map")]["data"] == {"release": "nodeagent"}
    assert docs[("scheduling.k8s.io/v1", "PriorityClass", "", "gpu-nodeagent")]["value"] == 1000


# -- the real apiserver ------------------------------------------------------------------------------------

# Stand-ins for the Prometheus Operator's CRDs: they let the API server check the objects' shape as
# Kubernetes objects (names, labels, namespaces); the rule groups themselves are judged by promtool in
# tests/e2e/test_prometheus_rules.py.
OPERATOR_CRDS = (("servicemonitors", "ServiceMonitor"), ("prometheusrules", "PrometheusRule"))


def plural(kind: str) -> str:
    low = kind.lower()
    return low[:-1] + "ies" if low.endswith("y") else low + ("es" if low.endswith("s") else "s")


def apply(server: KubeApiServer, doc: Doc, *, dry_run: bool) -> tuple[int, Doc]:
    group_version = doc["apiVersion"]
    base = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    meta = doc["metadata"]
    ns = f"/namespaces/{meta['namespace']}" if meta.get("namespace") else ""
    path = f"{base}{ns}/{plural(doc['kind'])}/{meta['name']}"
    query = "?fieldManager=nodeagent-helm&fieldValidation=Strict&force=true" + (
        "&dryRun=All" if dry_run else ""
    )
    status, body = server.request(
        "PATCH", path + query, json.dumps(doc).encode(), content_type="application/apply-patch+yaml"
    )
    return status, json.loads(body or b"{}")


def install_operator_crds(server: KubeApiServer) -> None:
    for resource, kind in OPERATOR_CRDS:
        crd = {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{resource}.monitoring.coreos.com"},
            "spec": {
                "group": "monitoring.coreos.com",
                "scope": "Namespaced",
                "names": {"plural": resource, "kind": kind},
                "versions": [
                    {
                        "name": "v1",
                        "served": True,
                        "storage": True,
                        "schema": {
                            "openAPIV3Schema": {
                                "type": "object",
                                "properties": {
                                    "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                                },
                            }
                        },
                    }
                ],
            },
        }
        status, body = apply(server, crd, dry_run=False)
        assert status in (200, 201), body
    deadline = 30.0
    import time

    start = time.monotonic()
    while any(
        server.get(f"/apis/monitoring.coreos.com/v1/namespaces/nodeagent/{r}")[0] != 200
        for r, _ in OPERATOR_CRDS
    ):
        assert time.monotonic() - start < deadline, "the stand-in CRDs were never served"
        time.sleep(0.2)


@pytest.mark.parametrize("variant", ["default", *VARIANTS])
def test_every_variant_is_accepted_by_server_side_dry_run(
    helm: Path, kube_apiserver: KubeApiServer, variant: str
) -> None:
    docs = render(helm, *VARIANTS.get(variant, ()))
    status, body = apply(
        kube_apiserver,
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "nodeagent"}},
        dry_run=False,
    )
    assert status in (200, 201), body
    if variant == "monitoring":
        install_operator_crds(kube_apiserver)
    for doc in docs:
        status, body = apply(kube_apiserver, doc, dry_run=True)
        assert status in (200, 201), (
            f"{variant}: {doc['kind']} {doc['metadata']['name']}: {body.get('message')}"
        )


# -- the values schema -----------------------------------------------------------------------------------

REFUSED = [
    (["--set", "plane=gpu"], "at '/plane': value must be one of"),
    (["--set-string", "rbac.create=yes"], "at '/rbac/create': got string, want boolean"),
    (["--set-string", "metrics.port=9400"], "at '/metrics/port': got string, want integer"),
    (
        ["--set", "metrics.serviceMonitor.enabled=1"],
        "at '/metrics/serviceMonitor/enabled': got number, want boolean",
    ),
    (["--set", "migStrategy=mixd"], "at '/migStrategy': value must be one of"),
    (["--set", "deviceListStrategy=files"], "at '/deviceListStrategy': value must be one of"),
    (["--set", "tolerations=none"], "at '/tolerations': got string, want array"),
    (["--set", "hostPaths.kubeletRootDir=var/lib/kubelet"], "at '/hostPaths/kubeletRootDir'"),
    (["--set", "image.pullPolicy=Sometimes"], "at '/image/pullPolicy': value must be one of"),
    (["--set", "cdi=true"], "at '/cdi': got boolean, want object"),
    (["--set", "nodeSelector.gpu=true"], "at '/nodeSelector/gpu': got boolean, want string"),
    (["--set", "prometheusRule.enabled=maybe"], "at '/prometheusRule/enabled': got string, want boolean"),
]


@pytest.mark.parametrize(("args", "named"), REFUSED, ids=[a[1].split("=")[0] for a, _ in REFUSED])
def test_schema_refuses_a_wrong_type_naming_the_value(helm: Path, args: list[str], named: str) -> None:
    proc = run_helm(helm, "template", "nodeagent", str(CHART), *args)
    assert proc.returncode != 0, proc.stdout
    assert "values don't meet the specifications of the schema" in proc.stderr, proc.stderr
    assert named in proc.stderr, proc.stderr


def test_values_the_chart_cannot_merge_are_refused(helm: Path) -> None:
    proc = run_helm(
        helm, "template", "nodeagent", str(CHART), "--set", "config.toml=kube = true", "--set", "plane=dra"
    )
    assert proc.returncode != 0
    assert "plane cannot be merged into the config given as config.toml" in proc.stderr, proc.stderr
    proc = run_helm(
        helm,
        "template",
        "nodeagent",
        str(CHART),
        "--set",
        "migStrategy=single",
        "--set-string",
        "devicePlugin.config=version: v1",
    )
    assert proc.returncode != 0
    assert "devicePlugin.config is passed to the agent unchanged" in proc.stderr, proc.stderr
    proc = run_helm(helm, "template", "nodeagent", str(CHART), "--set", "config.agent.metrics.labels.a=b")
    assert proc.returncode != 0
    assert "config.agent.metrics.labels: a string, boolean, number or list is expected" in proc.stderr, (
        proc.stderr
    )


def test_install_upgrade_uninstall(helm: Path, kube_apiserver: KubeApiServer, tmp_path: Path) -> None:
    """`helm install` / `upgrade` / `uninstall` on the real apiserver (no kubelet: the pods stay unscheduled).
    Another release name and namespace than the other tests' objects: every name follows the release."""
    home = {
        "HOME": str(tmp_path),  # the Kubernetes client's discovery cache goes under $HOME/.kube
        "HELM_CACHE_HOME": str(tmp_path / "cache"),
        "HELM_CONFIG_HOME": str(tmp_path / "config"),
        "HELM_DATA_HOME": str(tmp_path / "data"),
        "PATH": "/usr/bin:/bin",
    }

    def run(*args: str) -> str:
        proc = subprocess.run(
            [str(helm), *args, "--kubeconfig", str(kube_apiserver.kubeconfig)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env=home,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    def get(path: str) -> tuple[int, Doc]:
        status, body = kube_apiserver.get(path)
        return status, json.loads(body or b"{}")

    ds = "/apis/apps/v1/namespaces/gpu-system/daemonsets/gpu-agent"
    cm = "/api/v1/namespaces/gpu-system/configmaps/gpu-agent-config"
    dc = "/apis/resource.k8s.io/v1/deviceclasses/gpu.nodeagent.io"
    policy = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies/gpu-agent-own-node"
    run("uninstall", "gpu-agent", "--namespace", "gpu-system", "--ignore-not-found")
    out = run("install", "gpu-agent", str(CHART), "--namespace", "gpu-system", "--create-namespace")
    assert "STATUS: deployed" in out, out
    status, daemonset = get(ds)
    assert status == 200 and daemonset["metadata"]["annotations"]["meta.helm.sh/release-name"] == "gpu-agent"
    assert daemonset["spec"]["template"]["spec"]["serviceAccountName"] == "gpu-agent"
    status, vap = get(policy)
    assert status == 200
    assert "'system:serviceaccount:gpu-system:gpu-agent'" in vap["spec"]["matchConditions"][0]["expression"]
    assert get("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/gpus.nodeagent.io")[0] == 200
    assert get(dc)[0] == 404
    dra_role = "/apis/rbac.authorization.k8s.io/v1/clusterroles/gpu-agent-dra"
    assert get(dra_role)[0] == 404
    # upgrade to the DRA plane: the DeviceClasses and the DRA role appear, the agent's config follows
    out = run("upgrade", "gpu-agent", str(CHART), "--namespace", "gpu-system", "--set", "plane=dra")
    assert "REVISION: 2" in out, out
    assert get(dc)[0] == 200
    assert get(dra_role)[0] == 200
    assert 'plane = "dra"' in get(cm)[1]["data"]["config.toml"]
    history = json.loads(run("history", "gpu-agent", "--namespace", "gpu-system", "--output", "json"))
    assert [h["revision"] for h in history] == [1, 2]
    run("uninstall", "gpu-agent", "--namespace", "gpu-system", "--wait")
    for path in (ds, cm, dc, policy, dra_role):
        assert get(path)[0] == 404, path
    assert not (REPO / ".kube").exists()  # nothing of the client's cache in the checkout
    # helm never deletes a CRD it installed: the GPU objects of every node outlive the release
    assert get("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/gpus.nodeagent.io")[0] == 200


def test_compute_domains_render_the_plain_controller_manifest(helm: Path) -> None:
    """computeDomains.enabled (with the DRA plane) renders packaging/kubernetes/computedomain-controller.yaml
    object for object; the default renders none of it; with the device-plugin plane it is one clear error."""
    plain = [d for d in yaml.safe_load_all((MANIFESTS / "computedomain-controller.yaml").read_text()) if d]
    rendered = by_key(render(helm, "plane=dra", "computeDomains.enabled=true"))
    for doc in plain:
        assert rendered[key(doc)] == doc, key(doc)
    names = {d["metadata"]["name"] for d in plain}
    assert not [key(d) for d in render(helm, "plane=dra") if d["metadata"]["name"] in names]
    proc = run_helm(helm, "template", "nodeagent", str(CHART), "--set", "computeDomains.enabled=true")
    assert proc.returncode != 0 and "computeDomains.enabled needs the DRA plane" in proc.stderr, proc.stderr


def test_remediation_controller_renders_the_plain_manifest(helm: Path) -> None:
    """remediation.controller.enabled renders packaging/kubernetes/remediation-controller.yaml object for object,
    on any plane and without computeDomains; the default renders none of it."""
    plain = [d for d in yaml.safe_load_all((MANIFESTS / "remediation-controller.yaml").read_text()) if d]
    rendered = by_key(render(helm, "remediation.controller.enabled=true"))
    for doc in plain:
        assert rendered[key(doc)] == doc, key(doc)
    names = {d["metadata"]["name"] for d in plain}
    assert not [key(d) for d in render(helm) if d["metadata"]["name"] in names]


def test_fleet_and_nodefeature_render_their_plain_roles_and_config(helm: Path) -> None:
    """fleet.enabled and nodeFeature.enabled each render their plain file (rbac-fleet.yaml, rbac-nodefeature.yaml)
    object for object and set their keys in config.toml to the release namespace; the default renders neither
    Role; the keys in config.agent without the value, one clear error naming both."""
    from nodeagent.config import parse_config

    for variant, name in (("fleet", "rbac-fleet.yaml"), ("nodefeature", "rbac-nodefeature.yaml")):
        docs = render(helm, *VARIANTS[variant])
        rendered = by_key(docs)
        plain = [d for d in yaml.safe_load_all((MANIFESTS / name).read_text()) if d]
        assert {d["kind"] for d in plain} == {"Role", "RoleBinding"}, name
        for doc in plain:
            assert rendered[key(doc)] == doc, (variant, key(doc))
        assert not [key(d) for d in render(helm) if key(d) in {key(p) for p in plain}]
        cfg = parse_config(agent_config(docs)[0], f"{variant}/config.toml")
        if variant == "fleet":
            assert cfg.mig.fleet_namespace == "nodeagent"
            assert cfg.publish.labels is True
        else:
            assert (cfg.publish.labels, cfg.publish.nodefeature_namespace) == ("nodefeature", "nodeagent")
            assert cfg.mig.fleet_namespace == ""
    default = parse_config(agent_config(render(helm))[0], "default")
    assert (default.mig.fleet_namespace, default.publish.labels) == ("", True)

    proc = run_helm(helm, "template", "nodeagent", str(CHART), "--set", "config.agent.mig.fleet_namespace=nodeagent")
    assert proc.returncode != 0
    assert "config.agent.mig.fleet_namespace needs the fleet's Role" in proc.stderr, proc.stderr
    assert "set fleet.enabled=true instead" in proc.stderr, proc.stderr
    proc = run_helm(helm, "template", "nodeagent", str(CHART), "--set", "config.agent.publish.labels=nodefeature")
    assert proc.returncode != 0
    assert "set nodeFeature.enabled=true instead" in proc.stderr, proc.stderr
    for value in ("fleet", "nodeFeature"):
        proc = run_helm(helm, "template", "nodeagent", str(CHART), "--set", f"{value}.enabled=yes")
        assert proc.returncode != 0 and f"at '/{value}/enabled': got string, want boolean" in proc.stderr, proc.stderr


# -- the host-managed IMEX daemon -------------------------------------------------------------------------

def _by_name(items: list[Doc]) -> dict[str, Doc]:
    return {i["name"]: i for i in items}


def _comparable(pod: Doc) -> Doc:
    """The pod spec with its volumes and every container's mounts keyed by name (their order means nothing)."""
    out = dict(pod)
    out["volumes"] = _by_name(pod["volumes"])
    out["containers"] = [{**c, "volumeMounts": _by_name(c["volumeMounts"])} for c in pod["containers"]]
    out["initContainers"] = [{**c, "volumeMounts": _by_name(c["volumeMounts"])} for c in pod["initContainers"]]
    return out


def test_imex_renders_the_pod_side_and_the_config(helm: Path) -> None:
    """imex.enabled: the pod on the node's network with the node's /etc/nvidia-imex at /host/etc/nvidia-imex (the
    agent's container only) and [imex] enabled in config.toml, merged with config.agent.imex's other keys; none
    of it without the value; [imex] in config.agent without the value, one clear error naming both."""
    from nodeagent.config import parse_config

    docs = render(helm, *VARIANTS["imex"], "config.agent.imex.server_port=50100")
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    assert (pod["hostNetwork"], pod["dnsPolicy"]) == (True, "ClusterFirstWithHostNet")
    assert _by_name(pod["volumes"])["imex-etc"] == {
        "name": "imex-etc", "hostPath": {"path": "/etc/nvidia-imex", "type": "DirectoryOrCreate"}}
    agent, = pod["containers"]
    assert _by_name(agent["volumeMounts"])["imex-etc"] == {"name": "imex-etc", "mountPath": "/host/etc/nvidia-imex"}
    assert "imex-etc" not in _by_name(pod["initContainers"][0]["volumeMounts"])
    imex = parse_config(agent_config(docs)[0], "imex/config.toml").imex
    assert (imex.enabled, imex.server_port, imex.cmd_port) == (True, 50100, 50005)

    default = one(render(helm), "DaemonSet")["spec"]["template"]["spec"]
    assert "hostNetwork" not in default and "dnsPolicy" not in default
    assert "imex-etc" not in _by_name(default["volumes"])
    assert "imex" not in tomllib.loads(agent_config(render(helm))[0])

    # a config of the user's own: the pod side only, [imex] is that config's
    own = render(helm, "imex.enabled=true", "config.name=my-nodeagent-config")
    assert one(own, "DaemonSet")["spec"]["template"]["spec"]["hostNetwork"] is True
    assert not [d for d in own if d["kind"] == "ConfigMap"]

    _feature_value_refusals(helm, "imex", "needs the pod on the node's network with /etc/nvidia-imex")


def _feature_value_refusals(helm: Path, feature: str, need: str) -> None:
    """``config.agent.<feature>.enabled`` without the chart value is refused with the line saying what it needs
    and to set ``<feature>.enabled=true``; the value itself must be a boolean."""
    proc = run_helm(helm, "template", "nodeagent", str(CHART), "--set", f"config.agent.{feature}.enabled=true")
    assert proc.returncode != 0
    assert f"config.agent.{feature}.enabled {need}: set {feature}.enabled=true instead" in proc.stderr, proc.stderr
    proc = run_helm(helm, "template", "nodeagent", str(CHART), "--set", f"{feature}.enabled=yes")
    assert proc.returncode != 0 and f"at '/{feature}/enabled': got string, want boolean" in proc.stderr, proc.stderr


@pytest.mark.parametrize("variant", ["imex", "vfio"])
def test_patch_file_gives_the_charts_pod(helm: Path, tmp_path: Path, variant: str) -> None:
    """The one kubectl line of docs/racks.md (docs/vfio-cc.md) for the plain manifests:
    packaging/kubernetes/daemonset-imex.patch.yaml (daemonset-vfio.patch.yaml), applied by kubectl's own strategic
    merge (--local: no server) onto daemonset.yaml, gives the pod the chart renders with imex.enabled
    (vfio.enabled), field for field (volumes and mounts compared by name)."""
    kubectl = peer_binary("NODEAGENT_KUBECTL", "nodeagent_peers_kubelet", "kubectl v1.34")
    patch = MANIFESTS / f"daemonset-{variant}.patch.yaml"
    proc = subprocess.run(
        [str(kubectl), "patch", "--local", "-f", str(MANIFESTS / "daemonset.yaml"), "--patch-file", str(patch),
         "-o", "json"],
        capture_output=True, text=True, timeout=60, check=False,
        env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "KUBECONFIG": str(tmp_path / "none")})
    assert proc.returncode == 0, proc.stderr
    patched = json.loads(proc.stdout)
    rendered = one(render(helm, *VARIANTS[variant]), "DaemonSet")
    assert _comparable(patched["spec"]["template"]["spec"]) == _comparable(rendered["spec"]["template"]["spec"])
    # nothing else of the DaemonSet moves (the pods' config hash aside: the chart's config carries the section)
    plain = yaml.safe_load((MANIFESTS / "daemonset.yaml").read_text())
    for doc in (patched, plain):
        doc["spec"]["template"]["metadata"].pop("annotations")
        doc["spec"]["template"]["spec"] = {}
    assert patched == plain


# -- the VFIO passthrough switch ------------------------------------------------------------------------------

def _sys_mounts(pod: Doc) -> list[Doc]:
    return [m for c in (*pod["initContainers"], *pod["containers"]) for m in c["volumeMounts"]
            if m["mountPath"] in ("/host/sys", "/host/usr/share")]


def test_vfio_makes_sysfs_writable_only_when_enabled(helm: Path) -> None:
    """By default every container mounts the node's /sys read-only and /usr/share not at all; vfio.enabled
    makes /sys writable in the agent's container only (the bootstrap container keeps it read-only), adds
    /usr/share read-only (pci.ids) and [vfio] enabled in config.toml, merged with config.agent.vfio's other
    keys; [vfio] enabled in config.agent without the value, one clear error naming both."""
    from nodeagent.config import parse_config

    default = one(render(helm), "DaemonSet")["spec"]["template"]["spec"]
    assert _sys_mounts(default) == [{"name": "sys", "mountPath": "/host/sys", "readOnly": True}] * 2
    assert "usr-share" not in _by_name(default["volumes"])
    assert "vfio" not in tomllib.loads(agent_config(render(helm))[0])

    docs = render(helm, *VARIANTS["vfio"], "config.agent.vfio.release_timeout=90")
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    init, = pod["initContainers"]
    agent, = pod["containers"]
    assert _by_name(init["volumeMounts"])["sys"] == {"name": "sys", "mountPath": "/host/sys", "readOnly": True}
    assert "usr-share" not in _by_name(init["volumeMounts"])
    mounts = _by_name(agent["volumeMounts"])
    assert mounts["sys"] == {"name": "sys", "mountPath": "/host/sys", "readOnly": False}
    assert mounts["usr-share"] == {"name": "usr-share", "mountPath": "/host/usr/share", "readOnly": True}
    assert _by_name(pod["volumes"])["usr-share"] == {
        "name": "usr-share", "hostPath": {"path": "/usr/share", "type": "Directory"}}
    vfio = parse_config(agent_config(docs)[0], "vfio/config.toml").vfio
    assert (vfio.enabled, vfio.release_timeout) == (True, 90)

    _feature_value_refusals(helm, "vfio", "needs the node's /sys writable in the agent's container")
