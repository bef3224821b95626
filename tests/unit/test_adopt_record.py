"""The hand-over record on the Node (annotation ``nodeagent.io/handed-over``) when it is not one: ``adopt``,
``adopt --release`` and the daemon's hand-over refuse it in one line naming it and change nothing (a value of
100,000 ``[`` was a RecursionError in each); doctor's reading of it stays quiet."""

from __future__ import annotations

import asyncio
import logging
import types
from typing import Any

import pytest

from nodeagent import adopt as ad
from nodeagent.config import AgentConfig
from nodeagent.errors import LabelValueError

LINE_MAX = 400


class FakeKube:
    """The Node (with ``annotation`` as its hand-over record) and no operand pods; PATCHes are kept."""

    def __init__(self, annotation: str | None) -> None:
        self.annotation = annotation
        self.patches: list[Any] = []

    def request(self, method: str, path: str, *, query: Any = None, body: Any = None, content_type: str | None = None,
                timeout: Any = 30.0, action: str | None = None, subject: str | None = None) -> dict[str, Any]:
        if method == "PATCH":
            self.patches.append(body)
            return {}
        if path == "/api/v1/pods":
            return {"items": []}
        annotations = {} if self.annotation is None else {ad.HANDED_OVER: self.annotation}
        return {"metadata": {"name": "n", "labels": {ad.DEPLOY_PREFIX + "device-plugin": "false"},
                             "annotations": annotations}}


BAD = [
    ("[" * 100_000, "is 100000 characters long, more than the 1024 a record takes"),
    ("[" * 1000, "is not JSON"),
    ("device-plugin", "is not JSON"),
    ('{"device-plugin": true}', "is not a JSON list of operand names"),
    ('[["device-plugin"]]', "is not a JSON list of operand names"),
]


@pytest.mark.parametrize(("value", "why"), BAD)
@pytest.mark.parametrize("release", [False, True])
def test_a_record_that_is_not_one_is_refused_in_one_line(value: str, why: str, release: bool) -> None:
    kube = FakeKube(value)
    with pytest.raises(LabelValueError) as err:
        if release:
            ad.release(kube, "n")
        else:
            ad.hand_over(kube, "n", timeout_s=0)
    msg = str(err.value)
    assert msg.startswith(f"node n: annotation {ad.HANDED_OVER} {why} (") and "\n" not in msg, msg[:500]
    assert "kubectl annotate node n nodeagent.io/handed-over-" in msg and len(msg) <= LINE_MAX, msg[:500]
    assert err.value.exit_code == 2 and kube.patches == []  # nothing changed
    assert ad.handed_over(kube.request("GET", "/api/v1/nodes/n")) == []  # doctor's reading: none, no error


def test_the_daemon_says_it_once_and_hands_over_when_it_is_corrected(caplog: pytest.LogCaptureFixture) -> None:
    from nodeagent.daemon.components.adopt import AdoptComponent

    kube = FakeKube("[" * 100_000)
    class Adoption:
        take_over: bool | None = None

        def set_take_over(self, take_over: bool) -> None:
            self.take_over = take_over

    adoption = Adoption()
    statuses: list[str] = []
    ctx: Any = types.SimpleNamespace(
        config=AgentConfig(), kube=None, node_name="n", shared=types.SimpleNamespace(adoption=adoption),
        set_status=lambda name, text: statuses.append(text))
    component = AdoptComponent(ctx)
    ctx.kube = kube
    component.poll_s = 0.01

    async def no_detection(*, api: bool = True) -> None:
        return None

    component.detect = no_detection  # type: ignore[method-assign]

    async def scenario() -> None:
        task = asyncio.ensure_future(component._hand_over())
        await asyncio.sleep(0.3)  # many polls with the bad record
        assert not task.done() and kube.patches == []
        kube.annotation = '["gpu-feature-discovery"]'  # corrected by the admin
        await asyncio.wait_for(task, 5)

    with caplog.at_level(logging.WARNING, logger="nodeagent.daemon.components.adopt"):
        asyncio.run(scenario())
    refusals = [r.getMessage() for r in caplog.records if "hand-over refused" in r.getMessage()]
    assert len(refusals) == 1 and "is 100000 characters long" in refusals[0], caplog.text[:2000]
    assert all(len(r.getMessage()) <= LINE_MAX + 40 for r in caplog.records)
    assert adoption.take_over is True and len(kube.patches) == 1
    assert kube.patches[0]["metadata"]["annotations"][ad.HANDED_OVER] == \
        '["container-toolkit", "gpu-feature-discovery", "mig-manager"]'
