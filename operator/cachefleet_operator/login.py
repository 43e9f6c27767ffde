"""Where the operator's Kubernetes credentials come from (adapter over ``kubernetes.config``).

One place decides it, for both the kopf watch (a login handler) and the
``kubernetes`` client that reads Secrets:

1. ``--kubeconfig FILE`` when given: an explicit choice wins;
2. in a pod: ``KUBERNETES_SERVICE_HOST`` / ``KUBERNETES_SERVICE_PORT`` and
   the service-account token and CA in ``--service-account-dir`` (default
   the kubelet's mount point);
3. otherwise the kubeconfig kubectl would use: ``$KUBECONFIG`` (a list of
   files is merged), else ``~/.kube/config``.

Nothing is read at import time (the ``kubernetes`` package reads
``$KUBECONFIG`` when it is imported, which is why a flag that only set the
variable later had no effect). The token file is read again on every login,
so a rotated service-account token is used when kopf re-authenticates after
a 401.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

#: Where the kubelet mounts a pod's service-account token, CA and namespace.
DEFAULT_SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
#: Fallback kubeconfig, as kubectl's.
DEFAULT_KUBECONFIG = "~/.kube/config"
_HOST_ENV = "KUBERNETES_SERVICE_HOST"


class CredentialsUnavailable(RuntimeError):
    """No usable credentials: the message says what was tried."""


@dataclass(frozen=True)
class CredentialSource:
    """The operator's choice of credentials (from the command line)."""

    kubeconfig: str | None = None
    service_account_dir: str = DEFAULT_SERVICE_ACCOUNT_DIR

    def describe(self) -> str:
        if self.kubeconfig:
            return f"kubeconfig {self.kubeconfig}"
        if self.in_cluster():
            return f"in-cluster service account ({self.service_account_dir})"
        return f"kubeconfig {os.environ.get('KUBECONFIG') or DEFAULT_KUBECONFIG}"

    def in_cluster(self) -> bool:
        return bool(os.environ.get(_HOST_ENV)) and os.path.isfile(
            os.path.join(self.service_account_dir, "token")
        )


def client_configuration(source: CredentialSource) -> Any:
    """A fresh ``kubernetes.client.Configuration`` for ``source`` (reads the files now)."""
    from kubernetes import client, config
    from kubernetes.config import incluster_config

    # kubernetes' loaders are unannotated behind a py.typed marker: called through
    # Any-typed handles, so no stub release can change what mypy says of these lines.
    loaders: Any = config
    in_cluster_loader: Any = incluster_config.InClusterConfigLoader

    cfg = client.Configuration()
    try:
        if source.kubeconfig:
            if not os.path.isfile(os.path.expanduser(source.kubeconfig)):
                raise CredentialsUnavailable(f"--kubeconfig {source.kubeconfig}: no such file")
            loaders.load_kube_config(
                config_file=os.path.expanduser(source.kubeconfig), client_configuration=cfg
            )
        elif source.in_cluster():
            sa = source.service_account_dir
            loader = in_cluster_loader(
                token_filename=os.path.join(sa, "token"),
                cert_filename=os.path.join(sa, "ca.crt"),
            )
            loader.load_and_set(cfg)
        else:
            path = os.environ.get("KUBECONFIG") or os.path.expanduser(DEFAULT_KUBECONFIG)
            loaders.load_kube_config(config_file=path, client_configuration=cfg)
    except CredentialsUnavailable:
        raise
    except (config.ConfigException, OSError, ValueError, KeyError, TypeError) as exc:
        raise CredentialsUnavailable(
            f"cannot log in with {source.describe()}: {type(exc).__name__}: {exc}"
        ) from exc
    return cfg


def _bearer(cfg: Any) -> tuple[str | None, str | None]:
    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix(
        "authorization"
    )
    if not header:
        return None, None
    parts = str(header).strip().split(" ", 1)  # a token file may end with a newline
    if len(parts) == 1:
        return None, parts[0]
    scheme = "Bearer" if parts[0].lower() == "bearer" else parts[0]
    return scheme, parts[1].strip()


def connection_info(source: CredentialSource) -> Any:
    """kopf's ``ConnectionInfo`` for ``source`` (what the login handler returns)."""
    import kopf

    cfg = client_configuration(source)
    scheme, token = _bearer(cfg)
    namespace = None
    ns_file = os.path.join(source.service_account_dir, "namespace")
    if not source.kubeconfig and source.in_cluster() and os.path.isfile(ns_file):
        with open(ns_file, encoding="utf-8") as f:
            namespace = f.read().strip() or None
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert or None,
        insecure=not cfg.verify_ssl,
        username=cfg.username or None,
        password=cfg.password or None,
        scheme=scheme,
        token=token,
        certificate_path=cfg.cert_file or None,
        private_key_path=cfg.key_file or None,
        default_namespace=namespace,
    )


_SOURCE: dict[str, CredentialSource] = {}


def install(source: CredentialSource) -> None:
    """Use ``source`` for the ``kubernetes`` client and for kopf (a login handler).

    Raises :class:`CredentialsUnavailable` at once when nothing can be loaded,
    so the operator exits with a reason instead of retrying forever.
    """
    import kopf
    from kubernetes import client

    client.Configuration.set_default(client_configuration(source))
    first = not _SOURCE
    _SOURCE["source"] = source
    if first:

        @kopf.on.login(id="cachefleet-login")
        def login(**_: Any) -> Any:
            try:
                return connection_info(_SOURCE["source"])
            except CredentialsUnavailable as exc:
                raise kopf.LoginError(str(exc)) from exc
