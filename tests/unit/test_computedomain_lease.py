"""The Lease rules of nodeagent/computedomain/lease.py against an in-memory API that answers as the API server
does (resourceVersion compare-and-swap, 409 on a stale write, 404 for a missing Lease): expiry by the
candidate's own clock, a lost race, the renew deadline, the release."""

from __future__ import annotations

import copy
from datetime import datetime, timezone
from typing import Any

from nodeagent.computedomain.lease import LeaderElector, LeaseConfig
from nodeagent.errors import KubeError


class FakeApi:
    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0
        self.down = False
        self.race = False  # the next write loses to another writer

    def request(self, method: str, path: str, *, body: Any = None, **_: Any) -> dict[str, Any]:
        if self.down:
            raise KubeError("connection refused", status=0, retryable=True)
        if method == "GET":
            if self.lease is None:
                raise KubeError("not found", status=404)
            return copy.deepcopy(self.lease)
        if method == "POST":
            if self.lease is not None:
                raise KubeError("exists", status=409)
        elif method == "PUT":
            assert self.lease is not None
            if self.race or body["metadata"].get("resourceVersion") != self.lease["metadata"]["resourceVersion"]:
                self.race = False
                raise KubeError("conflict", status=409)
        self.version += 1
        self.lease = copy.deepcopy(body)
        self.lease["metadata"]["resourceVersion"] = str(self.version)
        return copy.deepcopy(self.lease)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def elector(api: FakeApi, clock: Clock, who: str) -> LeaderElector:
    cfg = LeaseConfig("ns", "ctl", who, lease_duration=15, renew_deadline=10, retry_period=2)
    return LeaderElector(api, cfg, clock=clock, wall=lambda: datetime(2026, 1, 1, tzinfo=timezone.utc))  # type: ignore[arg-type]


def test_expiry_by_own_clock_race_deadline_and_release() -> None:
    api, clock = FakeApi(), Clock()
    a, b = elector(api, clock, "a"), elector(api, clock, "b")
    assert a.try_acquire_or_renew() and not b.try_acquire_or_renew()
    assert api.lease is not None and api.lease["spec"]["holderIdentity"] == "a"
    assert api.lease["spec"]["leaseTransitions"] == 0
    # a stops renewing: b waits a whole lease duration from when IT saw the record last change
    clock.t += 14.9
    assert not b.try_acquire_or_renew()  # the record b saw first is 14.9 s old by b's clock
    clock.t += 15.1
    assert b.try_acquire_or_renew()
    assert api.lease["spec"]["holderIdentity"] == "b" and api.lease["spec"]["leaseTransitions"] == 1
    # a comes back: it sees b's fresh record and stands by, then loses a write race as well
    assert not a.try_acquire_or_renew() and not a.leading
    api.race = True
    assert b.try_acquire_or_renew()  # b's renewal lost a write race, but within the renew deadline it leads
    assert not api.race and b.leading
    # the API goes away: b leads until the renew deadline has passed since its last renewal, then stops
    api.down = True
    clock.t += 9.0
    assert b.try_acquire_or_renew()
    clock.t += 2.0
    assert not b.try_acquire_or_renew() and not b.leading
    # back again; b renews (its own Lease), then releases it on a clean stop; a takes it at once
    api.down = False
    assert b.try_acquire_or_renew()
    b.release()
    assert api.lease["spec"]["holderIdentity"] == ""
    assert a.try_acquire_or_renew() and api.lease["spec"]["holderIdentity"] == "a"
