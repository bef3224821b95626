"""A real container registry on this host's loopback: Debian's ``docker-registry`` (the Distribution project's
registry 2.8) serving plain HTTP on 127.0.0.1 with its blobs in a temporary directory, for the tests that
push an image the way the README says and let a node's containerd pull it.

Pushing (``buildah push``, ``buildah manifest push --all``) runs with a private containers configuration
(``buildah_env``): a registries.conf that names this registry insecure (plain HTTP, as containerd reaches a
loopback registry without any configuration) and a storage.conf with a storage of its own (never the host's
/var/lib/containers, never the setup's cache), so the README's command lines run as printed.

What containerd fetched is in the registry's access log (``requests``: method, path, status, user agent).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.peers._proc import stop_process, tail
from tests.peers._resolve import system_binary
from tests.peers.apiserver import free_port

REGISTRY = Path("/usr/bin/docker-registry")
MANIFEST_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)
INDEX_TYPES = MANIFEST_TYPES[:2]
# the access log's lines (gorilla's combined format): 127.0.0.1 - - [date] "GET /v2/... HTTP/1.1" 200 123 "" "agent"
ACCESS = re.compile(r'"(?P<method>[A-Z]+) (?P<path>\S+) HTTP/[0-9.]+" (?P<status>\d{3}) \S+ "[^"]*" "(?P<agent>[^"]*)"')

CONFIG = """version: 0.1
log:
  level: info
  formatter: text
  accesslog:
    disabled: false
storage:
  filesystem:
    rootdirectory: {root}
  delete:
    enabled: true
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: 127.0.0.1:{port}
"""


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    status: int
    agent: str


@dataclass
class Registry:
    """A running registry: ``host`` is what an image name starts with (``127.0.0.1:PORT``)."""

    host: str
    workdir: Path
    proc: subprocess.Popen[bytes]

    @property
    def log(self) -> Path:
        return self.workdir / "registry.log"

    def requests(self) -> list[Request]:
        found = []
        for line in self.log.read_text(errors="replace").splitlines():
            m = ACCESS.search(line)
            if m:
                found.append(Request(m["method"], m["path"], int(m["status"]), m["agent"]))
        return found

    def get(self, path: str, accept: tuple[str, ...] = (), method: str = "GET") -> tuple[bytes, dict[str, str]]:
        """``GET http://HOST/v2/PATH`` (or another method): the body and the headers."""
        req = urllib.request.Request(f"http://{self.host}/v2/{path}", method=method)
        if accept:
            req.add_header("Accept", ", ".join(accept))
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.read(), {k.lower(): v for k, v in resp.headers.items()}

    def manifest(self, repository: str, reference: str) -> tuple[str, dict[str, Any]]:
        """(digest, manifest) of ``repository:reference`` as the registry serves it (index or image)."""
        body, headers = self.get(f"{repository}/manifests/{reference}", MANIFEST_TYPES)
        doc: dict[str, Any] = json.loads(body)
        return headers["docker-content-digest"], doc

    def blob(self, repository: str, digest: str) -> bytes:
        return self.get(f"{repository}/blobs/{digest}")[0]

    def buildah_env(self, base: dict[str, str]) -> dict[str, str]:
        """``base`` with the containers configuration of this registry's pushes (see the module's doc)."""
        conf = self.workdir / "containers"
        if not conf.is_dir():
            conf.mkdir()
            (conf / "registries.conf").write_text(
                f'# the nodeagent tests\' registry (tests/peers/registry.py): plain HTTP on loopback\n'
                f'[[registry]]\nlocation = "{self.host}"\ninsecure = true\n')
            (conf / "storage.conf").write_text(
                f'[storage]\ndriver = "overlay"\ngraphroot = "{self.workdir / "storage"}"\n'
                f'runroot = "{self.workdir / "storage-run"}"\n')
        return {**base, "CONTAINERS_REGISTRIES_CONF": str(conf / "registries.conf"),
                "CONTAINERS_STORAGE_CONF": str(conf / "storage.conf"), "BUILDAH_ISOLATION": "chroot"}

    def buildah(self, *args: str, timeout: float = 300.0) -> str:
        """``buildah ARGS`` with ``buildah_env``; its stdout (fails with its stderr)."""
        binary = system_binary("buildah", "buildah")
        proc = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=timeout, check=False,
                              env=self.buildah_env({"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(self.workdir)}))
        if proc.returncode != 0:
            raise RuntimeError(f"buildah {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()[-3000:]}")
        return proc.stdout


def _answers(host: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}/v2/", timeout=2) as resp:
            return bool(resp.status == 200)
    except (OSError, urllib.error.URLError):
        return False


@contextmanager
def running_registry() -> Iterator[Registry]:
    """``docker-registry serve`` on a free loopback port until the block ends; its storage goes with it."""
    if not REGISTRY.is_file():
        system_binary("docker-registry", "docker-registry")  # raises PeerMissingError naming the package
    workdir = Path(tempfile.mkdtemp(prefix="nodeagent-registry-"))
    port = free_port()
    config = workdir / "config.yml"
    config.write_text(CONFIG.format(root=workdir / "blobs", port=port))
    log = (workdir / "registry.log").open("ab")
    proc = subprocess.Popen([str(REGISTRY), "serve", str(config)], stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    registry = Registry(host=f"127.0.0.1:{port}", workdir=workdir, proc=proc)
    try:
        deadline = time.monotonic() + 30
        while not _answers(registry.host):
            if proc.poll() is not None:
                raise RuntimeError(f"docker-registry exited {proc.returncode}:\n{tail(registry.log)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"docker-registry does not answer on {registry.host}:\n{tail(registry.log)}")
            time.sleep(0.1)
        yield registry
    finally:
        stop_process(proc)
        log.close()
        # buildah's overlay storage may have mounted its directory on itself (a private mount)
        with open("/proc/self/mounts", encoding="utf-8") as f:
            mounts = [line.split()[1] for line in f if line.split()[1].startswith(f"{workdir}/")]
        for target in sorted(mounts, key=len, reverse=True):
            subprocess.run(["umount", "-l", target], check=False, capture_output=True, timeout=30)
        subprocess.run(["rm", "-rf", "--one-file-system", str(workdir)], check=False, timeout=120)
        shutil.rmtree(workdir, ignore_errors=True)


__all__ = ["INDEX_TYPES", "MANIFEST_TYPES", "Registry", "Request", "running_registry"]
