"""Sidecar injection, pure: the sidecar container and the JSON patch that adds it to a Pod.

The mutating admission webhook (:mod:`cachefleet_operator.webhook`) calls
:func:`injection_patch` for every Pod created with the label
``cachefleet.io/cache=<name>``; everything it needs arrives as arguments:
the Pod, the webhook's :class:`SidecarSettings` (image, ports, resources;
the chart writes them to a file) and, when the InferenceCache named by the
label exists, a :class:`CacheInfo` read from it (Redis endpoint, model
version, L1 size, default policy). No Kubernetes client here.

Rules a user can rely on:

* only Pods labelled ``cachefleet.io/cache`` with a valid name are touched;
  ``cachefleet.io/inject: "false"`` opts a labelled Pod out;
* a Pod that already runs the sidecar (a container named
  :data:`SIDECAR_NAME`, or the :data:`INJECTED_ANNOTATION`) is never patched twice;
* the sidecar is configured through ``CACHEFLEET_<FLAG>`` environment
  variables (see :mod:`cachefleet_sidecar.flags`); a Redis URL held in a
  Secret stays in the Secret (``valueFrom.secretKeyRef``);
* ``cachefleet.io/api-keys-secret: <secret>`` mounts that Secret's
  ``keys.json`` read-only into the sidecar as its API-keys file (the key then
  decides the tenant, see docs/security.md);
* a port clash with another container is refused with a message naming it,
  rather than injecting a sidecar that cannot bind.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cachefleet_common.contract.fleet import FLEET_SAMPLE_RATE
from cachefleet_common.prices import format_price_table
from cachefleet_operator.api import SavingsSpec
from cachefleet_operator.quantity import parse_bytes

#: Label that asks for the sidecar; its value is the InferenceCache's name.
CACHE_LABEL = "cachefleet.io/cache"
#: Annotation that opts a labelled Pod out when set to "false".
INJECT_ANNOTATION = "cachefleet.io/inject"
#: Annotation that overrides the sidecar's upstream (the model server URL) for one Pod.
UPSTREAM_ANNOTATION = "cachefleet.io/upstream"
#: Annotation naming a Secret (Pod's namespace) whose key ``keys.json`` is the sidecar's
#: API-keys file; mounted read-only, so a Secret update reaches the sidecar's reload.
API_KEYS_ANNOTATION = "cachefleet.io/api-keys-secret"
API_KEYS_VOLUME = "cachefleet-api-keys"
API_KEYS_DIR = "/etc/cachefleet/api-keys"
API_KEYS_FILE = "keys.json"
#: Annotation the webhook sets on an injected Pod: ``<namespace>/<name>`` of its cache.
INJECTED_ANNOTATION = "cachefleet.io/injected"
#: Name of the injected container.
SIDECAR_NAME = "cachefleet-sidecar"
#: Port names (at most 15 characters, unique in the Pod).
PROXY_PORT_NAME = "cf-proxy"
ADMIN_PORT_NAME = "cf-admin"
#: Environment variable prefix of every sidecar flag.
ENV_PREFIX = "CACHEFLEET_"

#: Probe timings of the sidecar, seconds.
PROBE_PERIOD_S = 10
PROBE_TIMEOUT_S = 2
LIVENESS_FAILURE_THRESHOLD = 3
READINESS_FAILURE_THRESHOLD = 3
#: Seconds the sidecar may take to start before liveness counts.
STARTUP_GRACE_S = 5

_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_FALSY = frozenset({"false", "0", "no", "off"})


class InjectionError(ValueError):
    """The Pod cannot take the sidecar as asked; the message says why (shown to the user)."""


class Resources(BaseModel):
    """Requests and limits of the sidecar container (Kubernetes quantities)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    requests: dict[str, str] = Field(default_factory=lambda: {"cpu": "100m", "memory": "384Mi"})
    limits: dict[str, str] = Field(default_factory=lambda: {"memory": "1Gi"})


#: The numeric user (and group) of the cachefleet image (Containerfile ``USER``).
IMAGE_UID = 10001


class SidecarSettings(BaseModel):
    """Webhook-wide settings of the injected sidecar (the chart's ``sidecar`` values)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    image: str = Field(min_length=1, description="Sidecar image, repository:tag or @digest.")
    image_pull_policy: str = Field(default="IfNotPresent", alias="imagePullPolicy")
    proxy_port: int = Field(default=8080, ge=1, le=65535, alias="proxyPort")
    admin_port: int = Field(default=8081, ge=1, le=65535, alias="adminPort")
    upstream: str = Field(default="http://127.0.0.1:8000", pattern=r"^https?://")
    tenant_header: str = Field(default="X-Tenant-ID", min_length=1, alias="tenantHeader")
    trusted_proxies: str = Field(
        default="",
        alias="trustedProxies",
        description="CIDRs whose tenant header the sidecar believes (empty: none).",
    )
    default_tenant: str | None = Field(default=None, alias="defaultTenant")
    log_level: str = Field(default="info", alias="logLevel")
    run_as_user: int = Field(
        default=IMAGE_UID, ge=1, alias="runAsUser", description="The image's numeric user."
    )
    resources: Resources = Field(default_factory=Resources)
    env: dict[str, str] = Field(
        default_factory=dict, description="Further CACHEFLEET_* variables, verbatim."
    )


@dataclass(frozen=True)
class CacheInfo:
    """What the sidecar needs from its InferenceCache (see :func:`cache_info`)."""

    namespace: str
    name: str
    redis_url: str | None = None
    redis_secret: tuple[str, str] | None = None
    model_version: str | None = None
    l1_bytes_per_pod: int | None = None
    policy: str | None = None
    outage_staleness_s: int = 0
    #: Admission flags from ``spec.admission`` as (flag, value) pairs; empty: off.
    admission: tuple[tuple[str, str], ...] = ()
    #: spec.upstream's bounds (None: the sidecar's defaults).
    upstream_max_connections: int | None = None
    upstream_max_queued: int | None = None
    #: ``spec.namespaceHeader``, ``spec.warmup`` as sidecar flags; empty: the defaults.
    cache_flags: tuple[tuple[str, str], ...] = ()
    #: ``spec.fleetSampleRate``: always given, so every injected pod of a cache forwards
    #: the same keys whatever its image's default.
    fleet_sample_rate: float = FLEET_SAMPLE_RATE

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


def _bytes(value: Any) -> int | None:
    """A size from a stored spec (integer or quantity); None when absent or unreadable.

    The CRD schema admits only quantities, so unreadable means an object written around
    it: the sidecar then keeps its own default rather than failing the pod's admission.
    """
    if value is None:
        return None
    try:
        return parse_bytes(value)
    except ValueError:
        return None


def cache_info(obj: Mapping[str, Any]) -> CacheInfo:
    """Read the parts of an InferenceCache object (as the API returns it) the sidecar uses."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    redis = spec.get("redis") or {}
    secret = redis.get("secretRef") or None
    capacity = spec.get("capacity") or {}
    l1 = capacity.get("l1BytesPerPod")
    upstream = spec.get("upstream") or {}
    max_connections = upstream.get("maxConnections")
    max_queued = upstream.get("maxQueued")
    return CacheInfo(
        namespace=str(meta.get("namespace", "")),
        name=str(meta.get("name", "")),
        redis_url=redis.get("url") or None,
        redis_secret=None if secret is None else (secret["name"], secret.get("key", "url")),
        model_version=(spec.get("model") or {}).get("version") or None,
        l1_bytes_per_pod=_bytes(l1),
        policy=spec.get("defaultPolicy") or None,
        outage_staleness_s=int(redis.get("outageStalenessSeconds") or 0),
        admission=admission_flags(spec.get("admission")),
        upstream_max_connections=None if max_connections is None else int(max_connections),
        upstream_max_queued=None if max_queued is None else int(max_queued),
        cache_flags=cache_flags(spec),
        fleet_sample_rate=fleet_sample_rate(spec.get("fleetSampleRate")),
    )


def cache_flags(spec: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """Sidecar flags of spec.namespaceHeader, spec.warmup, spec.savings and
    spec.observability (absent: none)."""
    flags: list[tuple[str, str]] = []
    if spec.get("namespaceHeader"):
        flags.append(("namespace-header", str(spec["namespaceHeader"])))
    warmup = spec.get("warmup")
    warm_bytes = _bytes(warmup.get("bytes")) if isinstance(warmup, Mapping) else None
    if isinstance(warmup, Mapping) and warm_bytes:
        flags.append(("warm-bytes", str(warm_bytes)))
        if warmup.get("timeoutSeconds") is not None:
            flags.append(("warm-timeout", str(warmup["timeoutSeconds"])))
    prices = price_table(spec.get("savings"))
    if prices is not None:
        flags.append(("price-table", prices))
    observability = spec.get("observability")
    otlp = observability.get("otlpEndpoint") if isinstance(observability, Mapping) else None
    # one the API server would refuse (not http(s)) is left out: the Pod still starts
    if isinstance(otlp, str) and otlp.startswith(("http://", "https://")):
        flags.append(("otlp-endpoint", otlp))
    return tuple(flags)


def fleet_sample_rate(value: Any) -> float:
    """``spec.fleetSampleRate`` for the sidecars: absent or invalid (the API server refuses
    one; the operator's status names the field), the default, so the Pod still starts."""
    try:
        rate = float(value)
    except (TypeError, ValueError):
        return FLEET_SAMPLE_RATE
    return rate if 0.0 < rate <= 1.0 else FLEET_SAMPLE_RATE


def price_table(savings: Any) -> str | None:
    """``spec.savings.prices`` as the sidecars' ``--price-table`` JSON (None: no prices).

    An invalid ``spec.savings`` (the API server refuses one; the operator's
    status names the field) gives none: the Pod still starts, counting no cost.
    """
    if not isinstance(savings, Mapping) or not savings.get("prices"):
        return None
    try:
        parsed = SavingsSpec.model_validate(savings, by_alias=True, by_name=False)
    except ValidationError:
        return None
    return format_price_table(parsed.price_table())


#: spec.admission field -> sidecar flag
_ADMISSION_FLAGS = {
    "maxWaiting": "admission-max-waiting",
    "maxKvUsage": "admission-max-kv-usage",
    "maxRunning": "admission-max-running",
    "standardQueue": "admission-standard-queue",
    "standardMaxWaitSeconds": "admission-standard-max-wait",
}


def admission_flags(spec: Any) -> tuple[tuple[str, str], ...]:
    """The sidecar flags of an InferenceCache's ``spec.admission`` (absent or disabled: none)."""
    if not isinstance(spec, Mapping) or spec.get("enabled") is False:
        return ()
    flags = [("admission", "true")]
    flags += [(flag, str(spec[key])) for key, flag in _ADMISSION_FLAGS.items() if key in spec]
    return tuple(flags)


def requested_cache(pod: Mapping[str, Any]) -> str | None:
    """The InferenceCache name a Pod asks for, or None if it asks for no sidecar."""
    meta = pod.get("metadata") or {}
    name = (meta.get("labels") or {}).get(CACHE_LABEL)
    if not name:
        return None
    if str((meta.get("annotations") or {}).get(INJECT_ANNOTATION, "")).lower() in _FALSY:
        return None
    return str(name)


def already_injected(pod: Mapping[str, Any]) -> bool:
    """True if the Pod already carries the sidecar (re-invocation, or an applied manifest)."""
    meta = pod.get("metadata") or {}
    if INJECTED_ANNOTATION in (meta.get("annotations") or {}):
        return True
    containers = (pod.get("spec") or {}).get("containers") or []
    return any(c.get("name") == SIDECAR_NAME for c in containers)


def _env(flag: str, value: str) -> dict[str, Any]:
    return {"name": ENV_PREFIX + flag.upper().replace("-", "_"), "value": value}


def sidecar_container(
    cache: CacheInfo,
    settings: SidecarSettings,
    *,
    upstream: str | None = None,
    api_keys_secret: str | None = None,
) -> dict[str, Any]:
    """The sidecar container of a Pod that belongs to ``cache``."""
    env: list[dict[str, Any]] = [
        _env("cache", cache.ref),
        _env("listen", f"0.0.0.0:{settings.proxy_port}"),
        _env("admin-listen", f"0.0.0.0:{settings.admin_port}"),
        _env("upstream", upstream or settings.upstream),
        _env("tenant-header", settings.tenant_header),
        _env("log-level", settings.log_level),
        {
            "name": ENV_PREFIX + "POD",
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
        },
    ]
    if settings.default_tenant:
        env.append(_env("default-tenant", settings.default_tenant))
    if settings.trusted_proxies:
        env.append(_env("trusted-proxies", settings.trusted_proxies))
    if cache.redis_secret is not None:
        secret, key = cache.redis_secret
        env.append(
            {
                "name": ENV_PREFIX + "REDIS_URL",
                "valueFrom": {"secretKeyRef": {"name": secret, "key": key}},
            }
        )
    elif cache.redis_url:
        env.append(_env("redis-url", cache.redis_url))
    if cache.model_version:
        env.append(_env("model-version", cache.model_version))
    if cache.l1_bytes_per_pod is not None:
        env.append(_env("l1-bytes", str(cache.l1_bytes_per_pod)))
    if cache.policy:
        env.append(_env("policy", cache.policy))
    if cache.outage_staleness_s:
        env.append(_env("redis-outage-staleness", str(cache.outage_staleness_s)))
    env.extend(_env(flag, value) for flag, value in cache.admission)
    if cache.upstream_max_connections is not None:
        env.append(_env("upstream-max-connections", str(cache.upstream_max_connections)))
    if cache.upstream_max_queued is not None:
        env.append(_env("upstream-max-queued", str(cache.upstream_max_queued)))
    env.extend(_env(flag, value) for flag, value in cache.cache_flags)
    env.append(_env("fleet-sample-rate", repr(cache.fleet_sample_rate)))
    if api_keys_secret:
        env.append(_env("api-keys-file", f"{API_KEYS_DIR}/{API_KEYS_FILE}"))
    set_names = {e["name"] for e in env}
    env.extend(
        {"name": k, "value": v} for k, v in sorted(settings.env.items()) if k not in set_names
    )

    def probe(path: str, failures: int) -> dict[str, Any]:
        return {
            "httpGet": {"path": path, "port": ADMIN_PORT_NAME},
            "initialDelaySeconds": STARTUP_GRACE_S,
            "periodSeconds": PROBE_PERIOD_S,
            "timeoutSeconds": PROBE_TIMEOUT_S,
            "failureThreshold": failures,
        }

    mounts = [{"name": API_KEYS_VOLUME, "mountPath": API_KEYS_DIR, "readOnly": True}]
    return {
        "name": SIDECAR_NAME,
        **({"volumeMounts": mounts} if api_keys_secret else {}),
        "image": settings.image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["cachefleet", "sidecar"],
        "env": env,
        "ports": [
            {"name": PROXY_PORT_NAME, "containerPort": settings.proxy_port, "protocol": "TCP"},
            {"name": ADMIN_PORT_NAME, "containerPort": settings.admin_port, "protocol": "TCP"},
        ],
        "livenessProbe": probe("/healthz", LIVENESS_FAILURE_THRESHOLD),
        "readinessProbe": probe("/readyz", READINESS_FAILURE_THRESHOLD),
        "resources": settings.resources.model_dump(),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "runAsUser": settings.run_as_user,
            "runAsGroup": settings.run_as_user,
            "capabilities": {"drop": ["ALL"]},
        },
    }


def _check_ports(pod: Mapping[str, Any], settings: SidecarSettings) -> None:
    ours = {settings.proxy_port: PROXY_PORT_NAME, settings.admin_port: ADMIN_PORT_NAME}
    if len(ours) < 2:
        raise InjectionError("cachefleet: sidecar proxyPort and adminPort must differ")
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("containerPort") in ours:
                raise InjectionError(
                    f"cachefleet: container {container.get('name')!r} already uses port "
                    f"{port['containerPort']}, which the sidecar needs for "
                    f"{ours[port['containerPort']]}; change the sidecar ports in the chart values"
                )
            if port.get("name") in ours.values():
                raise InjectionError(
                    f"cachefleet: container {container.get('name')!r} already has a port "
                    f"named {port['name']!r}, which the sidecar needs"
                )


def _escape(key: str) -> str:
    """A map key as one JSON-pointer token (RFC 6901)."""
    return key.replace("~", "~0").replace("/", "~1")


def injection_patch(
    pod: Mapping[str, Any],
    namespace: str,
    settings: SidecarSettings,
    cache: CacheInfo | None = None,
) -> list[dict[str, Any]]:
    """JSON-patch ops (RFC 6902) that add the sidecar to ``pod``; ``[]`` when none is due.

    ``namespace`` is the Pod's namespace (from the admission request: a Pod
    being created may not carry it yet). ``cache`` is the InferenceCache
    named by the label when the caller could read it; without it the sidecar
    still runs (L1 only, until the cache exists and the Pod is recreated).
    """
    name = requested_cache(pod)
    if name is None or already_injected(pod):
        return []
    if not _NAME_RE.match(name):
        raise InjectionError(f"cachefleet: label {CACHE_LABEL}={name!r} is not a valid name")
    _check_ports(pod, settings)
    if cache is None or (cache.namespace, cache.name) != (namespace, name):
        cache = CacheInfo(namespace=namespace, name=name)
    annotations = (pod.get("metadata") or {}).get("annotations")
    upstream = (annotations or {}).get(UPSTREAM_ANNOTATION) or None
    keys_secret = (annotations or {}).get(API_KEYS_ANNOTATION) or None
    if keys_secret is not None and not _NAME_RE.match(str(keys_secret)):
        raise InjectionError(
            f"cachefleet: annotation {API_KEYS_ANNOTATION}={keys_secret!r} is not a Secret name"
        )
    ops: list[dict[str, Any]] = [
        {
            "op": "add",
            "path": "/spec/containers/-",
            "value": sidecar_container(
                cache, settings, upstream=upstream, api_keys_secret=keys_secret
            ),
        }
    ]
    if keys_secret is not None:
        volume = {
            "name": API_KEYS_VOLUME,
            "secret": {
                "secretName": keys_secret,
                "items": [{"key": API_KEYS_FILE, "path": API_KEYS_FILE}],
            },
        }
        if (pod.get("spec") or {}).get("volumes") is None:
            ops.append({"op": "add", "path": "/spec/volumes", "value": [volume]})
        else:
            ops.append({"op": "add", "path": "/spec/volumes/-", "value": volume})
    if annotations is None:
        ops.append(
            {
                "op": "add",
                "path": "/metadata/annotations",
                "value": {INJECTED_ANNOTATION: cache.ref},
            }
        )
    else:
        ops.append(
            {
                "op": "add",
                "path": f"/metadata/annotations/{_escape(INJECTED_ANNOTATION)}",
                "value": cache.ref,
            }
        )
    return ops
