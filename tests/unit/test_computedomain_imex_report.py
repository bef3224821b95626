"""The DRA plane's ComputeDomain report follows the host IMEX daemon's readiness (``[imex] enabled``): a
prepared domain is NotReady until the racks component reports the daemon READY, Ready then, NotReady again
when it stops answering; without ``[imex]`` a prepared domain is Ready. Each change of the readiness writes
the report again; a change of another condition input writes nothing."""

from __future__ import annotations

import asyncio
from typing import Any

from nodeagent.computedomain.reconcile import REPORT_ANNOTATION
from nodeagent.computedomain.report import NodeReporter
from nodeagent.config import AgentConfig, apply_overrides
from nodeagent.daemon.components.dra import DraPlaneComponent
from nodeagent.daemon.shared import Shared
from nodeagent.kube.conditions import ImexInput


class _Kube:
    def __init__(self) -> None:
        self.patches: list[Any] = []

    def request(self, method: str, path: str, **kw: Any) -> None:
        assert (method, path) == ("PATCH", "/api/v1/nodes/n1"), (method, path)
        self.patches.append(kw["body"]["metadata"]["annotations"][REPORT_ANNOTATION])


class _Dra:
    def compute_domains(self) -> list[str]:
        return ["uid-1"]


class _Ctx:
    def __init__(self, imex: bool) -> None:
        self.config = apply_overrides(AgentConfig(), {"imex.enabled": imex, "device_plugin.plane": "dra"})
        self.shared = Shared()
        self.tasks: list[asyncio.Task[Any]] = []

    def spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        self.tasks.append(task)
        return task


def _plane(ctx: _Ctx, kube: _Kube) -> DraPlaneComponent:
    """The component's report path only (its DRA driver is a stand-in listing one prepared domain)."""
    comp = object.__new__(DraPlaneComponent)
    comp._ctx = ctx  # type: ignore[assignment]
    comp.dra = _Dra()  # type: ignore[assignment]
    comp._reporter = NodeReporter(kube, "n1", imex_ready=comp._imex_ready)  # type: ignore[arg-type]
    comp._started = True
    comp._imex_seen = comp._imex_ready()
    ctx.shared.conditions.subscribe(comp._imex_changed)
    return comp


async def _settle(ctx: _Ctx) -> None:
    while ctx.tasks:
        await ctx.tasks.pop()


async def test_the_report_follows_the_imex_daemons_readiness() -> None:
    ctx, kube = _Ctx(imex=True), _Kube()
    comp = _plane(ctx, kube)
    await comp._report_domains()
    assert len(kube.patches) == 1
    assert "NotReady" in kube.patches[-1]
    ctx.shared.conditions.report_imex(ImexInput(running=True, ready=False, peers=2, answer="NOT_READY", clique="c.1"))
    await _settle(ctx)
    assert len(kube.patches) == 1  # still not ready: nothing new written
    ctx.shared.conditions.report_imex(ImexInput(running=True, ready=True, peers=2, answer="READY", clique="c.1"))
    await _settle(ctx)
    assert len(kube.patches) == 2 and "NotReady" not in kube.patches[-1] and "Ready" in kube.patches[-1]
    ctx.shared.conditions.report_mig(state="success")  # another input: no write
    await _settle(ctx)
    assert len(kube.patches) == 2
    ctx.shared.conditions.report_imex(ImexInput(running=False, ready=False, peers=2, clique="c.1"))  # daemon died
    await _settle(ctx)
    assert len(kube.patches) == 3 and "NotReady" in kube.patches[-1]


async def test_without_imex_a_prepared_domain_is_ready() -> None:
    ctx, kube = _Ctx(imex=False), _Kube()
    comp = _plane(ctx, kube)
    await comp._report_domains()
    assert len(kube.patches) == 1 and "NotReady" not in kube.patches[0] and "Ready" in kube.patches[0]
