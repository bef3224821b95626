"""The README's push of the agent's image for one architecture, ``buildah push registry.example.com/nodeagent:0.1.0``,
run as printed into a real registry on 127.0.0.1 (Debian's docker-registry, tests/peers/registry.py), whose
address stands for registry.example.com. The image its build line makes is the amd64 image the setup built from
the same Containerfile (the build itself is the setup's, tests/testbin/setup.sh), loaded into a buildah storage
of the test's own under the README's name. The two-architecture push (``buildah manifest push --all``) runs in
tests/cluster/test_whole_node.py, where the cluster's containerd pulls the agent from it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.cluster.test_whole_node import README_REGISTRY, readme_blocks
from tests.oci_image import archive_image
from tests.peers.registry import MANIFEST_TYPES, running_registry


def test_readme_push_puts_the_image_in_the_registry() -> None:
    archive = os.environ.get("NODEAGENT_AGENT_IMAGE", "")
    if not Path(archive).is_file():
        pytest.fail(f"NODEAGENT_AGENT_IMAGE is not set or not a file ({archive!r}): run `bash tests/testbin/setup.sh` "
                    "(step nodeagent_peers_agent_image)", pytrace=False)
    block = next(b for b in readme_blocks() if any(c[:2] == ["buildah", "push"] for c in b))
    assert [c[:2] for c in block] == [["buildah", "build"], ["buildah", "push"]], block
    build, push = block
    assert "--platform" not in build and "--manifest" not in build, build
    _, built = archive_image(archive)
    with running_registry() as registry:
        start = time.monotonic()
        name = build[build.index("-t") + 1].replace(README_REGISTRY, registry.host)
        image_id = registry.buildah("pull", "-q", f"oci-archive:{archive}").strip()
        registry.buildah("tag", image_id, name)
        loaded = time.monotonic()
        registry.buildah(*[a.replace(README_REGISTRY, registry.host) for a in push[1:]])
        print(f"the agent's image: loaded in {loaded - start:.1f}s, pushed in {time.monotonic() - loaded:.1f}s")
        digest, manifest = registry.manifest("nodeagent", "0.1.0")
        assert manifest["mediaType"] in MANIFEST_TYPES[2:], manifest  # an image, not a list
        config = json.loads(registry.blob("nodeagent", manifest["config"]["digest"]))
        # the image the setup built: its platform, entrypoint and file systems, layer for layer
        assert (config["os"], config["architecture"]) == ("linux", "amd64"), config
        assert config["config"]["Entrypoint"] == built["config"]["Entrypoint"] == ["/usr/local/bin/nodeagent-entrypoint"]
        assert config["rootfs"]["diff_ids"] == built["rootfs"]["diff_ids"], (config["rootfs"], built["rootfs"])
        assert len(manifest["layers"]) == len(config["rootfs"]["diff_ids"]), manifest
        # each layer is in the registry at the size the manifest says (the registry checked its digest on upload)
        for layer in manifest["layers"]:
            _, headers = registry.get(f"nodeagent/blobs/{layer['digest']}", method="HEAD")
            assert int(headers["content-length"]) == layer["size"], (layer, headers)
        pushes = [r for r in registry.requests() if r.method == "PUT" and "/manifests/" in r.path]
        assert [(r.path, r.status) for r in pushes] == [("/v2/nodeagent/manifests/0.1.0", 201)], pushes
        assert digest.startswith("sha256:")
