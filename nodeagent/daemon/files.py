"""The files the agent config names, read and validated together with it (at start and on SIGHUP)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nodeagent.config import AgentConfig, require_named_file
from nodeagent.hostpaths import HostPaths

if TYPE_CHECKING:
    from nodeagent.gpu.inventory import Inventory
    from nodeagent.mig.pipeline import MigSources


@dataclass(frozen=True)
class ConfigFiles:
    """The files the agent config names, read and validated together with it (at start and on SIGHUP).

    Components use these parsed contents, never the files directly, so a broken edit of one of them is
    refused as a whole like a broken config.toml, and the running config stays. ``digests`` maps a config
    section to a fingerprint of its files, so SIGHUP also rebuilds a component whose file alone changed.
    """

    plugin_config: Any = None  # sharing.spec.PluginConfig; None = the built-in defaults
    mig: MigSources | None = None  # None = the MIG reconciler does not run
    digests: Mapping[str, str] = field(default_factory=dict)

    def check(self, inventory: Inventory) -> None:
        """Refuse (``ConfigError``) what the node's GPUs can never give, whatever their MIG layout: MPS replicas
        beyond what one MPS server accepts on a GPU of its compute capability. The daemon asks at start, once
        the GPUs are known (a refusal stops it, exit 2), and on reload (a refusal changes nothing)."""
        from nodeagent.sharing.devices import check_mps_replicas
        from nodeagent.sharing.spec import PluginConfig

        if isinstance(self.plugin_config, PluginConfig):
            check_mps_replicas(inventory, self.plugin_config)


def read_config_files(config: AgentConfig, paths: HostPaths) -> ConfigFiles:
    """Read and validate every file ``config`` names and will use; ConfigError names the file and the problem.

    The device-plugin config is read when the device plugin is on; the MIG config and hooks files when the
    MIG reconciler runs (``mig.enabled`` with the API). A missing file is an error, except the default
    ``mig.config_file``, whose absence means the standard configs.
    """
    digests: dict[str, str] = {}
    plugin_config = None
    dp = config.device_plugin
    if dp.enabled and dp.config:
        from nodeagent.sharing.spec import parse_plugin_config

        shown = paths.shown(dp.config)  # a ConfigMap's file, not the ..data directory it resolves to
        text = require_named_file(paths(dp.config), "device-plugin config", "device_plugin.config", shown)
        plugin_config = parse_plugin_config(text, source=shown)
        digests["device_plugin"] = hashlib.sha256(text.encode()).hexdigest()
    mig_sources = None
    if config.mig.enabled and config.kube:
        from nodeagent.mig.pipeline import load_configured_sources

        mig_sources = load_configured_sources(config.mig, paths)
        digests["mig"] = mig_sources.digest
    return ConfigFiles(plugin_config, mig_sources, digests)


