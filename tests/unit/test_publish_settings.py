"""``[publish]`` reaches the publisher as it is written: the config's settings type is the publisher's."""

from __future__ import annotations

import dataclasses
from typing import Any

import kubernetes.client as k8s

from nodeagent.config import PublishSettings
from nodeagent.kube.client import KubeClient
from nodeagent.kube.publisher import NodePublisher
from nodeagent.kube.resources import ResourceSettings


def test_each_publish_switch_reaches_the_publisher() -> None:
    with k8s.ApiClient() as api:  # never called: the switches are read at construction
        kube = KubeClient(api)
        for name in ("labels", "extended_resources", "gpu_objects", "events"):
            off: dict[str, Any] = {name: False}
            settings = dataclasses.replace(PublishSettings(), **off)
            pub = NodePublisher(kube, "node-a", settings)
            assert pub.settings is settings
            assert getattr(pub.settings, name) is False
        assert NodePublisher(kube, "node-a", PublishSettings(events=False)).events.enabled is False


def test_what_the_config_cannot_set_keeps_the_publisher_defaults() -> None:
    with k8s.ApiClient() as api:
        assert NodePublisher(KubeClient(api), "node-a", PublishSettings()).resources == ResourceSettings()
