"""CRDs on `helm upgrade`: the chart's pre-install/pre-upgrade hook Job (crds.upgradeJob).

Helm applies crds/ on the first install only. The hook Job applies the chart's own
crds/ files with ``kubectl apply --server-side`` before the rest of a release changes;
these tests render it (Helm's Go SDK), validate its built-in objects offline, and check
what makes it work: it mounts the crds/ files byte for byte, runs as a ServiceAccount
bound to a ClusterRole that can touch only those CRDs, and runs before the operator.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "cachefleet"
KUBE_VERSION = "1.30.0"
HOOK = "pre-install,pre-upgrade"
OFF = {"crds": {"upgradeJob": {"enabled": False}}}


def render(values: dict[str, Any] | None = None) -> tuple[list[dict[str, Any]], str]:
    out = helm_python.Chart.load(str(CHART)).render(
        values or {}, name="cf", namespace="cachefleet", is_install=True
    )
    docs: list[dict[str, Any]] = []
    notes = ""
    for path, text in out.items():
        if path.endswith("NOTES.txt"):
            notes = text
        else:
            docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs, notes


def crd_hooks(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The hook objects of the CRD Job, by kind."""
    found: dict[str, dict[str, Any]] = {}
    for d in docs:
        labels = d["metadata"].get("labels", {})
        if labels.get("app.kubernetes.io/component") == "crds":
            assert d["kind"] not in found, d["kind"]
            found[d["kind"]] = d
    return found


def crd_files() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted((CHART / "crds").glob("*.yaml"))}


def test_the_hook_job_applies_the_charts_crds_server_side() -> None:
    hooks = crd_hooks(render()[0])
    assert set(hooks) == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "Job"}
    for obj in hooks.values():
        assert obj["metadata"]["annotations"]["helm.sh/hook"] == HOOK
        assert "hook-succeeded" in obj["metadata"]["annotations"]["helm.sh/hook-delete-policy"]
    # the ConfigMap carries crds/ byte for byte
    assert hooks["ConfigMap"]["data"] == crd_files()
    job = hooks["Job"]
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "registry.k8s.io/kubectl:v1.34.1"
    assert container["command"] == ["kubectl"]
    assert container["args"][:2] == ["apply", "--server-side"]
    assert "--force-conflicts" in container["args"]
    assert "--filename=/crds/" in container["args"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/crds"]]["configMap"]["name"] == hooks["ConfigMap"]["metadata"]["name"]
    assert pod["restartPolicy"] == "Never"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert "/tmp" in mounts  # kubectl's cache under HOME=/tmp
    assert {"name": "HOME", "value": "/tmp"} in container["env"]


def test_the_job_runs_after_its_rbac_and_configmap_and_before_the_release() -> None:
    hooks = crd_hooks(render()[0])

    def weight(kind: str) -> int:
        return int(hooks[kind]["metadata"]["annotations"]["helm.sh/hook-weight"])

    for kind in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap"):
        assert weight(kind) < weight("Job")
    # the operator's Deployment is no hook: Helm applies it after pre-upgrade hooks succeed
    (dep,) = [d for d in render()[0] if d["kind"] == "Deployment"]
    assert "helm.sh/hook" not in dep["metadata"].get("annotations", {})


def test_its_service_account_may_touch_only_the_charts_crds() -> None:
    hooks = crd_hooks(render()[0])
    names = sorted(yaml.safe_load(text)["metadata"]["name"] for text in crd_files().values())
    (rule,) = hooks["ClusterRole"]["rules"]
    assert rule["apiGroups"] == ["apiextensions.k8s.io"]
    assert rule["resources"] == ["customresourcedefinitions"]
    assert sorted(rule["resourceNames"]) == names
    assert set(rule["verbs"]) == {"get", "create", "patch"}
    binding = hooks["ClusterRoleBinding"]
    sa = hooks["ServiceAccount"]["metadata"]
    assert binding["roleRef"]["name"] == hooks["ClusterRole"]["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["name"], "namespace": sa["namespace"]}
    ]
    assert hooks["Job"]["spec"]["template"]["spec"]["serviceAccountName"] == sa["name"]
    # not the operator's ServiceAccount, which can do much more
    operator = next(d for d in render()[0] if d["kind"] == "Deployment")
    assert operator["spec"]["template"]["spec"]["serviceAccountName"] != sa["name"]


@pytest.mark.parametrize("values", [{}, OFF], ids=["on", "off"])
def test_chart_lints_and_the_hook_objects_validate(values: dict[str, Any]) -> None:
    lint = helm_python.lint(str(CHART), values, strict=True, kube_version=KUBE_VERSION)
    assert lint["errors"] == []
    assert all(m["severity"] < 2 for m in lint["messages"]), lint["messages"]
    for obj in crd_hooks(render(values)[0]).values():
        kubernetes_validate.validate(obj, KUBE_VERSION.rsplit(".", 1)[0], strict=True)


def test_switched_off_there_is_no_job_and_the_notes_say_what_to_apply() -> None:
    docs, notes = render(OFF)
    assert crd_hooks(docs) == {}
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]
    assert "NEVER upgrades" in notes
    assert f"kubectl apply --server-side -f cachefleet-crds-{version}.yaml" in notes
    _, on = render()
    assert "cf-cachefleet-crds applies this chart's CRDs" in on


def test_the_job_uses_the_charts_pull_secrets_and_a_chosen_kubectl() -> None:
    values = {
        "imagePullSecrets": [{"name": "mirror"}],
        "crds": {"upgradeJob": {"image": {"repository": "mirror.example/k", "tag": "v1.30.4"}}},
    }
    pod = crd_hooks(render(values)[0])["Job"]["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "mirror"}]
    assert pod["containers"][0]["image"] == "mirror.example/k:v1.30.4"
