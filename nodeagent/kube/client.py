"""The only module that imports the kubernetes client library.

``connect`` builds an API client from a kubeconfig file or the in-cluster service account; ``KubeClient``
wraps the typed APIs nodeagent uses and converts ``ApiException`` into ``KubeError`` at this boundary.
"""

from __future__ import annotations

from pathlib import Path

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from nodeagent.errors import KubeError


def connect(kubeconfig: Path | None = None) -> k8s.ApiClient:
    """An API client from ``kubeconfig``, else from the in-cluster service account."""
    try:
        if kubeconfig is not None:
            return k8s_config.new_client_from_config(config_file=str(kubeconfig))
        cfg = k8s.Configuration()
        k8s_config.load_incluster_config(client_configuration=cfg)
        return k8s.ApiClient(cfg)
    except (k8s_config.ConfigException, OSError) as e:
        where = str(kubeconfig) if kubeconfig else "in-cluster service account"
        raise KubeError(f"cannot load Kubernetes credentials from {where}: {e}", subject=where) from e


def is_transient(e: ApiException) -> bool:
    return e.status in (0, 408, 429) or (e.status is not None and e.status >= 500)


class KubeClient:
    """Typed API handles sharing one connection pool."""

    def __init__(self, api: k8s.ApiClient) -> None:
        self.api = api
        self.core = k8s.CoreV1Api(api)
        self.node_api = k8s.NodeV1Api(api)
        self.custom = k8s.CustomObjectsApi(api)
        self.apiext = k8s.ApiextensionsV1Api(api)

    def close(self) -> None:
        self.api.close()


def kube_error(action: str, e: ApiException, subject: str | None = None) -> KubeError:
    """Convert an ``ApiException`` into a ``KubeError`` that says what was attempted."""
    reason = e.reason or ""
    return KubeError(
        f"{action}: HTTP {e.status} {reason}".rstrip(), subject=subject, retryable=is_transient(e)
    )
