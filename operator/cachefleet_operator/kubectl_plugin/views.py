"""What ``kubectl cachefleet status``, ``top`` and ``invalidate`` show (pure).

Objects come in as the Kubernetes API returns them (plain dicts); the
InferenceCache and CacheInvalidation status is read with the models of
:mod:`cachefleet_operator.api`, so a field means here what the operator
means when it writes it. Heartbeats and acknowledgements come in already
joined by the adapter (:class:`SidecarSeen`). Out come tables (the kubectl
look: upper-case headers, columns padded) and documents for ``-o json|yaml``.

Savings: a tenant's ``savings`` mapping in the status (and the cache's
``status.savings``) is shown as it is, one column per number, and only when
the status has it. Rate limits: a tenant's ``limits`` (usage against each
limit, fleet-wide, as the operator last read it) is one LIMITS column,
``req/min 87/120, tok/min 4.1k/10k``, only when some tenant has limits.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import ValidationError

from cachefleet_common import epochs
from cachefleet_operator.api import (
    CacheInvalidationStatus,
    InferenceCacheStatus,
    InvalidationPhase,
    SpecError,
    TenantStatus,
    parse_spec,
    unlisted_l1_bytes,
    unlisted_l2_bytes,
)
from cachefleet_operator.outcome import parse_rfc3339

#: What a missing value looks like in a table.
NONE = "-"


# ----------------------------------------------------------------- helpers


def human_bytes(n: int | None) -> str:
    """``1536`` -> ``1.5Ki`` (binary units, as Kubernetes quantities)."""
    if n is None:
        return NONE
    value = float(n)
    for unit in ("", "Ki", "Mi", "Gi", "Ti"):
        if abs(value) < 1024 or unit == "Ti":
            if unit == "":
                return f"{int(value)}"
            return f"{value:.1f}{unit}".replace(".0" + unit, unit)
        value /= 1024
    raise AssertionError("unreachable")


def human_count(n: int | None) -> str:
    """``4100`` -> ``4.1k``, ``10000`` -> ``10k``, ``1000000`` -> ``1M`` (decimal units:
    requests and tokens)."""
    if n is None:
        return NONE
    value = float(n)
    if abs(value) < 1000:
        return f"{int(value)}"
    for unit in ("k", "M", "G", "T"):
        value /= 1000
        text = f"{value:.1f}" if abs(value) < 9.95 else f"{value:.0f}"
        if abs(float(text)) < 1000 or unit == "T":
            return text.removesuffix(".0") + unit
    raise AssertionError("unreachable")


def human_age(seconds: float | None) -> str:
    """``75`` -> ``1m15s``, as kubectl prints ages."""
    if seconds is None:
        return NONE
    s = max(0, int(seconds))
    if s < 120:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60}s" if s % 60 else f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60}m"
    return f"{s // 86400}d"


def _number(value: float) -> str:
    if float(value).is_integer():
        return f"{int(value)}"
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}"


def _ratio(value: float | None) -> str:
    return NONE if value is None else f"{value:.2f}"


def _percent(value: float | None) -> str:
    return NONE if value is None else f"{value * 100:.1f}%"


def table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """Columns padded to their widest cell, three spaces apart (kubectl's look)."""
    body = [list(headers), *[list(r) for r in rows]]
    widths = [max(len(r[i]) for r in body) for i in range(len(headers))]
    lines = ["   ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in body]
    return "\n".join(lines) + "\n"


def _words(camel: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", " ", camel).upper()


def _numbers(raw: Any) -> dict[str, float]:
    """The numeric members of a ``savings`` mapping (anything else is not shown)."""
    if not isinstance(raw, Mapping):
        return {}
    return {
        str(k): float(v)
        for k, v in raw.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }


def _meta(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


# ------------------------------------------------------------ invalidations


@dataclass(frozen=True, slots=True)
class InvalidationView:
    """One CacheInvalidation as the user sees it."""

    namespace: str
    name: str
    cache: str
    scope: str
    phase: str
    epoch: int | None
    acks: int | None
    expected_acks: int | None
    propagation_seconds: float | None
    lagging_pods: list[str]
    message: str
    created: str

    @property
    def done(self) -> bool:
        return self.phase in (InvalidationPhase.COMPLETED.value, InvalidationPhase.FAILED.value)


def scope_text(spec_scope: Mapping[str, Any]) -> str:
    """A CacheInvalidation's ``spec.scope`` in a few words.

    The epoch scope's name where it has one (``cache``, ``tenant:a``,
    ``model:m``, ``namespace:a/kb``, named by the sidecar's own
    :mod:`cachefleet_common.epochs`); a Key purge by its digest, whole, so it
    can be searched for or pasted (``purge of key 3fa9...``, ``in tenant a``
    when it names one).
    """
    kind = str(spec_scope.get("type") or "")
    tenant = str(spec_scope.get("tenant") or "")
    if kind == "Tenant":
        return epochs.tenant_scope(tenant)
    if kind == "Model":
        return epochs.model_scope(str(spec_scope.get("model") or ""))
    if kind == "Namespace":
        return epochs.namespace_scope(tenant, str(spec_scope.get("namespace") or ""))
    if kind == "Key":
        text = f"purge of key {spec_scope.get('key') or NONE}"
        return f"{text} in tenant {tenant}" if tenant else text
    return kind.lower() or NONE


def invalidation_view(obj: Mapping[str, Any]) -> InvalidationView:
    namespace, name = _meta(obj)
    spec = obj.get("spec") or {}
    raw = obj.get("status") or {}
    try:
        status = CacheInvalidationStatus.model_validate(raw)
    except ValidationError:
        status = CacheInvalidationStatus(message="status unreadable by this version of the plugin")
    return InvalidationView(
        namespace=namespace,
        name=name,
        cache=str((spec.get("cacheRef") or {}).get("name") or ""),
        scope=scope_text(spec.get("scope") or {}),
        phase=status.phase.value if status.phase is not None else InvalidationPhase.PENDING.value,
        epoch=status.epoch,
        acks=status.acks,
        expected_acks=status.expected_acks,
        propagation_seconds=status.propagation_seconds,
        lagging_pods=list(status.lagging_pods or []),
        message=status.message or "",
        created=str((obj.get("metadata") or {}).get("creationTimestamp") or ""),
    )


def progress_line(view: InvalidationView) -> str:
    """One progress line of ``invalidate --wait`` (printed when it changes)."""
    parts = [f"{view.name}: {view.phase}"]
    if view.epoch is not None:
        parts.append(f"epoch {view.epoch}")
    if view.expected_acks is not None:
        parts.append(f"{view.acks or 0}/{view.expected_acks} sidecars acknowledged")
    line = ", ".join(parts)
    if view.message:
        line += f": {view.message}"
    if view.lagging_pods:
        line += f" (lagging pods: {', '.join(view.lagging_pods)})"
    return line


def invalidation_summary(view: InvalidationView) -> str:
    """The last invalidation of a cache in one line (for ``status``)."""
    line = f"{view.name} {view.phase} ({view.scope}"
    if view.epoch is not None:
        line += f", epoch {view.epoch}"
    if view.expected_acks is not None:
        line += f", {view.acks or 0}/{view.expected_acks} acks"
    if view.propagation_seconds is not None:
        line += f", {view.propagation_seconds * 1000:.1f} ms"
    line += ")"
    if view.lagging_pods:
        line += f"; lagging pods: {', '.join(view.lagging_pods)}"
    return line


# ------------------------------------------------------------------- status


@dataclass(frozen=True, slots=True)
class TenantRow:
    name: str
    priority_class: str
    share: float
    weight: float
    l1_bytes: int
    l2_bytes: int
    hit_ratio: float | None
    p95_seconds: float | None
    rps: float | None
    sla_met: bool | None
    reason: str
    savings: dict[str, float] = field(default_factory=dict)
    #: Usage against each stated limit (``status.tenants[].limits``), in spec order.
    limits: list[LimitCell] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class LimitCell:
    """One of a tenant's limits and its usage, fleet-wide, at the last reconcile."""

    #: The spec's field: ``requestsPerMinute``, ``tokensPerMinute``, ``tokensPerDay``.
    limit_name: str
    limit: int
    used: int
    remaining: int
    reset_seconds: float


#: How the LIMITS column names each limit.
LIMIT_LABELS = {
    "requestsPerMinute": "req/min",
    "tokensPerMinute": "tok/min",
    "tokensPerDay": "tok/day",
}


def limits_text(cells: Sequence[LimitCell]) -> str:
    """The LIMITS cell: ``req/min 87/120, tok/min 4.1k/10k, tok/day 12k/1M`` (used/limit)."""
    if not cells:
        return NONE
    return ", ".join(
        f"{LIMIT_LABELS[c.limit_name]} {human_count(c.used)}/{human_count(c.limit)}" for c in cells
    )


def _limit_cells(status: TenantStatus) -> list[LimitCell]:
    usage = status.limits
    if usage is None:
        return []
    cells = []
    for name, part in (
        ("requestsPerMinute", usage.requests_per_minute),
        ("tokensPerMinute", usage.tokens_per_minute),
        ("tokensPerDay", usage.tokens_per_day),
    ):
        if part is not None:
            cells.append(LimitCell(name, part.limit, part.used, part.remaining, part.reset_seconds))
    return cells


@dataclass(frozen=True, slots=True)
class UnlistedView:
    """``spec.tenantDefaults``: the pools of the tenants the spec does not list."""

    #: Each pod's L1 bytes for all of them, and that as a fraction of the pod's L1.
    l1_bytes: int
    l1_share: float
    #: The fleet's L2 bytes for all of them (0: they stay in L1), and that as a fraction.
    l2_bytes: int
    l2_share: float
    #: The most of the L2 pool one of them may hold.
    l2_guest_max_share: float
    priority_class: str
    #: Their L1 policy (None: the cache's default).
    policy: str | None


def unlisted_view(spec: Mapping[str, Any]) -> UnlistedView | None:
    """The unlisted tenants' pools of a spec (None: no tenantDefaults, or a spec this
    version of the plugin cannot read)."""
    if not spec.get("tenantDefaults"):
        return None
    try:
        parsed = parse_spec(dict(spec))
    except SpecError:
        return None
    defaults = parsed.tenant_defaults
    if defaults is None:
        return None
    l1, l2 = unlisted_l1_bytes(parsed), unlisted_l2_bytes(parsed)
    return UnlistedView(
        l1_bytes=l1,
        l1_share=l1 / max(1, parsed.capacity.l1_bytes_per_pod),
        l2_bytes=l2,
        l2_share=l2 / max(1, parsed.capacity.l2_bytes),
        l2_guest_max_share=defaults.l2_guest_max_share,
        priority_class=defaults.priority_class,
        policy=None if defaults.policy is None else defaults.policy.value,
    )


def unlisted_text(u: UnlistedView) -> str:
    """The ``unlisted:`` line of ``status``."""
    l2 = (
        f"L2 {_percent(u.l2_share)} ({human_bytes(u.l2_bytes)}; one tenant at most"
        f" {_percent(u.l2_guest_max_share)} of it)"
        if u.l2_bytes
        else "no L2 (they stay in L1)"
    )
    return (
        f"L1 {_percent(u.l1_share)} of each pod ({human_bytes(u.l1_bytes)}), {l2},"
        f" {u.priority_class}, policy {u.policy or 'the cache default'}"
    )


@dataclass(frozen=True, slots=True)
class CacheView:
    """One InferenceCache's status, as ``status`` shows it."""

    namespace: str
    name: str
    model: str
    model_version: str
    reconciled: bool
    quota_generation: int | None
    last_rebalance: str | None
    sla_attainment: str | None
    sidecars_seen: int | None
    sidecars_in_sync: int | None
    sidecars_epochs_in_sync: int | None
    epochs: dict[str, int]
    conditions: list[dict[str, str]]
    tenants: list[TenantRow]
    savings: dict[str, float]
    last_invalidation: InvalidationView | None
    problem: str | None = None
    #: spec.tenantDefaults (None: unlisted tenants are refused).
    unlisted: UnlistedView | None = None

    @property
    def lagging_quotas(self) -> int | None:
        if self.sidecars_seen is None or self.sidecars_in_sync is None:
            return None
        return self.sidecars_seen - self.sidecars_in_sync

    @property
    def lagging_epochs(self) -> int | None:
        if self.sidecars_seen is None or self.sidecars_epochs_in_sync is None:
            return None
        return self.sidecars_seen - self.sidecars_epochs_in_sync


def _last_for(
    namespace: str, name: str, invalidations: Iterable[Mapping[str, Any]]
) -> InvalidationView | None:
    views = [
        v
        for v in (invalidation_view(o) for o in invalidations)
        if v.cache == name and v.namespace == namespace
    ]
    if not views:
        return None
    return max(views, key=lambda v: (parse_rfc3339(v.created) or 0.0, v.name))


def cache_view(
    obj: Mapping[str, Any], invalidations: Iterable[Mapping[str, Any]] = ()
) -> CacheView:
    """The view of one InferenceCache; ``invalidations`` may hold any namespace's."""
    namespace, name = _meta(obj)
    spec = obj.get("spec") or {}
    model = spec.get("model") or {}
    raw = obj.get("status") or {}
    problem = None
    try:
        status = InferenceCacheStatus.model_validate(raw)
    except ValidationError as exc:
        status = InferenceCacheStatus()
        problem = f"status unreadable by this version of the plugin: {exc.error_count()} error(s)"
    raw_tenants = {str(t.get("name")): t for t in raw.get("tenants") or [] if isinstance(t, dict)}
    tenants = [
        TenantRow(
            name=t.name,
            priority_class=t.priority_class.value,
            share=t.share,
            weight=t.weight,
            l1_bytes=t.l1_bytes,
            l2_bytes=t.l2_bytes,
            hit_ratio=t.observed.hit_ratio if t.observed else None,
            p95_seconds=t.observed.p95_seconds if t.observed else None,
            rps=t.observed.rps if t.observed else None,
            sla_met=t.sla_met,
            reason=t.reason,
            savings=_numbers(raw_tenants.get(t.name, {}).get("savings")),
            limits=_limit_cells(t),
        )
        for t in status.tenants or []
    ]
    sidecars = status.sidecars
    return CacheView(
        namespace=namespace,
        name=name,
        model=str(model.get("name") or ""),
        model_version=str(model.get("version") or ""),
        reconciled=bool(raw),
        quota_generation=status.quota_generation,
        last_rebalance=status.last_rebalance_time,
        sla_attainment=status.sla_attainment,
        sidecars_seen=sidecars.seen if sidecars else None,
        sidecars_in_sync=sidecars.in_sync if sidecars else None,
        sidecars_epochs_in_sync=sidecars.epochs_in_sync if sidecars else None,
        epochs=dict(status.epochs or {}),
        conditions=[
            {
                "type": c.type,
                "status": c.status.value,
                "reason": c.reason,
                "message": c.message,
            }
            for c in status.conditions or []
        ],
        tenants=tenants,
        savings=_numbers(raw.get("savings")),
        last_invalidation=_last_for(namespace, name, invalidations),
        problem=problem,
        unlisted=unlisted_view(spec),
    )


def _sla(met: bool | None) -> str:
    return NONE if met is None else ("met" if met else "MISSED")


def _savings_columns(views: Sequence[CacheView]) -> list[str]:
    names: list[str] = []
    for v in views:
        for t in v.tenants:
            names += [k for k in t.savings if k not in names]
    return names


def tenant_table(view: CacheView, wide: bool = False) -> str:
    """The per-tenant table of ``status``; savings and limits columns only when the
    status has them."""
    saved = _savings_columns([view])
    limited = any(t.limits for t in view.tenants)
    headers = ["TENANT", "CLASS", "SHARE", "L1/POD", "L2", "HIT RATIO", "SLA"]
    if wide:
        headers[5:5] = ["WEIGHT"]
        headers += ["P95", "RPS"]
    if limited:
        headers.append("LIMITS (USED/LIMIT)")
    headers += [f"SAVED {_words(k)}" for k in saved]
    if wide:
        headers.append("REASON")
    rows = []
    for t in view.tenants:
        row = [
            t.name,
            t.priority_class,
            _percent(t.share),
            human_bytes(t.l1_bytes),
            human_bytes(t.l2_bytes),
            _ratio(t.hit_ratio),
            _sla(t.sla_met),
        ]
        if wide:
            row[5:5] = [f"{t.weight:.3g}"]
            row += [
                NONE if t.p95_seconds is None else f"{t.p95_seconds:.3f}s",
                NONE if t.rps is None else f"{t.rps:.1f}",
            ]
        if limited:
            row.append(limits_text(t.limits))
        row += [_number(t.savings[k]) if k in t.savings else NONE for k in saved]
        if wide:
            row.append(t.reason)
        rows.append(row)
    return table(headers, rows)


def _lagging_text(view: CacheView) -> str:
    parts = []
    if view.lagging_quotas is not None:
        parts.append(
            f"{view.lagging_quotas} behind quota generation {view.quota_generation}"
            if view.lagging_quotas
            else "none behind the quotas"
        )
    if view.lagging_epochs is not None:
        parts.append(
            f"{view.lagging_epochs} behind the epochs"
            if view.lagging_epochs
            else "none behind the epochs"
        )
    return "; ".join(parts) or NONE


def render_status(views: Sequence[CacheView], now: float, wide: bool = False) -> str:
    """``kubectl cachefleet status``: one block per InferenceCache."""
    blocks = []
    for v in views:
        lines = [
            f"InferenceCache {v.namespace}/{v.name}  model {v.model} {v.model_version}".rstrip()
        ]
        if v.problem:
            lines.append(f"  warning:      {v.problem}")
        if not v.reconciled:
            lines.append(
                "  status:       none yet (is the operator running and watching this namespace?)"
            )
            blocks.append("\n".join(lines) + "\n")
            continue
        rebalanced = parse_rfc3339(v.last_rebalance)
        age = human_age(now - rebalanced) + " ago" if rebalanced is not None else NONE
        for c in v.conditions:
            lines.append(
                f"  {c['type'] + ':':<13} {c['status']} ({c['reason']})"
                + (f": {c['message']}" if c["message"] and (wide or c["status"] != "False") else "")
            )
        generation = NONE if v.quota_generation is None else str(v.quota_generation)
        lines += [
            f"  quotas:       generation {generation}, rebalanced {age}",
            f"  SLA:          {v.sla_attainment or NONE} tenants meet their SLA",
        ]
        if v.unlisted is not None:
            lines.append(f"  unlisted:     {unlisted_text(v.unlisted)}")
        if v.sidecars_seen is not None:
            lines.append(
                f"  sidecars:     {v.sidecars_seen} live,"
                f" {v.sidecars_in_sync} in sync with the quotas"
                + (
                    f", {v.sidecars_epochs_in_sync} with the epochs"
                    if v.sidecars_epochs_in_sync is not None
                    else ""
                )
            )
            lines.append(f"  lagging:      {_lagging_text(v)}")
        if v.epochs:
            lines.append(
                "  epochs:       " + " ".join(f"{k}={e}" for k, e in sorted(v.epochs.items()))
            )
        if v.savings:
            lines.append(
                "  savings:      " + " ".join(f"{k}={_number(x)}" for k, x in v.savings.items())
            )
        if v.last_invalidation is not None:
            lines.append(f"  invalidation: {invalidation_summary(v.last_invalidation)}")
        if v.tenants:
            lines.append("")
            lines += ["  " + row for row in tenant_table(v, wide).splitlines()]
        blocks.append("\n".join(lines) + "\n")
    return "\n".join(blocks)


def status_document(views: Sequence[CacheView]) -> dict[str, Any]:
    """``status -o json|yaml``: the same facts, machine-readable."""
    items = []
    for v in views:
        doc = asdict(v)
        doc["lagging"] = {"quotas": v.lagging_quotas, "epochs": v.lagging_epochs}
        if not v.savings:
            doc.pop("savings")
        for t in doc["tenants"]:
            if not t["savings"]:
                t.pop("savings")
            if not t["limits"]:
                t.pop("limits")
        items.append(doc)
    return {"kind": "InferenceCacheStatusList", "items": items}


# ---------------------------------------------------------------------- top


@dataclass(frozen=True, slots=True)
class PodInfo:
    """What the Kubernetes API says about one pod."""

    name: str
    phase: str
    ready: str
    restarts: int
    node: str


@dataclass(frozen=True, slots=True)
class SidecarSeen:
    """What Redis says about one sidecar: its heartbeat joined with its acknowledgement."""

    pod: str
    quota_generation: int
    policy_by_tenant: dict[str, str]
    redis_ok: bool
    heartbeat_at: float
    #: Whether it acknowledged every epoch in the cache's status (None: no epochs there).
    epochs_acked: bool | None
    #: Unlisted tenants holding a partition there, by policy (counted, not named).
    unlisted_by_policy: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PodRow:
    pod: str
    phase: str
    ready: str
    restarts: int | None
    node: str
    heartbeat_age_s: float | None
    quota_generation: int | None
    quotas: str
    epochs: str
    redis: str
    policies: dict[str, str]
    #: Unlisted tenants with a partition on the pod, by policy.
    unlisted: dict[str, int] = field(default_factory=dict)


def pod_info(pod: Mapping[str, Any]) -> PodInfo:
    """A pod as the API returns it -> :class:`PodInfo`."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    containers = spec.get("containers") or []
    statuses = status.get("containerStatuses") or []
    ready = sum(1 for s in statuses if s.get("ready"))
    restarts = sum(int(s.get("restartCount") or 0) for s in statuses)
    return PodInfo(
        name=str(meta.get("name") or ""),
        phase=str(status.get("phase") or "Unknown"),
        ready=f"{ready}/{len(containers)}",
        restarts=restarts,
        node=str(spec.get("nodeName") or NONE),
    )


def pod_rows(
    pods: Sequence[PodInfo] | None,
    sidecars: Sequence[SidecarSeen] | None,
    quota_generation: int | None,
    now: float,
) -> list[PodRow]:
    """Pods (Kubernetes) joined with sidecars (Redis) by pod name.

    ``None`` for either side means that source could not be read: its columns
    say ``?``; a pod without a live heartbeat says ``no heartbeat``.
    """
    by_pod = {s.pod: s for s in sidecars or []}
    known = {p.name: p for p in pods or []}
    names = sorted(set(known) | set(by_pod))
    rows = []
    for name in names:
        p = known.get(name)
        s = by_pod.get(name)
        if sidecars is None:
            quotas = epochs = redis = "?"
        elif s is None:
            quotas, epochs, redis = "no heartbeat", NONE, NONE
        else:
            if quota_generation is None:
                quotas = f"gen {s.quota_generation}"
            elif s.quota_generation >= quota_generation:
                quotas = f"gen {s.quota_generation} in sync"
            else:
                quotas = f"gen {s.quota_generation} LAGGING (want {quota_generation})"
            epochs = NONE if s.epochs_acked is None else ("acked" if s.epochs_acked else "LAGGING")
            redis = "ok" if s.redis_ok else "DOWN"
        if pods is None:
            phase, ready, restarts, node = "?", "?", None, "?"
        elif p is None:
            phase, ready, restarts, node = "not matched", NONE, None, NONE
        else:
            phase, ready, restarts, node = p.phase, p.ready, p.restarts, p.node
        rows.append(
            PodRow(
                pod=name,
                phase=phase,
                ready=ready,
                restarts=restarts,
                node=node,
                heartbeat_age_s=None if s is None else max(0.0, now - s.heartbeat_at),
                quota_generation=None if s is None else s.quota_generation,
                quotas=quotas,
                epochs=epochs,
                redis=redis,
                policies=dict(sorted(s.policy_by_tenant.items())) if s else {},
                unlisted=dict(sorted(s.unlisted_by_policy.items())) if s else {},
            )
        )
    return rows


def render_top(rows: Sequence[PodRow], wide: bool = False) -> str:
    """``kubectl cachefleet top``: one row per pod."""
    headers = ["POD", "READY", "STATUS", "HEARTBEAT", "QUOTAS", "EPOCHS", "REDIS", "POLICIES"]
    # unlisted tenants (tenantDefaults): a count per pod, only where some pod has them
    unlisted = any(r.unlisted for r in rows)
    if unlisted:
        headers.append("UNLISTED")
    if wide:
        headers[3:3] = ["RESTARTS", "NODE"]
    out = []
    for r in rows:
        policies = ",".join(f"{t}={p}" for t, p in r.policies.items()) or NONE
        heartbeat = NONE if r.heartbeat_age_s is None else human_age(r.heartbeat_age_s) + " ago"
        row = [r.pod, r.ready, r.phase, heartbeat, r.quotas, r.epochs, r.redis, policies]
        if unlisted:
            row.append(_unlisted_counts(r.unlisted))
        if wide:
            row[3:3] = [NONE if r.restarts is None else str(r.restarts), r.node]
        out.append(row)
    return table(headers, out)


def _unlisted_counts(by_policy: Mapping[str, int]) -> str:
    """``12 (sits=10,lru=2)``: how many unlisted tenants, by policy."""
    total = sum(by_policy.values())
    if not total:
        return NONE
    return f"{total} (" + ",".join(f"{p}={n}" for p, n in by_policy.items()) + ")"


def top_document(
    namespace: str, name: str, rows: Sequence[PodRow], sources: Mapping[str, str]
) -> dict[str, Any]:
    """``top -o json|yaml``."""
    return {
        "kind": "InferenceCachePods",
        "namespace": namespace,
        "name": name,
        "sources": dict(sources),
        "pods": [asdict(r) for r in rows],
    }
