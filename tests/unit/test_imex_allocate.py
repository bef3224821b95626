"""The device-plugin path of IMEX channels: NVIDIA's plugin config ``imex`` parsed, and every container's answer
carrying the channel as NVIDIA's plugin gives it for each device-list strategy."""

from __future__ import annotations

import dataclasses

import pytest

from nodeagent.deviceplugin.allocate import container_allocation
from nodeagent.errors import ConfigError
from nodeagent.sharing.devices import build_resources
from nodeagent.sharing.spec import ImexChannelRef, ImexConfig, parse_plugin_config
from tests.unit._dp_inventories import nvswitch_box

CH0 = ImexChannelRef(0, "/dev/nvidia-caps-imex-channels/channel0", "/root/dev/nvidia-caps-imex-channels/channel0")


def test_imex_keys_parsed_as_nvidias_plugin_reads_them() -> None:
    cfg = parse_plugin_config("version: v1\nimex:\n  channelIDs: [0]\n  required: true\n")
    assert cfg.imex == ImexConfig(channel_ids=(0,), required=True)
    assert parse_plugin_config("version: v1\n").imex == ImexConfig()
    with pytest.raises(ConfigError, match=r"imex.channelIDs.*\[\] or \[0\]"):
        parse_plugin_config("version: v1\nimex:\n  channelIDs: [1]\n")
    with pytest.raises(ConfigError, match="imex"):
        parse_plugin_config("version: v1\nimex:\n  channelIds: [0]\n")


@pytest.mark.parametrize("strategy", ["envvar", "volume-mounts", "cdi-annotations", "cdi-cri"])
def test_every_strategy_carries_the_channel(strategy: str) -> None:
    cfg = parse_plugin_config(f"version: v1\nflags:\n  plugin:\n    deviceListStrategy: {strategy}\n"
                              "    passDeviceSpecs: true\nimex:\n  channelIDs: [0]\n")
    flags = dataclasses.replace(cfg.flags.plugin, imex_channels=(CH0,))
    resource = build_resources(nvswitch_box(2), cfg)["nvidia.com/gpu"]
    gpu = resource.devices[0].id
    a = container_allocation(resource, flags, [gpu])
    if strategy == "envvar":
        assert a.envs["NVIDIA_IMEX_CHANNELS"] == "0"
    elif strategy == "volume-mounts":
        assert ("/var/run/nvidia-container-devices/imex/0", "/dev/null") in [
            (m.container_path, m.host_path) for m in a.mounts]
    elif strategy == "cdi-annotations":
        assert next(iter(a.annotations.values())).split(",")[-1] == "nvidia.com/imex-channel=0"
    else:
        assert a.cdi_devices[-1] == "nvidia.com/imex-channel=0"
    assert (CH0.path, CH0.host_path, "rw") in [(d.container_path, d.host_path, d.permissions) for d in a.devices]
    # without channels nothing of IMEX appears
    plain = container_allocation(resource, cfg.flags.plugin, [gpu])
    assert "NVIDIA_IMEX_CHANNELS" not in plain.envs and not any("imex" in n for n in plain.cdi_devices)
