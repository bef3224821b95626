"""The README's quick start, as written: ``nodeagent --root ./demo run --simulate dgx-h100 --no-kube`` from a
fresh directory (a relative ``--root``) serves the device-plugin socket and stops cleanly on Ctrl-C."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from nodeagent.deviceplugin.api import pb2 as api_pb2
from nodeagent.deviceplugin.api import pb2_grpc as api_pb2_grpc

REPO = Path(__file__).resolve().parents[2]


def quickstart_args() -> list[str]:
    """The arguments the README's "Try it" block gives the installed ``nodeagent``."""
    readme = (REPO / "README.md").read_text()
    block = readme.split("## Try it", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    m = re.search(r"\.venv/bin/nodeagent (.+)$", block.strip(), re.M)
    assert m, f"no nodeagent command in the README's quick start: {block!r}"
    return shlex.split(m.group(1))


def test_readme_quickstart_serves_and_stops() -> None:
    # a short working directory, like a fresh clone's (pytest's tmp_path would overflow a socket path)
    tmp_path = Path(tempfile.mkdtemp(prefix="na-qs-", dir="/tmp"))
    try:
        _quickstart(tmp_path)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def _quickstart(tmp_path: Path) -> None:
    args = quickstart_args()
    assert "--root" in args and not Path(args[args.index("--root") + 1]).is_absolute()
    env = {k: v for k, v in os.environ.items() if not k.startswith("NODEAGENT_")}
    log = tmp_path / "agent.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "nodeagent", *args], cwd=tmp_path, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        root = tmp_path / args[args.index("--root") + 1]
        sock = root / "var/lib/kubelet/device-plugins/nvidia-gpu.sock"
        deadline = time.monotonic() + 20
        while not sock.exists():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"no {sock} after 20s:\n{log.read_text()}"
            time.sleep(0.05)
        assert sock.stat().st_mode & 0o777 == 0o600
        with grpc.insecure_channel(f"unix://{sock}") as channel:
            opts = api_pb2_grpc.DevicePluginStub(channel).GetDevicePluginOptions(api_pb2.Empty(), timeout=5)
        assert opts.get_preferred_allocation_available
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "failed to start" not in text and "Traceback" not in text, text
    assert not sock.exists()
