"""The only module that imports the kubernetes client library.

``connect`` builds an API client from a kubeconfig file or the in-cluster service account; ``KubeClient``
wraps the typed APIs nodeagent uses (built on first use) and converts ``ApiException`` into ``KubeError``
at this boundary.

Besides the typed handles, ``KubeClient.request`` speaks plain JSON to any API path (core, CRDs, patches
of every content type) and ``KubeClient.stream`` opens a watch stream; both count what they send in
``KubeClient.stats`` so the daemon's metrics and the benchmarks can see how kind we are to the server.
"""

from __future__ import annotations

import json
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import urllib3

from nodeagent import __version__
from nodeagent.errors import ConfigError, KubeError
from nodeagent.kube.kubeconfig import read_kubeconfig
from nodeagent.lazyimport import defer_modules, package_on_demand
from nodeagent.logs import one_line

# ``kubernetes/__init__.py`` imports the dynamic client, informers, leader election, watch and the
# websocket ``stream`` client (~35 modules, ~1 MiB resident) that nodeagent never uses. Registering the
# package without running its __init__ loads only ``kubernetes.client`` and ``kubernetes.config`` below;
# any other use of the package still finds everything (see nodeagent.lazyimport). Keep this before the
# kubernetes imports.
package_on_demand("kubernetes")
# The kubeconfig loader imports requests_oauthlib and oauthlib (with requests, ~5 MiB resident) at its top
# but uses them only to refresh OIDC tokens; they are imported for real the first time that happens.
defer_modules({"requests_oauthlib": ("OAuth2Session",), "oauthlib": (), "oauthlib.oauth2": ()})

from kubernetes import client as k8s  # noqa: E402
from kubernetes import config as k8s_config  # noqa: E402
from kubernetes.client.exceptions import ApiException  # noqa: E402

JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"

Query = Mapping[str, str | int | bool]
USER_AGENT = "nodeagent/" + __version__  # the API server names our writes' field manager "nodeagent"


def connect(kubeconfig: Path | None = None) -> k8s.ApiClient:
    """An API client from ``kubeconfig``; without one, as kubectl finds credentials: the in-cluster service
    account, else ``$KUBECONFIG`` (its first file), else ``~/.kube/config``. One error naming every place
    tried when none holds credentials."""
    if kubeconfig is not None:
        return _from_kubeconfig(kubeconfig)
    tried: list[str] = []
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        try:
            cfg = k8s.Configuration()
            k8s_config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
            return k8s.ApiClient(cfg)
        except (k8s_config.ConfigException, OSError) as e:
            tried.append(f"in-cluster service account ({e})")
    else:
        tried.append("in-cluster service account (KUBERNETES_SERVICE_HOST is not set: not in a pod)")
    env = os.environ.get("KUBECONFIG", "")
    first = next((p for p in env.split(os.pathsep) if p), "")
    if first:
        found, why = _readable_file(Path(first))
        if found:
            return _from_kubeconfig(Path(first))
        tried.append(f"$KUBECONFIG {first} ({why})")
    else:
        tried.append("$KUBECONFIG (not set)")
    home = Path.home() / ".kube" / "config"
    found, why = _readable_file(home)
    if found:
        return _from_kubeconfig(home)
    tried.append(f"{home} ({why})")
    raise KubeError("no Kubernetes credentials; tried " + "; ".join(tried)
                    + ". Give --kubeconfig FILE, or --no-kube to run without the API", subject="kubeconfig")


def _readable_file(path: Path) -> tuple[bool, str]:
    """(True, "") when something is at ``path`` (a FIFO or a directory there is the reader's to refuse), else
    (False, why): "not found", or the error of looking (a home directory a systemd unit hides with
    ProtectHome= answers EACCES)."""
    try:
        return (True, "") if path.exists() else (False, "not found")
    except OSError as e:
        return False, f"cannot look: {e.strerror or e}"


def _from_kubeconfig(path: Path) -> k8s.ApiClient:
    found, why = _readable_file(path)
    if not found:
        raise KubeError(f"kubeconfig {path}: {why}", subject=str(path))
    read_kubeconfig(path)  # bounded, and of the shape the client reads: else one ConfigError naming the file
    try:
        api: k8s.ApiClient = k8s_config.new_client_from_config(  # type: ignore[no-untyped-call]
            config_file=str(path)
        )
        return api
    except (k8s_config.ConfigException, OSError, ValueError) as e:
        raise KubeError(f"cannot load Kubernetes credentials from {path}: {_shown_error(e)}",
                        subject=str(path)) from e
    except (TypeError, KeyError, AttributeError, IndexError) as e:  # a shape the check above does not know
        raise ConfigError(f"kubeconfig {path}: the kubernetes client cannot read it: {type(e).__name__}: "
                          f"{_shown_error(e)}", subject=str(path)) from e


def _shown_error(e: BaseException) -> str:
    """An exception's text for an error line: its first line, cut (a library may quote a whole value)."""
    lines = str(e).splitlines()
    return one_line(lines[0] if lines else "", 300)


def is_transient(e: ApiException) -> bool:
    return e.status in (0, 408, 429) or (e.status is not None and e.status >= 500)


def _transient_status(status: int) -> bool:
    return status in (0, 408, 429) or status >= 500


WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


@dataclass
class RequestStats:
    """Requests sent through one ``KubeClient``: by method, writes, errors (thread-safe)."""

    by_method: Counter[str] = field(default_factory=Counter)
    errors: Counter[int] = field(default_factory=Counter)
    watches: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, method: str, status: int | None, *, watch: bool = False) -> None:
        with self._lock:
            self.by_method[method] += 1
            if watch:
                self.watches += 1
            if status is not None and not 200 <= status < 300:
                self.errors[status] += 1

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self.by_method.values())

    @property
    def writes(self) -> int:
        with self._lock:
            return sum(n for m, n in self.by_method.items() if m in WRITE_METHODS)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "total": sum(self.by_method.values()),
                "writes": sum(n for m, n in self.by_method.items() if m in WRITE_METHODS),
                "by_method": dict(self.by_method),
                "watches": self.watches,
                "errors": {str(k): v for k, v in self.errors.items()},
            }


RequestHook = Callable[[str, int | None], None]


class WatchStream:
    """An open watch response: iterate decoded events; ``close`` from any thread ends the iteration.

    Only the iterating thread tears the response down. ``close`` from another thread merely shuts the
    socket's read side, which wakes the blocked read with end-of-stream; the iteration then ends quietly
    (no exception) and closes the response itself. Closing the response under a reading thread instead
    would pull its file object away mid-read (urllib3 then fails with ``AttributeError``).
    """

    def __init__(self, response: Any, action: str) -> None:
        self._resp = response
        self._action = action
        self._closed = False
        self._reading = False
        self._torn_down = False
        self._lock = threading.Lock()

    @property
    def closed(self) -> bool:
        return self._closed

    def __iter__(self) -> Iterator[dict[str, Any]]:
        with self._lock:
            if self._closed:
                self._teardown()
                return
            self._reading = True
        buf = b""
        try:
            for chunk in self._resp.stream(8192, decode_content=True):
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip():
                        yield json.loads(line)
        except (urllib3.exceptions.HTTPError, OSError, ValueError, AttributeError, TypeError) as e:
            if self._closed:
                return  # closed on purpose: whatever the interrupted read raised is expected
            if isinstance(e, AttributeError | TypeError):
                raise
            raise KubeError(f"{self._action}: stream broke: {e}", retryable=True) from e
        finally:
            with self._lock:
                self._reading = False
                self._closed = True
                self._teardown()

    def close(self) -> None:
        """End the stream; safe from any thread, any number of times, never raises."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._reading:
                self._interrupt()
            else:
                self._teardown()

    def _interrupt(self) -> None:
        shutdown = getattr(self._resp, "shutdown", None)
        if shutdown is None:
            return
        try:
            shutdown()
        except Exception:  # already released or closed: the reader is finishing anyway
            return

    def _teardown(self) -> None:
        if self._torn_down:
            return
        self._torn_down = True
        try:
            # close first (this closes the half-read connection), then hand the closed connection back
            # so the pool opens a fresh one next time instead of losing the slot
            self._resp.close()
            self._resp.release_conn()
        except Exception:  # closing a broken stream must never raise
            pass


class KubeClient:
    """Typed API handles sharing one connection pool, plus plain-JSON requests with accounting."""

    def __init__(self, api: k8s.ApiClient, *, on_request: RequestHook | None = None) -> None:
        self.api = api
        # the field manager of every write (managedFields): how nodeagent tells its labels from another agent's
        api.user_agent = USER_AGENT
        self.stats = RequestStats()
        self.on_request = on_request

    # The typed handles are built on first use: naming one makes the client library import its API module
    # and every model class that module refers to (CoreV1Api alone is ~20 MiB resident), while the daemon
    # only ever sends plain JSON through ``request``/``stream``.
    @cached_property
    def core(self) -> k8s.CoreV1Api:
        return k8s.CoreV1Api(self.api)

    @cached_property
    def node_api(self) -> k8s.NodeV1Api:
        return k8s.NodeV1Api(self.api)

    @cached_property
    def custom(self) -> k8s.CustomObjectsApi:
        return k8s.CustomObjectsApi(self.api)

    def close(self) -> None:
        self.api.close()  # type: ignore[no-untyped-call]

    def _record(self, method: str, status: int | None, *, watch: bool = False) -> None:
        self.stats.record(method, status, watch=watch)
        if self.on_request is not None:
            self.on_request(method, status)

    def _send(
        self,
        method: str,
        path: str,
        *,
        query: Query | None,
        body: Any,
        content_type: str | None,
        timeout: float | tuple[float, float] | None,
        action: str,
        subject: str | None,
        watch: bool = False,
    ) -> Any:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type or "application/json"
        q = [(k, str(v).lower() if isinstance(v, bool) else str(v)) for k, v in (query or {}).items()]
        try:
            m, url, hdrs, b, post = self.api.param_serialize(
                method, path, query_params=q, header_params=headers, body=body, auth_settings=["BearerToken"]
            )
            resp = self.api.call_api(m, url, hdrs, b, post, _request_timeout=timeout)
        except ApiException as e:
            self._record(method, e.status or 0, watch=watch)
            raise kube_error(action, e, subject) from e
        except (urllib3.exceptions.HTTPError, OSError) as e:
            self._record(method, 0, watch=watch)
            raise KubeError(f"{action}: {e}", subject=subject, retryable=True, status=0) from e
        status = int(resp.status)
        self._record(method, status, watch=watch)
        if not 200 <= status < 300:
            try:
                resp.read()  # type: ignore[no-untyped-call]
                detail = json.loads(resp.data or b"{}").get("message", "")
            except (ValueError, AttributeError, urllib3.exceptions.HTTPError, OSError):
                detail = ""
            msg = f"{action}: HTTP {status}" + (f": {detail}" if detail else "")
            raise KubeError(msg, subject=subject, retryable=_transient_status(status), status=status)
        return resp

    def request(
        self,
        method: str,
        path: str,
        *,
        query: Query | None = None,
        body: Any = None,
        content_type: str | None = None,
        timeout: float | tuple[float, float] | None = 30.0,
        action: str | None = None,
        subject: str | None = None,
    ) -> dict[str, Any]:
        """Send one request to ``path`` (e.g. ``/api/v1/nodes/n1``); the decoded JSON answer.

        Non-2xx answers raise ``KubeError`` with ``status`` set; network failures raise a retryable
        ``KubeError`` with status 0.
        """
        act = action or f"{method} {path}"
        resp = self._send(
            method, path, query=query, body=body, content_type=content_type, timeout=timeout,
            action=act, subject=subject,
        )
        try:
            resp.read()
            data = resp.data
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise KubeError(f"{act}: reading the answer failed: {e}", subject=subject, retryable=True) from e
        if not data:
            return {}
        try:
            out = json.loads(data)
        except ValueError as e:
            raise KubeError(f"{act}: answer is not JSON", subject=subject, retryable=True) from e
        return out if isinstance(out, dict) else {"items": out}

    def stream(
        self,
        path: str,
        *,
        query: Query | None = None,
        timeout: float | tuple[float, float] | None = None,
        action: str | None = None,
        subject: str | None = None,
    ) -> WatchStream:
        """Open a watch (``watch=true`` is added) on a collection path."""
        act = action or f"watch {path}"
        q = dict(query or {})
        q["watch"] = True
        resp = self._send(
            "GET", path, query=q, body=None, content_type=None, timeout=timeout, action=act,
            subject=subject, watch=True,
        )
        return WatchStream(resp.response, act)

    # resource.k8s.io/v1 (DRA). The client library's typed models lag the API, so these speak plain JSON.
    RESOURCE_V1 = "/apis/resource.k8s.io/v1"

    def list_nodes(self, *, label_selector: str) -> list[dict[str, Any]]:
        """The Nodes that carry ``label_selector`` (``nvidia.com/gpu.clique=<clique>``), as JSON objects."""
        out = self.request("GET", "/api/v1/nodes", query={"labelSelector": label_selector},
                           action=f"list Nodes {label_selector}")
        return list(out.get("items") or [])

    def list_resource_slices(self, *, field_selector: str | None = None) -> list[dict[str, Any]]:
        """ResourceSlices, optionally narrowed by a field selector (``spec.nodeName=n1,spec.driver=d``)."""
        query: dict[str, str] = {"fieldSelector": field_selector} if field_selector else {}
        out = self.request("GET", f"{self.RESOURCE_V1}/resourceslices", query=query,
                           action="list ResourceSlices")
        return list(out.get("items") or [])

    def create_resource_slice(self, body: Mapping[str, Any]) -> dict[str, Any]:
        name = str(body.get("metadata", {}).get("name", ""))
        return self.request("POST", f"{self.RESOURCE_V1}/resourceslices", body=dict(body),
                            action=f"create ResourceSlice {name}", subject=name)

    def replace_resource_slice(self, name: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """PUT: ``body.metadata.resourceVersion`` makes it a compare-and-swap."""
        return self.request("PUT", f"{self.RESOURCE_V1}/resourceslices/{name}", body=dict(body),
                            action=f"replace ResourceSlice {name}", subject=name)

    def delete_resource_slice(self, name: str) -> bool:
        """Delete one ResourceSlice; ``False`` when it was already gone."""
        try:
            self.request("DELETE", f"{self.RESOURCE_V1}/resourceslices/{name}",
                         action=f"delete ResourceSlice {name}", subject=name)
        except KubeError as e:
            if e.status == 404:
                return False
            raise
        return True

    def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        return self.request("GET", f"{self.RESOURCE_V1}/namespaces/{namespace}/resourceclaims/{name}",
                            action=f"get ResourceClaim {namespace}/{name}", subject=f"{namespace}/{name}")


def kube_error(action: str, e: ApiException, subject: str | None = None) -> KubeError:
    """Convert an ``ApiException`` into a ``KubeError`` that says what was attempted."""
    reason = e.reason or ""
    return KubeError(
        f"{action}: HTTP {e.status} {reason}".rstrip(),
        subject=subject,
        retryable=is_transient(e),
        status=e.status,
    )
