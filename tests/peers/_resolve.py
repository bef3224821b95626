"""Finding the peer binaries: the variables tests/testbin/setup.sh exports, else setup.sh's own logic."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

TESTBIN = Path(__file__).resolve().parent.parent / "testbin"
SETUP_SH = TESTBIN / "setup.sh"


class PeerMissingError(RuntimeError):
    """A real peer is not available; the message says how to get it."""


def peer_file(env_var: str, setup_function: str, what: str) -> Path:
    """Path of a peer data file (a CRD set, ...), resolved as ``peer_binary`` resolves a binary."""
    return peer_binary(env_var, setup_function, what, executable=False)


def peer_binary(env_var: str, setup_function: str, what: str, *, executable: bool = True) -> Path:
    """Path of a peer binary.

    Uses ``$env_var`` when set (tests/run.sh sources setup.sh, which exports it); otherwise runs the
    named setup.sh function, which builds into the cache only when the binary is not there yet. After
    setup.sh's whole setup ran (``NODEAGENT_PEERS_READY=1``), an unset variable is a fault of the setup,
    not a reason to build inside a timed test: it fails at once.
    """
    value = os.environ.get(env_var)
    if not value and os.environ.get("NODEAGENT_PEERS_READY") == "1":
        raise PeerMissingError(
            f"{what}: {env_var} is not set although tests/testbin/setup.sh finished its setup; "
            f"the step that exports it belongs in NODEAGENT_PEERS_STEPS ({SETUP_SH})"
        )
    if not value:
        script = (
            f"NODEAGENT_PEERS_LIB_ONLY=1; source {SETUP_SH}; set -euo pipefail; "
            f'{setup_function} >&2; printf "%s" "${{{env_var}}}"'
        )
        proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=False)
        if proc.returncode != 0 or not proc.stdout:
            raise PeerMissingError(
                f"{what} is not available ({env_var} unset and `{setup_function}` from {SETUP_SH} failed: "
                f"{proc.stderr.strip()[-2000:]}). Run `bash tests/run.sh` or `bash {SETUP_SH}`."
            )
        value = proc.stdout.strip()
        os.environ[env_var] = value
    path = Path(value)
    if not (path.is_file() and (os.access(path, os.X_OK) or not executable)):
        kind = "an executable file" if executable else "a file"
        raise PeerMissingError(f"{what}: {env_var}={value} is not {kind}; run `bash {SETUP_SH}`")
    return path


def system_binary(name: str, package: str) -> Path:
    found = shutil.which(name)
    if found is None:
        raise PeerMissingError(f"`{name}` is not installed: apt-get install {package} (tests/testbin/setup.sh does)")
    return Path(found)

