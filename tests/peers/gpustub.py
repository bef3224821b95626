"""The kubelet's own device-plugin stub (k8s.io/kubernetes/pkg/kubelet/cm/devicemanager/plugin/v1beta1, the
server of the Kubernetes sample device plugin) as another vendor's GPU plugin: ``tests/testbin/
sample-device-plugin/cmd/gpu-stub``, built by tests/testbin/setup.sh (NODEAGENT_GPU_STUB)."""

from __future__ import annotations

import selectors
import signal
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.peers._resolve import peer_binary


@dataclass
class GpuStub:
    proc: subprocess.Popen[str]
    socket: Path
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM: the stub stops serving and removes its socket; its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
        return int(self.proc.returncode)


@contextmanager
def running_gpu_stub(
    socket: Path,
    kubelet_socket: Path,
    devices: Sequence[str],
    workdir: Path,
    resource: str = "nvidia.com/gpu",
    timeout: float = 30.0,
) -> Iterator[GpuStub]:
    """Serve ``devices`` as ``resource`` on ``socket`` and register with the kubelet at ``kubelet_socket``;
    yields once the registration was accepted. Stopped (SIGTERM) at the end if still running."""
    binary = peer_binary("NODEAGENT_GPU_STUB", "nodeagent_peers_harness", "kubelet device-plugin stub")
    log = workdir / "gpu-stub.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [
                str(binary),
                f"-socket={socket}",
                f"-kubelet={kubelet_socket}",
                f"-resource={resource}",
                f"-devices={','.join(devices)}",
            ],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    stub = GpuStub(proc, socket, log)
    try:
        assert proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout) or proc.stdout.readline().strip() != "registered":
                raise RuntimeError(f"gpu-stub did not register within {timeout}s:\n{log.read_text()[-2000:]}")
        yield stub
    finally:
        if proc.poll() is None:
            stub.stop()
        if proc.stdout is not None:
            proc.stdout.close()
