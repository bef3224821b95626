"""One NodePrepareResources naming 20,000 claims: a bounded number of API reads, of reads at once and of log
lines; the claims beyond the per-call bound are refused without a read."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from nodeagent.dra.cdi import ClaimSpecs
from nodeagent.dra.checkpoint import Checkpoint
from nodeagent.dra.devices import build_devices
from nodeagent.dra.service import MAX_CLAIMS_PER_CALL, MAX_CONCURRENT_READS, ClaimPreparer, ClaimRef
from nodeagent.errors import KubeError
from tests.unit._dp_inventories import mig_box

FLOOD = 20_000


class SlowClaims:
    """An API server that knows none of the claims and answers each GET after 5 ms, counting reads and the
    most reads in flight at once."""

    def __init__(self) -> None:
        self.reads = 0
        self.inflight = 0
        self.peak = 0
        self._lock = threading.Lock()

    def read(self, namespace: str, name: str) -> Mapping[str, Any]:
        with self._lock:
            self.reads += 1
            self.inflight += 1
            self.peak = max(self.peak, self.inflight)
        time.sleep(0.005)
        with self._lock:
            self.inflight -= 1
        raise KubeError(f"get ResourceClaim {namespace}/{name}: HTTP 404", status=404)


async def test_a_flood_of_claims_is_bounded(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    api = SlowClaims()
    preparer = ClaimPreparer(
        Checkpoint.load(tmp_path / "state" / "dra-claims.json"),
        ClaimSpecs(tmp_path / "cdi"),
        api.read,
        "node-a",
    )
    preparer.set_devices(build_devices(mig_box(per_gpu=2, gpus_on=1, gpus_off=2)))
    refs = [ClaimRef("ns", f"uid-{i:05d}", f"claim-{i}") for i in range(FLOOD)]
    caplog.set_level(logging.INFO, logger="nodeagent")
    t0 = time.monotonic()
    results = await preparer.prepare(refs)
    took = time.monotonic() - t0
    assert len(results) == FLOOD and all(r.error for r in results.values())
    assert api.reads == MAX_CLAIMS_PER_CALL  # was one GET per claim: 20,000
    assert api.peak <= MAX_CONCURRENT_READS
    beyond = [results[r.uid].error for r in refs[MAX_CLAIMS_PER_CALL:]]
    assert all("more than the" in e for e in beyond)
    lines = [r for r in caplog.records if r.name.startswith("nodeagent")]
    assert len(lines) <= MAX_CLAIMS_PER_CALL + 1, len(lines)  # was 20,001
    assert took < 30
    unprepared = await preparer.unprepare(refs)
    assert len(unprepared) == FLOOD
    assert sum(1 for e in unprepared.values() if e) == FLOOD - MAX_CLAIMS_PER_CALL
