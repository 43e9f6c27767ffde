"""The router's Kubernetes API client: credentials in, an ``httpx.AsyncClient`` out.

The router only lists and watches (pods, InferencePools), on the event loop
with httpx, no thread beside it. Credentials, in this order:

1. ``--kubeconfig FILE`` when given;
2. in a pod: ``KUBERNETES_SERVICE_HOST`` / ``KUBERNETES_SERVICE_PORT`` with the
   service-account token and CA the kubelet mounts (the token file is re-read
   at most every :data:`TOKEN_REREAD_S`, so a rotated token is picked up);
3. otherwise ``$KUBECONFIG``, else ``~/.kube/config``.

Kubeconfig files are read with the ``kubernetes`` package's loader (contexts,
client certificates, exec plugins). The operator makes the same choice in
``cachefleet_operator.login``, which the router may not import (import-linter).
"""

from __future__ import annotations

import os
import time
from collections.abc import Generator
from typing import Any

import httpx

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
DEFAULT_KUBECONFIG = "~/.kube/config"
#: seconds between re-reads of the service-account token file
TOKEN_REREAD_S = 60.0
#: connect / request timeouts of non-watch calls, seconds
CONNECT_TIMEOUT_S = 5.0
REQUEST_TIMEOUT_S = 15.0


class KubeCredentialsError(RuntimeError):
    """No usable credentials; the message says what was tried."""


class _TokenFileAuth(httpx.Auth):
    """``Authorization: Bearer`` from a token file that the kubelet rotates."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._token = ""
        self._read_at = -TOKEN_REREAD_S

    def _current(self) -> str:
        now = time.monotonic()
        if now - self._read_at >= TOKEN_REREAD_S:
            with open(self.path, encoding="utf-8") as f:
                self._token = f.read().strip()
            self._read_at = now
        return self._token

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers["Authorization"] = f"Bearer {self._current()}"
        yield request


def in_cluster(service_account_dir: str = SERVICE_ACCOUNT_DIR) -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and os.path.isfile(
        os.path.join(service_account_dir, "token")
    )


def own_namespace(service_account_dir: str = SERVICE_ACCOUNT_DIR) -> str | None:
    """The pod's own namespace (the kubelet mounts it), or None outside a pod."""
    path = os.path.join(service_account_dir, "namespace")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _from_kubeconfig(path: str) -> dict[str, Any]:
    from kubernetes import client, config

    # kubernetes' loaders are unannotated behind a py.typed marker: called through an
    # Any-typed handle, so no stub release can change what mypy says of this call.
    loaders: Any = config
    cfg = client.Configuration()
    try:
        loaders.load_kube_config(config_file=path, client_configuration=cfg)
    except (config.ConfigException, OSError, ValueError, KeyError, TypeError) as exc:
        raise KubeCredentialsError(f"cannot use kubeconfig {path}: {exc}") from exc
    kwargs: dict[str, Any] = {"base_url": cfg.host}
    token = cfg.api_key.get("authorization") or cfg.api_key.get("BearerToken")
    if token:
        token = str(token).strip()
        kwargs["headers"] = {
            "Authorization": token if " " in token else f"Bearer {token}",
        }
    if cfg.cert_file and cfg.key_file:
        kwargs["cert"] = (cfg.cert_file, cfg.key_file)
    if cfg.username and cfg.password:
        kwargs["auth"] = httpx.BasicAuth(cfg.username, cfg.password)
    kwargs["verify"] = (cfg.ssl_ca_cert or True) if cfg.verify_ssl else False
    return kwargs


def client_kwargs(
    kubeconfig: str | None = None, service_account_dir: str = SERVICE_ACCOUNT_DIR
) -> dict[str, Any]:
    """Keyword arguments of ``httpx.AsyncClient`` for the API server (reads the files now)."""
    if kubeconfig:
        path = os.path.expanduser(kubeconfig)
        if not os.path.isfile(path):
            raise KubeCredentialsError(f"--kubeconfig {kubeconfig}: no such file")
        return _from_kubeconfig(path)
    if in_cluster(service_account_dir):
        host = os.environ["KUBERNETES_SERVICE_HOST"]
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if ":" in host:
            host = f"[{host}]"
        ca = os.path.join(service_account_dir, "ca.crt")
        return {
            "base_url": f"https://{host}:{port}",
            "auth": _TokenFileAuth(os.path.join(service_account_dir, "token")),
            "verify": ca if os.path.isfile(ca) else True,
        }
    path = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0] or os.path.expanduser(
        DEFAULT_KUBECONFIG
    )
    if not os.path.isfile(path):
        raise KubeCredentialsError(
            f"no Kubernetes credentials: not in a pod, and no kubeconfig at {path} "
            "(give --kubeconfig, or use --endpoints)"
        )
    return _from_kubeconfig(path)


def make_client(kubeconfig: str | None = None) -> httpx.AsyncClient:
    kwargs = client_kwargs(kubeconfig)
    return httpx.AsyncClient(
        timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=CONNECT_TIMEOUT_S), **kwargs
    )
