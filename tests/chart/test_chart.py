"""The Helm chart: renders and lints, valid Kubernetes objects, values that switch things.

Rendered with Helm's own Go SDK (helm-python-sdk) and validated offline with
kubernetes-validate; no cluster needed. The PrometheusRule tests (promtool)
live in test_rules.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml

from cachefleet_operator.injection import SidecarSettings

CHART = Path(__file__).resolve().parents[2] / "charts" / "cachefleet"
KUBE_VERSION = "1.30.0"
NAMESPACE = "cachefleet"
#: Kinds whose schemas ship with kubernetes-validate.
BUILTIN_GROUPS = ("v1", "apps/v1", "rbac.authorization.k8s.io/v1", "autoscaling/v2")
BUILTIN_GROUPS += ("admissionregistration.k8s.io/v1",)
COMPONENT = "app.kubernetes.io/component"


def render(values: dict[str, Any] | None = None) -> dict[str, Any]:
    """Render the chart; returns {'docs': [...], 'notes': str}."""
    out = helm_python.Chart.load(str(CHART)).render(
        values or {}, name="cf", namespace=NAMESPACE, is_install=True
    )
    docs: list[dict[str, Any]] = []
    notes = ""
    for path, text in out.items():
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    # the CRD upgrade hook's own objects (its ClusterRole too) are test_crds_upgrade.py's
    docs = [d for d in docs if d["metadata"].get("labels", {}).get(COMPONENT) != "crds"]
    return {"docs": docs, "notes": notes}


def kinds(docs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    return by_kind


def operator_args(docs: list[dict[str, Any]]) -> list[str]:
    (dep,) = kinds(docs)["Deployment"]
    return list(dep["spec"]["template"]["spec"]["containers"][0]["args"])


ALL_ON = {
    "operator": {"replicas": 2},
    "monitoring": {"prometheusOperator": True},
    "webhook": {"certManager": {"enabled": True}},
    "autoscaling": {"mode": "hpa", "targetDeployment": "vllm", "cache": "inference/llama"},
}


@pytest.mark.parametrize(
    "values",
    [{}, ALL_ON, {"operator": {"clusterWide": False, "namespaces": ["a", "b"]}}],
    ids=["defaults", "everything-on", "namespaced"],
)
def test_chart_lints_and_builtin_objects_validate(values: dict[str, Any]) -> None:
    lint = helm_python.lint(str(CHART), values, strict=True, kube_version=KUBE_VERSION)
    assert lint["errors"] == []
    assert all(m["severity"] < 2 for m in lint["messages"]), lint["messages"]
    docs = render(values)["docs"]
    checked = 0
    for doc in docs:
        if doc["apiVersion"] in BUILTIN_GROUPS:
            kubernetes_validate.validate(doc, KUBE_VERSION.rsplit(".", 1)[0], strict=True)
            checked += 1
    assert checked >= 6


def test_crds_ship_in_the_chart_and_notes_say_helm_never_upgrades_them() -> None:
    crds = {p.name for p in (CHART / "crds").glob("*.yaml")}
    assert "inferencecaches.cachefleet.io.yaml" in crds
    assert "cacheinvalidations.cachefleet.io.yaml" in crds
    notes = render({"crds": {"upgradeJob": {"enabled": False}}})["notes"]
    assert "NEVER upgrades" in notes
    assert "kubectl apply --server-side -f cachefleet/crds/" in notes
    # kubectl cannot apply a directory by URL
    assert not [line for line in notes.splitlines() if "apply" in line and "://" in line]


def test_single_replica_runs_standalone_and_several_use_kopf_peering() -> None:
    one = render()["docs"]
    assert not any(a.startswith("--peering") for a in operator_args(one))
    assert "ClusterKopfPeering" not in kinds(one)
    two = render({"operator": {"replicas": 3}})["docs"]
    assert "--peering=cachefleet" in operator_args(two)
    assert kinds(two)["ClusterKopfPeering"][0]["metadata"]["name"] == "cachefleet"
    (dep,) = kinds(two)["Deployment"]
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert dep["spec"]["replicas"] == 3
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert {"name": "metrics", "containerPort": 9180, "protocol": "TCP"} in container["ports"]


def test_namespaced_install_gets_roles_per_namespace_only() -> None:
    docs = render({"operator": {"clusterWide": False, "namespaces": ["a", "b"]}})["docs"]
    roles = kinds(docs)["Role"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["a", "b"]
    assert "--namespace=a" in operator_args(docs)
    (cluster_role,) = kinds(docs)["ClusterRole"]
    assert not any("secrets" in r["resources"] for r in cluster_role["rules"])


def test_rbac_grants_what_the_operator_uses() -> None:
    (role,) = kinds(render()["docs"])["ClusterRole"]
    grants = {
        (group, res, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for res in rule["resources"]
        for verb in rule["verbs"]
    }
    for needed in [
        ("cachefleet.io", "inferencecaches", "watch"),
        ("cachefleet.io", "cacheinvalidations", "patch"),
        ("cachefleet.io", "inferencecaches/status", "patch"),
        ("cachefleet.io", "cacheinvalidations/status", "patch"),
        ("", "events", "create"),
        ("kopf.dev", "clusterkopfpeerings", "patch"),
        ("kopf.dev", "kopfpeerings", "patch"),
        ("", "secrets", "get"),
        ("", "pods", "list"),
        ("admissionregistration.k8s.io", "mutatingwebhookconfigurations", "create"),
    ]:
        assert needed in grants, needed
    assert ("", "secrets", "list") not in grants


def test_self_signed_webhook_is_managed_by_the_operator() -> None:
    docs = render()["docs"]
    by = kinds(docs)
    args = operator_args(docs)
    assert "--webhook-managed=cf-cachefleet.cachefleet.io" in args
    assert "--webhook-service=cf-cachefleet-webhook" in args
    assert "MutatingWebhookConfiguration" not in by
    assert "cf-cachefleet-webhook" in {s["metadata"]["name"] for s in by["Service"]}


def test_cert_manager_webhook_renders_certificate_and_configuration() -> None:
    docs = render({"webhook": {"certManager": {"enabled": True}}})["docs"]
    by = kinds(docs)
    (mwc,) = by["MutatingWebhookConfiguration"]
    (hook,) = mwc["webhooks"]
    assert hook["clientConfig"]["service"]["path"] == "/inject-sidecar"
    assert hook["objectSelector"]["matchExpressions"][0]["key"] == "cachefleet.io/cache"
    assert hook["failurePolicy"] == "Ignore"
    assert mwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == (
        "cachefleet/cf-cachefleet-webhook"
    )
    (cert,) = by["Certificate"]
    assert "cf-cachefleet-webhook.cachefleet.svc" in cert["spec"]["dnsNames"]
    args = operator_args(docs)
    assert "--webhook-certfile=/etc/cachefleet/tls/tls.crt" in args
    assert not any(a.startswith("--webhook-managed") for a in args)


def test_sidecar_config_map_is_what_the_webhook_parses() -> None:
    values = {"sidecar": {"proxyPort": 9080, "env": {"CACHEFLEET_L2_TTL": "600"}}}
    (cm,) = [c for c in kinds(render(values)["docs"])["ConfigMap"] if "sidecar.yaml" in c["data"]]
    settings = SidecarSettings.model_validate(yaml.safe_load(cm["data"]["sidecar.yaml"]))
    assert settings.image == "ghcr.io/cachefleet/cachefleet:0.1.0"
    assert settings.proxy_port == 9080
    assert settings.env == {"CACHEFLEET_L2_TTL": "600"}


def test_monitoring_objects_only_when_prometheus_operator_is_said_present() -> None:
    off = kinds(render()["docs"])
    assert not {"ServiceMonitor", "PodMonitor", "PrometheusRule"} & set(off)
    on = kinds(render({"monitoring": {"prometheusOperator": True}})["docs"])
    assert {"ServiceMonitor", "PodMonitor", "PrometheusRule"} <= set(on)
    (pm,) = on["PodMonitor"]
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "cf-admin"
    some = kinds(
        render({"monitoring": {"prometheusOperator": True, "podMonitor": {"enabled": False}}})[
            "docs"
        ]
    )
    assert "PodMonitor" not in some
    assert "ServiceMonitor" in some


def test_autoscaling_mode_selects_hpa_or_keda() -> None:
    assert "HorizontalPodAutoscaler" not in kinds(render()["docs"])
    hpa = kinds(render(ALL_ON)["docs"])["HorizontalPodAutoscaler"][0]
    metric = hpa["spec"]["metrics"][0]["external"]
    assert metric["metric"]["name"] == "cachefleet_operator_slo_pressure"
    assert metric["target"] == {"type": "Value", "value": "1000m"}
    keda_values = {"autoscaling": {"mode": "keda", "targetDeployment": "vllm", "cache": "a/b"}}
    by = kinds(render(keda_values)["docs"])
    assert "HorizontalPodAutoscaler" not in by
    (so,) = by["ScaledObject"]
    assert "cachefleet_operator_slo_pressure" in so["spec"]["triggers"][0]["metadata"]["query"]


def test_autoscaling_without_target_fails_with_a_clear_message() -> None:
    with pytest.raises(Exception, match=r"autoscaling.targetDeployment is required"):
        render({"autoscaling": {"mode": "hpa"}})
    with pytest.raises(Exception, match=r"autoscaling.cache"):
        render({"autoscaling": {"mode": "keda", "targetDeployment": "vllm"}})


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"operator": {"replica": 2}}, "replica"),
        ({"webhok": {}}, "webhok"),
        ({"operator": {"replicas": 0}}, "replicas"),
        ({"autoscaling": {"mode": "vpa"}}, "mode"),
    ],
)
def test_schema_rejects_bad_values_naming_them(values: dict[str, Any], needle: str) -> None:
    with pytest.raises(Exception, match="values don't meet the specifications") as info:
        render(values)
    assert needle in str(info.value)


def test_helm_test_pod_checks_the_operator() -> None:
    out = helm_python.Chart.load(str(CHART)).render({}, name="cf", namespace=NAMESPACE)
    test_docs = [yaml.safe_load(t) for p, t in out.items() if "/tests/" in p]
    (pod,) = test_docs
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert "/healthz" in " ".join(pod["spec"]["containers"][0]["command"])


def test_pods_run_as_the_images_numeric_user() -> None:
    """runAsUser of the operator pod and of the injected sidecar = the Containerfile's USER."""
    from cachefleet_operator.injection import IMAGE_UID

    containerfile = (CHART.parents[1] / "Containerfile").read_text()
    users = [line.split()[1] for line in containerfile.splitlines() if line.startswith("USER ")]
    assert users == [f"{IMAGE_UID}:{IMAGE_UID}"]
    docs = render(ALL_ON)["docs"]
    (dep,) = kinds(docs)["Deployment"]
    pod = dep["spec"]["template"]["spec"]["securityContext"]
    assert (pod["runAsUser"], pod["runAsGroup"], pod["runAsNonRoot"]) == (
        IMAGE_UID,
        IMAGE_UID,
        True,
    )
    (config,) = [d for d in kinds(docs)["ConfigMap"] if d["metadata"]["name"].endswith("-sidecar")]
    assert yaml.safe_load(config["data"]["sidecar.yaml"])["runAsUser"] == IMAGE_UID
