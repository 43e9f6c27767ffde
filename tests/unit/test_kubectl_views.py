"""``kubectl cachefleet`` output from status dicts: the columns and values a user reads.

Statuses are built with the operator's own status models (``api.py``), so a
field renamed there breaks these tests rather than the plugin in a cluster.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from cachefleet_operator.allocation import PriorityClass
from cachefleet_operator.api import (
    Condition,
    ConditionStatus,
    InferenceCacheStatus,
    ObservedMetrics,
    SidecarStatus,
    TenantStatus,
    parse_spec,
)
from cachefleet_operator.kubectl_plugin import cli, views
from cachefleet_operator.kubectl_plugin.cluster import label_selector
from cachefleet_operator.outcome import parse_rfc3339

NOW = parse_rfc3339("2026-12-01T12:00:00Z") or 0.0
MI = 1024 * 1024


def _cache(status: dict[str, Any] | None, name: str = "chat") -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "cachefleet.io/v1alpha1",
        "kind": "InferenceCache",
        "metadata": {"name": name, "namespace": "inference"},
        "spec": {"model": {"name": "llama-3-8b", "version": "v7"}},
    }
    if status is not None:
        obj["status"] = status
    return obj


def _status(**extra: Any) -> dict[str, Any]:
    status = InferenceCacheStatus(
        quota_generation=7,
        last_rebalance_time="2026-12-01T11:59:15Z",
        tenant_count=2,
        sla_attainment="1/2",
        tenants=[
            TenantStatus(
                name="search",
                priority_class=PriorityClass.GUARANTEED,
                share=0.625,
                weight=3.0,
                l1_bytes=640 * MI,
                l2_bytes=5 * 1024 * MI,
                reason="floor 0.5; SLA needs 0.6 (predicted hit ratio 0.71)",
                observed=ObservedMetrics(p95_seconds=0.084, hit_ratio=0.7312, rps=41.5),
                sla_met=True,
            ),
            TenantStatus(
                name="sweep",
                priority_class=PriorityClass.BEST_EFFORT,
                share=0.375,
                weight=0.25,
                l1_bytes=384 * MI,
                l2_bytes=3 * 1024 * MI,
                reason="what is left",
                observed=ObservedMetrics(p95_seconds=1.9, hit_ratio=0.04, rps=3.0),
                sla_met=False,
            ),
        ],
        sidecars=SidecarStatus(seen=3, in_sync=2, epochs_in_sync=1),
        epochs={"cache": 1, "tenant:search": 4},
        model_version="v7",
        conditions=[
            Condition(
                type="Ready",
                status=ConditionStatus.TRUE,
                reason="QuotasPublished",
                message="quota generation 7 published; 2/3 sidecars in sync",
            ),
            Condition(
                type="SLAViolated",
                status=ConditionStatus.TRUE,
                reason="TenantsMissSLA",
                message="SLA missed by: sweep",
            ),
        ],
    ).wire()
    status.update(extra)
    return status


def _rows(text: str) -> list[list[str]]:
    """A table's rows split into cells (columns are 3+ spaces apart)."""
    import re

    return [re.split(r" {3,}", line.strip()) for line in text.strip().splitlines()]


def _tenant_table(text: str) -> list[list[str]]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("TENANT"))
    return _rows("\n".join(lines[start:]))


def test_status_block_shows_sync_sla_lagging_and_tenants() -> None:
    view = views.cache_view(_cache(_status()))
    text = views.render_status([view], NOW)
    assert text.startswith("InferenceCache inference/chat  model llama-3-8b v7\n")
    assert "Ready:        True (QuotasPublished)" in text
    assert "SLAViolated:  True (TenantsMissSLA): SLA missed by: sweep" in text
    assert "generation 7, rebalanced 45s ago" in text
    assert "1/2 tenants meet their SLA" in text
    assert "3 live, 2 in sync with the quotas, 1 with the epochs" in text
    assert "lagging:      1 behind quota generation 7; 2 behind the epochs" in text
    assert "epochs:       cache=1 tenant:search=4" in text
    assert "savings" not in text.lower()  # the status has none: no column, no line
    rows = _tenant_table(text)
    assert rows[0] == ["TENANT", "CLASS", "SHARE", "L1/POD", "L2", "HIT RATIO", "SLA"]
    assert rows[1] == ["search", "Guaranteed", "62.5%", "640Mi", "5Gi", "0.73", "met"]
    assert rows[2] == ["sweep", "BestEffort", "37.5%", "384Mi", "3Gi", "0.04", "MISSED"]


def test_status_wide_adds_weight_p95_rps_and_reason() -> None:
    view = views.cache_view(_cache(_status()))
    rows = _tenant_table(views.render_status([view], NOW, wide=True))
    assert rows[0] == [
        "TENANT", "CLASS", "SHARE", "L1/POD", "L2", "WEIGHT", "HIT RATIO", "SLA", "P95", "RPS",
        "REASON",
    ]  # fmt: skip
    assert rows[1][5] == "3"
    assert rows[1][8:] == ["0.084s", "41.5", "floor 0.5; SLA needs 0.6 (predicted hit ratio 0.71)"]


def test_savings_columns_appear_only_when_the_status_has_them() -> None:
    status = _status(savings={"modelSeconds": 5400.75, "promptTokens": 120000})
    status["tenants"][0]["savings"] = {"modelSeconds": 0.125, "promptTokens": 100000}
    view = views.cache_view(_cache(status))
    text = views.render_status([view], NOW)
    rows = _tenant_table(text)
    assert rows[0][-2:] == ["SAVED MODEL SECONDS", "SAVED PROMPT TOKENS"]
    assert rows[1][-2:] == ["0.125", "100000"]
    assert rows[2][-2:] == ["-", "-"]  # a tenant the status gives no savings: none invented
    assert "savings:      modelSeconds=5401 promptTokens=120000" in text
    doc = views.status_document([view])["items"][0]
    assert doc["savings"] == {"modelSeconds": 5400.75, "promptTokens": 120000.0}
    assert "savings" not in doc["tenants"][1]


def test_a_cache_the_operator_has_not_reconciled_says_so() -> None:
    text = views.render_status([views.cache_view(_cache(None))], NOW)
    assert "status:       none yet (is the operator running" in text
    assert "TENANT" not in text


def test_last_invalidation_names_its_lagging_pods() -> None:
    failed = {
        "metadata": {
            "name": "chat-b2",
            "namespace": "inference",
            "creationTimestamp": "2026-12-01T11:50:00Z",
        },
        "spec": {"cacheRef": {"name": "chat"}, "scope": {"type": "Tenant", "tenant": "search"}},
        "status": {
            "phase": "Failed",
            "epoch": 4,
            "acks": 2,
            "expectedAcks": 3,
            "laggingPods": ["llm-2"],
            "message": "tenant:search advanced to epoch 4, but 1 of 3 ...",
        },
    }
    older = {
        "metadata": {
            "name": "chat-a1",
            "namespace": "inference",
            "creationTimestamp": "2026-12-01T11:00:00Z",
        },
        "spec": {"cacheRef": {"name": "chat"}, "scope": {"type": "Cache"}},
        "status": {"phase": "Completed", "epoch": 1, "acks": 3, "expectedAcks": 3},
    }
    other_cache = {**failed, "spec": {**failed["spec"], "cacheRef": {"name": "other"}}}
    other_cache["metadata"] = {**failed["metadata"], "creationTimestamp": "2026-12-01T11:59:00Z"}
    view = views.cache_view(_cache(_status()), [older, failed, other_cache])
    text = views.render_status([view], NOW)
    assert (
        "invalidation: chat-b2 Failed (tenant:search, epoch 4, 2/3 acks); lagging pods: llm-2"
        in text
    )


def test_status_json_and_yaml_carry_the_same_facts() -> None:
    view = views.cache_view(_cache(_status()))
    doc = views.status_document([view])
    item = doc["items"][0]
    assert item["lagging"] == {"quotas": 1, "epochs": 2}
    assert [t["name"] for t in item["tenants"]] == ["search", "sweep"]
    assert item["tenants"][0]["hit_ratio"] == pytest.approx(0.7312)
    out = io.StringIO()
    cli._dump(doc, "json", out)
    assert json.loads(out.getvalue()) == json.loads(json.dumps(doc))
    out = io.StringIO()
    cli._dump(doc, "yaml", out)
    assert yaml.safe_load(out.getvalue())["items"][0]["quota_generation"] == 7


def test_top_joins_pods_and_heartbeats() -> None:
    pods = [
        views.pod_info(
            {
                "metadata": {"name": "llm-0"},
                "spec": {"containers": [{"name": "vllm"}, {"name": "cachefleet-sidecar"}]},
                "status": {
                    "phase": "Running",
                    "containerStatuses": [
                        {"ready": True, "restartCount": 0},
                        {"ready": True, "restartCount": 2},
                    ],
                },
            }
        ),
        views.pod_info({"metadata": {"name": "llm-1"}, "spec": {"containers": [{}]}}),
    ]
    sidecars = [
        views.SidecarSeen("llm-0", 7, {"search": "sits", "sweep": "lru"}, True, NOW - 3, True),
        views.SidecarSeen("llm-9", 6, {}, False, NOW - 12, False),
    ]
    rows = views.pod_rows(pods, sidecars, 7, NOW)
    table = _rows(views.render_top(rows))
    assert table[0] == [
        "POD", "READY", "STATUS", "HEARTBEAT", "QUOTAS", "EPOCHS", "REDIS", "POLICIES",
    ]  # fmt: skip
    assert table[1] == [
        "llm-0", "2/2", "Running", "3s ago", "gen 7 in sync", "acked", "ok",
        "search=sits,sweep=lru",
    ]  # fmt: skip
    assert table[2] == ["llm-1", "0/1", "Unknown", "-", "no heartbeat", "-", "-", "-"]
    assert table[3] == [
        "llm-9", "-", "not matched", "12s ago", "gen 6 LAGGING (want 7)", "LAGGING", "DOWN", "-",
    ]  # fmt: skip
    wide = _rows(views.render_top(rows, wide=True))
    assert wide[0][3:5] == ["RESTARTS", "NODE"]
    assert wide[1][3] == "2"


def test_top_counts_unlisted_tenants_by_policy_in_a_column_of_their_own() -> None:
    sidecars = [
        views.SidecarSeen("llm-0", 7, {"search": "sits"}, True, NOW - 3, True, {"sits": 10}),
        views.SidecarSeen("llm-1", 7, {"search": "sits"}, True, NOW - 3, True, {}),
        views.SidecarSeen(
            "llm-2", 7, {"search": "lru"}, True, NOW - 3, True, {"lru": 2, "sits": 10}
        ),
    ]
    table = _rows(views.render_top(views.pod_rows(None, sidecars, 7, NOW)))
    assert table[0][-2:] == ["POLICIES", "UNLISTED"]
    assert [row[-2:] for row in table[1:]] == [
        ["search=sits", "10 (sits=10)"],
        ["search=sits", "-"],
        ["search=lru", "12 (lru=2,sits=10)"],
    ]
    doc = views.top_document("inference", "chat", views.pod_rows(None, sidecars, 7, NOW), {})
    assert doc["pods"][2]["unlisted"] == {"lru": 2, "sits": 10}


def test_status_shows_the_unlisted_tenants_pools_from_the_spec() -> None:
    example = Path(__file__).parents[2] / "examples" / "inferencecache.yaml"
    spec = yaml.safe_load(example.read_text())["spec"]
    obj = _cache(_status())
    obj["spec"] = {**spec, "tenantDefaults": {"share": 0.25, "l2Share": 0.2, "policy": "sits"}}
    view = views.cache_view(obj)
    parsed = parse_spec(obj["spec"])
    l1, l2 = parsed.capacity.l1_bytes_per_pod // 4, int(parsed.capacity.l2_bytes * 0.2)
    (line,) = [x for x in views.render_status([view], NOW).splitlines() if "unlisted:" in x]
    assert line.split(":", 1)[1].strip() == (
        f"L1 25.0% of each pod ({views.human_bytes(l1)}), L2 20.0% ({views.human_bytes(l2)};"
        " one tenant at most 25.0% of it), Standard, policy sits"
    )
    assert views.status_document([view])["items"][0]["unlisted"]["l2_bytes"] == l2
    # L1 only, and no tenantDefaults at all
    obj["spec"]["tenantDefaults"] = {"l2Share": 0}
    (line,) = [
        x for x in views.render_status([views.cache_view(obj)], NOW).splitlines() if "unlisted" in x
    ]
    assert "no L2 (they stay in L1)" in line
    assert "policy the cache default" in line
    del obj["spec"]["tenantDefaults"]
    assert "unlisted" not in views.render_status([views.cache_view(obj)], NOW)


def test_top_without_redis_marks_sidecar_columns_unknown() -> None:
    pods = [views.PodInfo("llm-0", "Running", "2/2", 0, "node-a")]
    rows = views.pod_rows(pods, None, 7, NOW)
    assert _rows(views.render_top(rows))[1] == ["llm-0", "2/2", "Running", "-", "?", "?", "?", "-"]


def test_invalidation_progress_lines() -> None:
    obj: dict[str, Any] = {
        "metadata": {"name": "chat-x"},
        "spec": {"cacheRef": {"name": "chat"}, "scope": {"type": "Model", "model": "m"}},
    }
    assert views.progress_line(views.invalidation_view(obj)) == "chat-x: Pending"
    obj["status"] = {"phase": "Running", "epoch": 3, "message": "advancing model:m to epoch 3"}
    assert (
        views.progress_line(views.invalidation_view(obj))
        == "chat-x: Running, epoch 3: advancing model:m to epoch 3"
    )
    obj["status"] = {
        "phase": "Failed",
        "epoch": 3,
        "acks": 1,
        "expectedAcks": 3,
        "laggingPods": ["p1", "p2"],
        "message": "m",
    }
    assert views.progress_line(views.invalidation_view(obj)) == (
        "chat-x: Failed, epoch 3, 1/3 sidecars acknowledged: m (lagging pods: p1, p2)"
    )


DIGEST = "3fa9" + "0" * 56 + "beef"


def _invalidation(scope: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "chat-k1",
            "namespace": "inference",
            "creationTimestamp": "2026-12-01T11:55:00Z",
        },
        "spec": {"cacheRef": {"name": "chat"}, "scope": scope},
        "status": status,
    }


@pytest.mark.parametrize(
    ("scope", "text"),
    [
        ({"type": "Cache"}, "cache"),
        ({"type": "Tenant", "tenant": "a"}, "tenant:a"),
        ({"type": "Model", "model": "m"}, "model:m"),
        # the epoch scope the operator advances: namespace:<tenant>/<namespace>
        ({"type": "Namespace", "tenant": "acme", "namespace": "kb-1"}, "namespace:acme/kb-1"),
        ({"type": "Key", "key": DIGEST}, f"purge of key {DIGEST}"),
        ({"type": "Key", "key": DIGEST, "tenant": "acme"}, f"purge of key {DIGEST} in tenant acme"),
    ],
)
def test_scope_text_of_every_scope(scope: dict[str, Any], text: str) -> None:
    assert views.scope_text(scope) == text


def test_last_invalidation_line_of_the_new_scopes() -> None:
    done = {"phase": "Completed", "epoch": 2, "acks": 3, "expectedAcks": 3}
    purge = _invalidation({"type": "Key", "key": DIGEST}, done)
    view = views.cache_view(_cache(_status()), [purge])
    text = views.render_status([view], NOW)
    # the whole digest: what was purged can be searched for (X-Cache-Key)
    assert f"invalidation: chat-k1 Completed (purge of key {DIGEST}, epoch 2, 3/3 acks)" in text
    failed = {**done, "phase": "Failed", "acks": 2, "laggingPods": ["llm-2"]}
    kb = _invalidation({"type": "Namespace", "tenant": "search", "namespace": "kb-billing"}, failed)
    text = views.render_status([views.cache_view(_cache(_status()), [kb])], NOW)
    assert (
        "invalidation: chat-k1 Failed (namespace:search/kb-billing, epoch 2, 2/3 acks); "
        "lagging pods: llm-2" in text
    )
    doc = views.status_document([views.cache_view(_cache(_status()), [kb])])
    assert "namespace:search/kb-billing" in json.dumps(doc)


CACHE_OBJ: dict[str, Any] = {"metadata": {"name": "chat"}, "spec": {"model": {"name": "m"}}}


def _body(scope: str, **flags: str | None) -> dict[str, Any]:
    spec: dict[str, Any] = cli.invalidation_body(CACHE_OBJ, scope, None, 60, **flags)["spec"]
    return spec


def test_invalidation_body_of_the_namespace_and_key_scopes() -> None:
    spec = _body("namespace", tenant="acme", namespace="kb-billing")
    assert spec == {
        "cacheRef": {"name": "chat"},
        "scope": {"type": "Namespace", "tenant": "acme", "namespace": "kb-billing"},
        "timeoutSeconds": 60,
    }
    assert _body("key", key=DIGEST)["scope"] == {"type": "Key", "key": DIGEST}
    # the same digest in capitals (and pasted with a newline) is still that digest
    assert _body("key", key=f" {DIGEST.upper()}\n", tenant="acme")["scope"] == {
        "type": "Key",
        "tenant": "acme",
        "key": DIGEST,
    }
    # the older scopes are unchanged
    assert _body("model")["scope"] == {"type": "Model", "model": "m"}
    assert _body("tenant", tenant="a")["scope"] == {"type": "Tenant", "tenant": "a"}


@pytest.mark.parametrize(
    ("scope", "flags", "message"),
    [
        ("key", {}, "--scope key needs --key (the X-Cache-Key response header"),
        ("key", {"key": "abc"}, "--key: 'abc' is not 64 hex digits (the X-Cache-Key"),
        ("key", {"key": DIGEST[:-1] + "g"}, "--key: "),
        ("namespace", {"tenant": "acme"}, "--scope namespace needs --namespace-value"),
        ("namespace", {}, "--scope namespace needs --tenant and --namespace-value"),
        ("namespace", {"tenant": "acme", "namespace": "kb billing"}, "--namespace-value: "),
        ("cache", {"key": DIGEST}, "--key goes with --scope key, not --scope cache"),
        ("tenant", {"tenant": "a", "namespace": "kb"}, "--namespace-value goes with --scope"),
        ("model", {"tenant": "a"}, "--tenant goes with --scope tenant or namespace or key, not"),
    ],
)
def test_invalidation_body_refusals_name_the_flag(
    scope: str, flags: dict[str, str], message: str
) -> None:
    with pytest.raises(cli.UsageError) as caught:
        _body(scope, **flags)
    assert str(caught.value).startswith(message)


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0"), (1023, "1023"), (1536, "1.5Ki"), (640 * MI, "640Mi"), (5 * 1024 * MI, "5Gi")],
)
def test_human_bytes(n: int, text: str) -> None:
    assert views.human_bytes(n) == text


@pytest.mark.parametrize(("text", "seconds"), [("60s", 60), ("2m", 120), ("1h", 3600), ("90", 90)])
def test_durations(text: str, seconds: int) -> None:
    assert cli.parse_duration(text, "--timeout") == seconds


@pytest.mark.parametrize("text", ["0s", "2h", "soon", "-5s"])
def test_bad_durations_name_the_flag(text: str) -> None:
    with pytest.raises(cli.UsageError, match="--timeout"):
        cli.parse_duration(text, "--timeout")


def test_the_cache_selector_as_a_label_selector_query() -> None:
    selector = {
        "matchLabels": {"app": "llm", "tier": "serve"},
        "matchExpressions": [
            {"key": "zone", "operator": "In", "values": ["a", "b"]},
            {"key": "canary", "operator": "DoesNotExist"},
            {"key": "gpu", "operator": "Exists"},
            {"key": "pool", "operator": "NotIn", "values": ["spot"]},
        ],
    }
    assert label_selector(selector) == (
        "app=llm,tier=serve,zone in (a,b),!canary,gpu,pool notin (spot)"
    )


def test_the_package_installs_the_plugin_as_kubectl_cachefleet() -> None:
    import importlib
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    scripts = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, func = scripts["kubectl-cachefleet"].partition(":")
    assert getattr(importlib.import_module(module), func) is cli.main
    out, err = io.StringIO(), io.StringIO()
    assert cli.main([], out=out, err=err) == cli.EXIT_USAGE
    assert "status" in err.getvalue()
    assert "explain-key" in err.getvalue()


def test_the_connection_flags_go_before_or_after_the_command_and_read_no_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kubectl's way: the command line says where; the operator's and the sidecar's
    ``CACHEFLEET_*`` variables (same names) point the plugin nowhere."""
    monkeypatch.setenv("CACHEFLEET_NAMESPACE", "elsewhere")
    monkeypatch.setenv("CACHEFLEET_REDIS_URL", "redis://elsewhere:6379/0")
    monkeypatch.setenv("CACHEFLEET_TENANT", "elsewhere")
    flags = cli.build_flags()
    assert flags.parse(["-n", "a", "status"]).namespace == "a"
    assert flags.parse(["status", "-n", "b", "-A"]).namespace == "b"
    assert flags.parse(["status"]).namespace is None
    assert flags.parse(["top"]).redis_url is None
    args = flags.parse(["invalidate", "c", "--scope", "cache"])
    assert (args.tenant, args.timeout, args.wait) == (None, "60s", False)
    assert flags.parse(["explain-key"]).tenant == "default"
