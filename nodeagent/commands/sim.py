"""``nodeagent sim``: the NVML simulator's machines, state, layouts and fault injection.

Every state-changing subcommand works on a ``--sim-state FILE`` (the same file a running
``nodeagent run --simulate ... --sim-state FILE`` reads), so faults reach a live daemon.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import click

from nodeagent.clicontext import Group
from nodeagent.commands.common import gpu_options, gpu_opts
from nodeagent.errors import InputError

if TYPE_CHECKING:
    from nodeagent.simulator.state import SimStore


def _store(ctx: click.Context) -> SimStore:
    from nodeagent.simulator.state import SimStore

    opts = gpu_opts(ctx)
    if opts.sim_state is None:
        raise InputError("this command changes simulator state and needs --sim-state FILE")
    return SimStore.open(opts.simulate, opts.sim_state)


def _error_code(value: str) -> int:
    import pynvml

    text = value.strip().upper()
    if text.lstrip("-").isdigit():
        return int(text)
    name = text if text.startswith("NVML_ERROR_") else "NVML_ERROR_" + text
    code = getattr(pynvml, name, None)
    if not isinstance(code, int):
        raise InputError(f"unknown NVML error {value!r} (use a number or a name like IN_USE)", subject=value)
    return code


@click.group(cls=Group)
def sim() -> None:
    """The NVML simulator: machines, MIG layouts, reboots and fault injection."""


@sim.command("machines")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
def machines(as_json: bool) -> None:
    """List the simulated machines."""
    from nodeagent.simulator.machine import load_machine, machine_names

    rows: list[dict[str, Any]] = []
    for name in machine_names():
        m = load_machine(name)
        models = sorted({g.name for g in m.gpus})
        rows.append({"name": name, "gpus": len(m.gpus), "models": models, "description": m.description})
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        click.echo(f"{r['name']:<{width}}  {r['gpus']} GPU(s)  {r['description']}")


@sim.command("show")
@gpu_options
@click.pass_context
def show(ctx: click.Context) -> None:
    """Print the raw simulator state (JSON)."""
    store = _store(ctx)
    click.echo(json.dumps(store.read(), indent=2, sort_keys=True))


@sim.command("reboot")
@gpu_options
@click.pass_context
def reboot(ctx: click.Context) -> None:
    """Reboot the simulated host: MIG instances vanish, pending (Ampere) MIG modes apply."""
    from nodeagent.simulator import inject

    store = _store(ctx)
    inject.reboot(store)
    click.echo("rebooted")


@sim.command("mig")
@gpu_options
@click.option("--gpu", "gpus", required=True, help="GPU index, comma-separated indices, or 'all'.")
@click.option("--disable", is_flag=True, help="Turn MIG off (no instances) instead of writing a layout.")
@click.argument("profiles", nargs=-1)
@click.pass_context
def mig(ctx: click.Context, gpus: str, disable: bool, profiles: tuple[str, ...]) -> None:
    """Write a MIG layout (PROFILES) straight into the state: --gpu 0 3g.40gb 3g.40gb.

    MIG is switched on as if already applied and reset; no PROFILES gives MIG on with no instances.
    For tests and demos: `nodeagent mig apply` is the real way.
    """
    from nodeagent.simulator import inject
    store = _store(ctx)
    count = len(store.machine.gpus)
    if gpus == "all":
        indices = [g.index for g in store.machine.gpus if g.mig_product is not None]
    else:
        try:
            indices = [int(x) for x in gpus.split(",")]
        except ValueError as e:
            raise InputError(f"--gpu must be an index, a list like 0,1 or 'all'; got {gpus!r}") from e
    for i in indices:
        if not 0 <= i < count:
            raise InputError(f"GPU {i} does not exist on {store.machine.name} (0..{count - 1})")
        if disable:
            if profiles:
                raise InputError("--disable takes no profiles")
            inject.set_mig_mode(store, i, False)
        elif profiles:
            inject.write_mig_layout(store, i, list(profiles))
        else:
            inject.set_mig_mode(store, i, True)
    click.echo(f"MIG {'disabled' if disable else 'layout written'} on GPU(s) {', '.join(map(str, indices))}")


@sim.group("inject", cls=Group)
def inject_group() -> None:
    """Inject faults into a simulator state file (a running daemon notices them)."""


@inject_group.command("xid")
@gpu_options
@click.option("--gpu", type=int, required=True, help="GPU index (see `nodeagent discover`).")
@click.option("--code", type=int, required=True, help="XID number, e.g. 48 (DBE), 79 (fallen off the bus).")
@click.option("--gi", "gi_id", type=int, default=None, help="GPU instance the error is attributed to.")
@click.option("--recovery-action", default=None,
              help="The recovery action the driver asks for with it, e.g. recover-imex-domain (with XID 154).")
@click.pass_context
def inject_xid(ctx: click.Context, gpu: int, code: int, gi_id: int | None, recovery_action: str | None) -> None:
    """An XID critical-error event on a GPU."""
    from nodeagent.simulator import inject

    action = None
    if recovery_action is not None:
        action = inject.RECOVERY_ACTIONS.get(recovery_action)
        if action is None:
            raise InputError(f"--recovery-action {recovery_action!r} is not one of "
                             f"{', '.join(inject.RECOVERY_ACTIONS)}", subject=recovery_action)
    inject.inject_xid(_store(ctx), gpu, code, gi_id, action)
    click.echo(f"XID {code} on GPU {gpu}")


@inject_group.command("lost")
@gpu_options
@click.option("--gpu", type=int, required=True, help="GPU index (see `nodeagent discover`).")
@click.pass_context
def inject_lost(ctx: click.Context, gpu: int) -> None:
    """The GPU falls off the bus (NVML_ERROR_GPU_IS_LOST on every call, XID 79 event)."""
    from nodeagent.simulator import inject

    inject.inject_lost(_store(ctx), gpu)
    click.echo(f"GPU {gpu} lost")


@inject_group.command("process")
@gpu_options
@click.option("--gpu", type=int, required=True, help="GPU index (see `nodeagent discover`).")
@click.option("--pid", type=int, required=True, help="Process ID the GPU reports.")
@click.option("--name", default="python3", show_default=True, help="Process name the GPU reports.")
@click.option("--used-mib", type=int, default=1024, show_default=True, help="GPU memory it uses (MiB).")
@click.option("--gi", "gi_id", type=int, default=None, help="Run inside this GPU instance.")
@click.pass_context
def inject_process(ctx: click.Context, gpu: int, pid: int, name: str, used_mib: int,
                   gi_id: int | None) -> None:
    """A process running on a GPU (blocks MIG changes and resets with IN_USE)."""
    from nodeagent.simulator import inject

    inject.inject_process(_store(ctx), gpu, pid, name, used_mib, gi_id)
    click.echo(f"process {pid} ({name}) on GPU {gpu}")


@inject_group.command("kill")
@gpu_options
@click.option("--gpu", type=int, required=True, help="GPU index (see `nodeagent discover`).")
@click.option("--pid", type=int, default=None, help="Only this process (default: all on the GPU).")
@click.pass_context
def inject_kill(ctx: click.Context, gpu: int, pid: int | None) -> None:
    """End processes on a GPU."""
    from nodeagent.simulator import inject

    inject.kill_process(_store(ctx), gpu, pid)
    click.echo(f"processes ended on GPU {gpu}")


@inject_group.command("compute-mode")
@gpu_options
@click.option("--gpu", type=int, required=True, help="GPU index (see `nodeagent discover`).")
@click.argument("mode", type=click.Choice(["DEFAULT", "EXCLUSIVE_THREAD", "PROHIBITED", "EXCLUSIVE_PROCESS"]))
@click.pass_context
def inject_compute_mode(ctx: click.Context, gpu: int, mode: str) -> None:
    """Set a GPU's compute mode as nvidia-smi -c does (the stand-in MPS daemon refuses PROHIBITED)."""
    from nodeagent.simulator import inject

    inject.set_compute_mode(_store(ctx), gpu, mode)
    click.echo(f"GPU {gpu} compute mode {mode}")


@inject_group.command("persistence")
@gpu_options
@click.option("--gpu", type=int, default=None, help="GPU index (default: every GPU).")
@click.argument("mode", type=click.Choice(["enabled", "disabled"]))
@click.pass_context
def inject_persistence(ctx: click.Context, gpu: int | None, mode: str) -> None:
    """Set the driver persistence mode as nvidia-smi -pm does (until the next sim reboot)."""
    from nodeagent.simulator import inject

    inject.set_persistence_mode(_store(ctx), gpu, mode == "enabled")
    click.echo(f"{'every GPU' if gpu is None else f'GPU {gpu}'}: persistence mode {mode}")


@inject_group.command("recover")
@gpu_options
@click.option("--gpu", type=int, default=None, help="Only this GPU (default: all, and pending failures).")
@click.pass_context
def inject_recover(ctx: click.Context, gpu: int | None) -> None:
    """Undo faults: lost GPUs come back, processes end."""
    from nodeagent.simulator import inject

    inject.recover(_store(ctx), gpu)
    click.echo("recovered")


@sim.command("fabric")
@gpu_options
@click.option("--rack", default=None, help="Rack name: nodes placed in the same rack share a cluster UUID.")
@click.option("--node", "slot", type=int, default=None, help="Compute-tray slot in the rack (1..18 on NVL72).")
@click.option("--clique", type=int, default=None, help="NVLink clique ID of this node's GPUs.")
@click.option("--bring-up", "bring_up", type=float, default=None,
              help="Restart the fabric manager: NOT_STARTED, then IN_PROGRESS, COMPLETED after this many seconds.")
@click.pass_context
def fabric(ctx: click.Context, rack: str | None, slot: int | None, clique: int | None,
           bring_up: float | None) -> None:
    """Place a simulated rack node (GB200/GB300 NVL72) in a rack, slot and clique; restart fabric bring-up."""
    from nodeagent.simulator import nvml_fabric

    store = _store(ctx)
    nvml_fabric.place(store, rack, slot, clique)
    if bring_up is not None:
        nvml_fabric.bring_up(store, bring_up)
    f = nvml_fabric.fabric_state(store.read())
    click.echo(f"rack {f.get('rack', nvml_fabric.DEFAULT_RACK)} "
               f"(cluster {nvml_fabric.cluster_uuid(str(f.get('rack', nvml_fabric.DEFAULT_RACK)))}), "
               f"node {f.get('node', '-')}, clique {f.get('clique', nvml_fabric.DEFAULT_CLIQUE)}")


@inject_group.command("fabric")
@gpu_options
@click.option("--state", type=click.Choice(["not-started", "in-progress", "completed"]), default=None,
              help="Hold the fabric registration in this state (not-started/in-progress: fabric not ready).")
@click.option("--status", default=None, help="Status once COMPLETED: an NVML error name or number (SUCCESS: 0).")
@click.option("--degraded-bandwidth/--full-bandwidth", default=None, help="Health mask: degraded bandwidth.")
@click.option("--route-unhealthy/--route-healthy", default=None, help="Health mask: route unhealthy.")
@click.option("--gpu", type=int, default=None, help="With --clique: the GPU whose clique disagrees.")
@click.option("--clique", type=int, default=None, help="With --gpu: the clique that GPU reports.")
@click.option("--heal", is_flag=True, help="Undo every fabric fault first (placement kept).")
@click.pass_context
def inject_fabric(ctx: click.Context, state: str | None, status: str | None, degraded_bandwidth: bool | None,
                  route_unhealthy: bool | None, gpu: int | None, clique: int | None, heal: bool) -> None:
    """NVLink fabric faults of a simulated rack node: not ready, an error status, degraded bandwidth, an
    unhealthy route, one GPU in another clique."""
    from nodeagent.simulator import nvml_fabric

    if (gpu is None) != (clique is None):
        raise InputError("--gpu and --clique go together (the GPU and the clique it reports)")
    store = _store(ctx)
    if heal:
        nvml_fabric.heal(store)
    health = {name: value for name, value in (("degraded-bandwidth", degraded_bandwidth),
                                               ("route-unhealthy", route_unhealthy)) if value is not None}
    code = None
    if status is not None:
        code = 0 if status.strip().upper() in ("SUCCESS", "NVML_SUCCESS") else _error_code(status)
    nvml_fabric.set_fabric(store, state=state, status=code, health=health,
                           gpu_clique=(gpu, clique) if gpu is not None else None)
    click.echo("fabric fault set" if not heal or state or code is not None or health or gpu is not None
               else "fabric healed")


@inject_group.command("fail-next")
@gpu_options
@click.option("--function", "function", required=True,
              help="NVML function, e.g. nvmlDeviceCreateGpuInstance.")
@click.option("--code", required=True, help="NVML error number or name, e.g. 23 or INSUFFICIENT_RESOURCES.")
@click.option("--count", type=int, default=1, show_default=True, help="How many calls fail.")
@click.option("--after", type=int, default=0, show_default=True, help="Let this many calls succeed first.")
@click.pass_context
def inject_fail_next(ctx: click.Context, function: str, code: str, count: int, after: int) -> None:
    """Fail upcoming calls of one NVML function with an NVML error (one-shot)."""
    from nodeagent.simulator import inject

    inject.fail_next(_store(ctx), function, _error_code(code), count, after)
    click.echo(f"{function} fails {count} time(s) after {after} success(es)")
