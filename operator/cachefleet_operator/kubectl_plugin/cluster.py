"""The plugin's adapter: kubeconfig, the Kubernetes API and the cache's Redis.

Credentials as kubectl finds them: ``--kubeconfig FILE``, else
``$KUBECONFIG`` (a list of files is merged), else ``~/.kube/config``, else
(inside a pod) the service account, through
:mod:`cachefleet_operator.login`. ``--context`` picks a context of the
kubeconfig; the namespace is ``-n`` when given, else the context's, else
``default``.

Every failure becomes a :class:`PluginError` whose message a user can act
on: the API unreachable (with the server's address), the CRDs not installed
(checked through discovery on a 404, so it is not mistaken for a missing
object), an object not found, access forbidden, Redis unreachable.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from cachefleet_common.contract.clients import redis_from_url
from cachefleet_common.contract.ops import live_members, read_acks
from cachefleet_common.contract.urls import redact_url
from cachefleet_operator.api import GROUP, VERSION
from cachefleet_operator.invalidation import ack_progress
from cachefleet_operator.kubectl_plugin.views import SidecarSeen
from cachefleet_operator.login import DEFAULT_KUBECONFIG, CredentialSource, CredentialsUnavailable

#: Timeout of one Kubernetes API request, seconds (connect and read).
REQUEST_TIMEOUT_S = 10.0
#: Retries of a request whose connection failed (then the API is "unreachable").
CONNECT_RETRIES = 1
#: Timeouts of the Redis reads of ``top``, seconds.
REDIS_TIMEOUT_S = 3.0

CACHES = "inferencecaches"
INVALIDATIONS = "cacheinvalidations"
_KINDS = {CACHES: "InferenceCache", INVALIDATIONS: "CacheInvalidation"}
_BUILTIN_KINDS = {"pods": "Pod", "secrets": "Secret"}

#: Exit status of an error talking to the cluster (kubectl's).
EXIT_ERROR = 1


class PluginError(Exception):
    """A failure with a message for the user; ``exit_code`` is the plugin's exit status."""

    exit_code = EXIT_ERROR


class Unreachable(PluginError):
    """The API server (or Redis) did not answer."""


class CrdMissing(PluginError):
    """The cluster does not serve cachefleet.io/v1alpha1's resource."""


class NotFound(PluginError):
    """The named object does not exist."""


@dataclass(frozen=True, slots=True)
class Target:
    """Where the plugin talks to: the API client, the namespace and how they were chosen."""

    api: Any
    namespace: str
    server: str
    source: str


def _contexts(path: str) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    from kubernetes import config

    # kubernetes' loaders are unannotated behind a py.typed marker: called through an
    # Any-typed handle, so no stub release can change what mypy says of this call.
    loaders: Any = config
    try:
        contexts, active = loaders.list_kube_config_contexts(config_file=path)
    except (config.ConfigException, OSError, ValueError, KeyError, TypeError) as exc:
        raise PluginError(f"cannot read kubeconfig {path}: {exc}") from exc
    return list(contexts or []), active


def connect(kubeconfig: str | None, context: str | None, namespace: str | None) -> Target:
    """The API client and namespace the flags and the environment choose."""
    from kubernetes import client, config

    # kubernetes' loaders are unannotated behind a py.typed marker: called through an
    # Any-typed handle, so no stub release can change what mypy says of this call.
    loaders: Any = config
    cfg = client.Configuration()
    env = os.environ.get("KUBECONFIG")
    default = os.path.expanduser(DEFAULT_KUBECONFIG)
    path: str | None
    if kubeconfig:
        path = os.path.expanduser(kubeconfig)
        if not os.path.isfile(path):
            raise PluginError(f"--kubeconfig {kubeconfig}: no such file")
    elif env:
        path = env
    elif os.path.isfile(default):
        path = default
    else:
        path = None
    ns_from_config: str | None = None
    if path is not None:
        contexts, active = _contexts(path)
        chosen = active
        if context is not None:
            chosen = next((c for c in contexts if c.get("name") == context), None)
            if chosen is None:
                names = ", ".join(str(c.get("name")) for c in contexts) or "none"
                raise PluginError(f"--context {context}: not in {path} (contexts: {names})")
        try:
            loaders.load_kube_config(config_file=path, context=context, client_configuration=cfg)
        except (config.ConfigException, OSError, ValueError, KeyError, TypeError) as exc:
            raise PluginError(f"cannot use kubeconfig {path}: {exc}") from exc
        ns_from_config = ((chosen or {}).get("context") or {}).get("namespace")
        source = f"kubeconfig {path}" + (f", context {chosen.get('name')}" if chosen else "")
    else:
        sa = CredentialSource()
        if not sa.in_cluster():
            raise PluginError(
                f"no kubeconfig: pass --kubeconfig, set $KUBECONFIG or create {DEFAULT_KUBECONFIG}"
            )
        from cachefleet_operator.login import client_configuration

        try:
            cfg = client_configuration(sa)
        except CredentialsUnavailable as exc:
            raise PluginError(str(exc)) from exc
        ns_file = os.path.join(sa.service_account_dir, "namespace")
        if os.path.isfile(ns_file):
            with open(ns_file, encoding="utf-8") as f:
                ns_from_config = f.read().strip() or None
        source = sa.describe()
    cfg.retries = CONNECT_RETRIES
    return Target(
        api=client.ApiClient(cfg),
        namespace=namespace or ns_from_config or "default",
        server=str(cfg.host),
        source=source,
    )


T = TypeVar("T")


class Cluster:
    """The Kubernetes calls of the plugin, with errors a user can act on."""

    def __init__(self, target: Target) -> None:
        from kubernetes import client

        self.target = target
        self._custom = client.CustomObjectsApi(target.api)
        self._core = client.CoreV1Api(target.api)

    def _call(self, fn: Callable[[], T], plural: str, name: str | None, namespace: str | None) -> T:
        from kubernetes.client import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return fn()
        except ApiException as exc:
            if exc.status == 404 and plural in _KINDS and not self._served(plural):
                raise CrdMissing(
                    f"the cluster does not serve {plural}.{GROUP}/{VERSION}: the cachefleet CRDs "
                    "are not installed (kubectl apply -f crds/, or install the Helm chart)"
                ) from exc
            kind = _KINDS.get(plural) or _BUILTIN_KINDS.get(plural, plural)
            where = f" in namespace {namespace!r}" if namespace else ""
            if exc.status == 404 and name is not None:
                raise NotFound(f'{kind} "{name}" not found{where}') from exc
            if exc.status in (401, 403):
                raise PluginError(
                    f"{'unauthorized' if exc.status == 401 else 'forbidden'}: cannot access "
                    f"{plural}{where} with {self.target.source}: {_api_message(exc)}"
                ) from exc
            raise PluginError(
                f"the API server answered {exc.status} for {plural}{where}: {_api_message(exc)}"
            ) from exc
        except (HTTPError, OSError) as exc:
            raise Unreachable(
                f"cannot reach the Kubernetes API at {self.target.server} "
                f"({self.target.source}): {type(exc).__name__}: {exc}"
            ) from exc

    def _served(self, plural: str) -> bool:
        """Whether discovery lists ``plural`` in cachefleet.io/v1alpha1 (a 404 there: no)."""
        from kubernetes.client import ApiException

        try:
            found = self._custom.get_api_resources(
                GROUP, VERSION, _request_timeout=REQUEST_TIMEOUT_S
            )
        except ApiException as exc:
            return bool(exc.status != 404)  # other answers: cannot tell, report the original error
        except Exception:
            return True
        return any(r.name == plural for r in found.resources or [])

    def get(self, plural: str, namespace: str, name: str) -> dict[str, Any]:
        def call() -> Any:
            return self._custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, plural, name, _request_timeout=REQUEST_TIMEOUT_S
            )

        return dict(self._call(call, plural, name, namespace))

    def list_objects(self, plural: str, namespace: str | None) -> list[dict[str, Any]]:
        def call() -> Any:
            if namespace is None:
                return self._custom.list_cluster_custom_object(
                    GROUP, VERSION, plural, _request_timeout=REQUEST_TIMEOUT_S
                )
            return self._custom.list_namespaced_custom_object(
                GROUP, VERSION, namespace, plural, _request_timeout=REQUEST_TIMEOUT_S
            )

        found = self._call(call, plural, None, namespace)
        items = [dict(i) for i in found.get("items") or []]
        return sorted(
            items, key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"])
        )

    def create(self, plural: str, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        def call() -> Any:
            # the raw answer: the generated client deserialises only a 201, and an
            # API server (or an emulator) may answer a create with 200
            return self._custom.create_namespaced_custom_object(
                GROUP,
                VERSION,
                namespace,
                plural,
                body,
                _request_timeout=REQUEST_TIMEOUT_S,
                _preload_content=False,
            )

        response = self._call(call, plural, None, namespace)
        created = json.loads(response.data or b"{}")
        if not isinstance(created, dict) or not (created.get("metadata") or {}).get("name"):
            raise PluginError(f"the API server's answer to creating a {_KINDS[plural]} has no name")
        return created

    def pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        """Pods matching ``selector``, as the API returns them (camelCase; read raw, so a
        field the generated client's models would refuse does not hide the pod)."""

        def call() -> Any:
            return self._core.list_namespaced_pod(
                namespace,
                label_selector=selector,
                _request_timeout=REQUEST_TIMEOUT_S,
                _preload_content=False,
            )

        found = json.loads(self._call(call, "pods", None, namespace).data or b"{}")
        return [p for p in found.get("items") or [] if isinstance(p, dict)]

    def secret_value(self, namespace: str, name: str, key: str) -> str:
        def call() -> Any:
            return self._core.read_namespaced_secret(
                name, namespace, _request_timeout=REQUEST_TIMEOUT_S, _preload_content=False
            )

        secret = json.loads(self._call(call, "secrets", name, namespace).data or b"{}")
        data = secret.get("data") or {}
        if key not in data:
            raise PluginError(f"Secret {namespace}/{name} has no key {key!r}")
        return base64.b64decode(data[key]).decode().strip()


def _api_message(exc: Any) -> str:
    try:
        body = json.loads(exc.body or "")
        return str(body.get("message") or exc.reason)
    except (ValueError, AttributeError):
        return str(exc.reason)


def label_selector(selector: Mapping[str, Any]) -> str:
    """A LabelSelector (wire form) as the ``labelSelector`` query string."""
    parts = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for req in selector.get("matchExpressions") or []:
        key, op = req.get("key"), req.get("operator")
        values = ",".join(req.get("values") or [])
        if op == "In":
            parts.append(f"{key} in ({values})")
        elif op == "NotIn":
            parts.append(f"{key} notin ({values})")
        elif op == "Exists":
            parts.append(str(key))
        elif op == "DoesNotExist":
            parts.append(f"!{key}")
    return ",".join(parts)


async def _read_sidecars(url: str, cache: str, epochs: Mapping[str, int]) -> list[SidecarSeen]:
    client = redis_from_url(
        url, socket_connect_timeout=REDIS_TIMEOUT_S, socket_timeout=REDIS_TIMEOUT_S
    )
    try:
        members = await live_members(client, cache)
        acks = await read_acks(client, cache)
    finally:
        await client.aclose()
    acked, _ = ack_progress([m.pod for m in members], acks, epochs)
    return [
        SidecarSeen(
            pod=m.pod,
            quota_generation=m.quota_generation,
            policy_by_tenant={t: p.value for t, p in m.policy_by_tenant.items()},
            redis_ok=m.redis_ok,
            heartbeat_at=m.sent_at,
            epochs_acked=(m.pod in acked) if epochs else None,
            unlisted_by_policy={p.value: n for p, n in m.unlisted_by_policy.items()},
        )
        for m in members
    ]


def read_sidecars(url: str, cache: str, epochs: Mapping[str, int]) -> list[SidecarSeen]:
    """The live sidecars' heartbeats and acknowledgements of ``cache`` (a cache_ref)."""
    from redis.exceptions import RedisError

    try:
        return asyncio.run(
            asyncio.wait_for(_read_sidecars(url, cache, epochs), REDIS_TIMEOUT_S * 3)
        )
    except (RedisError, OSError, TimeoutError, ValueError) as exc:
        raise Unreachable(
            f"cannot read the sidecars' heartbeats from Redis at {redact_url(url)}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
