"""Reading a Secret key through the Kubernetes API (adapter for ``spec.redis.secretRef``).

The official ``kubernetes`` client is synchronous, so reads run in a worker
thread with a timeout. Configuration (in-cluster or kubeconfig) is loaded
once by :func:`load_config`, which ``run.py`` calls at startup.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

from cachefleet_operator.reconcile import SecretUnavailable

#: Timeout of one Secret read, seconds.
SECRET_READ_TIMEOUT_S = 5.0


def load_config(kubeconfig: str | None = None) -> None:
    """In-cluster config when running in a pod, else the kubeconfig."""
    from kubernetes import config

    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        config.load_kube_config(config_file=kubeconfig)  # type: ignore[no-untyped-call]


class KubernetesSecretReader:
    """Reads ``data[key]`` of a Secret with the ``kubernetes`` client."""

    def __init__(self, api: Any | None = None) -> None:
        if api is None:
            from kubernetes import client

            api = client.CoreV1Api()
        self._api = api

    def _read(self, namespace: str, name: str, key: str) -> str:
        secret = self._api.read_namespaced_secret(
            name, namespace, _request_timeout=SECRET_READ_TIMEOUT_S
        )
        data = secret.data or {}
        if key not in data:
            raise SecretUnavailable(f"Secret {namespace}/{name} has no key {key!r}")
        return base64.b64decode(data[key]).decode().strip()

    async def read(self, namespace: str, name: str, key: str) -> str:
        try:
            return await asyncio.wait_for(
                asyncio.to_thread(self._read, namespace, name, key), SECRET_READ_TIMEOUT_S + 1.0
            )
        except SecretUnavailable:
            raise
        except Exception as exc:  # API errors, timeouts, decoding
            raise SecretUnavailable(
                f"Secret {namespace}/{name}: {type(exc).__name__}: {exc}"
            ) from exc
