"""A real etcd + kube-apiserver pair on loopback ports, with generated certificates."""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from tests.peers._ports import free_port
from tests.peers._proc import stop_process, tail
from tests.peers._resolve import PeerMissingError, peer_binary, system_binary

READY_TIMEOUT = 90.0


def _openssl(*args: str) -> None:
    proc = subprocess.run(["openssl", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args[:2])} failed: {proc.stderr.strip()}")


def make_pki(d: Path) -> None:
    """CA, serving cert for 127.0.0.1/localhost, admin client cert (system:masters), SA key pair."""
    system_binary("openssl", "openssl")
    d.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=nodeagent-test-ca",
             "-keyout", str(d / "ca.key"), "-out", str(d / "ca.crt"))
    ext = d / "server.ext"
    ext.write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost,IP:10.0.0.1,DNS:kubernetes.default.svc\n"
        "extendedKeyUsage=serverAuth\n"
    )
    for name, subj, extfile in (
        ("server", "/CN=kube-apiserver", ext),
        ("admin", "/O=system:masters/CN=nodeagent-test-admin", None),
    ):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", subj,
                 "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.csr"))
        sign = ["x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / "ca.crt"),
                "-CAkey", str(d / "ca.key"), "-CAcreateserial", "-days", "2", "-out", str(d / f"{name}.crt")]
        if extfile is not None:
            sign += ["-extfile", str(extfile)]
        _openssl(*sign)
    _openssl("genrsa", "-out", str(d / "sa.key"), "2048")
    _openssl("rsa", "-in", str(d / "sa.key"), "-pubout", "-out", str(d / "sa.pub"))


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def write_kubeconfig(path: Path, url: str, pki: Path) -> None:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "test", "cluster": {
            "server": url, "certificate-authority-data": _b64(pki / "ca.crt")}}],
        "users": [{"name": "admin", "user": {
            "client-certificate-data": _b64(pki / "admin.crt"), "client-key-data": _b64(pki / "admin.key")}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "admin"}}],
        "current-context": "test",
    }
    path.write_text(json.dumps(config, indent=1))
    path.chmod(0o600)


_WRITE_VERBS = ("create", "update", "patch", "delete", "deletecollection")
AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
  - level: Metadata
    verbs: """ + json.dumps(_WRITE_VERBS) + """
  - level: Metadata
    verbs: ["list", "watch"]
    resources: [{group: "", resources: ["nodes"]}]
  - level: None
"""
AUDIT_FLUSH_S = 1.5  # the batch backend's default max wait is 1 s


@dataclass(frozen=True)
class AuditWrite:
    """One write request as the apiserver's audit log records it."""

    verb: str
    resource: str
    subresource: str
    namespace: str
    name: str
    code: int
    user: str


@dataclass
class KubeApiServer:
    """A running kube-apiserver (with its etcd). ``kubeconfig`` gives cluster-admin access."""

    url: str
    kubeconfig: Path
    workdir: Path
    etcd_url: str
    version: str = ""
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list, repr=False)
    _logs: list[IO[bytes]] = field(default_factory=list, repr=False)

    def api_client(self) -> Any:
        """A new ``kubernetes.client.ApiClient`` for the admin user."""
        from kubernetes import config as k8s_config

        return k8s_config.new_client_from_config(config_file=str(self.kubeconfig))  # type: ignore[no-untyped-call]

    def ssl_context(self) -> ssl.SSLContext:
        pki = self.workdir / "pki"
        ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        return ctx

    def get(self, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
        """GET ``path`` as admin; (status, body). Handy for /readyz, /version and raw checks."""
        return self.request("GET", path, timeout=timeout)

    def request(self, method: str, path: str, body: Any = None, *, content_type: str = "application/json",
                timeout: float = 10.0) -> tuple[int, bytes]:
        """One admin request; ``body`` is JSON-encoded unless bytes. Returns (status, body)."""
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(req, context=self.ssl_context(), timeout=timeout) as resp:
                status: int = resp.status
                return status, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    @property
    def audit_log(self) -> Path:
        """The apiserver's audit log: one JSON line per write request (create/update/patch/delete) and per
        list or watch of Nodes, read with ``audit_writes`` and ``audit_node_reads``."""
        return self.workdir / "audit.log"

    def _audit_events(self, since: int, settle: float) -> tuple[list[dict[str, Any]], int]:
        if settle > 0:  # the log backend writes in batches (flushed every second)
            time.sleep(settle)
        try:
            with self.audit_log.open("rb") as f:
                f.seek(since)
                data = f.read()
        except FileNotFoundError:
            return [], since
        end = data.rfind(b"\n") + 1
        return [json.loads(line) for line in data[:end].splitlines()], since + end

    def audit_node_reads(self, name: str, since: int = 0, settle: float = AUDIT_FLUSH_S) -> tuple[list[str], int]:
        """The lists and watches of the one Node ``name`` (field-selected to it) logged from byte offset
        ``since``, as verbs in order ("list" when it answered, "watch" when it started), and the next offset."""
        events, end = self._audit_events(since, settle)
        out = [str(ev["verb"]) for ev in events
               if ev.get("verb") in ("list", "watch") and (ev.get("objectRef") or {}).get("name") == name
               and ev.get("stage") == ("ResponseStarted" if ev["verb"] == "watch" else "ResponseComplete")]
        return out, end

    def audit_writes(self, since: int = 0, settle: float = AUDIT_FLUSH_S) -> tuple[list[AuditWrite], int]:
        """Write requests the apiserver has logged from byte offset ``since`` (0: all), and the offset to
        pass next time. Waits ``settle`` s first."""
        out: list[AuditWrite] = []
        events, end = self._audit_events(since, settle)
        for ev in events:
            if ev.get("verb") not in _WRITE_VERBS:
                continue
            ref = ev.get("objectRef") or {}
            out.append(AuditWrite(
                verb=str(ev.get("verb", "")), resource=str(ref.get("resource", "")),
                subresource=str(ref.get("subresource", "")), namespace=str(ref.get("namespace", "")),
                name=str(ref.get("name", "")), code=int((ev.get("responseStatus") or {}).get("code", 0)),
                user=str((ev.get("user") or {}).get("username", "")),
            ))
        return out, end

    def log_tail(self, name: str = "kube-apiserver", lines: int = 40) -> str:
        return tail(self.workdir / f"{name}.log", lines)

    def stop(self) -> None:
        for proc in reversed(self._procs):
            stop_process(proc)
        self._procs.clear()
        for f in self._logs:
            f.close()
        self._logs.clear()


def _wait_ready(server: KubeApiServer, apiserver: subprocess.Popen[bytes], etcd: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    last = ""
    while time.monotonic() < deadline:
        for name, proc in (("etcd", etcd), ("kube-apiserver", apiserver)):
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{server.log_tail(name)}")
        try:
            status, body = server.get("/readyz", timeout=2.0)
            if status == 200:
                return
            last = f"/readyz {status}: {body.decode(errors='replace')[-500:]}"
        except (OSError, ssl.SSLError) as e:
            last = str(e)
        time.sleep(0.2)
    raise RuntimeError(f"kube-apiserver not ready after {READY_TIMEOUT:.0f}s ({last}):\n{server.log_tail()}")


# DRA device taints and partitionable devices (shared counters) are alpha before 1.36: without the gates the
# server drops those fields silently.
DEFAULT_FEATURE_GATES = "DRADeviceTaints=true,DRAPartitionableDevices=true"


def start_apiserver(workdir: Path | None = None, *, binary: Path | None = None,
                    feature_gates: str = DEFAULT_FEATURE_GATES, extra_args: Sequence[str] = (),
                    bind_address: str = "127.0.0.1", advertise_address: str = "127.0.0.1",
                    service_accounts: bool = False) -> KubeApiServer:
    """Start etcd and kube-apiserver; returns once /readyz answers 200. Call ``stop()`` when done.

    ``binary`` is another kube-apiserver build (default: NODEAGENT_KUBE_APISERVER); ``feature_gates`` its
    --feature-gates value ("" for the release's defaults); ``extra_args`` more flags (e.g. --runtime-config).
    ``bind_address``/``advertise_address`` for pods to reach it (tests/peers/cluster.py); ``service_accounts``
    keeps the ServiceAccount admission plugin on (pods get their projected token; needs the controller
    manager's service-account controller)."""
    apiserver_bin = binary or peer_binary("NODEAGENT_KUBE_APISERVER", "nodeagent_peers_apiserver", "kube-apiserver")
    etcd_bin = peer_binary("NODEAGENT_ETCD", "nodeagent_peers_apiserver", "etcd")
    own_dir = workdir is None
    wd = Path(tempfile.mkdtemp(prefix="nodeagent-apiserver-")) if workdir is None else workdir
    try:
        pki = wd / "pki"
        make_pki(pki)
        etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        url = f"https://127.0.0.1:{api_port}"
        server = KubeApiServer(url=url, kubeconfig=wd / "kubeconfig", workdir=wd, etcd_url=etcd_url)
        write_kubeconfig(server.kubeconfig, url, pki)
        etcd_log = (wd / "etcd.log").open("wb")
        server._logs.append(etcd_log)
        etcd = subprocess.Popen(
            [str(etcd_bin), "--name", "default", "--data-dir", str(wd / "etcd"),
             "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
             "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
             "--initial-cluster", f"default=http://127.0.0.1:{peer_port}",
             "--unsafe-no-fsync", "--log-level", "warn"],
            stdin=subprocess.DEVNULL, stdout=etcd_log, stderr=subprocess.STDOUT,
        )
        server._procs.append(etcd)
        policy = wd / "audit-policy.yaml"
        policy.write_text(AUDIT_POLICY)
        api_log = (wd / "kube-apiserver.log").open("wb")
        server._logs.append(api_log)
        apiserver = subprocess.Popen(
            [str(apiserver_bin),
             f"--etcd-servers={etcd_url}",
             f"--bind-address={bind_address}", f"--advertise-address={advertise_address}",
             f"--secure-port={api_port}",
             f"--cert-dir={wd / 'certs'}",
             f"--tls-cert-file={pki / 'server.crt'}", f"--tls-private-key-file={pki / 'server.key'}",
             f"--client-ca-file={pki / 'ca.crt'}",
             "--service-cluster-ip-range=10.0.0.0/24",
             "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
             f"--service-account-key-file={pki / 'sa.pub'}",
             f"--service-account-signing-key-file={pki / 'sa.key'}",
             "--authorization-mode=RBAC",
             # No controller-manager runs, so nothing would create the default service accounts.
             *(() if service_accounts else ("--disable-admission-plugins=ServiceAccount",)),
             "--allow-privileged=true", "--profiling=false", "--v=1",
             # every write, at Metadata level, one JSON line each: tests count an agent's writes by name
             f"--audit-policy-file={policy}", f"--audit-log-path={server.audit_log}",
             "--audit-log-maxbackup=1", "--audit-log-maxsize=200", "--audit-log-mode=batch",
             *([f"--feature-gates={feature_gates}"] if feature_gates else []), *extra_args],
            stdin=subprocess.DEVNULL, stdout=api_log, stderr=subprocess.STDOUT,
        )
        server._procs.append(apiserver)
        try:
            _wait_ready(server, apiserver, etcd)
            status, body = server.get("/version")
            if status == 200:
                server.version = str(json.loads(body).get("gitVersion", ""))
        except BaseException:
            server.stop()
            raise
        return server
    except BaseException:
        if own_dir:
            shutil.rmtree(wd, ignore_errors=True)
        raise


@contextlib.contextmanager
def running_apiserver(*, binary: Path | None = None,
                      feature_gates: str = DEFAULT_FEATURE_GATES) -> Iterator[KubeApiServer]:
    server = start_apiserver(binary=binary, feature_gates=feature_gates)
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.workdir, ignore_errors=True)


__all__ = ["KubeApiServer", "PeerMissingError", "free_port", "running_apiserver", "start_apiserver"]
