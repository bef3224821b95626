"""doctor's containerd and cdi areas: the config and its NVIDIA runtime wiring, containerd's own verdict on
the real host, the CDI spec."""

from __future__ import annotations

from nodeagent import fileio
from nodeagent.doctor.findings import Report, Sources
from nodeagent.errors import NodeAgentError
from nodeagent.gpu.inventory import Inventory


def check_containerd(src: Sources, report: Report) -> None:
    from nodeagent.runtime import configure as rc
    from nodeagent.runtime import containerd_versions as ctv

    if not src.config.runtime.enabled:
        report.add("containerd", "ok", "not managed ([runtime] enabled = false)")
        return
    try:
        info = rc.show(src.paths, src.config.runtime.containerd_config)
        planned = rc.configure(src.paths, rc.options_from_settings(src.config.runtime, dry_run=True,
                                                                  kubelet_dir=src.config.kubelet.dir))
    except NodeAgentError as e:
        report.add("containerd", "error", f"containerd's config cannot be used: {e}",
                   "fix the file by hand (nodeagent never rewrites a file it cannot read)")
        return
    for warning in info["warnings"]:
        report.add("containerd", "error" if "CRI" in warning or "cri" in warning else "warning", warning)
    installed = ctv.parse_containerd_version(info["containerd_version"] or "")
    problem, fix = ctv.load_problem(installed, int(info["config_version"]))
    if problem and info["sources"]:
        report.add("containerd", "error", f"{info['sources'][0]}: {problem}", fix)
    if info["sources"]:
        _containerd_loads(src, str(info["sources"][0]), report)
    if planned.changed:
        files = ", ".join(f.path for f in planned.files if f.action != "unchanged")
        report.add("containerd", "warning", f"not wired for the NVIDIA runtime ({files} differ)",
                   _configure_command(src))
    else:
        report.add("containerd", "ok", f"wired: runtimes {', '.join(info['runtimes']) or 'none'}; default "
                   f"{info['default_runtime']}; CDI {'on' if info['enable_cdi'] else 'off'}; containerd "
                   f"{info['containerd_version'] or 'version unknown'}")


def _containerd_loads(src: Sources, config: str, report: Report) -> None:
    """containerd's own verdict on its config file (``containerd --config FILE config dump``), on the real host
    only: under --root nothing is executed, and the verdict is nodeagent's reading alone."""
    if src.host is None:
        report.add("containerd", "ok", f"{config} read by nodeagent only: containerd itself is not asked under "
                   f"--root {src.paths.root} (nothing is executed there)")
        return
    if src.host.containerd_loads is None:
        report.add("containerd", "ok", f"{config} read by nodeagent only: no containerd program on PATH to ask")
        return
    verdict = src.host.containerd_loads(str(src.paths(config)))
    asked = f"{verdict.binary} --config {config} config dump"
    if verdict.loads:
        report.add("containerd", "ok", f"containerd loads {config} ({asked})")
    elif verdict.loads is False:
        report.add("containerd", "error", f"containerd refuses {config}: {verdict.message} ({asked}); containerd "
                   "would not start with it", f"correct {config} (then: {asked})")
    else:
        report.add("containerd", "warning", f"containerd could not be asked about {config}: {verdict.message}")


def check_cdi(src: Sources, inventory: Inventory, report: Report) -> None:
    from nodeagent.cdi.writer import CdiWriter

    if not src.config.cdi.enabled:
        report.add("cdi", "ok", "not managed ([cdi] enabled = false)")
        return
    writer = CdiWriter(src.paths, driver_root=src.config.cdi.driver_root)
    fix = src.gpu_command("cdi generate")
    try:
        text = fileio.read_text(src.paths(writer.spec_path))
        wanted = writer.render(inventory)
    except (NodeAgentError, OSError) as e:
        report.add("cdi", "error", f"the CDI spec cannot be read or made: {e}", fix)
        return
    if text is None:
        report.add("cdi", "warning" if wanted is not None else "ok",
                   f"no CDI spec at {writer.spec_path}" + ("" if wanted is not None else " (no GPU)"),
                   fix if wanted is not None else "")
    elif text != wanted:
        report.add("cdi", "warning", f"{writer.spec_path} differs from the GPUs now (stale)", fix)
    else:
        report.add("cdi", "ok", f"{writer.spec_path} is current")



def _configure_command(src: Sources) -> str:
    """``runtime configure`` with the agent config's ``[runtime]`` wiring (what this check planned)."""
    from nodeagent.config import RuntimeSettings

    rt, default = src.config.runtime, RuntimeSettings()
    words = ["runtime configure"]
    if rt.containerd_config != default.containerd_config:
        words += ["--containerd-config", src.shell_path(rt.containerd_config)]
    if rt.mode == "in-place":
        words.append("--in-place")
    elif rt.dropin != default.dropin:
        words += ["--drop-in", src.shell_path(rt.dropin)]
    words += [flag for flag, on in (("--set-as-default", rt.set_as_default), ("--cdi", rt.cdi),
                                    ("--no-leak-guard", not rt.leak_guard)) if on]
    return src.command(" ".join(words))
