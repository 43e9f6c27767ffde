"""What every CRD model shares: the group and version, the bounds and CEL rules, the
base models (strict specs, lenient status) and :class:`SpecError`."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.alias_generators import to_camel

from cachefleet_common.contract.names import NAME_RE

GROUP = "cachefleet.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

#: The most tenants one InferenceCache may list (bounds CEL cost and object size).
MAX_TENANTS = 1000
#: Largest fairness weight of a tenant (the sidecar's queue takes weights within its bounds).
MAX_FAIRNESS_WEIGHT = 1000.0
#: Most entries of spec.objectives.
MAX_OBJECTIVES = 256
#: Fraction of each pod's L1 that all unlisted tenants share when tenantDefaults does not say.
DEFAULT_UNLISTED_SHARE = 0.1
#: The most models spec.savings.prices may price (the table travels in an env variable).
MAX_PRICES = 256
#: The most of each pod's L1 tenantDefaults may set aside (the --guest-share bound).
MAX_UNLISTED_SHARE = 0.9
#: Fraction of the fleet's L2 bytes all unlisted tenants share when the spec says none.
DEFAULT_UNLISTED_L2_SHARE = 0.1
#: Shortest rebalance interval a spec may ask for, seconds.
MIN_REBALANCE_INTERVAL_S = 1
#: Rebalance interval when the spec does not say, seconds.
DEFAULT_REBALANCE_INTERVAL_S = 30
#: Prometheus query timeout when the spec does not say, seconds.
DEFAULT_PROMETHEUS_TIMEOUT_S = 5.0
#: Rate window of the PromQL queries when the spec does not say.
DEFAULT_METRICS_WINDOW = "2m"
#: Window of the reuse-distance (miss-ratio curve) query when the spec does not say:
#: longer than the rate window, so reuse at long distances (minutes apart) is seen.
DEFAULT_CURVE_WINDOW = "10m"
#: Invalidation acknowledgement timeout when the spec does not say, seconds.
DEFAULT_INVALIDATION_TIMEOUT_S = 60

_NAME_PATTERN = NAME_RE.pattern
_DURATION_PATTERN = r"^[1-9][0-9]*(s|m|h)$"

GUARANTEED_SUM_RULE = (
    "!has(self.tenants) || self.tenants.filter(t, has(t.priorityClass) && "
    "t.priorityClass == 'Guaranteed').map(t, has(t.minShare) ? t.minShare : 0.0).sum() <= 1.0"
)
GUARANTEED_SUM_MESSAGE = "the minShare of all Guaranteed tenants must sum to at most 1"
ALL_MIN_SUM_RULE = (
    "!has(self.tenants) || self.tenants.map(t, has(t.minShare) ? t.minShare : 0.0).sum() <= 1.0"
)
ALL_MIN_SUM_MESSAGE = "the minShare of all tenants must sum to at most 1"
MIN_MAX_RULE = "!has(self.minShare) || !has(self.maxShare) || self.minShare <= self.maxShare"
MIN_MAX_MESSAGE = "minShare must not exceed maxShare"
BEST_EFFORT_RULE = (
    "!has(self.priorityClass) || self.priorityClass != 'BestEffort' || !has(self.minShare) "
    "|| self.minShare == 0.0"
)
BEST_EFFORT_MESSAGE = "a BestEffort tenant has no floor: minShare must be 0"
REDIS_ONE_OF_RULE = "has(self.url) != has(self.secretRef)"
REDIS_ONE_OF_MESSAGE = "set exactly one of url and secretRef"
POOL_REF_RULE = "!has(self.inferencePoolRef) || (has(self.enabled) && self.enabled)"
POOL_REF_MESSAGE = "inferencePoolRef needs enabled: true"
NAMESPACE_SCOPE_RULE = "self.type != 'Namespace' || (has(self.tenant) && has(self.namespace))"
NAMESPACE_SCOPE_MESSAGE = "scope Namespace needs tenant and namespace"
KEY_SCOPE_RULE = "self.type != 'Key' || has(self.key)"
KEY_SCOPE_MESSAGE = "scope Key needs key (the X-Cache-Key of a hit)"
#: A key purge names an entry by the SHA-256 hex digest of its key (X-Cache-Key).
KEY_DIGEST_PATTERN = r"^[0-9a-f]{64}$"
#: An HTTP header name (a token).
HEADER_NAME_PATTERN = r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}$"
IMMUTABLE_RULE = "self == oldSelf"
IMMUTABLE_MESSAGE = "a CacheInvalidation is one-shot: its spec is immutable"


def _cel(rule: str, message: str, field_path: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"rule": rule, "message": message}
    if field_path is not None:
        out["fieldPath"] = field_path
    return out


class SpecError(ValueError):
    """A spec the operator cannot act on; ``field`` is its path, e.g. ``spec.tenants[1]``."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class _Model(BaseModel):
    # extra="forbid": an unknown field in a spec is an error naming it, as the API
    # server's strict field validation (kubectl's default) makes it. Status models
    # and the whole-object models ignore extras (kopf keeps its own state there).
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        use_enum_values=False,
    )

    def wire(self) -> dict[str, Any]:
        """The object as Kubernetes stores it (camelCase, ``None`` fields left out)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class _Observed(_Model):
    """Status and whole objects: fields this version does not know are ignored."""

    model_config = ConfigDict(extra="ignore")


def _loc(loc: tuple[int | str, ...], root: str) -> str:
    out = root
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part and not part.startswith("function-") and part != "__root__":
            out += f".{part}"
    return out


def _spec_error(exc: ValidationError) -> SpecError:
    errors = exc.errors()
    # an unknown field first: that is what the API server reports for such an object
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    field = _loc(tuple(first["loc"]), "spec")
    if first["type"] == "extra_forbidden":
        return SpecError(field, "unknown field")
    return SpecError(field, str(first["msg"]).removeprefix("Value error, "))
