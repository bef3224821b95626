"""NodePrepareResources / NodeUnprepareResources, independent of the gRPC layer.

Prepare, per claim: a claim already ``prepared`` in the checkpoint answers from the checkpoint (no API
read, nothing written); otherwise the claim is read from the API server, its allocation results for this
driver are checked against this node's pool and devices, its CDI spec is written and then the claim is
recorded as prepared. Unprepare drops the record and then the spec; an unknown claim is already
unprepared. One failing claim never affects the others of the same call.

Dynamic MIG devices (``DraDevice.placement``) need a GPU instance: the claim is recorded ``preparing``
first, then each GPU instance is created at its allocated placement with one compute instance through the
``MigAdministration`` port, then the CDI spec names the new MIG devices and the record becomes
``prepared``. A failure midway destroys what this call created and drops the record. Unprepare records
``unpreparing``, destroys the instances, removes the spec and drops the record. ``recover()`` at start
undoes a ``preparing`` record and finishes an ``unpreparing`` one (see ``nodeagent.dra.checkpoint``), and
drops a ``prepared`` MIG record whose instance is gone (a reboot): the kubelet prepares it again.

What a caller of the socket can make the driver do is bounded: a claim whose UID, namespace or name cannot be
a Kubernetes object's is refused with a short error and no API read; a claim the API server does not know (or
knows under another UID) is answered from a short negative cache for ``UNKNOWN_TTL_S``; calls asking for one
claim at once share one read; reads that give no claim this node can prepare (unknown, another node's, not
allocated, an API error) draw on a budget (``FAILED_READS_BURST``, refilled ``FAILED_READS_PER_S`` a second):
while it is spent a claim is refused unread and the kubelet retries. Reads of claims that prepare never draw
on it, so the kubelet's own claims are held up only while such a flood goes on. Every refusal goes through one
``RefusalLog`` (cut lines, at most a burst a minute).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from nodeagent.dra import DRIVER_NAME
from nodeagent.dra.cdi import ClaimSpecs, cdi_device_id
from nodeagent.dra.channels import CONFIG_KIND as CHANNEL_CONFIG_KIND
from nodeagent.dra.channels import channel_ids, claim_channel_config
from nodeagent.dra.checkpoint import (
    PREPARED,
    PREPARING,
    UNPREPARING,
    Checkpoint,
    ClaimRecord,
    MigInstance,
    PreparedDevice,
)
from nodeagent.dra.devices import (
    COMPUTE_SHARE_CAPACITY,
    COMPUTE_SHARE_TOTAL,
    MEMORY_CAPACITY,
    DraDevice,
    Share,
    device_gpu_index,
    with_instance,
    with_share,
)
from nodeagent.dra.metadata import ClaimMetadata, base_request, group_requests, pod_claim_name
from nodeagent.dra.mps import ClaimMps, MpsClaimConfig, MpsConfigError, parse_mps, with_consumed_capacity
from nodeagent.dra.quantity import quantity_int
from nodeagent.errors import ConfigError, GpuBusyError, KubeError, NodeAgentError
from nodeagent.gpu.inventory import Inventory, MigDevice
from nodeagent.gpu.ports import MigAdministration
from nodeagent.imex.channels import DEFAULT_CHANNEL_COUNT
from nodeagent.logs import RefusalLog

log = logging.getLogger(__name__)

ReadClaim = Callable[[str, str], Mapping[str, Any]]  # (namespace, name) → ResourceClaim JSON (blocking)
# called (on the loop) after a claim was newly prepared, with what it was prepared with
OnPrepared = Callable[["ClaimRef", "tuple[PreparedDevice, ...]"], None]

# The kubelet calls with the claims of one pod (a pod names at most 32 ResourceClaims); a call with more is
# answered for the first MAX_CLAIMS_PER_CALL and refused for the rest without an API read or a log line each.
MAX_CLAIMS_PER_CALL = 128
MAX_CONCURRENT_READS = 8  # ResourceClaim GETs in flight at once, over all calls
# ResourceClaim GETs that gave no claim this node can prepare: a burst of this many, then this many a second;
# while they are spent, a claim is refused unread ("the kubelet retries"). Reads that prepare a claim are free.
FAILED_READS_BURST = 64
FAILED_READS_PER_S = 8.0
# A claim the API server does not know (404), or knows under another UID, is answered from memory this long
# (at most MAX_UNKNOWN claims remembered, the oldest forgotten first).
UNKNOWN_TTL_S = 10.0
MAX_UNKNOWN = 4096
# What a claim reference must look like to be looked up: a UID as the API server assigns them (a UUID, 36
# characters; letters, digits and dashes up to MAX_UID taken), a namespace a DNS label, a name a DNS subdomain.
MAX_UID = 64
_UID = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?")
_DNS_LABEL = re.compile(r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*")
QUOTED = 60  # characters of a bad value an error quotes


@dataclass(frozen=True)
class ClaimRef:
    namespace: str
    uid: str
    name: str


@dataclass(frozen=True)
class PrepareResult:
    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


class Wanted(NamedTuple):
    """One device a claim is prepared with (a shared device: one share of it, ``dev.share``)."""

    dev: DraDevice
    requests: tuple[str, ...]
    consumed: tuple[tuple[str, str], ...] = ()
    admin: bool = False
    domain: str = ""  # an IMEX channel device: the ComputeDomain (UID) of the claim's channel config


class ClaimError(Exception):
    """This claim cannot be prepared here; the message goes back to the kubelet."""


# what a claim is prepared with: devices, MPS, the pod's name for a claim made from a template
Resolved = tuple[list[Wanted], MpsClaimConfig | None, str | None]


class UnknownClaim(ClaimError):
    """The API server has no such claim, or has it under another UID (remembered for ``UNKNOWN_TTL_S``)."""


def quoted(value: str) -> str:
    """``value`` escaped (``repr``) in at most ``QUOTED`` characters, and its length when cut."""
    text = repr(value)
    if len(text) <= QUOTED:
        return text
    return f"{text[:QUOTED]}... ({len(value)} characters)"


def ref_error(ref: ClaimRef) -> str | None:
    """Why ``ref`` cannot name a ResourceClaim (None: it can), in a short line."""
    if len(ref.uid) > MAX_UID or not _UID.fullmatch(ref.uid):
        return f"claim UID {quoted(ref.uid)} is not a Kubernetes UID"
    if len(ref.namespace) > 63 or not _DNS_LABEL.fullmatch(ref.namespace):
        return f"claim namespace {quoted(ref.namespace)} is not a Kubernetes namespace name"
    if len(ref.name) > 253 or not _DNS_SUBDOMAIN.fullmatch(ref.name):
        return f"claim name {quoted(ref.name)} is not a Kubernetes object name"
    return None


class TokenBucket:
    """``burst`` tokens, refilled ``per_s`` a second (on a clock that can be injected); a token taken may be
    given back (a read that turned out well)."""

    def __init__(self, burst: int, per_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.burst = burst
        self.per_s = per_s
        self._clock = clock
        self._tokens = float(burst)
        self._at = clock()

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.per_s)
        self._at = now

    def take(self) -> bool:
        """Take one token, if there is one."""
        self._refill()
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def give_back(self) -> None:
        self._refill()
        self._tokens = min(float(self.burst), self._tokens + 1.0)


@dataclass(frozen=True)
class Allocated:
    """One allocation result of this driver in a claim."""

    request: str  # "<request>" or, from a prioritized list, "<request>/<subrequest>"
    pool: str
    device: str
    share_id: str | None = None  # an allocation of a device that allows several (consumable capacity)
    consumed: tuple[tuple[str, str], ...] = ()  # capacity name → consumed quantity, sorted
    admin: bool = False  # admin access: the device is reached without being taken


def _allocated(claim: Mapping[str, Any], ref: ClaimRef, driver: str) -> list[Allocated]:
    """Every allocation result of ``driver``."""
    meta = claim.get("metadata") or {}
    if meta.get("uid") != ref.uid:
        raise UnknownClaim(f"ResourceClaim {ref.namespace}/{ref.name} has UID {meta.get('uid')}, "
                         f"not {ref.uid} (the claim was replaced)")
    alloc = (claim.get("status") or {}).get("allocation")
    if not alloc:
        raise ClaimError(f"ResourceClaim {ref.namespace}/{ref.name} is not allocated")
    results = ((alloc.get("devices") or {}).get("results")) or []
    out: list[Allocated] = []
    for r in results:
        if r.get("driver") != driver:
            continue
        share = r.get("shareID")
        consumed = r.get("consumedCapacity") or {}
        if not isinstance(consumed, Mapping):
            raise ClaimError(f"ResourceClaim {ref.namespace}/{ref.name}: consumedCapacity of device "
                             f"{r.get('device')} is not a map")
        out.append(Allocated(str(r.get("request", "")), str(r.get("pool", "")), str(r.get("device", "")),
                             None if share is None else str(share),
                             tuple(sorted((str(k), str(v)) for k, v in consumed.items())),
                             r.get("adminAccess") is True))
    if not out:
        raise ClaimError(f"ResourceClaim {ref.namespace}/{ref.name} has no device of driver {driver}")
    return out


_SHARE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,63}$")


def _share(ref: ClaimRef, dev: DraDevice, share_id: str | None,
           consumed: tuple[tuple[str, str], ...]) -> Share | None:
    """What one allocation of a shared device may use; None for a device taken whole."""
    if share_id is None:
        return None
    if not dev.shared:
        raise ClaimError(f"ResourceClaim {ref.namespace}/{ref.name}: device {dev.name} is allocated as a share "
                         f"({share_id}) but this node does not share it")
    if not _SHARE_ID_RE.match(share_id):
        raise ClaimError(f"ResourceClaim {ref.namespace}/{ref.name}: share ID of device {dev.name} is not "
                         f"usable: {share_id!r}")
    amounts = dict(consumed)
    try:
        memory = quantity_int(amounts[MEMORY_CAPACITY]) if MEMORY_CAPACITY in amounts else None
        compute = quantity_int(amounts.get(COMPUTE_SHARE_CAPACITY, "0"))
    except ValueError as e:
        raise ClaimError(f"ResourceClaim {ref.namespace}/{ref.name}: consumed capacity of device {dev.name}: "
                         f"{e}") from None
    total = quantity_int(str(dev.capacity[MEMORY_CAPACITY]["value"]))
    if memory is None:
        memory = total
    if not 0 < memory <= total or not 0 <= compute <= COMPUTE_SHARE_TOTAL:
        raise ClaimError(f"ResourceClaim {ref.namespace}/{ref.name}: device {dev.name} consumed "
                         f"{dict(consumed)}, outside its capacity")
    return Share(share_id, memory, compute)


def _instance_of(inv: Inventory, m: MigInstance) -> MigDevice | None:
    """The MIG device at the record's placement (same GPU, profile and start), if it exists."""
    for gpu in inv.gpus:
        if gpu.index != m.gpu_index or gpu.uuid != m.gpu_uuid:
            continue
        for dev in (*gpu.mig_devices, *gpu.bare_gpu_instances):
            if dev.placement_start == m.start and dev.profile == m.profile:
                return dev
    return None


class ClaimPreparer:
    def __init__(self, checkpoint: Checkpoint, specs: ClaimSpecs, read_claim: ReadClaim, pool: str,
                 *, driver: str = DRIVER_NAME, mig: MigAdministration | None = None,
                 mps: ClaimMps | None = None, on_prepared: OnPrepared | None = None,
                 clock: Callable[[], float] = time.monotonic, metadata: ClaimMetadata | None = None) -> None:
        self.checkpoint = checkpoint
        self.metadata = metadata  # KEP-5304 device metadata files and their CDI specs (none: not written)
        self.mps = mps  # MPS daemons of claims asking for MPS (none: such claims are refused)
        self.specs = specs
        self.read_claim = read_claim
        self.pool = pool
        self.driver = driver
        self.mig = mig  # needed for dynamic MIG devices only
        self.on_prepared = on_prepared
        self.channel_count = DEFAULT_CHANNEL_COUNT  # IMEX channels an "All" claim gets
        self.devices: dict[str, DraDevice] = {}
        self._lock = asyncio.Lock()
        # GPUs a MIG change has withdrawn: no new claim is prepared on them until they are re-advertised
        self.withdrawn: frozenset[int] = frozenset()
        # claims between the withdrawn check and their checkpoint record (the record may be written in a
        # thread): counted by ``claims_on`` so a MIG change waiting for its GPUs cannot miss them
        self._inflight: dict[str, tuple[ClaimRef, frozenset[int]]] = {}
        self._reads = asyncio.Semaphore(MAX_CONCURRENT_READS)
        self._failed_reads = TokenBucket(FAILED_READS_BURST, FAILED_READS_PER_S, clock)
        self._clock = clock
        # (namespace, name, uid) → (until when, the error): claims the API server does not know as named
        self._unknown: OrderedDict[ClaimRef, tuple[float, str]] = OrderedDict()
        self.refusals = RefusalLog(log)  # every refused claim (the DRA sockets' refusals too): cut, rate-limited
        self._pending: dict[ClaimRef, asyncio.Future[Resolved]] = {}  # reads under way

    def set_devices(self, devices: Sequence[DraDevice]) -> None:
        self.devices = {d.name: d for d in devices}

    def domains(self) -> set[str]:
        """The ComputeDomains (UIDs) of the IMEX channel claims prepared here."""
        return {d.domain for rec in self.checkpoint.claims.values() if rec.state == PREPARED
                for d in rec.devices if d.channels and d.domain}

    async def refresh_metadata(self) -> list[str]:
        """Bring the device metadata of every prepared claim up to date with the devices as they are now (a
        changed attribute raises the file's generation); the claims whose metadata was rewritten."""
        if self.metadata is None:
            return []
        async with self._lock:  # not beside a prepare or unprepare of the same claim
            return await asyncio.to_thread(self._refresh_metadata)

    def _refresh_metadata(self) -> list[str]:
        out: list[str] = []
        for uid, rec in sorted(self.checkpoint.claims.items()):
            if rec.state != PREPARED:
                continue
            devs = [self._spec_device(d) for d in rec.devices]
            if any(d is None for d in devs):
                continue  # a device gone from the node: what the container was given stays as written
            try:
                if self._write_metadata(rec, [d for d in devs if d is not None]):
                    out.append(f"{rec.namespace}/{rec.name}")
                    log.info("claim %s/%s (%s): device metadata updated", rec.namespace, rec.name, uid)
            except (OSError, ValueError) as e:
                log.warning("claim %s/%s (%s): device metadata not updated: %s", rec.namespace, rec.name, uid, e)
        return out

    def owned_instances(self) -> dict[int, set[tuple[str, int]]]:
        """GPU index → (profile, start) of every GPU instance a claim record names (prepared or not)."""
        out: dict[int, set[tuple[str, int]]] = {}
        for rec in self.checkpoint.claims.values():
            for d in rec.devices:
                if d.mig is not None:
                    out.setdefault(d.mig.gpu_index, set()).add((d.mig.profile, d.mig.start))
        return out

    def live_instances(self) -> dict[str, int]:
        """Device name → GPU instance id of every dynamic MIG device a claim record holds with its instance
        created (what a fault NVML reports on that instance is about)."""
        return {d.device: d.mig.gi_id for rec in self.checkpoint.claims.values() for d in rec.devices
                if d.mig is not None and d.mig.gi_id is not None}

    def claims_on(self, gpu_indices: frozenset[int]) -> dict[int, tuple[ClaimRef, ...]]:
        """GPU index → every claim the checkpoint records on it (prepared, or in the middle of prepare or
        unprepare: its devices are in use or about to be), sorted; GPUs no claim uses are absent."""
        out: dict[int, set[ClaimRef]] = {}
        for rec in list(self.checkpoint.claims.values()):
            for d in rec.devices:
                if d.admin:  # admin access reaches the device without holding it
                    continue
                if d.mig is not None:
                    gpu: int | None = d.mig.gpu_index
                elif d.pool != self.pool:
                    continue
                else:
                    known = self.devices.get(d.device)
                    gpu = known.gpu_index if known is not None else device_gpu_index(d.device)
                if gpu is not None and gpu in gpu_indices:
                    out.setdefault(gpu, set()).add(ClaimRef(rec.namespace, rec.uid, rec.name))
        for ref, gpus in list(self._inflight.values()):
            for gpu in gpus & gpu_indices:
                out.setdefault(gpu, set()).add(ref)
        return {g: tuple(sorted(refs, key=lambda r: (r.namespace, r.name, r.uid)))
                for g, refs in sorted(out.items())}

    # -- start-up ------------------------------------------------------------------------------------
    def recover(self, inventory: Inventory | None = None) -> list[str]:
        """Settle what a killed process left: undo ``preparing`` records and finish ``unpreparing`` ones
        (with ``inventory`` and the MIG port), drop ``prepared`` MIG records whose instance is gone,
        rewrite missing specs of prepared claims (``/var/run`` is emptied by a reboot) and delete spec files
        no record owns. What was done, one line each."""
        done: list[str] = []
        for uid, rec in sorted(self.checkpoint.claims.items()):
            label = f"claim {rec.namespace}/{rec.name} ({uid})"
            if rec.state in (PREPARING, UNPREPARING):
                if any(d.mig is not None for d in rec.devices) and (inventory is None or self.mig is None):
                    log.warning("%s: %s, but no MIG access to settle it", label, rec.state)
                    continue
                assert inventory is not None
                self._destroy_instances(rec, inventory)
                self.checkpoint.drop(uid)
                self.specs.remove(uid)
                self._remove_metadata(ClaimRef(rec.namespace, uid, rec.name))
                what = ("undid the interrupted prepare" if rec.state == PREPARING
                        else "finished the interrupted unprepare")
                done.append(f"{what} of {label}")
                continue
            migs = [d.mig for d in rec.devices if d.mig is not None]
            if migs and inventory is not None and any(
                    (inst := _instance_of(inventory, m)) is None or inst.gi_id != m.gi_id for m in migs):
                # the GPU instance is gone (reboot, GPU reset): nothing is prepared any more
                if self.mig is not None:
                    self._destroy_instances(rec, inventory)
                self.checkpoint.drop(uid)
                self.specs.remove(uid)
                self._remove_metadata(ClaimRef(rec.namespace, uid, rec.name))
                done.append(f"dropped {label}: its MIG instance is gone")
                continue
            devs = [self._spec_device(d) for d in rec.devices]
            if all(d is not None for d in devs):
                wanted = [d for d in devs if d is not None]
                try:
                    if self.specs.current(uid) != self.specs.render(uid, wanted):
                        self.specs.write(uid, wanted)
                        done.append(f"rewrote the CDI spec of {label}")
                except NodeAgentError as e:  # e.g. an IMEX channel that cannot be made: the spec stays
                    log.warning("%s: CDI spec not rewritten: %s", label, e)
                try:
                    if self._write_metadata(rec, wanted):
                        done.append(f"wrote the device metadata of {label}")
                except (OSError, ValueError) as e:
                    log.warning("%s: device metadata not written: %s", label, e)
            elif not self.specs.path(uid).exists():
                log.warning("claim %s/%s (%s): devices gone, CDI spec not rewritten",
                            rec.namespace, rec.name, uid)
        for uid in sorted(self.specs.claim_uids() - set(self.checkpoint.claims)):
            self.specs.remove(uid)
            done.append(f"removed the orphaned CDI spec of claim {uid}")
        if self.metadata is not None:
            done += self.metadata.remove_orphans(
                set(self.checkpoint.claims),
                {f"{r.namespace}_{r.name}" for r in self.checkpoint.claims.values()})
        for line in done:
            log.info("DRA recovery: %s", line)
        return done

    # -- prepare ---------------------------------------------------------------------------------------
    async def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        served, refused = claims[:MAX_CLAIMS_PER_CALL], claims[MAX_CLAIMS_PER_CALL:]
        out: dict[str, PrepareResult] = {}
        if refused:
            msg = (f"NodePrepareResources names {len(claims)} claims, more than the {MAX_CLAIMS_PER_CALL} one "
                   "call may name; this claim was not prepared")
            self.refusals.refused("NodePrepareResources", f"{len(claims)} claims in one call, the {len(refused)} "
                                  f"beyond {MAX_CLAIMS_PER_CALL} refused")
            out = {c.uid: PrepareResult(error=msg) for c in refused}
        results = await asyncio.gather(*(self._prepare_one(c) for c in served))
        out.update({c.uid: r for c, r in zip(served, results, strict=True)})
        return out

    def _refuse(self, ref: ClaimRef, msg: str) -> PrepareResult:
        """One claim refused: ``msg`` goes back to the kubelet, and into the rate-limited refusal log."""
        self.refusals.refused("NodePrepareResources", f"claim {ref.namespace}/{ref.name} ({ref.uid}): {msg}")
        return PrepareResult(error=msg)

    def _known_unknown(self, ref: ClaimRef) -> str | None:
        """The error the API server's last answer about ``ref`` gave, while it is remembered."""
        entry = self._unknown.get(ref)
        if entry is None:
            return None
        if entry[0] <= self._clock():
            del self._unknown[ref]
            return None
        return entry[1]

    def _remember_unknown(self, ref: ClaimRef, error: str) -> None:
        self._unknown[ref] = (self._clock() + UNKNOWN_TTL_S, error)
        self._unknown.move_to_end(ref)
        while len(self._unknown) > MAX_UNKNOWN:
            self._unknown.popitem(last=False)

    async def _lookup(self, ref: ClaimRef) -> Resolved:
        """What the claim is prepared with, read from the API server within the bounds on reads: a claim the API
        server did not know a moment ago is not asked for again, calls asking for one claim at once share one
        read, and while the budget of failed reads is spent nothing is read (raises ``ClaimError``,
        ``NodeAgentError``, ``ValueError``)."""
        known = self._known_unknown(ref)
        if known is not None:
            raise UnknownClaim(known)
        pending = self._pending.get(ref)
        if pending is None:
            pending = asyncio.ensure_future(self._read(ref))
            self._pending[ref] = pending
            pending.add_done_callback(lambda t: self._read_done(ref, t))
        return await asyncio.shield(pending)  # one caller cancelled leaves the read to the others

    def _read_done(self, ref: ClaimRef, task: asyncio.Future[Resolved]) -> None:
        if self._pending.get(ref) is task:
            del self._pending[ref]
        if not task.cancelled():
            task.exception()  # retrieved here: every caller may have gone

    async def _read(self, ref: ClaimRef) -> Resolved:
        """One read, paid with a token of the failed-read budget (taken when the read starts, not when it
        queued), which a claim this node can prepare gives back."""
        async with self._reads:  # a bounded number of GETs at once, whatever the kubelet sends
            if not self._failed_reads.take():
                raise ClaimError(
                    f"ResourceClaim {ref.namespace}/{ref.name} not read: more than {FAILED_READS_BURST} reads "
                    f"gave no claim this node can prepare ({FAILED_READS_PER_S:g} a second allowed after); "
                    "the kubelet retries")
            try:
                claim = await asyncio.to_thread(self.read_claim, ref.namespace, ref.name)
            except KubeError as e:
                if e.status == 404:
                    self._remember_unknown(ref, str(e))
                raise
        try:
            resolved = (self._with_channels(claim, ref, self._resolve(claim, ref)),
                        parse_mps(claim, self.driver, f"ResourceClaim {ref.namespace}/{ref.name}"),
                        pod_claim_name(claim))
        except UnknownClaim as e:
            self._remember_unknown(ref, str(e))
            raise
        self._failed_reads.give_back()
        return resolved

    async def _prepare_one(self, ref: ClaimRef) -> PrepareResult:
        rec = self.checkpoint.claims.get(ref.uid)
        if rec is not None and rec.state == PREPARED:
            return PrepareResult(rec.devices)
        bad = ref_error(ref)
        if bad is not None:  # no API read, and the log line quotes the reference cut and escaped
            self.refusals.refused("NodePrepareResources", bad)
            return PrepareResult(error=bad)
        if rec is not None:  # an unprepare that could not finish (instance busy): it must complete first
            return self._refuse(ref, f"claim {ref.namespace}/{ref.name} is being unprepared ({rec.state}); "
                                "NodeUnprepareResources has to finish first")
        try:
            self.specs.path(ref.uid)  # rejects a UID unusable in a file or CDI name before anything else
            wanted, mps, pod_claim = await self._lookup(ref)
        except (ClaimError, NodeAgentError, ValueError) as e:
            return self._refuse(ref, str(e))
        async with self._lock:
            rec = self.checkpoint.claims.get(ref.uid)
            if rec is not None and rec.state == PREPARED:  # a concurrent call got there first
                return PrepareResult(rec.devices)
            # an admin-access device is reached, not taken: it holds no GPU against a MIG change
            gpus = frozenset(w.dev.gpu_index for w in wanted if not w.admin)
            if gpus & self.withdrawn:
                busy = ", ".join(str(g) for g in sorted(gpus & self.withdrawn))
                return self._refuse(ref, f"cannot prepare claim {ref.namespace}/{ref.name} now: GPU {busy} is "
                                    "being reconfigured (a MIG change, or a move to the device plugin); the "
                                    "kubelet retries")
            self._inflight[ref.uid] = (ref, gpus)
            try:
                if mps is not None:
                    await self._start_mps(ref, [w.dev for w in wanted], mps)
                if any(w.dev.dynamic for w in wanted):
                    prepared = await asyncio.to_thread(self._write, ref, wanted, pod_claim)
                else:
                    # small specs and metadata files (no fsync) and the fsynced checkpoint, about 1 ms: done in
                    # the loop, no thread hop
                    prepared = self._write(ref, wanted, pod_claim)
            except (OSError, ValueError, NodeAgentError) as e:
                await self._stop_mps(ref.uid)
                msg = f"cannot prepare claim {ref.namespace}/{ref.name}: {e}"
                log.error("%s", msg)
                return PrepareResult(error=msg)
            finally:
                self._inflight.pop(ref.uid, None)
        log.info("prepared claim %s/%s (%s): %s", ref.namespace, ref.name, ref.uid,
                 ", ".join(d.device for d in prepared))
        if self.on_prepared is not None:
            self.on_prepared(ref, prepared)
        return PrepareResult(prepared)

    async def _start_mps(self, ref: ClaimRef, devices: list[DraDevice], cfg: MpsClaimConfig) -> None:
        if self.mps is None:
            raise MpsConfigError(f"ResourceClaim {ref.namespace}/{ref.name} asks for MPS, which this driver "
                                 "cannot run here")
        label = f"ResourceClaim {ref.namespace}/{ref.name}"
        # on a shared GPU the share's consumed memory (and compute) become its limits (the config may override)
        cfg = with_consumed_capacity(cfg, devices)
        self.specs.extra_edits[ref.uid] = await self.mps.prepare(ref.uid, devices, cfg, label)

    async def _stop_mps(self, uid: str) -> None:
        self.specs.extra_edits.pop(uid, None)
        if self.mps is not None:
            await self.mps.unprepare(uid)

    def _resolve(self, claim: Mapping[str, Any], ref: ClaimRef) -> list[Wanted]:
        """The devices to prepare: one per allocated device, or per share of a shared device; the requests
        naming it merged."""
        by_key: dict[tuple[str, str | None], Wanted] = {}
        for a in _allocated(claim, ref, self.driver):
            if a.pool != self.pool:
                raise ClaimError(f"ResourceClaim {ref.namespace}/{ref.name}: device {a.device} is from pool "
                                 f"{a.pool}, this node serves pool {self.pool}")
            dev = self.devices.get(a.device)
            if dev is None:
                raise ClaimError(f"ResourceClaim {ref.namespace}/{ref.name}: device {a.device} does not exist "
                                 "on this node")
            if a.admin and dev.dynamic:
                raise ClaimError(f"ResourceClaim {ref.namespace}/{ref.name}: admin access to {a.device}, a MIG "
                                 "placement without an instance, has nothing to reach")
            key = (a.device, a.share_id)
            old = by_key.get(key)
            if old is None:
                dev = with_share(dev, _share(ref, dev, a.share_id, a.consumed))
                by_key[key] = Wanted(dev, (a.request,), a.consumed, a.admin)
            elif a.request not in old.requests:
                by_key[key] = old._replace(requests=(*old.requests, a.request), admin=old.admin and a.admin)
        return list(by_key.values())

    def _with_channels(self, claim: Mapping[str, Any], ref: ClaimRef, wanted: list[Wanted]) -> list[Wanted]:
        """An IMEX channel device gets the channels of the claim's ``ComputeDomainChannelConfig`` (channel 0
        for Single, all for All); a channel device without that config is refused."""
        if not any(w.dev.kind == "channel" for w in wanted):
            return wanted
        label = f"ResourceClaim {ref.namespace}/{ref.name}"
        try:
            cfg = claim_channel_config(claim, self.driver, label)
        except ConfigError as e:
            raise ClaimError(str(e)) from None
        if cfg is None:
            raise ClaimError(f"{label}: an IMEX channel needs a {CHANNEL_CONFIG_KIND} (its ComputeDomain's "
                             "ResourceClaimTemplate carries one)")
        count = len(channel_ids(cfg.allocation_mode, self.channel_count))
        return [w._replace(dev=dataclasses.replace(w.dev, channels=count), domain=cfg.domain_id)
                if w.dev.kind == "channel" else w for w in wanted]

    def _spec_device(self, d: PreparedDevice) -> DraDevice | None:
        dev = self.devices.get(d.device)
        if dev is None:
            return None
        if d.channels:
            return dataclasses.replace(dev, channels=d.channels)
        if d.share_id is not None:
            try:
                dev = with_share(dev, _share(ClaimRef("", "", d.device), dev, d.share_id, d.consumed))
            except ClaimError:
                return None  # the device is no longer shared here (configuration changed)
        if d.mig is None:
            return dev
        if d.mig.gi_id is None or d.mig.ci_id is None:
            return None
        mig = MigDevice(d.mig.gpu_index, d.mig.gi_id, d.mig.ci_id, d.mig.profile, d.mig.start,
                        dev.placement.size if dev.placement else 0, 0, d.mig.uuid)
        return with_instance(dev, mig)

    def _metadata_ids(self, ref: ClaimRef, wanted: list[Wanted]) -> list[tuple[str, ...]]:
        """Per wanted device, the metadata CDI IDs it carries: each request's goes to its first device."""
        if self.metadata is None:
            return [() for _ in wanted]
        ids = self.metadata.cdi_ids(ref.uid, [r for w in wanted for r in w.requests])
        seen: set[str] = set()
        out: list[tuple[str, ...]] = []
        for w in wanted:
            mine = []
            for r in w.requests:
                base = base_request(r)
                if base not in seen:
                    seen.add(base)
                    mine.append(ids[base])
            out.append(tuple(mine))
        return out

    def _write_metadata(self, rec: ClaimRecord, devices: Sequence[DraDevice]) -> list[str]:
        """The claim's device metadata as its devices are now (the record's devices, in order)."""
        if self.metadata is None:
            return []
        grouped = group_requests([(pd.request_names, pd.pool, dev) for pd, dev in zip(rec.devices, devices,
                                                                                         strict=True)])
        return self.metadata.write(rec.namespace, rec.name, rec.uid, rec.pod_claim_name, grouped)

    def _remove_metadata(self, ref: ClaimRef) -> None:
        if self.metadata is not None:
            self.metadata.remove(ref.namespace, ref.name, ref.uid)

    def _write(self, ref: ClaimRef, wanted: list[Wanted], pod_claim: str | None = None) -> tuple[PreparedDevice, ...]:
        extra_ids = self._metadata_ids(ref, wanted)

        def prepared_device(w: Wanted, mig: MigInstance | None, extra: tuple[str, ...]) -> PreparedDevice:
            dev = w.dev
            share_id = dev.share.share_id if dev.share is not None else None
            return PreparedDevice(w.requests, self.pool, dev.name,
                                  (cdi_device_id(ref.uid, dev.name, share_id), *extra),
                                  mig, share_id, w.consumed if share_id is not None else (), w.admin,
                                  dev.channels, w.domain)

        if not any(w.dev.dynamic for w in wanted):
            prepared = tuple(prepared_device(w, None, x) for w, x in zip(wanted, extra_ids, strict=True))
            record = ClaimRecord(ref.uid, ref.namespace, ref.name, PREPARED, prepared, pod_claim)
            self.specs.write(ref.uid, [w.dev for w in wanted])
            try:
                self._write_metadata(record, [w.dev for w in wanted])
            except BaseException:
                self._remove_metadata(ref)
                self.specs.remove(ref.uid)
                raise
            self.checkpoint.put(record)
            return prepared
        if self.mig is None:
            raise ValueError("dynamic MIG devices need MIG access, which this driver has not got")
        # the intent goes to disk before the GPU changes
        intent = tuple(
            prepared_device(w, MigInstance(w.dev.placement.gpu_index, w.dev.placement.gpu_uuid,
                                           w.dev.placement.profile, w.dev.placement.start)
                            if w.dev.placement is not None else None, x)
            for w, x in zip(wanted, extra_ids, strict=True)
        )
        self.checkpoint.put(ClaimRecord(ref.uid, ref.namespace, ref.name, PREPARING, intent, pod_claim))
        created: list[MigDevice] = []
        try:
            final: list[PreparedDevice] = []
            spec_devices: list[DraDevice] = []
            for w, pd in zip(wanted, intent, strict=True):
                dev = w.dev
                if pd.mig is None:
                    final.append(pd)
                    spec_devices.append(dev)
                    continue
                inst = self.mig.create_mig_device(pd.mig.gpu_index, pd.mig.profile, pd.mig.start)
                created.append(inst)
                mig = dataclasses.replace(pd.mig, gi_id=inst.gi_id, ci_id=inst.ci_id, uuid=inst.uuid)
                final.append(dataclasses.replace(pd, mig=mig))
                spec_devices.append(with_instance(dev, inst))
            self.specs.write(ref.uid, spec_devices)
            prepared = tuple(final)
            record = ClaimRecord(ref.uid, ref.namespace, ref.name, PREPARED, prepared, pod_claim)
            self._write_metadata(record, spec_devices)
            self.checkpoint.put(record)
        except BaseException:
            for inst in reversed(created):
                try:
                    self.mig.destroy_mig_device(inst.gpu_index, inst.gi_id)
                except NodeAgentError as e:
                    log.error("claim %s/%s: cannot destroy GPU instance %d on GPU %d again: %s",
                              ref.namespace, ref.name, inst.gi_id, inst.gpu_index, e)
            self._remove_metadata(ref)
            self.specs.remove(ref.uid)
            self.checkpoint.drop(ref.uid)
            raise
        return prepared

    def _destroy_instances(self, rec: ClaimRecord, inventory: Inventory | None) -> None:
        """Destroy the GPU instances of a record: by the recorded id, or (an interrupted prepare) whatever
        instance of the recorded profile sits at the recorded placement."""
        for d in rec.devices:
            m = d.mig
            if m is None:
                continue
            assert self.mig is not None
            gi_id = m.gi_id
            if inventory is not None:
                inst = _instance_of(inventory, m)
                if inst is None:
                    continue
                gi_id = inst.gi_id
            if gi_id is None:
                continue
            self.mig.destroy_mig_device(m.gpu_index, gi_id)
            log.info("claim %s/%s: destroyed GPU instance %d (%s at %d) on GPU %d", rec.namespace, rec.name,
                     gi_id, m.profile, m.start, m.gpu_index)

    # -- unprepare -------------------------------------------------------------------------------------
    async def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        """Claim UID → error ("" when done or never prepared)."""
        out: dict[str, str] = {}
        if len(claims) > MAX_CLAIMS_PER_CALL:
            self.refusals.refused("NodeUnprepareResources", f"{len(claims)} claims in one call, the "
                                  f"{len(claims) - MAX_CLAIMS_PER_CALL} beyond {MAX_CLAIMS_PER_CALL} refused")
            msg = f"NodeUnprepareResources names more than the {MAX_CLAIMS_PER_CALL} claims one call may name"
            out = {ref.uid: msg for ref in claims[MAX_CLAIMS_PER_CALL:]}
            claims = claims[:MAX_CLAIMS_PER_CALL]
        async with self._lock:
            for ref in claims:
                bad = None if ref.uid in self.checkpoint.claims else ref_error(ref)
                if bad is not None:  # nothing of it can be prepared here: nothing touched
                    self.refusals.refused("NodeUnprepareResources", bad)
                    out[ref.uid] = bad
                    continue
                try:
                    await asyncio.to_thread(self._unprepare_one, ref)
                    await self._stop_mps(ref.uid)
                    out[ref.uid] = ""
                except (OSError, ValueError, NodeAgentError) as e:
                    out[ref.uid] = f"cannot unprepare claim {ref.namespace}/{ref.name}: {e}"
                    log.error("%s", out[ref.uid])
        return out

    def _unprepare_one(self, ref: ClaimRef) -> None:
        rec = self.checkpoint.claims.get(ref.uid)
        if rec is None:
            self.specs.remove(ref.uid)  # a spec without a record would be an orphan anyway
            self._remove_metadata(ref)
            return
        if any(d.mig is not None for d in rec.devices):
            if self.mig is None:
                raise ValueError("the claim holds dynamic MIG devices and this driver has no MIG access")
            inventory = self._live_inventory(rec)
            if rec.state != UNPREPARING:
                rec = dataclasses.replace(rec, state=UNPREPARING)
                self.checkpoint.put(rec)
            try:
                self._destroy_instances(rec, inventory)
            except GpuBusyError:
                raise
            except NodeAgentError:
                if inventory is not None:
                    raise
                # the recorded instance may be gone already (a GPU reset): look at what is there
                self._destroy_instances(rec, self.mig.discover())
        self.checkpoint.drop(ref.uid)
        self.specs.remove(ref.uid)
        self._remove_metadata(ref)
        log.info("unprepared claim %s/%s (%s)", ref.namespace, ref.name, ref.uid)

    def _live_inventory(self, rec: ClaimRecord) -> Inventory | None:
        """For a record whose instances may not all exist (a retried unprepare after a partial one): the
        MIG port's current view; None when every instance id is recorded and known to exist."""
        if all(d.mig is None or d.mig.gi_id is not None for d in rec.devices) and rec.state == PREPARED:
            return None
        assert self.mig is not None
        return self.mig.discover()
