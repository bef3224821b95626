"""The long-running agent (``nodeagent run``).

    supervisor   Daemon: start, resync, reload (SIGHUP), READY, stop; run_daemon
    component    Component, ComponentSpec, Context, GpuSource: what the daemon runs, and what a part may use
    support      RunRecorder, close_quietly, trim_heap: the daemon's small helpers
    files        ConfigFiles, read_config_files: the files the config names, validated with it
    shared       the typed links between components (device plugin, DRA, CDI, metrics, health, the Node
                 conditions and status), owned by the daemon
    wiring       open_gpu, open_kube, default_specs, build_daemon: the real parts
    components/  one module per component: cdi, deviceplugin, dra, mig, publisher, metrics, runtime,
                 conditions
"""

from __future__ import annotations

from nodeagent.daemon.files import ConfigFiles, read_config_files
from nodeagent.daemon.supervisor import (
    GLOBAL_SECTIONS,
    READY_FALLBACK,
    STOP_TIMEOUT,
    Component,
    ComponentSpec,
    Context,
    Daemon,
    GpuSource,
    run_daemon,
    trim_heap,
)
from nodeagent.daemon.wiring import build_daemon, default_specs, open_gpu, open_kube

__all__ = [
    "GLOBAL_SECTIONS",
    "READY_FALLBACK",
    "STOP_TIMEOUT",
    "Component",
    "ComponentSpec",
    "ConfigFiles",
    "Context",
    "Daemon",
    "GpuSource",
    "build_daemon",
    "default_specs",
    "open_gpu",
    "open_kube",
    "read_config_files",
    "run_daemon",
    "trim_heap",
]
