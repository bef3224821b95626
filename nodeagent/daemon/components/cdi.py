"""The node's CDI spec as a daemon component: written at start, on every new inventory (rediscovery,
driver change) and, through ``ctx.shared.cdi``, after a MIG apply before its devices are advertised."""

from __future__ import annotations

import logging

from nodeagent.daemon.supervisor import Component, Context
from nodeagent.gpu.inventory import Inventory

log = logging.getLogger(__name__)


class CdiComponent(Component):
    """Keeps ``/var/run/cdi/nvidia.yaml`` (under ``--root``) equal to what the inventory implies."""

    name = "cdi"

    def __init__(self, ctx: Context) -> None:
        super().__init__()
        from nodeagent.cdi.writer import CdiWriter

        self._ctx = ctx
        self.writer = CdiWriter(ctx.paths, driver_root=ctx.config.cdi.driver_root,
                                sim_host_files=bool(ctx.config.simulate.machine or ctx.config.simulate.state))

    async def start(self, ctx: Context) -> None:
        ctx.shared.cdi.attach(self._refresh)
        if ctx.inventory is not None:
            await self._refresh(ctx.inventory)

    async def on_inventory(self, inventory: Inventory) -> None:
        await self._refresh(inventory)

    async def _refresh(self, inventory: Inventory) -> None:
        from nodeagent.cdi.host import CdiError

        try:
            changed = await self.writer.on_inventory(inventory)
        except CdiError as e:  # the old spec stays; the next inventory tries again
            log.warning("cdi: %s", e)
            self._ctx.set_status("cdi", "spec not written")
            self._ctx.shared.conditions.report_cdi(current=False, detail=str(e))
            return
        self._ctx.shared.conditions.report_cdi(current=True)
        if changed:
            log.info("cdi: wrote %s", self.writer.file)

    async def stop(self) -> None:
        self._ctx.shared.cdi.detach(self._refresh)
