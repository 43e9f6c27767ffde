"""Reading a Secret key through the Kubernetes API (adapter for ``spec.redis.secretRef``).

The official ``kubernetes`` client is synchronous, so reads run in a worker
thread with a timeout. Its credentials are the client's default
configuration, which :func:`cachefleet_operator.login.install` sets at startup.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

from cachefleet_operator.outcome import SecretUnavailable

#: Timeout of one Secret read, seconds.
SECRET_READ_TIMEOUT_S = 5.0


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
