"""The sidecar's /metrics text: pieces, one header per family, bounded tenant labels."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cachefleet_sidecar.observe.metrics import MAX_MODEL_SERIES, OTHER_TENANT, SidecarMetrics


def samples(text: str) -> list[tuple[str, tuple[tuple[str, str], ...], float]]:
    return sorted(
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    )


def busy(metrics: SidecarMetrics, tenants: int) -> None:
    for i in range(tenants):
        tm = metrics.tenant(f"t{i}")
        tm.request("l1", "hit", 0.0002 * i)
        tm.request("upstream", "miss", 0.3)
        tm.upstream.observe(0.29)
        tm.evicted("l1", i)
        tm.saving("llama").add(10 + i, 20, 0.25, 0.001 if i % 2 else None)
        tm.directive_ignored("no-cache")


def test_pieces_make_the_same_exposition_as_the_registry() -> None:
    m = SidecarMetrics("ns/chat")
    busy(m, 40)
    m.cross_tenant_hits = 2
    text = m.render().decode()
    assert samples(text) == samples(generate_latest(m.registry).decode())
    for name in ("cachefleet_requests_total", "cachefleet_request_duration_seconds"):
        assert text.count(f"# TYPE {name} ") == 1


def test_zero_budget_cuts_a_piece_per_tenant_and_family() -> None:
    m = SidecarMetrics("ns/chat")
    busy(m, 10)
    pieces = list(m.exposition(budget_s=0))
    assert len(pieces) == 11 * 10 + 1  # eleven per-tenant families, then everything else
    assert samples(b"".join(pieces).decode()) == samples(m.render().decode())


def test_savings_series_and_their_model_label_bound() -> None:
    m = SidecarMetrics("ns/chat")
    tm = m.tenant("acme")
    for i in range(MAX_MODEL_SERIES + 5):
        tm.saving(f"model-{i}").add(100, 50, 2.0, 0.5)
    tm.saving("x" * 500).add(1, 1, 1.0, None)
    found = samples(m.render().decode())
    models = {
        dict(lab)["model"] for name, lab, _ in found if name == "cachefleet_saved_tokens_total"
    }
    assert len(models) == MAX_MODEL_SERIES + 1  # the first 16 and "_other"
    assert OTHER_TENANT in models
    other = [
        v
        for name, lab, v in found
        if name == "cachefleet_saved_tokens_total"
        and dict(lab)["model"] == OTHER_TENANT
        and dict(lab)["kind"] == "prompt"
    ]
    assert other == [5 * 100 + 1]
    seconds = {
        dict(lab)["model"]: v
        for name, lab, v in found
        if name == "cachefleet_saved_model_seconds_total"
    }
    assert seconds["model-0"] == 2.0
    assert seconds[OTHER_TENANT] == 5 * 2.0 + 1.0


def test_tenant_labels_are_bounded_and_known_tenants_keep_theirs() -> None:
    m = SidecarMetrics("ns/chat", max_tenant_series=5)
    m.set_reserved({"gold"})
    busy(m, 50)
    m.tenant("gold").request("l1", "hit", 0.001)
    labels = {s[1] for s in samples(m.render().decode())}
    tenants = {dict(lab).get("tenant") for lab in labels} - {None}
    assert tenants == {"t0", "t1", "t2", "t3", "t4", OTHER_TENANT, "gold"}
    other = m.tenants[OTHER_TENANT]
    assert other.requests[("l1", "hit")] == 45


def test_idle_series_expire() -> None:
    m = SidecarMetrics("ns/chat")
    m.tenant("idle").request("l1", "hit", 0.001)
    for _ in range(3):
        m.tenant("busy").request("l1", "hit", 0.001)
        m.expire_idle(2)
    assert set(m.tenants) == {"busy"}
