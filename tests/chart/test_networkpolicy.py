"""The chart's NetworkPolicy: only the gateway reaches the sidecar's proxy port."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import yaml

from cachefleet_operator.injection import CacheInfo, SidecarSettings, sidecar_container

from .test_chart import KUBE_VERSION, NAMESPACE, kinds, render


def policies(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return kinds(render(values)["docs"]).get("NetworkPolicy", [])


def test_default_policy_admits_only_gateway_and_monitoring() -> None:
    (policy,) = policies()
    kubernetes_validate.validate(policy, KUBE_VERSION.rsplit(".", 1)[0], strict=True)
    assert policy["metadata"]["namespace"] == NAMESPACE
    spec = policy["spec"]
    assert spec["podSelector"]["matchExpressions"] == [
        {"key": "cachefleet.io/cache", "operator": "Exists"}
    ]
    assert spec["policyTypes"] == ["Ingress"]
    by_port = {rule["ports"][0]["port"]: rule["from"] for rule in spec["ingress"]}
    assert set(by_port) == {8080, 8081}  # nothing reaches the model server's own port
    assert by_port[8080] == [
        {"namespaceSelector": {}, "podSelector": {"matchLabels": {"cachefleet.io/gateway": "true"}}}
    ]
    assert by_port[8081][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "monitoring"
    }


def test_policy_per_model_namespace_with_custom_gateway_and_ports() -> None:
    gateway = [{"ipBlock": {"cidr": "10.20.0.0/16"}}]
    found = policies(
        {
            "networkPolicy": {"namespaces": ["inference", "batch"], "gateway": gateway},
            "sidecar": {"proxyPort": 9090, "adminPort": 9091},
        }
    )
    assert [p["metadata"]["namespace"] for p in found] == ["inference", "batch"]
    for policy in found:
        kubernetes_validate.validate(policy, KUBE_VERSION.rsplit(".", 1)[0], strict=True)
        rules = {r["ports"][0]["port"]: r["from"] for r in policy["spec"]["ingress"]}
        assert rules[9090] == gateway
        assert 9091 in rules


def test_policy_can_be_switched_off() -> None:
    assert policies({"networkPolicy": {"enabled": False}}) == []


def test_trusted_proxies_reach_the_injected_sidecar() -> None:
    docs = render({"sidecar": {"trustedProxies": "10.20.0.0/16"}})["docs"]
    config = next(d for d in kinds(docs)["ConfigMap"] if d["metadata"]["name"].endswith("-sidecar"))
    settings = SidecarSettings.model_validate(yaml.safe_load(config["data"]["sidecar.yaml"]))
    env = sidecar_container(CacheInfo("inference", "chat"), settings)["env"]
    assert {"name": "CACHEFLEET_TRUSTED_PROXIES", "value": "10.20.0.0/16"} in env
