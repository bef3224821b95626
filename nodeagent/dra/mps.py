"""MPS for DRA claims: an opaque ``GpuConfig`` with ``sharing.strategy: MPS`` in a claim's allocation.

The parameters take the shape of NVIDIA's DRA driver (``apiVersion: resource.nvidia.com/v1beta1`` or
``resource.nodeagent.io/v1beta1``, ``kind: GpuConfig``)::

    sharing:
      strategy: MPS
      mpsConfig:
        defaultActiveThreadPercentage: 50        # 1..100
        defaultPinnedDeviceMemoryLimit: 10Gi     # every GPU of the claim
        defaultPerDevicePinnedMemoryLimit:       # by CUDA ordinal in the claim (0, 1, ...) or GPU UUID
          0: 5Gi

Prepare starts one control daemon for the claim's GPUs (``nodeagent.gpu.mps``; its directories under
``/run/nodeagent/mps/claim-<uid>``) and waits for its answer; the claim's CDI spec then carries
``CUDA_MPS_PIPE_DIRECTORY`` and mounts the pipe directory and ``/dev/shm``. Unprepare stops it: one claim,
one daemon, so the daemon goes with its last (only) claim. MIG devices are refused (MPS shares whole GPUs).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nodeagent import fileio
from nodeagent.dra.channels import CONFIG_KIND as CHANNEL_CONFIG_KIND
from nodeagent.dra.devices import DraDevice
from nodeagent.gpu.mps import MPS_RUN_DIR, PIPE_ENV, SHM_DIR, MpsDaemonSpec, MpsManager

API_VERSIONS = ("resource.nvidia.com/v1beta1", "resource.nodeagent.io/v1beta1")
KIND = "GpuConfig"
_QUANTITY = re.compile(r"^([0-9]+)(Ki|Mi|Gi|Ti|k|M|G|T)?$")
_SCALE = {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
          "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


class MpsConfigError(ValueError):
    """The claim's MPS parameters are invalid (the message goes back to the kubelet)."""


@dataclass(frozen=True)
class MpsClaimConfig:
    thread_percentage: int | None = None
    pinned_mib: int | None = None
    per_device_mib: Mapping[str, int] = field(default_factory=dict)  # ordinal ("0") or GPU UUID → MiB


def _mib(value: Any, where: str) -> int:
    text = str(value) if isinstance(value, int | str) and not isinstance(value, bool) else ""
    m = _QUANTITY.match(text)
    if m is None:
        raise MpsConfigError(f"{where}: {value!r} is not a memory quantity (e.g. 10Gi, 512Mi)")
    mib = int(m.group(1)) * _SCALE[m.group(2)] // (1 << 20)
    if mib < 1:
        raise MpsConfigError(f"{where}: {value!r} is less than 1Mi")
    return mib


def parse_mps(claim: Mapping[str, Any], driver: str, label: str) -> MpsClaimConfig | None:
    """The MPS settings of the claim's opaque configs for ``driver`` (None when it asks for no MPS)."""
    alloc = (claim.get("status") or {}).get("allocation") or {}
    configs = (alloc.get("devices") or {}).get("config") or []
    found: MpsClaimConfig | None = None
    for i, c in enumerate(configs if isinstance(configs, list) else []):
        opaque = c.get("opaque") if isinstance(c, Mapping) else None
        if not isinstance(opaque, Mapping) or opaque.get("driver") != driver:
            continue
        where = f"{label}: allocation config[{i}]"
        params = opaque.get("parameters")
        if isinstance(params, Mapping) and params.get("kind") == CHANNEL_CONFIG_KIND:
            continue  # an IMEX channel's (nodeagent.dra.channels)
        if not isinstance(params, Mapping) or params.get("kind") != KIND or params.get("apiVersion") not in API_VERSIONS:
            raise MpsConfigError(f"{where}: parameters must be kind {KIND} of apiVersion {' or '.join(API_VERSIONS)}")
        unknown = sorted(set(params) - {"apiVersion", "kind", "sharing"})
        if unknown:
            raise MpsConfigError(f"{where}: unknown key(s) {', '.join(map(str, unknown))}")
        sharing = params.get("sharing")
        if sharing is None:
            continue
        if not isinstance(sharing, Mapping) or sharing.get("strategy") not in ("MPS", "TimeSlicing"):
            raise MpsConfigError(f"{where}: sharing.strategy must be MPS or TimeSlicing")
        if sharing.get("strategy") != "MPS":
            raise MpsConfigError(f"{where}: sharing.strategy TimeSlicing is not served by this driver; use MPS")
        mc = sharing.get("mpsConfig") or {}
        if not isinstance(mc, Mapping):
            raise MpsConfigError(f"{where}: sharing.mpsConfig must be a mapping")
        unknown = sorted(set(mc) - {"defaultActiveThreadPercentage", "defaultPinnedDeviceMemoryLimit",
                                    "defaultPerDevicePinnedMemoryLimit"})
        if unknown:
            raise MpsConfigError(f"{where}: sharing.mpsConfig: unknown key(s) {', '.join(map(str, unknown))}")
        pct = mc.get("defaultActiveThreadPercentage")
        if pct is not None and (isinstance(pct, bool) or not isinstance(pct, int) or not 1 <= pct <= 100):
            raise MpsConfigError(f"{where}: defaultActiveThreadPercentage must be an integer 1..100, got {pct!r}")
        pinned = mc.get("defaultPinnedDeviceMemoryLimit")
        per = mc.get("defaultPerDevicePinnedMemoryLimit") or {}
        if not isinstance(per, Mapping):
            raise MpsConfigError(f"{where}: defaultPerDevicePinnedMemoryLimit must be a mapping")
        cfg = MpsClaimConfig(
            thread_percentage=pct,
            pinned_mib=None if pinned is None else _mib(pinned, f"{where}: defaultPinnedDeviceMemoryLimit"),
            per_device_mib={str(k): _mib(v, f"{where}: defaultPerDevicePinnedMemoryLimit[{k}]") for k, v in per.items()},
        )
        if found is not None and found != cfg:
            raise MpsConfigError(f"{label}: two allocation configs give different MPS settings")
        found = cfg
    return found


def with_consumed_capacity(cfg: MpsClaimConfig, devices: Sequence[DraDevice]) -> MpsClaimConfig:
    """The claim's MPS settings with what its shares of shared GPUs consumed (pure): a share's memory becomes
    the pinned memory limit of its GPU, and the smallest compute share the active thread percentage, unless the
    claim's config sets them (a default or per-device limit, a thread percentage: the config wins). Devices
    taken whole add nothing."""
    gpus = [d for d in devices if d.kind == "gpu"]
    per_device = dict(cfg.per_device_mib)
    for ordinal, dev in enumerate(gpus):
        if dev.share is None or cfg.pinned_mib is not None or str(ordinal) in per_device or dev.uuid in per_device:
            continue
        per_device[str(ordinal)] = max(1, dev.share.memory_bytes // (1 << 20))
    threads = cfg.thread_percentage
    computes = [d.share.compute_percent for d in gpus if d.share is not None and d.share.compute_percent > 0]
    if threads is None and computes:
        threads = min(computes)
    return MpsClaimConfig(threads, cfg.pinned_mib, per_device)


def daemon_spec(uid: str, devices: Sequence[DraDevice], cfg: MpsClaimConfig, label: str,
                under_root: Callable[[str], Path]) -> MpsDaemonSpec:
    """The claim's daemon (pure); refuses MIG devices and per-device limits naming no GPU of the claim."""
    gpus = [d for d in devices if d.kind == "gpu"]
    if len(gpus) != len(devices):
        mig = next(d.name for d in devices if d.kind != "gpu")
        raise MpsConfigError(f"{label}: device {mig} is a MIG device; MPS shares whole GPUs only")
    uuids = [d.uuid for d in gpus]
    limits: dict[int, int] = {}
    if cfg.pinned_mib is not None:
        limits = dict.fromkeys(range(len(gpus)), cfg.pinned_mib)
    for key, mib in cfg.per_device_mib.items():
        ordinal = uuids.index(key) if key in uuids else (int(key) if key.isdigit() else -1)
        if not 0 <= ordinal < len(gpus):
            raise MpsConfigError(f"{label}: defaultPerDevicePinnedMemoryLimit names {key}, which is no GPU of "
                                 f"the claim (0..{len(gpus) - 1} or one of its GPU UUIDs)")
        limits[ordinal] = mib
    base = under_root(f"{MPS_RUN_DIR}/claim-{uid}")
    return MpsDaemonSpec(
        name=f"claim {uid}", pipe_dir=base / "pipe", log_dir=base / "log", gpu_uuids=tuple(uuids),
        thread_percentage=cfg.thread_percentage or 100,
        pinned_limits=tuple((o, f"{mib}M") for o, mib in sorted(limits.items())),
    )


def container_edits(uid: str, publish: Callable[[str], str]) -> dict[str, Any]:
    """What the claim's CDI spec adds for MPS (pure; ``publish``: a host path as the runtime names it)."""
    pipe = f"{MPS_RUN_DIR}/claim-{uid}/pipe"
    return {
            "env": [f"{PIPE_ENV}={pipe}"],
            "mounts": [
                {"hostPath": publish(pipe), "containerPath": pipe, "options": ["rbind", "rw"]},
                {"hostPath": publish(SHM_DIR), "containerPath": SHM_DIR, "options": ["rbind", "rw"]},
            ],
        }


class ClaimMps:
    """The MPS daemons of prepared claims, and the CDI edits their containers get.

    What each claim asked for is kept in ``/run/nodeagent/mps/claims.json`` (under the root): a restarted
    agent starts the daemons of the claims still prepared and writes their specs with the same edits; a
    reboot empties /run together with the daemons."""

    def __init__(self, manager: MpsManager, under_root: Callable[[str], Path],
                 publish: Callable[[str], str] | None = None) -> None:
        self.manager = manager
        self.under_root = under_root
        self.publish: Callable[[str], str] = publish or (lambda p: str(under_root(p)))
        self._specs: dict[str, MpsDaemonSpec] = {}
        self._saved: dict[str, dict[str, Any]] = {}  # uid → {"devices": [...], "config": {...}}

    @property
    def state_path(self) -> Path:
        return self.under_root(f"{MPS_RUN_DIR}/claims.json")

    def _save(self) -> None:
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        fileio.atomic_write(self.state_path, json.dumps(self._saved, sort_keys=True) + "\n", mode=0o600,
                            backup=False, durable=False)

    def edits(self) -> dict[str, dict[str, Any]]:
        """Claim UID → its CDI container edits, for every claim with a daemon."""
        return {uid: container_edits(uid, self.publish) for uid in self._specs}

    def load(self, devices: Mapping[str, DraDevice]) -> dict[str, dict[str, Any]]:
        """At start, before the specs are checked: the claims saved by the previous process (their daemons
        are started by ``resume``); their CDI edits."""
        try:
            raw = json.loads(fileio.read_text(self.state_path) or "{}")
        except (OSError, ValueError, fileio.UnreadableFileError):
            raw = {}
        for uid, entry in (raw.items() if isinstance(raw, dict) else ()):
            try:
                devs = [devices[n] for n in entry["devices"]]
                c = entry["config"]
                cfg = MpsClaimConfig(c.get("thread_percentage"), c.get("pinned_mib"), dict(c.get("per_device_mib", {})))
                self._specs[uid] = daemon_spec(uid, devs, cfg, f"claim {uid}", self.under_root)
                self._saved[uid] = entry
            except (KeyError, TypeError, AttributeError, ValueError):
                continue  # its devices are gone: the claim is dropped by the recovery anyway
        return self.edits()

    async def resume(self, prepared: set[str]) -> None:
        """Start the daemons of the loaded claims that are still prepared; forget the others."""
        for uid in [u for u in self._specs if u not in prepared]:
            self._specs.pop(uid)
            self._saved.pop(uid, None)
        await self.manager.apply({s.name: s for s in self._specs.values()})
        self._save()

    async def prepare(self, uid: str, devices: Sequence[DraDevice], cfg: MpsClaimConfig,
                      label: str) -> dict[str, Any]:
        """Start (or keep) the claim's daemon and wait for its answer; the CDI container edits."""
        spec = daemon_spec(uid, devices, cfg, label, self.under_root)
        self._specs[uid] = spec
        await self.manager.apply({s.name: s for s in self._specs.values()})
        if not self.manager.ready(spec.name):
            daemon = self.manager.daemon(spec.name)
            why = daemon.state.last_error if daemon is not None else "not started"
            await self.unprepare(uid)
            raise MpsConfigError(f"{label}: the MPS control daemon did not start: {why}")
        self._saved[uid] = {"devices": [d.name for d in devices],
                            "config": {"thread_percentage": cfg.thread_percentage, "pinned_mib": cfg.pinned_mib,
                                       "per_device_mib": dict(cfg.per_device_mib)}}
        self._save()
        return container_edits(uid, self.publish)

    async def unprepare(self, uid: str) -> None:
        if self._specs.pop(uid, None) is not None:
            await self.manager.apply({s.name: s for s in self._specs.values()})
        if self._saved.pop(uid, None) is not None:
            self._save()

    def running(self) -> set[str]:
        return set(self._specs)

    async def stop(self) -> None:
        self._specs.clear()
        await self.manager.stop()
