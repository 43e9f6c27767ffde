"""`make release`'s chart, CRD and checksum artefacts (scripts/release.py), and the one version.

The image archive needs a builder and lives in tests/image/test_release.py; what is
here runs the same script `make release` runs, without the image, and checks what a
user installs: the packaged chart renders with its default values and asks for
``IMAGE:VERSION``, the image the archive carries; the CRD manifest is the chart's
crds/; SHA256SUMS checks. The version lives in pyproject.toml only: the chart's
``version``/``appVersion`` must say the same, and the chart's default image
repository must be the Makefile's ``IMAGE``.
"""

from __future__ import annotations

import hashlib
import io
import re
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "cachefleet"
SCRIPT = ROOT / "scripts" / "release.py"
KUBE_VERSION = "1.30.0"


def pyproject_version() -> str:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return str(tomllib.load(f)["project"]["version"])


def makefile_image() -> str:
    found = re.search(r"^IMAGE\s*\?=\s*(\S+)\s*$", (ROOT / "Makefile").read_text(), re.M)
    assert found, "the Makefile has no `IMAGE ?= <name>` default"
    return found.group(1)


VERSION = pyproject_version()


def release(dist: Path, image: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--image", image, "--dist", str(dist)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def rendered_images(chart: str) -> set[str]:
    """Every container image of the chart rendered with its defaults, and the sidecar's."""
    out = helm_python.Chart.load(chart).render({}, name="cf", namespace="cf", is_install=True)
    images: set[str] = set()
    for path, text in out.items():
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if not doc:
                continue
            if doc["kind"] == "Deployment":
                images |= {c["image"] for c in doc["spec"]["template"]["spec"]["containers"]}
            if doc["kind"] == "ConfigMap" and "sidecar.yaml" in doc.get("data", {}):
                images.add(yaml.safe_load(doc["data"]["sidecar.yaml"])["image"])
    return images


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    (out / "cachefleet-0.0.1.whl").write_bytes(b"not an artefact")  # dist/ is shared
    result = release(out, makefile_image())
    assert result.returncode == 0, result.stderr
    return out


def test_the_version_lives_in_pyproject_and_the_chart_follows_it() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert (chart["version"], chart["appVersion"]) == (VERSION, VERSION), (
        "charts/cachefleet/Chart.yaml's version and appVersion must equal pyproject.toml's "
        f"version {VERSION}"
    )
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    # an empty tag is the chart's appVersion: the image tag follows the version too
    assert values["image"]["tag"] == ""
    assert values["image"]["repository"] == makefile_image()


def test_release_leaves_the_chart_the_crds_and_their_checksums(dist: Path) -> None:
    names = sorted(p.name for p in dist.iterdir())
    assert names == sorted(
        [
            "SHA256SUMS",
            f"cachefleet-{VERSION}.tgz",
            f"cachefleet-crds-{VERSION}.yaml",
            "cachefleet-0.0.1.whl",
        ]
    )
    sums = {}
    for line in (dist / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split("  ")
        sums[name] = digest
    # sha256sum -c format, over the release's files only
    assert set(sums) == {f"cachefleet-{VERSION}.tgz", f"cachefleet-crds-{VERSION}.yaml"}
    for name, digest in sums.items():
        assert hashlib.sha256((dist / name).read_bytes()).hexdigest() == digest
    check = subprocess.run(
        ["sha256sum", "-c", "SHA256SUMS"], cwd=dist, capture_output=True, timeout=30, check=False
    )
    assert check.returncode == 0, check.stdout


def test_the_packaged_chart_is_what_helm_package_makes_with_the_version(dist: Path) -> None:
    with tarfile.open(dist / f"cachefleet-{VERSION}.tgz") as tgz:
        members = tgz.getnames()
        chart_yaml = tgz.extractfile("cachefleet/Chart.yaml")
        assert chart_yaml is not None
        chart = yaml.safe_load(io.TextIOWrapper(chart_yaml))
    assert {m.split("/", 1)[0] for m in members} == {"cachefleet"}
    for part in ("values.yaml", "values.schema.json", "templates/deployment.yaml"):
        assert f"cachefleet/{part}" in members
    crds = {f"cachefleet/crds/{p.name}" for p in (CHART / "crds").glob("*.yaml")}
    assert crds <= set(members)
    assert (chart["name"], chart["version"], chart["appVersion"]) == ("cachefleet",) + (
        VERSION,
    ) * 2


def test_the_packaged_chart_renders_with_defaults_and_asks_for_the_released_image(
    dist: Path,
) -> None:
    tgz = str(dist / f"cachefleet-{VERSION}.tgz")
    lint = helm_python.lint(tgz, {}, strict=True, kube_version=KUBE_VERSION)
    assert lint["errors"] == []
    # the operator's container and the sidecar the webhook injects: the archive's name:tag
    assert rendered_images(tgz) == {f"{makefile_image()}:{VERSION}"}


def test_release_stamps_another_image_name_into_the_chart(tmp_path: Path) -> None:
    image = "registry.example.com:5000/team/cachefleet"
    result = release(tmp_path, image)
    assert result.returncode == 0, result.stderr
    tgz = tmp_path / f"cachefleet-{VERSION}.tgz"
    assert rendered_images(str(tgz)) == {f"{image}:{VERSION}"}
    with tarfile.open(tgz) as archive:
        member = archive.extractfile("cachefleet/values.yaml")
        assert member is not None
        packaged = member.read().decode()
    # only that line changed: every key keeps its comment
    source = (CHART / "values.yaml").read_text().splitlines()
    changed = [(a, b) for a, b in zip(source, packaged.splitlines(), strict=True) if a != b]
    assert changed == [(f"  repository: {makefile_image()}", f"  repository: {image}")]


def test_release_refuses_an_image_name_with_a_tag(tmp_path: Path) -> None:
    result = release(tmp_path, "registry.example.com/cachefleet:latest")
    assert result.returncode == 2
    assert "without a tag" in result.stderr
    assert not list(tmp_path.iterdir())


def test_the_crd_manifest_is_the_charts_crds(dist: Path) -> None:
    docs: list[dict[str, Any]] = [
        d for d in yaml.safe_load_all((dist / f"cachefleet-crds-{VERSION}.yaml").read_text()) if d
    ]
    chart = [yaml.safe_load(p.read_text()) for p in sorted((CHART / "crds").glob("*.yaml"))]
    assert docs == chart
    assert {d["kind"] for d in docs} == {"CustomResourceDefinition"}
    names = {d["metadata"]["name"] for d in docs}
    assert {"inferencecaches.cachefleet.io", "cacheinvalidations.cachefleet.io"} <= names
