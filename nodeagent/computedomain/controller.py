"""``nodeagent controller``: keeps every ComputeDomain's ResourceClaimTemplate and status (the cluster-wide part
of ComputeDomains), while leading through a Lease.

While leading, the controller watches the ComputeDomains, the ResourceClaimTemplates and the Nodes (through
``kube.watch.CollectionWatch``: resumed after a watch ends, relisted after ``410 Gone``, backed off after
errors) and makes a pass as soon as one of them changes (of a Node only what a duty reads: its clique label,
InternalIP, report and eviction annotations; the kubelet's heartbeats wake nothing). A pass also runs every
``resync`` seconds whatever the watches said (the safety net for a missed event), and every ``interval``
seconds while a duty has work outstanding (an eviction a PodDisruptionBudget refuses) or after a pass failed.

Each pass reads the ComputeDomains, the Nodes and the templates this
controller made (label ``resource.nvidia.com/computeDomain``), and writes only the differences the pure planner
(``reconcile``) finds: a template created (or deleted and made again when its clique pin or spec is wrong; a
template of the user's own under the same name is never touched, the domain's status says so), a template of
a domain that is gone deleted (the garbage collector does it too, through the owner reference), and the
domain's ``status`` through the status subresource. One bad ComputeDomain or Node report is logged and
skipped; it never stops the others.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nodeagent.computedomain import reconcile as rc
from nodeagent.computedomain.lease import LeaderElector
from nodeagent.dra.channels import CLIQUE_LABEL
from nodeagent.errors import ConfigError, KubeError
from nodeagent.kube.client import MERGE_PATCH, KubeClient
from nodeagent.kube.watch import CollectionWatch

log = logging.getLogger(__name__)

CDS = f"/apis/{rc.GROUP}/{rc.VERSION}/{rc.PLURAL}"
CD = f"/apis/{rc.GROUP}/{rc.VERSION}/namespaces/{{ns}}/{rc.PLURAL}/{{name}}"
RCTS = "/apis/resource.k8s.io/v1/resourceclaimtemplates"
RCT = "/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaimtemplates"
NODES = "/api/v1/nodes"
DEFAULT_RESYNC_S = 300.0


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

    def reconcile_once(self, nodes_raw: Sequence[Mapping[str, Any]] | None = None) -> PassResult:
        """One pass over every ComputeDomain; ``nodes_raw``: the Nodes when the caller listed them already."""
        out = PassResult()
        domains = self.kube.request("GET", CDS, action="list ComputeDomains").get("items") or []
        if nodes_raw is None:
            nodes_raw = self.kube.request("GET", NODES, action="list Nodes").get("items") or []
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


def node_relevance(node: Mapping[str, Any]) -> object:
    """What the ComputeDomain pass reads of a Node: a change of anything else (a heartbeat) wakes no pass."""
    meta = node.get("metadata") or {}
    addresses = (node.get("status") or {}).get("addresses") or []
    return ((meta.get("labels") or {}).get(CLIQUE_LABEL), (meta.get("annotations") or {}).get(rc.REPORT_ANNOTATION),
            json.dumps(addresses, sort_keys=True))


@dataclass(frozen=True)
class Duty:
    """Another job of the same leader that acts on Nodes: ``sync(nodes)`` makes one pass over the listed Nodes
    and says whether work is outstanding (it then runs again after ``interval``, whatever the watches say);
    ``relevant(node)`` is the part of a Node it reads (a change there wakes a pass)."""

    name: str
    sync: Callable[[list[Mapping[str, Any]]], bool]
    relevant: Callable[[Mapping[str, Any]], object]


class _Watches:
    """The leader's watches; any change they report sets ``wake``."""

    def __init__(self, kube: KubeClient, wake: threading.Event, *, computedomains: bool,
                 duties: Sequence[Duty], watch_timeout_s: int) -> None:
        relevances = ([node_relevance] if computedomains else []) + [d.relevant for d in duties]

        def changed(kind: str, obj: Mapping[str, Any] | None) -> None:
            wake.set()

        self.all = [CollectionWatch(kube, NODES, changed, what="Nodes", watch_timeout_s=watch_timeout_s,
                                    relevant=lambda n: tuple(f(n) for f in relevances))]
        if computedomains:
            self.all += [
                CollectionWatch(kube, CDS, changed, what="ComputeDomains", watch_timeout_s=watch_timeout_s),
                # every template, not only ours: a user's template in a domain's place going away matters too
                CollectionWatch(kube, RCTS, changed, what="ResourceClaimTemplates", watch_timeout_s=watch_timeout_s),
            ]
        for w in self.all:
            w.start()

    def stop(self) -> None:
        for w in self.all:
            w.stop(timeout=5.0)


def one_pass(kube: KubeClient, controller: Controller | None, duties: Sequence[Duty]) -> bool:
    """One pass of every duty; whether to come back after ``interval`` (work outstanding, or a step failed)."""
    again = False
    try:
        nodes = list(kube.request("GET", NODES, action="list Nodes").get("items") or [])
    except KubeError as e:
        log.warning("pass failed: %s", e)
        return True
    if controller is not None:
        try:
            res = controller.reconcile_once(nodes)
            if res.created or res.deleted or res.statuses:
                log.info("computedomains: created %s, deleted %s, status of %s", res.created, res.deleted,
                         res.statuses)
        except KubeError as e:
            log.warning("computedomains: pass failed: %s", e)
            again = True
    for duty in duties:
        try:
            again = duty.sync(nodes) or again
        except KubeError as e:
            log.warning("%s: pass failed: %s", duty.name, e)
            again = True
    return again


def run(kube: KubeClient, elector: LeaderElector, stop: threading.Event, *, interval: float,
        resync: float = DEFAULT_RESYNC_S, computedomains: bool = True, duties: Sequence[Duty] = (),
        watch_timeout_s: int = 300) -> None:
    """Until ``stop``: try the Lease every ``retry_period``; while leading, watch and make a pass at once after
    each relevant change, every ``resync`` seconds, and every ``interval`` seconds while work is outstanding
    (the ComputeDomains when ``computedomains``, then each of ``duties``; a ``KubeError`` of one is logged and
    never stops the others). The watches run only while this candidate leads."""
    controller = Controller(kube) if computedomains else None
    wake = threading.Event()
    watches: _Watches | None = None
    leading = False
    next_try = next_resync = 0.0
    retry_at = math.inf
    try:
        while not stop.is_set():
            now = elector.clock()
            if now >= next_try:
                was, leading = leading, elector.try_acquire_or_renew()
                next_try = now + elector.cfg.retry_period
                if leading and not was:
                    watches = _Watches(kube, wake, computedomains=computedomains, duties=duties,
                                       watch_timeout_s=watch_timeout_s)
                    next_resync = 0.0
                elif was and not leading and watches is not None:
                    watches.stop()
                    watches = None
            if leading:
                now = elector.clock()
                if wake.is_set() or now >= next_resync or now >= retry_at:
                    wake.clear()  # before the pass reads: a change during the pass wakes the next one
                    if now >= next_resync:
                        next_resync = now + resync
                    retry_at = now + interval if one_pass(kube, controller, duties) else math.inf
                    continue
            due = min(next_try, next_resync, retry_at) if leading else next_try
            # ``stop`` is looked at at least every retry period
            (wake if leading else stop).wait(max(0.0, min(due - elector.clock(), elector.cfg.retry_period)))
    finally:
        if watches is not None:
            watches.stop()
        elector.release()
