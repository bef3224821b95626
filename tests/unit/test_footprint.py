"""What keeps the idle daemon small and quiet: lean imports, lazily built API handles, NIC facts read out
of process, and an XID wait that does not wake the event loop."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from nodeagent.gpu.health import HealthMonitor, HealthMonitorSettings
from nodeagent.hostpaths import HostPaths
from nodeagent.lazyimport import lean_import, package_on_demand
from nodeagent.net import nics

REPO = Path(__file__).resolve().parents[2]


def _python(code: str) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter; it prints one JSON document."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, cwd=REPO,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr.decode()
    out: dict[str, Any] = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    return out


# -- nodeagent.lazyimport ---------------------------------------------------------------------------------


@pytest.fixture
def fatpkg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A package whose __init__ imports a heavy submodule and counts its own runs."""
    name = f"fatpkg_{time.monotonic_ns()}"
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "with open(__file__ + '.runs', 'a') as f:\n    f.write('x')\n"
        "from .heavy import Heavy\nfrom .light import Light\nVALUE = 42\n"
    )
    (pkg / "heavy.py").write_text("class Heavy: pass\n")
    (pkg / "light.py").write_text("class Light: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[mod]


def _runs(name: str) -> int:
    """How often the package's real __init__ ran."""
    import importlib.util

    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin is not None
    runs = Path(spec.origin + ".runs")
    return len(runs.read_text()) if runs.exists() else 0


def test_lean_import_skips_the_package_init(fatpkg: str) -> None:
    light = lean_import(fatpkg, "light")
    assert light.Light.__name__ == "Light"
    assert f"{fatpkg}.heavy" not in sys.modules and _runs(fatpkg) == 0


def test_other_names_complete_the_package(fatpkg: str) -> None:
    lean_import(fatpkg, "light")
    pkg = sys.modules[fatpkg]
    assert pkg.VALUE == 42  # not a submodule: the real __init__ runs once, in place
    assert _runs(fatpkg) == 1 and f"{fatpkg}.heavy" in sys.modules
    assert pkg.Light is sys.modules[f"{fatpkg}.light"].Light  # same objects as a normal import
    assert pkg.Heavy.__name__ == "Heavy" and _runs(fatpkg) == 1


def test_package_already_imported_is_left_alone(fatpkg: str) -> None:
    import importlib

    real = importlib.import_module(fatpkg)
    assert package_on_demand(fatpkg) is real and _runs(fatpkg) == 1


def test_unknown_layout_falls_back_to_the_normal_import(fatpkg: str) -> None:
    with pytest.raises(ImportError):
        lean_import(fatpkg, "missing")
    assert fatpkg not in sys.modules or _runs(fatpkg) == 1  # the stub was withdrawn, never half-left


def test_missing_package_raises_import_error() -> None:
    with pytest.raises(ImportError):
        package_on_demand("no_such_package_nodeagent_test")


# -- kubernetes -----------------------------------------------------------------------------------------


def test_kube_client_loads_only_what_it_uses(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'https://127.0.0.1:1', insecure-skip-tls-verify: true}}]\n"
        "users: [{name: u, user: {token: t}}]\ncontexts: [{name: c, context: {cluster: k, user: u}}]\n"
    )
    got = _python(f"""
        import json, sys
        from pathlib import Path
        from nodeagent.kube.client import KubeClient, connect
        kube = KubeClient(connect(Path({str(kubeconfig)!r})))
        loaded = lambda p: any(m == p or m.startswith(p + ".") for m in sys.modules)
        before = {{p: loaded(p) for p in ("kubernetes.stream", "websocket", "kubernetes.dynamic",
                  "kubernetes.informer", "kubernetes.client.api.core_v1_api")}}
        core = type(kube.core).__name__  # built on first use
        import kubernetes
        from kubernetes import watch
        print(json.dumps({{"before": before, "core": core, "version": kubernetes.__version__,
                           "watch": watch.Watch.__name__, "host": kube.api.configuration.host}}))
    """)
    assert not any(got["before"].values()), got["before"]
    assert got["core"] == "CoreV1Api" and got["watch"] == "Watch" and got["version"]
    assert got["host"] == "https://127.0.0.1:1"


def test_oidc_dependencies_load_only_when_used(tmp_path: Path) -> None:
    """The kubeconfig loader's OIDC-only imports stay out until a name of theirs is used, then are real."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'https://127.0.0.1:1', insecure-skip-tls-verify: true}}]\n"
        "users: [{name: u, user: {token: t}}]\ncontexts: [{name: c, context: {cluster: k, user: u}}]\n"
    )
    got = _python(f"""
        import json, sys
        from pathlib import Path
        from nodeagent.kube.client import KubeClient, connect
        kube = KubeClient(connect(Path({str(kubeconfig)!r})))
        before = sorted(m for m in ("requests", "oauthlib.oauth2.rfc6749", "requests_oauthlib.oauth2_session")
                        if m in sys.modules)
        from kubernetes.config import kube_config
        session = kube_config.OAuth2Session(client_id="x")  # the loader's own reference, used as on refresh
        err = kube_config.oauthlib.oauth2.rfc6749.errors.InvalidClientIdError
        import oauthlib, requests_oauthlib
        print(json.dumps({{"before": before, "session": type(session).__module__, "err": err.__module__,
                           "real": [type(oauthlib).__name__, type(requests_oauthlib).__name__],
                           "host": kube.api.configuration.host}}))
    """)
    assert got["before"] == []
    assert got["session"] == "requests_oauthlib.oauth2_session"
    assert got["err"] == "oauthlib.oauth2.rfc6749.errors"
    assert got["real"] == ["module", "module"]
    assert got["host"] == "https://127.0.0.1:1"


def test_deferred_modules_already_imported_are_left_alone() -> None:
    got = _python("""
        import json, sys, json as real_json
        from nodeagent.lazyimport import defer_modules
        defer_modules({"json": ()})
        print(json.dumps({"same": sys.modules["json"] is real_json}))
    """)
    assert got == {"same": True}


# -- NIC facts ------------------------------------------------------------------------------------------


def test_netlink_child_prints_links() -> None:
    proc = subprocess.run([sys.executable, "-m", "nodeagent.net.nics", "links"], capture_output=True,
                          timeout=60, check=True)
    rows = json.loads(proc.stdout)
    assert any(loopback for _name, _up, loopback in rows)
    bad = subprocess.run([sys.executable, "-m", "nodeagent.net.nics"], capture_output=True, timeout=60)
    assert bad.returncode == 2 and b"usage" in bad.stderr


def test_real_root_reads_netlink_out_of_process_and_caches() -> None:
    # the host's interfaces may change under the test (the several-node cluster makes veth pairs beside it):
    # a try whose /sys/class/net changed between its two reads proves nothing and is made again
    for _ in range(5):
        got = _python("""
            import json, os, sys
            from pathlib import Path
            from nodeagent.hostpaths import HostPaths
            from nodeagent.net import nics
            calls = []
            real = nics.netlink_links
            nics.netlink_links = lambda: calls.append(1) or real()
            before = sorted(os.listdir("/sys/class/net"))
            first = nics.read_nics(HostPaths(Path("/")))
            second = nics.read_nics(HostPaths(Path("/")))
            print(json.dumps({"calls": len(calls), "same": first == second,
                              "steady": before == sorted(os.listdir("/sys/class/net")),
                              "pyroute2": any(m.startswith("pyroute2") for m in sys.modules),
                              "nics": [n.name for n in first.nics]}))
        """)
        if got["steady"]:
            break
    assert got["steady"], "the host's interfaces changed during every try"
    assert got["calls"] == 1 and got["same"]  # the second read reused the answer: /sys/class/net unchanged
    assert not got["pyroute2"]  # pyroute2 ran in the child only
    assert "lo" not in got["nics"]


def test_cache_expires_and_follows_sysfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    answers = [[nics.Link("eth0", True)], [nics.Link("eth0", True), nics.Link("eth1", True)]]
    calls: list[int] = []

    def fake_netlink() -> list[nics.Link]:  # our own function, replaced to count the asks
        calls.append(1)
        return answers[min(len(calls), len(answers)) - 1]

    monkeypatch.setattr(nics, "netlink_links", fake_netlink)
    monkeypatch.setattr(nics, "_cache", {})
    paths = HostPaths(tmp_path)
    (tmp_path / "sys/class/net/eth0").mkdir(parents=True)
    (tmp_path / "sys/class/net/eth0/operstate").write_text("up\n")
    assert [x.name for x in nics.cached_netlink_links(paths)] == ["eth0"]
    assert [x.name for x in nics.cached_netlink_links(paths)] == ["eth0"] and len(calls) == 1
    (tmp_path / "sys/class/net/eth1").mkdir()  # a new interface: ask netlink again
    assert [x.name for x in nics.cached_netlink_links(paths)] == ["eth0", "eth1"] and len(calls) == 2
    nics.cached_netlink_links(paths, max_age_s=0.0)  # too old: ask again
    assert len(calls) == 3


def test_netlink_in_child_loads_only_iproute() -> None:
    got = _python("""
        import json, sys
        from nodeagent.net.nics import netlink_links_here
        links = netlink_links_here()
        lean = sorted(m for m in sys.modules if m.startswith("pyroute2"))
        from pyroute2 import NDB, IPRoute  # the rest of the package is still there for anyone who asks
        import pyroute2.iproute.linux as linux
        print(json.dumps({"links": len(links), "ndb_before": "pyroute2.ndb.main" in lean,
                          "same": IPRoute is linux.IPRoute, "ndb": NDB.__name__}))
    """)
    assert got["links"] >= 1 and not got["ndb_before"] and got["same"] and got["ndb"] == "NDB"


# -- XID wait thread -------------------------------------------------------------------------------------


class _Source:
    def __init__(self, events: list[Sequence[Any]]) -> None:
        self.events = events
        self.calls = 0

    def wait_events(self, timeout_ms: int) -> Sequence[Any]:
        self.calls += 1
        return self.events.pop(0) if self.events else []  # returns at once, even with nothing

    def gpu_healthy(self, index: int) -> bool:
        return True

    fault_domain: str | None = None  # no UUIDs shared with other sources

    def recovery_action(self, index: int) -> int:
        return 0

    def gpu_uuid(self, index: int) -> str:
        return f"GPU-{index}"


async def test_event_thread_delivers_and_does_not_spin() -> None:
    changes: list[int] = []

    async def on_change() -> None:
        changes.append(1)

    source = _Source([[{"kind": "xid", "gpu_index": 1, "xid": 79}]])
    monitor = HealthMonitor(source, HealthMonitorSettings(event_wait_ms=100, poll_interval_s=60), on_change)
    await monitor.start([0, 1])
    try:
        for _ in range(100):
            if changes:
                break
            await asyncio.sleep(0.01)
        assert not monitor.is_healthy(1) and monitor.is_healthy(0)
        calls = source.calls
        await asyncio.sleep(0.35)
        assert source.calls - calls <= 5  # paced at event_wait_ms although the source returns at once
    finally:
        await monitor.stop()
