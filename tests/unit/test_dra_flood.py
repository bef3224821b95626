"""Floods of claims: one NodePrepareResources naming 20,000 claims (a bounded number of API reads, of reads at
once and of log lines; the claims beyond the per-call bound are refused without a read), many naming unknown
claims (remembered, reads rate-limited), claim references no Kubernetes object could have (refused unread)."""

from __future__ import annotations

import asyncio
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
from nodeagent.dra.service import (
    FAILED_READS_BURST,
    FAILED_READS_PER_S,
    MAX_CLAIMS_PER_CALL,
    MAX_CONCURRENT_READS,
    UNKNOWN_TTL_S,
    ClaimPreparer,
    ClaimRef,
    ref_error,
)
from nodeagent.errors import KubeError
from tests.unit._dp_inventories import mig_box
from tests.unit.test_dra_service import Claims, claim

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
    # was one GET per claim: 20,000; then the first 128 (the per-call bound); now the failed-read budget
    print(f"20,000 claims in one call: {api.reads} reads, {took:.2f} s")
    assert api.reads <= FAILED_READS_BURST + FAILED_READS_PER_S * took + 1, api.reads
    assert sum("not read: more than" in results[r.uid].error for r in refs[:MAX_CLAIMS_PER_CALL]) \
        == MAX_CLAIMS_PER_CALL - api.reads
    assert api.peak <= MAX_CONCURRENT_READS
    beyond = [results[r.uid].error for r in refs[MAX_CLAIMS_PER_CALL:]]
    assert all("more than the" in e for e in beyond)
    lines = [r for r in caplog.records if r.name.startswith("nodeagent")]
    assert len(lines) <= MAX_CLAIMS_PER_CALL + 1, len(lines)  # was 20,001
    assert took < 30
    unprepared = await preparer.unprepare(refs)
    assert len(unprepared) == FLOOD
    assert sum(1 for e in unprepared.values() if e) == FLOOD - MAX_CLAIMS_PER_CALL


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def counting_preparer(tmp_path: Path, api: Any, clock: Clock) -> ClaimPreparer:
    preparer = ClaimPreparer(Checkpoint.load(tmp_path / "state" / "dra-claims.json"), ClaimSpecs(tmp_path / "cdi"),
                             api.read, "node-a", clock=clock)
    preparer.set_devices(build_devices(mig_box(per_gpu=2, gpus_on=1, gpus_off=2)))
    return preparer


async def test_unknown_claims_are_remembered_and_failed_reads_are_rate_limited(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A claim the API server does not know is not read again for ``UNKNOWN_TTL_S``; calls asking for one claim
    at once share one read; after ``FAILED_READS_BURST`` reads that gave nothing to prepare, then
    ``FAILED_READS_PER_S`` a second, a claim is refused unread (the kubelet's own too, until the budget
    refills); every refusal is one line of the rate-limited refusal log."""
    api, clock = Claims(claim("u1", "one", [("gpu", "gpu-1")])), Clock()
    preparer = counting_preparer(tmp_path, api, clock)
    caplog.set_level(logging.INFO, logger="nodeagent")
    ghost = ClaimRef("ns", "uid-ghost", "ghost")
    same = await asyncio.gather(*(preparer.prepare([ghost]) for _ in range(50)))
    assert api.reads == 1 and all("HTTP 404" in r["uid-ghost"].error for r in same)
    for _ in range(100):
        assert "HTTP 404" in (await preparer.prepare([ghost]))["uid-ghost"].error
    assert api.reads == 1
    clock.now += UNKNOWN_TTL_S
    await preparer.prepare([ghost])
    assert api.reads == 2  # asked again once the answer is old
    # another UID under a known claim's name: the claim as named does not exist either
    replaced = ClaimRef("ns", "u1-old", "one")
    for _ in range(3):
        assert "(the claim was replaced)" in (await preparer.prepare([replaced]))["u1-old"].error
    assert api.reads == 3
    # distinct unknown claims: the budget (refilled after a quiet while), then its rate
    clock.now += FAILED_READS_BURST / FAILED_READS_PER_S
    for i in range(1000):
        await preparer.prepare([ClaimRef("ns", f"uid-{i:05d}", f"claim-{i}")])
    assert api.reads == 3 + FAILED_READS_BURST
    refused = (await preparer.prepare([ClaimRef("ns", "u1", "one")]))["u1"].error  # the kubelet's, meanwhile
    assert refused.startswith("ResourceClaim ns/one not read: more than") and refused.endswith("the kubelet retries")
    clock.now += 1.0
    for i in range(1000, 1100):
        await preparer.prepare([ClaimRef("ns", f"uid-{i:05d}", f"claim-{i}")])
    assert api.reads == 3 + FAILED_READS_BURST + int(FAILED_READS_PER_S)
    clock.now += 1 / FAILED_READS_PER_S
    assert (await preparer.prepare([ClaimRef("ns", "u1", "one")]))["u1"].error == ""  # once the flood paused
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 20 and all(ln.startswith("NodePrepareResources refused: claim ns/") for ln in lines)


async def test_reads_of_claims_that_prepare_spend_no_budget(tmp_path: Path) -> None:
    """Twice the failed-read budget of distinct claims of this node, each prepared and unprepared, back to back
    (the clock stands still): each is read and prepared; none is held back by the budget."""
    n = 2 * FAILED_READS_BURST
    api = Claims(*(claim(f"u{i}", f"c{i}", [("gpu", "gpu-1")]) for i in range(n)))
    preparer = counting_preparer(tmp_path, api, Clock())
    for i in range(n):
        ref = ClaimRef("ns", f"u{i}", f"c{i}")
        assert (await preparer.prepare([ref]))[ref.uid].error == ""
        assert await preparer.unprepare([ref]) == {ref.uid: ""}
    assert api.reads == n


@pytest.mark.parametrize(("namespace", "uid", "name", "error"), [
    ("ns", "\x00" * 1000, "claim", "claim UID '\\x00"),
    ("ns", "a" * 65, "claim", "claim UID 'aaaa"),
    ("ns", "../x", "claim", "claim UID '../x' is not a Kubernetes UID"),
    ("ns", "u1\n2026-01-01 forged line", "claim", "claim UID 'u1\\n2026"),
    ("NS", "u1", "claim", "claim namespace 'NS' is not a Kubernetes namespace name"),
    ("n" * 64, "u1", "claim", "claim namespace 'nnnn"),
    ("ns", "u1", "../../nodes/x", "claim name '../../nodes/x' is not a Kubernetes object name"),
    ("ns", "u1", "c" * 254, "claim name 'cccc"),
    ("ns", "u1", "", "claim name '' is not"),
])
async def test_claim_references_no_kubernetes_object_could_have_are_refused_unread(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, namespace: str, uid: str, name: str, error: str
) -> None:
    api = Claims()
    preparer = counting_preparer(tmp_path, api, Clock())
    caplog.set_level(logging.INFO, logger="nodeagent")
    got = (await preparer.prepare([ClaimRef(namespace, uid, name)]))[uid].error
    assert got.startswith(error) and len(got) < 200 and "\n" not in got and "\x00" not in got, got
    assert (await preparer.unprepare([ClaimRef(namespace, uid, name)]))[uid] == got  # nothing touched either
    assert api.reads == 0
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all(len(ln) < 300 and "\n" not in ln and "\x00" not in ln for ln in lines)


def test_a_kubernetes_uid_namespace_and_name_are_taken() -> None:
    assert ref_error(ClaimRef("kube-system", "0f3c4a2e-6b1d-4c3e-9a7f-2b8d5e1c9a40", "gpu-claim.v2-0")) is None
    assert ref_error(ClaimRef("a" * 63, "u", "b" * 253)) is None
