"""``[publish]`` reaches the publisher as it is written: each switch, and defaults for what it cannot set."""

from __future__ import annotations

import dataclasses

from nodeagent.config import PublishSettings
from nodeagent.kube.publisher import PublisherConfig


def test_each_publish_switch_reaches_the_publisher() -> None:
    for name in ("labels", "extended_resources", "gpu_objects", "events"):
        cfg = PublisherConfig.from_settings(dataclasses.replace(PublishSettings(), **{name: False}))
        assert getattr(cfg, name) is False
        others = {f.name for f in dataclasses.fields(PublishSettings)} - {name}
        assert all(getattr(cfg, other) is True for other in others)


def test_what_the_config_cannot_set_keeps_the_publisher_defaults() -> None:
    cfg = PublisherConfig.from_settings(PublishSettings())
    assert cfg.network_labels == PublisherConfig().network_labels
    assert cfg.resources == PublisherConfig().resources
