"""``nodeagent controller``: keeps every ComputeDomain's ResourceClaimTemplate and status (the cluster-wide part
of ComputeDomains), while leading through a Lease.

Each pass (every ``interval`` seconds while leading) reads the ComputeDomains, the Nodes and the templates this
controller made (label ``resource.nvidia.com/computeDomain``), and writes only the differences the pure planner
(``reconcile``) finds: a template created (or deleted and made again when its clique pin or spec is wrong; a
template of the user's own under the same name is never touched, the domain's status says so), a template of
a domain that is gone deleted (the garbage collector does it too, through the owner reference), and the
domain's ``status`` through the status subresource. One bad ComputeDomain or Node report is logged and
skipped; it never stops the others.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nodeagent.computedomain import reconcile as rc
from nodeagent.computedomain.lease import LeaderElector
from nodeagent.dra.channels import CLIQUE_LABEL
from nodeagent.errors import ConfigError, KubeError
from nodeagent.kube.client import MERGE_PATCH, KubeClient

log = logging.getLogger(__name__)

CDS = f"/apis/{rc.GROUP}/{rc.VERSION}/{rc.PLURAL}"
CD = f"/apis/{rc.GROUP}/{rc.VERSION}/namespaces/{{ns}}/{rc.PLURAL}/{{name}}"
RCTS = "/apis/resource.k8s.io/v1/resourceclaimtemplates"
RCT = "/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaimtemplates"


@dataclass
class PassResult:
    """What one pass wrote (for logs and tests)."""

    created: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    statuses: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


class Controller:
    def __init__(self, kube: KubeClient) -> None:
        self.kube = kube
        self._complaints: set[str] = set()

    def _complain(self, text: str, out: PassResult) -> None:
        out.problems.append(text)
        if text not in self._complaints:  # once per distinct problem, not every pass
            self._complaints.add(text)
            log.warning("%s", text)

    def reconcile_once(self) -> PassResult:
        out = PassResult()
        domains = self.kube.request("GET", CDS, action="list ComputeDomains").get("items") or []
        nodes_raw = self.kube.request("GET", "/api/v1/nodes", action="list Nodes").get("items") or []
        templates = self.kube.request("GET", RCTS, query={"labelSelector": rc.DOMAIN_LABEL},
                                      action="list ResourceClaimTemplates").get("items") or []
        nodes: list[rc.NodeFacts] = []
        for n in nodes_raw:
            facts, complaint = rc.node_facts(n)
            if complaint:
                self._complain(complaint, out)
            nodes.append(facts)
        by_key = {(t["metadata"]["namespace"], t["metadata"]["name"]): t for t in templates}
        live_uids: set[str] = set()
        for obj in domains:
            try:
                domain = rc.parse_domain(obj)
            except ConfigError as e:
                self._complain(str(e), out)
                continue
            live_uids.add(domain.uid)
            try:
                self._one(domain, obj, nodes, by_key.get((domain.namespace, domain.template)), out)
            except KubeError as e:
                self._complain(f"ComputeDomain {domain.namespace}/{domain.name}: {e}", out)
        for t in templates:  # templates of domains that are gone
            meta = t["metadata"]
            if meta.get("labels", {}).get(rc.DOMAIN_LABEL) not in live_uids and \
                    rc.owned_by(t, meta["labels"].get(rc.DOMAIN_LABEL, "")):
                self._delete_template(meta["namespace"], meta["name"], out)
        return out

    def _one(self, domain: rc.Domain, obj: Mapping[str, Any], nodes: list[rc.NodeFacts],
             existing: Mapping[str, Any] | None, out: PassResult) -> None:
        key = f"{domain.namespace}/{domain.template}"
        if existing is None:
            existing = self._get_template(domain.namespace, domain.template)
        if existing is not None and not rc.owned_by(existing, domain.uid):
            self._complain(f"ComputeDomain {domain.namespace}/{domain.name}: a ResourceClaimTemplate {key} "
                           "that this domain does not own exists; it is left alone", out)
        else:
            current = ((existing or {}).get("metadata") or {}).get("annotations", {}).get(rc.CLIQUE_ANNOTATION)
            clique = rc.choose_clique(domain, nodes, current)
            if clique is None:
                if existing is None:
                    self._complain(f"ComputeDomain {domain.namespace}/{domain.name}: no Node carries "
                                   f"{CLIQUE_LABEL}: its template waits for a fabric-attached node", out)
            else:
                want = rc.desired_template(domain, clique)
                if existing is not None and not rc.template_matches(existing, want):
                    self._delete_template(domain.namespace, domain.template, out)
                    existing = None
                if existing is None:
                    self.kube.request("POST", RCT.format(ns=domain.namespace), body=want,
                                      action=f"create ResourceClaimTemplate {key}", subject=key)
                    out.created.append(key)
        want_status = rc.desired_status(domain, obj.get("status"), nodes)
        if not rc.status_equal(obj.get("status"), want_status):
            body = {"status": {"status": want_status["status"], "nodes": want_status.get("nodes")}}
            self.kube.request("PATCH", CD.format(ns=domain.namespace, name=domain.name) + "/status",
                              body=body, content_type=MERGE_PATCH,
                              action=f"update status of ComputeDomain {domain.namespace}/{domain.name}")
            out.statuses.append(f"{domain.namespace}/{domain.name}")

    def _get_template(self, ns: str, name: str) -> dict[str, Any] | None:
        try:
            return self.kube.request("GET", f"{RCT.format(ns=ns)}/{name}",
                                     action=f"get ResourceClaimTemplate {ns}/{name}")
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    def _delete_template(self, ns: str, name: str, out: PassResult) -> None:
        try:
            self.kube.request("DELETE", f"{RCT.format(ns=ns)}/{name}",
                              action=f"delete ResourceClaimTemplate {ns}/{name}")
        except KubeError as e:
            if e.status != 404:
                raise
        out.deleted.append(f"{ns}/{name}")


def run(kube: KubeClient, elector: LeaderElector, stop: threading.Event, *, interval: float,
        computedomains: bool = True, passes: Sequence[tuple[str, Callable[[], object]]] = ()) -> None:
    """Until ``stop``: try the Lease every ``retry_period``; while leading, reconcile every ``interval`` (the
    ComputeDomains when ``computedomains``, then each of ``passes``: other duties of the same leader, by name;
    a ``KubeError`` of one is logged and never stops the others)."""
    controller = Controller(kube)
    next_pass = 0.0
    try:
        while not stop.is_set():
            leading = elector.try_acquire_or_renew()
            now = elector.clock()
            if leading and now >= next_pass:
                if computedomains:
                    try:
                        res = controller.reconcile_once()
                        if res.created or res.deleted or res.statuses:
                            log.info("computedomains: created %s, deleted %s, status of %s",
                                     res.created, res.deleted, res.statuses)
                    except KubeError as e:
                        log.warning("computedomains: pass failed: %s", e)
                for name, one in passes:
                    try:
                        one()
                    except KubeError as e:
                        log.warning("%s: pass failed: %s", name, e)
                next_pass = now + interval
            if not leading:
                next_pass = 0.0
            stop.wait(min(elector.cfg.retry_period, interval))
    finally:
        elector.release()
