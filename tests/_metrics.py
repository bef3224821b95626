"""Reading Prometheus metrics in peer tests: the agent's own endpoint, parsed by Prometheus' parser, and the
real kube-apiserver's gauge of open node watches. Shared by tests/e2e and tests/integration."""

from __future__ import annotations

import re
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.peers.apiserver import KubeApiServer

Samples = dict[str, list[tuple[dict[str, str], float]]]


def scrape(port: int) -> Samples:
    """Sample name (``..._total`` for counters) → its label sets and values, from 127.0.0.1:``port``/metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            out.setdefault(smp.name, []).append((smp.labels, smp.value))
    return out


def scrape_or_none(port: int) -> Samples | None:
    """Like ``scrape``, None while nothing answers on the port."""
    try:
        return scrape(port)
    except OSError:
        return None


def node_watches(server: KubeApiServer) -> dict[str, float]:
    """The apiserver's gauge of open WATCH requests on nodes, by scope ("resource" = one named object)."""
    status, body = server.get("/metrics")
    assert status == 200
    out: dict[str, float] = {}
    for line in body.decode().splitlines():
        if line.startswith("apiserver_longrunning_requests{") and 'resource="nodes"' in line and 'verb="WATCH"' in line:
            scope = re.search(r'scope="([^"]*)"', line)
            out[scope.group(1) if scope else "?"] = float(line.rsplit(" ", 1)[1])
    return out


def apiserver_request_counts(server: KubeApiServer) -> list[tuple[dict[str, str], float]]:
    """The apiserver's own ``apiserver_request_total`` samples: (labels: verb, resource, subresource, scope,
    code, ...; count)."""
    status, body = server.get("/metrics", timeout=30)
    assert status == 200
    return [(dict(s.labels), s.value) for fam in text_string_to_metric_families(body.decode())
            if fam.name == "apiserver_request" for s in fam.samples if s.name == "apiserver_request_total"]
