"""The chart's endpoint picker: Deployment, Service, RBAC, InferencePool, policies, monitors.

Rendered with Helm's Go SDK and checked offline: lint strict, built-in kinds
against their schemas (kubernetes-validate), and the InferencePool's fields as
the Gateway API Inference Extension's v1 API names them (selector.matchLabels,
targetPorts[].number, endpointPickerRef {kind, name, port.number,
failureMode}). Nothing of it renders unless router.enabled.
"""

from __future__ import annotations

from typing import Any

import helm_python
import kubernetes_validate
import pytest

from cachefleet_operator.api import RoutingSpec
from cachefleet_operator.injection import (
    ADMIN_PORT_NAME,
    PROXY_PORT_NAME,
    CacheInfo,
    SidecarSettings,
    sidecar_container,
)
from tests.chart.test_autoscaling import hpa_replicas

from .test_chart import BUILTIN_GROUPS, CHART, KUBE_VERSION, kinds, render

CACHE_NS, CACHE = "inference", "llama-chat"
ROUTER = {"enabled": True, "cache": f"{CACHE_NS}/{CACHE}"}
ROUTER_NAME = "cf-cachefleet-router"
POOL_API = "inference.networking.k8s.io/v1"
MONITORING = {"prometheusOperator": True, "modelServers": {"enabled": True}}
VALIDATED = (*BUILTIN_GROUPS, "networking.k8s.io/v1")


def docs(values: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    return kinds(render(values)["docs"])


def one(values: dict[str, Any], kind: str, name: str = ROUTER_NAME) -> dict[str, Any]:
    (found,) = [d for d in docs(values).get(kind, []) if d["metadata"]["name"] == name]
    return found


def container(values: dict[str, Any]) -> dict[str, Any]:
    (c,) = one(values, "Deployment")["spec"]["template"]["spec"]["containers"]
    return c


def router_related(doc: dict[str, Any]) -> bool:
    labels = doc["metadata"].get("labels") or {}
    return (
        labels.get("app.kubernetes.io/component") == "router"
        or "router" in doc["metadata"]["name"]
        or doc["kind"] == "InferencePool"
        or doc["metadata"]["name"].endswith("-model-servers")
    )


# ----------------------------------------------------------------- off by default


@pytest.mark.parametrize(
    "values",
    [{}, {"monitoring": {"prometheusOperator": True}}],
    ids=["defaults", "monitoring-on"],
)
def test_nothing_router_related_renders_by_default(values: dict[str, Any]) -> None:
    rendered = render(values)
    assert [d["metadata"]["name"] for d in rendered["docs"] if router_related(d)] == []
    assert "Endpoint picker" not in rendered["notes"]
    # the proxy port stays the gateway's alone
    (policy,) = docs(values)["NetworkPolicy"]
    proxy = [r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == 8080]
    assert [r["from"] for r in proxy] == [
        [
            {
                "namespaceSelector": {},
                "podSelector": {"matchLabels": {"cachefleet.io/gateway": "true"}},
            }
        ]
    ]


# --------------------------------------------------------------- valid objects


@pytest.mark.parametrize(
    "values",
    [
        {"router": ROUTER},
        {"router": {**ROUTER, "existingPool": "vllm-pool", "failureMode": "FailOpen"}},
        {
            "router": {**ROUTER, "redis": {"secretRef": {"name": "redis", "key": "url"}}},
            "monitoring": MONITORING,
            "autoscaling": {
                "mode": "hpa",
                "targetDeployment": "vllm",
                "cache": f"{CACHE_NS}/{CACHE}",
                "signals": ["sloPressure", "poolSaturation"],
            },
        },
    ],
    ids=["rendered-pool", "existing-pool", "everything-on"],
)
def test_router_lints_and_builtin_objects_validate(values: dict[str, Any]) -> None:
    lint = helm_python.lint(str(CHART), values, strict=True, kube_version=KUBE_VERSION)
    assert lint["errors"] == []
    assert all(m["severity"] < 2 for m in lint["messages"]), lint["messages"]
    checked = set()
    for doc in render(values)["docs"]:
        if router_related(doc) and doc["apiVersion"] in VALIDATED:
            kubernetes_validate.validate(doc, KUBE_VERSION.rsplit(".", 1)[0], strict=True)
            checked.add(doc["kind"])
    assert {"ServiceAccount", "Role", "RoleBinding", "Deployment", "Service"} <= checked
    assert "NetworkPolicy" in checked


# ----------------------------------------------------------------- the picker


def test_deployment_runs_the_router_command_line() -> None:
    dep = one({"router": ROUTER}, "Deployment")
    assert dep["metadata"]["namespace"] == CACHE_NS
    assert dep["spec"]["replicas"] == 2
    c = container({"router": ROUTER})
    assert c["command"] == ["cachefleet", "router"]
    assert c["args"] == [
        "--grpc-listen=0.0.0.0:9002",
        "--metrics-listen=0.0.0.0:9090",
        f"--pool-name={CACHE}",
        f"--namespace={CACHE_NS}",
        "--scrape-interval=0.5",
        "--tenant-header=X-Tenant-ID",
        "--fail-closed",
    ]
    assert "env" not in c  # no Redis: no tenants' classes, and no --cache
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http-metrics"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http-metrics"}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {
        "grpc": 9002,
        "http-metrics": 9090,
    }
    assert c["resources"]["requests"] == {"cpu": "250m", "memory": "256Mi"}


def test_picker_runs_as_locked_down_as_the_operator() -> None:
    by = docs({"router": ROUTER})
    operator, router = sorted(by["Deployment"], key=lambda d: d["metadata"]["name"])
    assert router["metadata"]["name"] == ROUTER_NAME
    op_pod, rt_pod = (d["spec"]["template"]["spec"] for d in (operator, router))
    assert rt_pod["securityContext"] == op_pod["securityContext"]
    assert rt_pod["containers"][0]["securityContext"] == op_pod["containers"][0]["securityContext"]
    assert rt_pod["containers"][0]["image"] == op_pod["containers"][0]["image"]
    assert rt_pod["serviceAccountName"] == ROUTER_NAME  # not the operator's
    # the operator's Deployment does not adopt the picker's pods, nor the reverse
    op_sel = operator["spec"]["selector"]["matchLabels"]
    rt_labels = router["spec"]["template"]["metadata"]["labels"]
    assert not op_sel.items() <= rt_labels.items()


def test_redis_url_reaches_the_picker_from_a_secret_and_names_the_cache() -> None:
    values = {"router": {**ROUTER, "redis": {"secretRef": {"name": "llama-redis", "key": "url"}}}}
    c = container(values)
    assert c["args"][-1] == f"--cache={CACHE_NS}/{CACHE}"
    (env,) = c["env"]
    assert env == {
        "name": "CACHEFLEET_REDIS_URL",
        "valueFrom": {"secretKeyRef": {"name": "llama-redis", "key": "url"}},
    }
    plain = container({"router": {**ROUTER, "redis": {"url": "redis://r:6379/0"}}})
    assert plain["env"] == [{"name": "CACHEFLEET_REDIS_URL", "value": "redis://r:6379/0"}]


def test_service_ports_and_selector() -> None:
    by = docs({"router": ROUTER})
    svc = one({"router": ROUTER}, "Service")
    assert svc["metadata"]["namespace"] == CACHE_NS
    assert svc["spec"]["ports"] == [
        {
            "name": "grpc",
            "port": 9002,
            "targetPort": "grpc",
            "protocol": "TCP",
            "appProtocol": "http2",
        },
        {"name": "http-metrics", "port": 9090, "targetPort": "http-metrics", "protocol": "TCP"},
    ]
    (dep,) = [d for d in by["Deployment"] if d["metadata"]["name"] == ROUTER_NAME]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()


def test_rbac_lets_the_picker_watch_pods_and_pools_and_nothing_more() -> None:
    role = one({"router": ROUTER}, "Role")
    assert role["metadata"]["namespace"] == CACHE_NS
    grants = {
        (group, res, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for res in rule["resources"]
        for verb in rule["verbs"]
    }
    read = ("get", "list", "watch")
    assert grants == {("", "pods", v) for v in read} | {
        ("inference.networking.k8s.io", "inferencepools", v) for v in read
    }
    binding = one({"router": ROUTER}, "RoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": ROUTER_NAME,
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": ROUTER_NAME, "namespace": CACHE_NS}
    ]
    assert one({"router": ROUTER}, "ServiceAccount")["metadata"]["namespace"] == CACHE_NS
    assert "Role" not in docs({"router": ROUTER, "rbac": {"create": False}})


# ----------------------------------------------------------------- the pool


def test_inference_pool_points_at_the_picker_and_the_sidecars() -> None:
    by = docs({"router": ROUTER})
    (pool,) = by["InferencePool"]
    assert pool["apiVersion"] == POOL_API
    assert pool["metadata"] == {**pool["metadata"], "name": CACHE, "namespace": CACHE_NS}
    spec = pool["spec"]
    assert spec["selector"] == {"matchLabels": {"cachefleet.io/cache": CACHE}}
    assert spec["targetPorts"] == [{"number": 8080}]
    svc = one({"router": ROUTER}, "Service")
    grpc = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc")
    # port.number is the Service's port, as the v1 API asks for a Service referent
    assert spec["endpointPickerRef"] == {
        "kind": "Service",
        "name": svc["metadata"]["name"],
        "port": {"number": grpc["port"]},
        "failureMode": "FailClose",
    }
    assert set(spec) == {"selector", "targetPorts", "endpointPickerRef"}


def test_pool_selects_the_pods_the_webhook_injects_and_targets_their_proxy_port() -> None:
    """The default selector and target port are the injected sidecar's label and proxy port."""
    values = {"router": ROUTER, "sidecar": {"proxyPort": 9080}}
    (pool,) = docs(values)["InferencePool"]
    settings = SidecarSettings.model_validate({"image": "img", "proxyPort": 9080})
    injected = sidecar_container(CacheInfo(namespace=CACHE_NS, name=CACHE), settings)
    ports = {p["name"]: p["containerPort"] for p in injected["ports"]}
    assert pool["spec"]["targetPorts"] == [{"number": ports[PROXY_PORT_NAME]}]
    assert pool["spec"]["selector"]["matchLabels"] == {"cachefleet.io/cache": CACHE}


def test_pool_shape_and_failure_mode_follow_the_values() -> None:
    values = {
        "router": {
            **ROUTER,
            "pool": {"matchLabels": {"app": "vllm"}, "targetPort": 8000},
            "failureMode": "FailOpen",
            "grpcPort": 9102,
        }
    }
    (pool,) = docs(values)["InferencePool"]
    assert pool["spec"]["selector"] == {"matchLabels": {"app": "vllm"}}
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    assert pool["spec"]["endpointPickerRef"]["port"] == {"number": 9102}
    args = container(values)["args"]
    assert "--fail-open" in args
    assert "--fail-closed" not in args
    assert "--grpc-listen=0.0.0.0:9102" in args


def test_an_existing_pool_renders_no_pool_and_the_picker_serves_it() -> None:
    values = {"router": {**ROUTER, "existingPool": "vllm-pool"}}
    rendered = render(values)
    by = kinds(rendered["docs"])
    assert "InferencePool" not in by
    assert "--pool-name=vllm-pool" in container(values)["args"]
    assert ROUTER_NAME in {s["metadata"]["name"] for s in by["Service"]}
    assert "inferencePoolRef: {name: vllm-pool}" in rendered["notes"]


@pytest.mark.parametrize(
    ("router", "expected_pool"),
    [(ROUTER, CACHE), ({**ROUTER, "existingPool": "vllm-pool"}, "vllm-pool")],
    ids=["rendered", "referenced"],
)
def test_operator_status_names_the_pool_the_chart_serves(
    router: dict[str, Any], expected_pool: str
) -> None:
    """status.routing.pool (from spec.routing) is the pool the picker is told to serve."""
    ref = {"name": router["existingPool"]} if "existingPool" in router else None
    spec = RoutingSpec.model_validate({"enabled": True, "inferencePoolRef": ref})
    assert spec.pool_name(CACHE) == expected_pool
    assert f"--pool-name={expected_pool}" in container({"router": router})["args"]


# ------------------------------------------------------------- network policies


def test_gateway_reaches_the_picker_and_the_picker_reaches_the_proxy_port() -> None:
    by = docs({"router": ROUTER})
    policies = {p["metadata"]["name"]: p for p in by["NetworkPolicy"]}
    router = policies[ROUTER_NAME]
    assert router["metadata"]["namespace"] == CACHE_NS
    rules = {r["ports"][0]["port"]: r["from"] for r in router["spec"]["ingress"]}
    gateway = [
        {"namespaceSelector": {}, "podSelector": {"matchLabels": {"cachefleet.io/gateway": "true"}}}
    ]
    assert rules == {
        9002: gateway,
        9090: [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
        ],
    }
    (dep,) = [d for d in by["Deployment"] if d["metadata"]["name"] == ROUTER_NAME]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert router["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    sidecar = policies["cf-cachefleet-sidecar"]
    proxy = next(r["from"] for r in sidecar["spec"]["ingress"] if r["ports"][0]["port"] == 8080)
    assert proxy[: len(gateway)] == gateway
    (picker,) = proxy[len(gateway) :]
    assert picker["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": CACHE_NS}}
    assert picker["podSelector"]["matchLabels"].items() <= pod_labels.items()


def test_proxy_port_peers_are_one_list_whatever_the_gateway_is() -> None:
    gateway = [{"ipBlock": {"cidr": "10.20.0.0/16"}}]
    values = {
        "router": ROUTER,
        "monitoring": MONITORING,
        "networkPolicy": {"gateway": gateway, "namespaces": [CACHE_NS]},
    }
    (policy,) = [
        p for p in docs(values)["NetworkPolicy"] if p["metadata"]["name"].endswith("-sidecar")
    ]
    kubernetes_validate.validate(policy, KUBE_VERSION.rsplit(".", 1)[0], strict=True)
    proxy = next(r["from"] for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == 8080)
    assert proxy[0] == gateway[0]
    assert proxy[1]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
    assert proxy[2:] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]


# --------------------------------------------------------------------- monitors


def test_monitors_scrape_the_picker_and_the_model_servers_through_the_proxy() -> None:
    values = {"router": ROUTER, "monitoring": MONITORING}
    by = docs(values)
    sm = one(values, "ServiceMonitor")
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [CACHE_NS]}
    assert sm["spec"]["endpoints"][0]["port"] == "http-metrics"
    svc = one(values, "Service")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    (ms,) = [p for p in by["PodMonitor"] if p["metadata"]["name"].endswith("-model-servers")]
    (endpoint,) = ms["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == (PROXY_PORT_NAME, "/metrics")
    assert ms["spec"]["podTargetLabels"] == ["cachefleet.io/cache"]
    (sidecars,) = [p for p in by["PodMonitor"] if p["metadata"]["name"].endswith("-sidecars")]
    assert sidecars["spec"]["podMetricsEndpoints"][0]["port"] == ADMIN_PORT_NAME
    # monitoring may now read the proxy port's /metrics too, and only then
    (policy,) = [p for p in by["NetworkPolicy"] if p["metadata"]["name"].endswith("-sidecar")]
    proxy = next(r["from"] for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == 8080)
    monitoring = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    }
    assert monitoring in proxy
    no_monitor = docs({"router": ROUTER, "monitoring": {"prometheusOperator": True}})
    (policy,) = [
        p for p in no_monitor["NetworkPolicy"] if p["metadata"]["name"].endswith("-sidecar")
    ]
    proxy = next(r["from"] for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == 8080)
    assert monitoring not in proxy
    assert not [p for p in no_monitor["PodMonitor"] if p["metadata"]["name"].endswith("-servers")]


# ------------------------------------------------------------------- scaling


AUTOSCALE = {
    "targetDeployment": "vllm",
    "cache": f"{CACHE_NS}/{CACHE}",
    "minReplicas": 1,
    "maxReplicas": 20,
}


@pytest.mark.parametrize(
    ("saturation", "current", "expected"),
    [(0.5, 4, 2), (1.0, 4, 4), (1.5, 4, 6)],
    ids=["half-saturated-scales-in", "at-target-holds", "over-scales-out"],
)
def test_hpa_scales_on_pool_saturation(saturation: float, current: int, expected: int) -> None:
    values = {"autoscaling": {**AUTOSCALE, "mode": "hpa", "signals": ["poolSaturation"]}}
    (hpa,) = docs({**values, "monitoring": MONITORING})["HorizontalPodAutoscaler"]
    (metric,) = hpa["spec"]["metrics"]
    external = metric["external"]
    assert external["metric"]["name"] == "cachefleet_pool_saturation"
    assert external["metric"]["selector"]["matchLabels"] == {
        "cache_namespace": CACHE_NS,
        "cache_name": CACHE,
    }
    lo, hi = hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]
    assert hpa_replicas(current, saturation, external["target"], lo, hi) == expected


def test_keda_gets_one_trigger_per_signal() -> None:
    values = {
        "autoscaling": {
            **AUTOSCALE,
            "mode": "keda",
            "signals": ["sloPressure", "poolSaturation"],
            "targetSaturation": 0.8,
        },
        "monitoring": MONITORING,
    }
    (so,) = docs(values)["ScaledObject"]
    queries = [t["metadata"]["query"] for t in so["spec"]["triggers"]]
    assert queries == [
        f'max(cachefleet_operator_slo_pressure{{cache_namespace="{CACHE_NS}",cache_name="{CACHE}"}})',
        f'max(cachefleet:pool_saturation{{cache_namespace="{CACHE_NS}",cache_name="{CACHE}"}})',
    ]
    assert [t["metricType"] for t in so["spec"]["triggers"]] == ["Value", "Value"]
    assert so["spec"]["triggers"][1]["metadata"]["threshold"] == "0.8"


# ------------------------------------------------------------------ bad values


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"router": {"enabled": True}}, "router.cache"),
        (
            {"router": {**ROUTER, "existingPool": "p", "pool": {"targetPort": 8000}}},
            "router.existingPool",
        ),
        (
            {"router": {**ROUTER, "redis": {"url": "redis://r:1/0", "secretRef": {"name": "s"}}}},
            "router.redis",
        ),
        (
            {"autoscaling": {**AUTOSCALE, "mode": "hpa", "signals": ["poolSaturation"]}},
            "monitoring.modelServers.enabled",
        ),
    ],
    ids=["no-cache", "pool-shape-with-existing-pool", "two-redis", "saturation-without-rules"],
)
def test_inconsistent_values_fail_naming_the_value(values: dict[str, Any], needle: str) -> None:
    with pytest.raises(Exception, match=needle.replace(".", r"\.")):
        render(values)


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"router": {**ROUTER, "failureMode": "Fail"}}, "failureMode"),
        ({"router": {**ROUTER, "replica": 2}}, "replica"),
        ({"router": {"enabled": True, "cache": "llama-chat"}}, "cache"),
        ({"router": {**ROUTER, "pool": {"targetPort": 70000}}}, "targetPort"),
        ({"autoscaling": {"signals": ["cpu"]}}, "signals"),
    ],
)
def test_schema_rejects_bad_router_values_naming_them(values: dict[str, Any], needle: str) -> None:
    with pytest.raises(Exception, match="values don't meet the specifications") as info:
        render(values)
    assert needle in str(info.value)
