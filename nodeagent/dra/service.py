"""NodePrepareResources / NodeUnprepareResources, independent of the gRPC layer.

Prepare, per claim: a claim already ``prepared`` in the checkpoint answers from the checkpoint (no API
read, nothing written); otherwise the claim is read from the API server, its allocation results for this
driver are checked against this node's pool and devices, its CDI spec is written and then the claim is
recorded as prepared. Unprepare drops the record and then the spec; an unknown claim is already
unprepared. One failing claim never affects the others of the same call.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nodeagent.dra import DRIVER_NAME
from nodeagent.dra.cdi import ClaimSpecs, cdi_device_id
from nodeagent.dra.checkpoint import PREPARED, Checkpoint, ClaimRecord, PreparedDevice
from nodeagent.dra.devices import DraDevice
from nodeagent.errors import NodeAgentError

log = logging.getLogger(__name__)

ReadClaim = Callable[[str, str], Mapping[str, Any]]  # (namespace, name) → ResourceClaim JSON (blocking)


@dataclass(frozen=True)
class ClaimRef:
    namespace: str
    uid: str
    name: str


@dataclass(frozen=True)
class PrepareResult:
    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


class ClaimError(Exception):
    """This claim cannot be prepared here; the message goes back to the kubelet."""


def _allocated(claim: Mapping[str, Any], ref: ClaimRef, driver: str) -> list[tuple[str, str, str]]:
    """(request, pool, device) for every allocation result of ``driver``."""
    meta = claim.get("metadata") or {}
    if meta.get("uid") != ref.uid:
        raise ClaimError(f"ResourceClaim {ref.namespace}/{ref.name} has UID {meta.get('uid')}, "
                         f"not {ref.uid} (the claim was replaced)")
    alloc = (claim.get("status") or {}).get("allocation")
    if not alloc:
        raise ClaimError(f"ResourceClaim {ref.namespace}/{ref.name} is not allocated")
    results = ((alloc.get("devices") or {}).get("results")) or []
    out = [(str(r.get("request", "")), str(r.get("pool", "")), str(r.get("device", "")))
           for r in results if r.get("driver") == driver]
    if not out:
        raise ClaimError(f"ResourceClaim {ref.namespace}/{ref.name} has no device of driver {driver}")
    return out


class ClaimPreparer:
    def __init__(self, checkpoint: Checkpoint, specs: ClaimSpecs, read_claim: ReadClaim, pool: str,
                 *, driver: str = DRIVER_NAME) -> None:
        self.checkpoint = checkpoint
        self.specs = specs
        self.read_claim = read_claim
        self.pool = pool
        self.driver = driver
        self.devices: dict[str, DraDevice] = {}
        self._lock = asyncio.Lock()

    def set_devices(self, devices: Sequence[DraDevice]) -> None:
        self.devices = {d.name: d for d in devices}

    # -- start-up ------------------------------------------------------------------------------------
    def recover(self) -> list[str]:
        """Rewrite missing specs of prepared claims (``/var/run`` is emptied by a reboot) and delete spec
        files no record owns (a process killed mid-prepare or mid-unprepare). What was done, one line each."""
        done: list[str] = []
        for uid, rec in sorted(self.checkpoint.claims.items()):
            if not self.specs.path(uid).exists():
                devs = [self.devices.get(d.device) for d in rec.devices]
                if all(d is not None for d in devs):
                    self.specs.write(uid, [d for d in devs if d is not None])
                    done.append(f"rewrote the CDI spec of claim {rec.namespace}/{rec.name} ({uid})")
                else:
                    log.warning("claim %s/%s (%s): devices gone, CDI spec not rewritten", rec.namespace,
                                rec.name, uid)
        for uid in sorted(self.specs.claim_uids() - set(self.checkpoint.claims)):
            self.specs.remove(uid)
            done.append(f"removed the orphaned CDI spec of claim {uid}")
        for line in done:
            log.info("DRA recovery: %s", line)
        return done

    # -- prepare ---------------------------------------------------------------------------------------
    async def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        results = await asyncio.gather(*(self._prepare_one(c) for c in claims))
        return {c.uid: r for c, r in zip(claims, results, strict=True)}

    async def _prepare_one(self, ref: ClaimRef) -> PrepareResult:
        rec = self.checkpoint.claims.get(ref.uid)
        if rec is not None and rec.state == PREPARED:
            return PrepareResult(rec.devices)
        try:
            self.specs.path(ref.uid)  # rejects a UID unusable in a file or CDI name before anything else
            claim = await asyncio.to_thread(self.read_claim, ref.namespace, ref.name)
            wanted = self._resolve(claim, ref)
        except (ClaimError, NodeAgentError, ValueError) as e:
            log.warning("NodePrepareResources %s/%s (%s): %s", ref.namespace, ref.name, ref.uid, e)
            return PrepareResult(error=str(e))
        async with self._lock:
            rec = self.checkpoint.claims.get(ref.uid)
            if rec is not None and rec.state == PREPARED:  # a concurrent call got there first
                return PrepareResult(rec.devices)
            try:
                prepared = await asyncio.to_thread(self._write, ref, wanted)
            except (OSError, ValueError) as e:
                msg = f"cannot prepare claim {ref.namespace}/{ref.name}: {e}"
                log.error("%s", msg)
                return PrepareResult(error=msg)
        log.info("prepared claim %s/%s (%s): %s", ref.namespace, ref.name, ref.uid,
                 ", ".join(d.device for d in prepared))
        return PrepareResult(prepared)

    def _resolve(self, claim: Mapping[str, Any], ref: ClaimRef) -> list[tuple[DraDevice, tuple[str, ...]]]:
        by_device: dict[str, list[str]] = {}
        for request, pool, device in _allocated(claim, ref, self.driver):
            if pool != self.pool:
                raise ClaimError(f"ResourceClaim {ref.namespace}/{ref.name}: device {device} is from pool "
                                 f"{pool}, this node serves pool {self.pool}")
            if device not in self.devices:
                raise ClaimError(f"ResourceClaim {ref.namespace}/{ref.name}: device {device} does not exist "
                                 "on this node")
            reqs = by_device.setdefault(device, [])
            if request not in reqs:
                reqs.append(request)
        return [(self.devices[name], tuple(reqs)) for name, reqs in by_device.items()]

    def _write(self, ref: ClaimRef, wanted: list[tuple[DraDevice, tuple[str, ...]]]) -> tuple[PreparedDevice, ...]:
        prepared = tuple(
            PreparedDevice(reqs, self.pool, dev.name, (cdi_device_id(ref.uid, dev.name),)) for dev, reqs in wanted
        )
        self.specs.write(ref.uid, [dev for dev, _ in wanted])
        self.checkpoint.put(ClaimRecord(ref.uid, ref.namespace, ref.name, PREPARED, prepared))
        return prepared

    # -- unprepare -------------------------------------------------------------------------------------
    async def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        """Claim UID → error ("" when done or never prepared)."""
        out: dict[str, str] = {}
        async with self._lock:
            for ref in claims:
                try:
                    await asyncio.to_thread(self._unprepare_one, ref)
                    out[ref.uid] = ""
                except (OSError, ValueError) as e:
                    out[ref.uid] = f"cannot unprepare claim {ref.namespace}/{ref.name}: {e}"
                    log.error("%s", out[ref.uid])
        return out

    def _unprepare_one(self, ref: ClaimRef) -> None:
        if ref.uid not in self.checkpoint.claims:
            self.specs.remove(ref.uid)  # a spec without a record would be an orphan anyway
            return
        self.checkpoint.drop(ref.uid)
        self.specs.remove(ref.uid)
        log.info("unprepared claim %s/%s (%s)", ref.namespace, ref.name, ref.uid)
