"""NVIDIA's ComputeDomain CRD, as tests/testbin/setup.sh caches it, installed into a test API server."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import yaml

from tests.peers._resolve import SETUP_SH, PeerMissingError
from tests.peers.apiserver import KubeApiServer

CRD_NAME = "computedomains.resource.nvidia.com"
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


def crd_file() -> Path:
    """The CRD file of NVIDIA's driver (``$NODEAGENT_COMPUTEDOMAIN_CRD``, else setup.sh's step fetches it)."""
    value = os.environ.get("NODEAGENT_COMPUTEDOMAIN_CRD")
    if not value:
        if os.environ.get("NODEAGENT_PEERS_READY") == "1":
            raise PeerMissingError("NODEAGENT_COMPUTEDOMAIN_CRD is not set although setup.sh finished")
        script = (f"NODEAGENT_PEERS_LIB_ONLY=1; source {SETUP_SH}; set -euo pipefail; "
                  'nodeagent_peers_computedomain_crd >&2; printf "%s" "$NODEAGENT_COMPUTEDOMAIN_CRD"')
        proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=False)
        if proc.returncode != 0 or not proc.stdout:
            raise PeerMissingError(f"the ComputeDomain CRD is not available: {proc.stderr.strip()[-1000:]}")
        value = proc.stdout.strip()
        os.environ["NODEAGENT_COMPUTEDOMAIN_CRD"] = value
    return Path(value)


def install_crd(server: KubeApiServer) -> None:
    """Create NVIDIA's CRD unchanged (once per API server) and wait until it is served."""
    crd = yaml.safe_load(crd_file().read_text())
    assert crd["metadata"]["name"] == CRD_NAME and crd["spec"]["group"] == "resource.nvidia.com"
    status, raw = server.request("POST", CRDS, crd)
    assert status in (201, 409), raw[:300]
    deadline = time.monotonic() + 30
    while True:
        got = json.loads(server.get(f"{CRDS}/{CRD_NAME}")[1])
        if any(c["type"] == "Established" and c["status"] == "True"
               for c in got.get("status", {}).get("conditions", [])):
            break
        assert time.monotonic() < deadline, "the ComputeDomain CRD never became established"
        time.sleep(0.1)
    # a freshly established CRD may still answer 404/429 for a moment
    while server.get("/apis/resource.nvidia.com/v1beta1/computedomains")[0] != 200:
        assert time.monotonic() < deadline, "ComputeDomains never served"
        time.sleep(0.1)
