"""ComputeDomain → the ResourceClaimTemplate and the status it should have (pure).

Inputs are the API objects as JSON (``dict``): the user's ComputeDomain (NVIDIA's CRD
``resource.nvidia.com/v1beta1``, unchanged), the Nodes (their ``nvidia.com/gpu.clique`` label, InternalIP and
the report annotation ``REPORT_ANNOTATION`` that each node's agent writes on its OWN Node), and the template
that exists. Outputs are the template that should exist (or none yet) and the status to write.

The node report is a JSON object ``{"<ComputeDomain UID>": "Ready" | "NotReady", ...}``: the domains whose
channel claims are prepared on that node and whether the node's IMEX daemon answers READY. A node can only
write its own Node's metadata (packaging/kubernetes/admission-policy.yaml), so a report speaks for one node.

The clique pin: a domain's template asks for the channel device of ONE clique (a CEL selector on the device
attribute ``clique``), so all its pods land in one NVLink clique. The clique is chosen when the template is
made — the clique of the nodes already in the domain, else the clique with the most nodes (ties: the lowest
name) — and kept while any Node still carries it. No clique in the cluster: no template yet (status
NotReady), as pods could not get a channel anywhere.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nodeagent.dra.channels import (
    ALL,
    CHANNEL_CLASS,
    CLIQUE_LABEL,
    CONFIG_API_VERSION,
    CONFIG_KIND,
    DRIVER,
    SINGLE,
    clique_selector,
)
from nodeagent.errors import ConfigError

GROUP, VERSION, PLURAL = "resource.nvidia.com", "v1beta1", "computedomains"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "ComputeDomain"
READY, NOT_READY = "Ready", "NotReady"
# on every Node, written by that node's agent only
REPORT_ANNOTATION = "nodeagent.io/computedomains"
# on the templates: NVIDIA's label naming the domain (by UID), and the clique the template is pinned to
DOMAIN_LABEL = "resource.nvidia.com/computeDomain"
CLIQUE_ANNOTATION = "nodeagent.io/clique"
MANAGED_BY = {"app.kubernetes.io/managed-by": "nodeagent-controller"}
REQUEST = "channel"


@dataclass(frozen=True)
class Domain:
    namespace: str
    name: str
    uid: str
    template: str
    allocation_mode: str
    num_nodes: int


def parse_domain(obj: Mapping[str, Any]) -> Domain:
    """The fields nodeagent acts on; one ``ConfigError`` naming the domain and the field otherwise (the CRD's
    schema already refuses most of these; a copy of it the cluster's admin changed might not)."""
    meta = obj.get("metadata") or {}
    ns, name, uid = str(meta.get("namespace", "")), str(meta.get("name", "")), str(meta.get("uid", ""))
    where = f"ComputeDomain {ns}/{name}"
    if not ns or not name or not uid:
        raise ConfigError(f"{where}: metadata.namespace, name and uid are required", subject=where)
    spec = obj.get("spec")
    channel = spec.get("channel") if isinstance(spec, Mapping) else None
    if not isinstance(channel, Mapping):
        raise ConfigError(f"{where}: spec.channel is required", subject=where)
    rct = channel.get("resourceClaimTemplate")
    template = rct.get("name") if isinstance(rct, Mapping) else None
    if not isinstance(template, str) or not _dns_subdomain(template):
        raise ConfigError(f"{where}: spec.channel.resourceClaimTemplate.name must be a DNS subdomain, got "
                          f"{template!r}", subject=where)
    mode = channel.get("allocationMode") or SINGLE
    if mode not in (SINGLE, ALL):
        raise ConfigError(f"{where}: spec.channel.allocationMode must be Single or All, got {mode!r}",
                          subject=where)
    num = spec.get("numNodes", 0) if isinstance(spec, Mapping) else 0
    if not isinstance(num, int) or isinstance(num, bool) or num < 0:
        raise ConfigError(f"{where}: spec.numNodes must be an integer >= 0, got {num!r}", subject=where)
    return Domain(ns, name, uid, template, str(mode), num)


def _dns_subdomain(s: str) -> bool:
    import re

    return len(s) <= 253 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*",
                                          s) is not None


@dataclass(frozen=True)
class NodeFacts:
    """What the controller knows of one Node: its clique, InternalIP, and the domains it reports."""

    name: str
    clique: str
    address: str
    reports: Mapping[str, str] = field(default_factory=dict)


def parse_report(value: str) -> dict[str, str]:
    """A node's report annotation; ``ValueError`` naming what is wrong (the caller logs it and treats the
    node as reporting nothing)."""
    try:
        data = json.loads(value)
    except ValueError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    out: dict[str, str] = {}
    for uid, status in data.items():
        if status not in (READY, NOT_READY):
            raise ValueError(f"domain {uid!r}: status must be Ready or NotReady, got {status!r}")
        out[str(uid)] = str(status)
    return out


def encode_report(reports: Mapping[str, str]) -> str:
    """The annotation value for a node's ``{uid: status}`` (sorted keys, so an unchanged report is equal)."""
    return json.dumps(dict(sorted(reports.items())), separators=(",", ":"))


def node_facts(node: Mapping[str, Any]) -> tuple[NodeFacts, str | None]:
    """(facts, a complaint about its report or None) of a Node object."""
    meta = node.get("metadata") or {}
    labels = meta.get("labels") or {}
    addresses = (node.get("status") or {}).get("addresses") or []
    address = next((str(a.get("address", "")) for a in addresses if a.get("type") == "InternalIP"), "")
    raw = (meta.get("annotations") or {}).get(REPORT_ANNOTATION)
    reports: dict[str, str] = {}
    complaint = None
    if raw is not None:
        try:
            reports = parse_report(str(raw))
        except ValueError as e:
            complaint = f"Node {meta.get('name')}: annotation {REPORT_ANNOTATION}: {e}"
    return NodeFacts(str(meta.get("name", "")), str(labels.get(CLIQUE_LABEL, "")), address, reports), complaint


def choose_clique(domain: Domain, nodes: Sequence[NodeFacts], current: str | None) -> str | None:
    """The clique the domain's template is pinned to (see the module's text)."""
    present = Counter(n.clique for n in nodes if n.clique)
    if current and current in present:
        return current
    members = Counter(n.clique for n in nodes if n.clique and domain.uid in n.reports)
    pool = members or present
    if not pool:
        return None
    return min(pool, key=lambda c: (-pool[c], c))


def desired_template(domain: Domain, clique: str) -> dict[str, Any]:
    """The ResourceClaimTemplate of ``domain``, pinned to ``clique``, owned by the domain (the garbage
    collector deletes it with the domain)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {
            "name": domain.template,
            "namespace": domain.namespace,
            "labels": {DOMAIN_LABEL: domain.uid, **MANAGED_BY},
            "annotations": {CLIQUE_ANNOTATION: clique},
            "ownerReferences": [{"apiVersion": API_VERSION, "kind": KIND, "name": domain.name,
                                 "uid": domain.uid, "controller": True}],
        },
        "spec": {"spec": {"devices": {
            "requests": [{"name": REQUEST, "exactly": {
                "deviceClassName": CHANNEL_CLASS,
                "selectors": [{"cel": {"expression": clique_selector(clique)}}],
            }}],
            "config": [{"requests": [REQUEST], "opaque": {"driver": DRIVER, "parameters": {
                "apiVersion": CONFIG_API_VERSION, "kind": CONFIG_KIND,
                "domainID": domain.uid, "allocationMode": domain.allocation_mode,
            }}}],
        }}},
    }


def _holds(stored: Any, want: Any) -> bool:
    """``stored`` has every field of ``want`` with its value; fields only ``stored`` has are the API server's
    defaults (``allocationMode: ExactCount``, ``count: 1``, an empty ``metadata``) and do not count."""
    if isinstance(want, Mapping):
        return isinstance(stored, Mapping) and all(k in stored and _holds(stored[k], v) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(stored, list) and len(stored) == len(want) and all(map(_holds, stored, want))
    return bool(stored == want)


def template_matches(existing: Mapping[str, Any], want: Mapping[str, Any]) -> bool:
    """Whether an existing template is the wanted one: its spec as the controller made it (with the server's
    defaults), owned by the same domain, same pin. The spec of a ResourceClaimTemplate cannot be changed, so a
    different one is deleted and made again."""
    meta = existing.get("metadata") or {}
    wmeta = want["metadata"]
    owners = [(o.get("uid"), bool(o.get("controller"))) for o in meta.get("ownerReferences") or []]
    return (_holds(existing.get("spec"), want["spec"])
            and (wmeta["ownerReferences"][0]["uid"], True) in owners
            and (meta.get("labels") or {}).get(DOMAIN_LABEL) == wmeta["labels"][DOMAIN_LABEL]
            and (meta.get("annotations") or {}).get(CLIQUE_ANNOTATION) == wmeta["annotations"][CLIQUE_ANNOTATION])


def owned_by(template: Mapping[str, Any], uid: str) -> bool:
    owners = (template.get("metadata") or {}).get("ownerReferences") or []
    return any(o.get("uid") == uid and o.get("controller") for o in owners)


def desired_status(domain: Domain, previous: Mapping[str, Any] | None,
                   nodes: Iterable[NodeFacts]) -> dict[str, Any]:
    """``status`` from the nodes' reports: one entry per node that reports the domain (name, InternalIP,
    clique, index, Ready/NotReady), indices kept for nodes already listed and the lowest free one within the
    clique for a new node; ``status`` Ready when at least ``numNodes`` nodes are listed and every one is
    Ready (the rule of NVIDIA's controller), else NotReady."""
    old = {str(n.get("name")): n for n in (previous or {}).get("nodes") or [] if isinstance(n, Mapping)}
    members = sorted((n for n in nodes if domain.uid in n.reports), key=lambda n: n.name)
    taken: dict[str, set[int]] = {}
    keep: dict[str, int] = {}
    for n in members:
        prev = old.get(n.name)
        idx = prev.get("index") if prev else None
        if (prev is not None and prev.get("cliqueID") == n.clique and isinstance(idx, int) and idx >= 0
                and idx not in taken.setdefault(n.clique, set())):
            keep[n.name] = idx
            taken[n.clique].add(idx)
    out_nodes = []
    for n in members:
        idx = keep.get(n.name)
        if idx is None:
            used = taken.setdefault(n.clique, set())
            idx = next(i for i in range(len(used) + 1) if i not in used)
            used.add(idx)
        out_nodes.append({"name": n.name, "ipAddress": n.address, "cliqueID": n.clique, "index": idx,
                          "status": n.reports[domain.uid]})
    ready = len(out_nodes) >= domain.num_nodes and all(n["status"] == READY for n in out_nodes)
    status: dict[str, Any] = {"status": READY if ready else NOT_READY}
    if out_nodes:
        status["nodes"] = out_nodes
    return status


def status_equal(current: Mapping[str, Any] | None, want: Mapping[str, Any]) -> bool:
    cur = dict(current or {})
    return cur.get("status") == want["status"] and (cur.get("nodes") or []) == (want.get("nodes") or [])
