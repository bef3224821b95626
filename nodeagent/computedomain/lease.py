"""Leader election through a ``coordination.k8s.io/v1`` Lease, the way Kubernetes components do it.

The rules are client-go's ``leaderelection`` package's: a candidate takes the Lease when nobody holds it or
when the record it last saw has not changed for ``leaseDurationSeconds`` by ITS OWN clock (the holder's
``renewTime`` is never compared with the local clock, so clock skew between machines cannot steal a Lease);
the leader renews every ``retry_period`` and stops leading when it could not renew for ``renew_deadline``.
Every write is a compare-and-swap on ``resourceVersion``, so two candidates can never both win. A leader that
stops on purpose gives the Lease up (empty holder), so a standby takes over at its next try.

The kubernetes client library's own leader election is not used: it lives outside the one module that imports
the library, and it compares the holder's renew time with the local clock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from nodeagent.errors import KubeError
from nodeagent.kube.client import KubeClient

log = logging.getLogger(__name__)

LEASES = "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"


def micro_time(now: datetime) -> str:
    return now.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class LeaseConfig:
    namespace: str
    name: str
    identity: str
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0


class LeaderElector:
    """One candidate. ``try_acquire_or_renew`` is called every ``retry_period`` by the caller's loop; it
    answers whether this candidate leads now."""

    def __init__(self, kube: KubeClient, cfg: LeaseConfig, *, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], datetime] = lambda: datetime.now(timezone.utc)) -> None:
        self.kube = kube
        self.cfg = cfg
        self.clock = clock
        self.wall = wall
        self._observed: tuple[Any, ...] | None = None  # the holder record last seen
        self._observed_at = 0.0
        self._last_renewed: float | None = None  # when this candidate last wrote the Lease as leader
        self.leading = False

    @property
    def path(self) -> str:
        return f"{LEASES.format(ns=self.cfg.namespace)}/{self.cfg.name}"

    def _body(self, spec_old: dict[str, Any], acquire: bool) -> dict[str, Any]:
        now = micro_time(self.wall())
        transitions = int(spec_old.get("leaseTransitions") or 0)
        spec = {
            "holderIdentity": self.cfg.identity,
            "leaseDurationSeconds": max(1, round(self.cfg.lease_duration)),
            "acquireTime": now if acquire else spec_old.get("acquireTime", now),
            "renewTime": now,
            "leaseTransitions": transitions + 1 if acquire and spec_old.get("holderIdentity") else transitions,
        }
        return spec

    def try_acquire_or_renew(self) -> bool:
        try:
            won = self._attempt()
        except KubeError as e:
            log.warning("lease %s: %s", self.path, e)
            won = False
        now = self.clock()
        if won:
            self._last_renewed = now
        elif self.leading and self._last_renewed is not None and now - self._last_renewed < self.cfg.renew_deadline:
            return True  # a failed renewal within the deadline: still the leader
        if self.leading != won:
            log.info("lease %s: %s", self.path, "leading" if won else "lost the lead")
        self.leading = won
        return won

    def _attempt(self) -> bool:
        try:
            lease = self.kube.request("GET", self.path, action=f"get Lease {self.cfg.name}")
        except KubeError as e:
            if e.status != 404:
                raise
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.cfg.name, "namespace": self.cfg.namespace},
                    "spec": self._body({}, acquire=True)}
            try:
                self.kube.request("POST", LEASES.format(ns=self.cfg.namespace), body=body,
                                  action=f"create Lease {self.cfg.name}")
            except KubeError as e2:
                if e2.status == 409:
                    return False  # another candidate made it first
                raise
            return True
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        record = (holder, spec.get("renewTime"), spec.get("acquireTime"), spec.get("leaseDurationSeconds"))
        now = self.clock()
        if record != self._observed:
            self._observed, self._observed_at = record, now
        duration = float(spec.get("leaseDurationSeconds") or self.cfg.lease_duration)
        mine = holder == self.cfg.identity
        if holder and not mine and now < self._observed_at + duration:
            return False  # held by another and not expired by our clock
        lease["spec"] = self._body(spec, acquire=not mine)
        try:
            out = self.kube.request("PUT", self.path, body=lease, action=f"update Lease {self.cfg.name}")
        except KubeError as e:
            if e.status == 409:
                return False  # someone else wrote it between our read and write
            raise
        s = out.get("spec") or {}
        self._observed = (s.get("holderIdentity"), s.get("renewTime"), s.get("acquireTime"),
                          s.get("leaseDurationSeconds"))
        self._observed_at = self.clock()
        return True

    def release(self) -> None:
        """Give the Lease up if this candidate holds it (on a clean stop)."""
        if not self.leading:
            return
        self.leading = False
        try:
            lease = self.kube.request("GET", self.path, action=f"get Lease {self.cfg.name}")
            spec = lease.get("spec") or {}
            if spec.get("holderIdentity") != self.cfg.identity:
                return
            spec["holderIdentity"] = ""
            spec["leaseDurationSeconds"] = 1
            spec["renewTime"] = micro_time(self.wall())
            self.kube.request("PUT", self.path, body=lease, action=f"release Lease {self.cfg.name}")
        except KubeError as e:
            log.warning("lease %s: cannot give it up: %s", self.path, e)
