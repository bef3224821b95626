"""packaging/prometheus/nodeagent-rules.yaml and packaging/grafana/nodeagent.json judged by Prometheus' own
promtool (Debian's prometheus package): the agent's real /metrics output passes `promtool check metrics` (but
for dcgm-exporter's own camelCase label modelName), the rules pass `promtool check rules`, every alert fires
(and only then) in `promtool test rules` on series taken from a scrape of a running agent, and every dashboard
query parses and returns data on those series.

The agent here runs without Kubernetes and without a kubelet (``--no-kube``), so the families only a cluster
fills (API requests, publish writes, MIG applies, Allocate calls) come from the agent's own ``Metrics`` class fed
through the methods the daemon calls: the same code renders them, with the same names and labels."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e._agent import REPO, eventually, node_root, running_agent
from tests.peers._resolve import system_binary
from tests.peers.apiserver import free_port

pytestmark = pytest.mark.peers

RULES = REPO / "packaging/prometheus/nodeagent-rules.yaml"
DASHBOARD = REPO / "packaging/grafana/nodeagent.json"
INSTANCE = "10.0.0.5:9400"  # the scrape target Prometheus would label the agent's series with
OTHER = "10.0.0.6:9400"  # a second node, for the MIG pending case
SICK_GPU = "1"


@dataclass(frozen=True)
class Series:
    name: str
    labels: dict[str, str]
    value: float
    counter: bool

    def selector(self, **extra: str) -> str:
        labels = {**self.labels, **extra}
        inner = ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(labels.items()))
        return f"{self.name}{{{inner}}}"


def parse(text: str) -> list[Series]:
    out: list[Series] = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            counter = fam.type in ("counter", "histogram") and not s.name.endswith("_created")
            out.append(Series(s.name, dict(s.labels), float(s.value), counter))
    return out


@pytest.fixture(scope="module")
def promtool() -> Path:
    """Debian's promtool: NODEAGENT_PROMTOOL from tests/testbin/setup.sh, else the one on PATH."""
    exported = os.environ.get("NODEAGENT_PROMTOOL")
    return Path(exported) if exported else system_binary("promtool", "prometheus")


@pytest.fixture(scope="module")
def scrape_text(tmp_path_factory: pytest.TempPathFactory) -> str:
    """/metrics of a running agent (simulated A30 x4, no Kubernetes, no kubelet) after GPU 1 reported XID 48
    and the driver asks for a GPU reset."""
    from nodeagent.simulator.inject import set_recovery_action
    from nodeagent.simulator.state import SimStore

    work = tmp_path_factory.mktemp("agent")
    sim_state = work / "sim.json"
    cfg = work / "config.toml"
    cfg.write_text("resync_interval = 300.0\n[runtime]\ncheck_interval = 0.0\n[metrics]\ninterval = 60.0\n")
    port = free_port()
    args = ["run", "--config", str(cfg), "--simulate", "a30x4", "--sim-state", str(sim_state), "--no-kube"]
    # GPU 0 in MIG mode with two 2g.12gb devices, from the start
    layout = subprocess.run(
        [
            sys.executable,
            "-m",
            "nodeagent",
            "sim",
            "mig",
            "--simulate",
            "a30x4",
            "--sim-state",
            str(sim_state),
            "--gpu",
            "0",
            "2g.12gb",
            "2g.12gb",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert layout.returncode == 0, layout.stderr
    with node_root() as root, running_agent(work, root, args, metrics=f"127.0.0.1:{port}") as agent:
        eventually(lambda: _get(port, "nodeagent_device_healthy"), 30, "the agent's metrics")
        set_recovery_action(SimStore.open(None, sim_state), int(SICK_GPU), 1)
        injected = subprocess.run(
            [
                sys.executable,
                "-m",
                "nodeagent",
                "sim",
                "inject",
                "xid",
                "--sim-state",
                str(sim_state),
                "--gpu",
                SICK_GPU,
                "--code",
                "48",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert injected.returncode == 0, injected.stderr
        eventually(
            lambda: 'recovery_action="' in (_get(port, "nodeagent_gpu_fault") or ""),
            30,
            "the XID in nodeagent_gpu_fault",
        )
        text = _get(port, "") or ""
        assert "Traceback" not in agent.log()
    return text


def _get(port: int, needle: str) -> str | None:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text: str = r.read().decode()
    except OSError:
        return None
    return text if needle in text else None


def cluster_families(hostname: str, mig_state: str, mig_config: str) -> str:
    """The families a cluster fills, rendered by the agent's Metrics class after the calls the daemon makes."""
    from nodeagent.kube.conditions import ConditionSnapshot, MigInput
    from nodeagent.metrics import Metrics

    m = Metrics(hostname)
    for method, status in (("GET", 200), ("PATCH", 200), ("PATCH", 409), ("POST", None)):
        m.record_request(method, status)
    m.count_publish({"labels": 1, "status": 1, "gpu_objects": 4})
    m.observe_reconcile("mig", mig_state, 2.5)
    m.update_state(
        ConditionSnapshot(mig=MigInput(state=mig_state, config=mig_config)),
        {"nvidia.com/gpu": True},
        {("nvidia.com/gpu", "answered"): 7, ("nvidia.com/gpu", "refused"): 1},
    )
    return generate_latest(m.registry).decode()


def input_series(scrape: str) -> list[dict[str, str]]:
    """promtool input series for 20 minutes at 1m steps: the agent's scrape as target INSTANCE (gauges hold
    their value, counters grow), the cluster families for both nodes, and Prometheus' own `up`."""
    real = parse(scrape)
    real_names = {s.name for s in real}
    out: dict[str, str] = {}

    def add(series: Series, instance: str) -> None:
        sel = series.selector(job="nodeagent", instance=instance)
        step = 1 if series.counter else 0
        out[sel] = f"{series.value:g}+{step}x20"

    for s in real:
        add(s, INSTANCE)
    for instance, state, config in ((INSTANCE, "failed", "all-1g.6gb"), (OTHER, "pending", "all-balanced")):
        for s in parse(cluster_families(instance, state, config)):
            if s.name not in real_names or instance == OTHER:
                add(s, instance)
    out[f'up{{instance="{INSTANCE}",job="nodeagent"}}'] = "1x20"
    out[f'up{{instance="{OTHER}",job="nodeagent"}}'] = "1 0x20"
    return [{"series": k, "values": v} for k, v in out.items()]


def values_of(scrape: str, name: str) -> list[Series]:
    return [s for s in parse(scrape) if s.name == name]


def test_the_scrape_is_what_the_rules_read(scrape_text: str) -> None:
    """The series the alerts read are in the real output, shaped as the rules expect."""
    healthy = {s.labels["gpu"]: s.value for s in values_of(scrape_text, "nodeagent_device_healthy")}
    assert healthy == {"0": 1.0, "1": 0.0, "2": 1.0, "3": 1.0}, healthy
    faults = values_of(scrape_text, "nodeagent_gpu_fault")
    assert [(f.labels["gpu"], f.labels["xid"], f.labels["recovery_action"]) for f in faults] == [
        (SICK_GPU, "48", "GPU reset")
    ], faults
    conditions = {
        (s.labels["condition"], s.labels["status"]): s.value
        for s in values_of(scrape_text, "nodeagent_node_condition")
    }
    assert conditions[("nodeagent.io/GPUReady", "false")] == 1.0
    assert conditions[("nodeagent.io/GPUReady", "true")] == 0.0
    # no kubelet here: nothing registered; no containerd config in the root: not wired
    registered = values_of(scrape_text, "nodeagent_device_plugin_registered")
    assert registered and {s.value for s in registered} == {0.0}, registered
    assert [s.value for s in values_of(scrape_text, "nodeagent_containerd_wired")] == [0.0]
    # the MIG layout made before the start, per GPU
    mig = {
        (s.labels["gpu"], s.labels["pending"]): s.value
        for s in values_of(scrape_text, "nodeagent_gpu_mig_enabled")
    }
    assert mig == {("0", "false"): 1.0, ("1", "false"): 0.0, ("2", "false"): 0.0, ("3", "false"): 0.0}, mig
    devices = [
        (s.labels["gpu"], s.labels["GPU_I_PROFILE"], s.value)
        for s in values_of(scrape_text, "nodeagent_mig_devices")
    ]
    assert devices == [("0", "2g.12gb", 2.0)], devices


def check_metrics(promtool: Path, text: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(promtool), "check", "metrics"],
        input=text,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_promtool_check_metrics_on_the_real_output(promtool: Path, scrape_text: str) -> None:
    """nodeagent's own families lint clean. The dcgm-exporter families keep dcgm-exporter's label names
    (modelName, which the lint would have in snake_case) so that dashboards built for dcgm-exporter work
    unchanged: that one finding, and nothing else, is allowed on them."""
    proc = check_metrics(promtool, scrape_text)
    findings = (proc.stdout + proc.stderr).strip().splitlines()
    assert findings, "the camelCase finding on dcgm-exporter's modelName label is expected"
    for line in findings:
        assert re.fullmatch(
            r"DCGM_FI_DEV_\w+ label names should be written in 'snake_case' not 'camelCase'", line
        ), line
    assert proc.returncode == 3, proc.returncode  # promtool's exit code for lint findings (1: not parsable)
    own = "".join(
        block for block in re.split(r"(?m)^(?=# HELP )", scrape_text) if not block.startswith("# HELP DCGM_")
    )
    assert "nodeagent_device_healthy" in own and "DCGM_" not in own
    proc = check_metrics(promtool, own)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "" and proc.stderr.strip() == "", proc.stdout + proc.stderr
    # without the modelName label, the dcgm-exporter families lint clean too
    renamed = scrape_text.replace("modelName=", "model_name=")
    proc = check_metrics(promtool, renamed)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_promtool_check_rules(promtool: Path) -> None:
    proc = subprocess.run(
        [str(promtool), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 8 rules found" in proc.stdout, proc.stdout


def rules() -> dict[str, dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return {r["alert"]: r for g in doc["groups"] for r in g["rules"]}


def expand(text: str, labels: dict[str, str]) -> str:
    """The annotation as Prometheus expands it (the rules use only {{ $labels.<name> }})."""
    assert "{{" not in re.sub(r"\{\{ \$labels\.(\w+) \}\}", "", text), text
    return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels.get(m.group(1), ""), text)


def expected_alert(name: str, series_labels: dict[str, str]) -> dict[str, Any]:
    rule = rules()[name]
    labels = {**series_labels, **rule.get("labels", {})}
    return {
        "exp_labels": labels,
        "exp_annotations": {k: expand(v, labels) for k, v in rule.get("annotations", {}).items()},
    }


def labels_of(scrape: str, name: str, instance: str = INSTANCE, **match: str) -> list[dict[str, str]]:
    """The label sets of ``name``'s series as Prometheus stores them (an empty label is no label)."""
    return [
        {**{k: v for k, v in s.labels.items() if v}, "job": "nodeagent", "instance": instance}
        for s in values_of(scrape, name)
        if all(s.labels.get(k) == v for k, v in match.items())
    ]


def promtool_unit_test(promtool: Path, path: Path, rule_files: list[str], test: dict[str, Any]) -> (
        subprocess.CompletedProcess[str]):
    """``promtool test rules`` on one unit-test file at ``path``: ``test`` (its series at 1-minute steps, plus
    alert_rule_test or promql_expr_test) over ``rule_files``."""
    spec = {"rule_files": rule_files, "evaluation_interval": "1m", "tests": [{"interval": "1m", **test}]}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return subprocess.run([str(promtool), "test", "rules", str(path)], capture_output=True, text=True, timeout=120,
                          check=False)


def test_every_alert_fires_on_the_agents_series(promtool: Path, scrape_text: str, tmp_path: Path) -> None:
    sick = labels_of(scrape_text, "nodeagent_device_healthy", gpu=SICK_GPU)
    fault = labels_of(scrape_text, "nodeagent_gpu_fault")
    not_ready = labels_of(
        scrape_text, "nodeagent_node_condition", condition="nodeagent.io/GPUReady", status="false"
    )
    unregistered = labels_of(scrape_text, "nodeagent_device_plugin_registered")
    unwired = labels_of(scrape_text, "nodeagent_containerd_wired")
    failed = [{"config": "all-1g.6gb", "state": "failed", "job": "nodeagent", "instance": INSTANCE}]
    pending = [{"config": "all-balanced", "state": "pending", "job": "nodeagent", "instance": OTHER}]
    down = [{"job": "nodeagent", "instance": OTHER}]
    for found in (sick, fault, not_ready, unregistered, unwired):
        assert found, "a family the rules read is missing from the scrape"
    # (alert, series labels it fires for, minutes it needs, a time before that)
    cases: list[tuple[str, list[dict[str, str]], str, str | None]] = [
        ("NodeagentDown", down, "7m", "5m"),
        ("NodeagentGpuUnhealthy", sick, "2m", "30s"),
        ("NodeagentGpuRecoveryRequired", fault, "1m", None),
        ("NodeagentGpuNotReady", not_ready, "6m", "4m"),
        ("NodeagentMigConfigFailed", failed, "1m", None),
        ("NodeagentMigConfigPendingTooLong", pending, "16m", "14m"),
        ("NodeagentContainerdNotWired", unwired, "11m", "9m"),
        ("NodeagentDevicePluginNotRegistered", unregistered, "6m", "4m"),
    ]
    assert {c[0] for c in cases} == set(rules())
    alert_tests: list[dict[str, Any]] = []
    for name, fired, at, before in cases:
        alert_tests.append(
            {"eval_time": at, "alertname": name, "exp_alerts": [expected_alert(name, lab) for lab in fired]}
        )
        if before is not None:
            alert_tests.append({"eval_time": before, "alertname": name, "exp_alerts": []})
    proc = promtool_unit_test(promtool, tmp_path / "rules-test.yaml", [str(RULES)],
                              {"input_series": input_series(scrape_text), "alert_rule_test": alert_tests})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout, proc.stdout


def test_no_alert_fires_on_a_healthy_agent(promtool: Path, scrape_text: str, tmp_path: Path) -> None:
    """The same families with every value healthy: registered, wired, GPUs healthy, MIG applied, scraped."""
    healthy: dict[str, str] = {
        "nodeagent_device_healthy": "1",
        "nodeagent_device_plugin_registered": "1",
        "nodeagent_containerd_wired": "1",
    }
    series = []
    for s in parse(scrape_text):
        if s.name in healthy:
            series.append(
                {"series": s.selector(job="nodeagent", instance=INSTANCE), "values": f"{healthy[s.name]}x20"}
            )
        elif s.name == "nodeagent_node_condition":
            value = "1" if s.labels["status"] == "true" else "0"
            series.append({"series": s.selector(job="nodeagent", instance=INSTANCE), "values": f"{value}x20"})
    for s in parse(cluster_families(INSTANCE, "success", "all-1g.6gb")):
        if s.name == "nodeagent_mig_config_state":
            series.append(
                {"series": s.selector(job="nodeagent", instance=INSTANCE), "values": f"{s.value:g}x20"}
            )
    series.append({"series": f'up{{instance="{INSTANCE}",job="nodeagent"}}', "values": "1x20"})
    quiet = [{"eval_time": "20m", "alertname": name, "exp_alerts": []} for name in rules()]
    proc = promtool_unit_test(promtool, tmp_path / "healthy-test.yaml", [str(RULES)],
                              {"input_series": series, "alert_rule_test": quiet})
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- the dashboard ---------------------------------------------------------------------------------------


def dashboard_queries() -> Iterator[tuple[str, str]]:
    doc = json.loads(DASHBOARD.read_text())
    for panel in doc["panels"]:
        for target in panel.get("targets", []):
            yield f"{panel['title']} ({target['refId']})", target["expr"]


def test_dashboard_queries_parse(promtool: Path, tmp_path: Path) -> None:
    queries = list(dashboard_queries())
    assert len(queries) >= 10
    groups = [
        {
            "name": "dashboard",
            "rules": [
                {"record": f"dashboard:query_{i}", "expr": expr} for i, (_, expr) in enumerate(queries)
            ],
        }
    ]
    rule_file = tmp_path / "dashboard-rules.yaml"
    rule_file.write_text(yaml.safe_dump({"groups": groups}))
    proc = subprocess.run(
        [str(promtool), "check", "rules", str(rule_file)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(queries)} rules found" in proc.stdout, proc.stdout


def test_dashboard_queries_return_data(promtool: Path, scrape_text: str, tmp_path: Path) -> None:
    """Each query, evaluated by promtool on the agent's series 15 minutes in, returns at least one sample."""
    queries = list(dashboard_queries())
    expr_tests = [
        {
            "expr": f"(count({expr}) > bool 0) or vector(0)",
            "eval_time": "15m",
            "exp_samples": [{"labels": "{}", "value": 1}],
        }
        for _, expr in queries
    ]
    proc = promtool_unit_test(promtool, tmp_path / "dashboard-test.yaml", [],
                              {"input_series": input_series(scrape_text), "promql_expr_test": expr_tests})
    # promtool names the failing expression: map it back to the panel
    assert proc.returncode == 0, "\n".join(
        [proc.stdout + proc.stderr] + [f"{title}: {expr}" for title, expr in queries if expr in proc.stdout]
    )
