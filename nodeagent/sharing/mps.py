"""MPS resources → the control daemons they need and what their containers get (pure, no I/O).

One daemon per shared resource: its GPUs are the GPUs of the resource's replicas, its default active
thread percentage is 100 / replicas, and each GPU's default pinned device memory limit is the GPU's memory
/ its replicas, in MiB (the values NVIDIA's MPS control daemon sets). ``CUDA_VISIBLE_DEVICES`` lists the
daemon's GPUs by UUID, so the pinned limits name CUDA device ordinals in that order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from nodeagent.gpu.inventory import Gpu
from nodeagent.gpu.mps import MPS_RUN_DIR, SHM_DIR, MpsDaemonSpec
from nodeagent.sharing.devices import MpsAccess, Resource


def daemon_dir_name(resource: str) -> str:
    """``nvidia.com/gpu`` → ``nvidia.com_gpu`` (one directory per resource)."""
    return resource.replace("/", "_")


def daemon_spec(name: str, gpus: list[tuple[Gpu, int]], base: Path) -> MpsDaemonSpec:
    """The daemon serving ``gpus`` (each with its replica count) with its directories below ``base``."""
    most = max(replicas for _, replicas in gpus)
    return MpsDaemonSpec(
        name=name,
        pipe_dir=base / "pipe",
        log_dir=base / "log",
        gpu_uuids=tuple(g.uuid for g, _ in gpus),
        thread_percentage=max(1, 100 // most),
        pinned_limits=tuple((ordinal, f"{g.memory_mib // replicas}M") for ordinal, (g, replicas) in enumerate(gpus)),
    )


def plan_daemons(resources: dict[str, Resource], under_root: Callable[[str], Path]) -> dict[str, MpsDaemonSpec]:
    """Resource name → its daemon, for every resource shared with MPS."""
    out: dict[str, MpsDaemonSpec] = {}
    for name, r in resources.items():
        if r.sharing != "mps":
            continue
        per_gpu: dict[int, tuple[Gpu, int]] = {}
        for d in r.devices:
            g = d.physical.gpu
            per_gpu[g.index] = (g, per_gpu.get(g.index, (g, 0))[1] + 1)
        gpus = [per_gpu[i] for i in sorted(per_gpu)]
        out[name] = daemon_spec(name, gpus, under_root(f"{MPS_RUN_DIR}/{daemon_dir_name(name)}"))
    return out


def with_access(resources: dict[str, Resource], publish: Callable[[str], str]) -> dict[str, Resource]:
    """The resources, MPS ones carrying the mounts their containers need (``publish``: a host path as the
    kubelet and the container runtime name it)."""
    out: dict[str, Resource] = {}
    for name, r in resources.items():
        if r.sharing == "mps":
            pipe = f"{MPS_RUN_DIR}/{daemon_dir_name(name)}/pipe"
            r = dataclasses.replace(r, mps=MpsAccess(pipe_dir=pipe, pipe_dir_on_host=publish(pipe),
                                                     shm_on_host=publish(SHM_DIR)))
        out[name] = r
    return out
