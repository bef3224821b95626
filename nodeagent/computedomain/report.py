"""The node's part of ComputeDomains: its agent reports, on its OWN Node, the domains whose IMEX channel claims
are prepared there and whether the node's IMEX daemon is ready (annotation ``REPORT_ANNOTATION``, read by
``nodeagent controller``). The admission policy lets an agent change only its own Node, so no node can speak
for another. Writes only when the report changed; an empty report removes the annotation."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from nodeagent.computedomain.reconcile import NOT_READY, READY, REPORT_ANNOTATION, encode_report
from nodeagent.kube.client import MERGE_PATCH, KubeClient

log = logging.getLogger(__name__)


class NodeReporter:
    """``sync(domains)`` (blocking: call it from a worker thread). ``imex_ready`` says whether the node's IMEX
    daemon answers READY; without one (no supervised daemon on this node) a prepared domain is Ready."""

    def __init__(self, kube: KubeClient, node_name: str, imex_ready: Callable[[], bool] | None = None) -> None:
        self.kube = kube
        self.node_name = node_name
        self.imex_ready = imex_ready
        # the value last written ("" none): a start with no domain prepared writes nothing (a report left by an
        # earlier run whose claims all went while it was down stays until the next domain comes and goes)
        self._written = ""

    def report(self, domains: Iterable[str]) -> dict[str, str]:
        status = READY if self.imex_ready is None or self.imex_ready() else NOT_READY
        return {uid: status for uid in sorted(domains)}

    def sync(self, domains: Iterable[str]) -> bool:
        """Write the report if it changed; whether a write was sent. ``KubeError`` when it failed (the next
        sync tries again)."""
        rep = self.report(domains)
        value = encode_report(rep) if rep else ""
        if value == self._written:
            return False
        self.kube.request("PATCH", f"/api/v1/nodes/{self.node_name}", content_type=MERGE_PATCH,
                          body={"metadata": {"annotations": {REPORT_ANNOTATION: value or None}}},
                          action=f"report ComputeDomains on Node {self.node_name}", subject=self.node_name)
        self._written = value
        log.info("ComputeDomains on this node: %s", rep or "none")
        return True
