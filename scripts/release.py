"""The chart, CRD and checksum artefacts of a release (``make release`` runs this).

``python scripts/release.py --image NAME --dist dist`` writes, for the version in
pyproject.toml (the one version: the image tag, the chart's ``version`` and
``appVersion``):

- ``cachefleet-VERSION.tgz``: the chart packaged by Helm's own Go SDK
  (helm-python-sdk's ``package``, what ``helm package`` does), with ``version`` and
  ``appVersion`` set to VERSION and ``image.repository`` set to NAME, so its default
  image reference is ``NAME:VERSION``, the image ``scripts/release.sh`` saved;
- ``cachefleet-crds-VERSION.yaml``: the chart's crds/ as one manifest;
- ``SHA256SUMS``: ``sha256sum -c`` input for those two and the image archive
  ``cachefleet-VERSION.oci.tar`` that ``scripts/release.sh`` put there first (when
  there is one; other files in the directory are not release artefacts).
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
import tempfile
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "cachefleet"
SUMS = "SHA256SUMS"


def project_version(root: Path = ROOT) -> str:
    """The version in pyproject.toml."""
    with (root / "pyproject.toml").open("rb") as f:
        return str(tomllib.load(f)["project"]["version"])


def stamp_repository(values: str, image: str) -> str:
    """values.yaml's text with ``image.repository`` set to ``image`` (comments kept)."""
    lines = values.splitlines(keepends=True)
    block = False
    for i, line in enumerate(lines):
        if line and not line[0].isspace() and not line.startswith("#"):
            block = line.rstrip() == "image:"  # a top-level key opens or closes the block
        elif block and line.startswith("  repository: "):
            lines[i] = f"  repository: {image}\n"
            stamped = "".join(lines)
            if yaml.safe_load(stamped)["image"]["repository"] == image:
                return stamped
            break
    raise ValueError("values.yaml: no image.repository line to stamp")


def package_chart(dist: Path, version: str, image: str, chart: Path = CHART) -> Path:
    """Package ``chart`` into ``dist`` as ``<name>-<version>.tgz``; returns its path."""
    import helm_python  # the dev extra: only the release needs Helm's SDK

    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / chart.name
        shutil.copytree(chart, copy)
        values = copy / "values.yaml"
        values.write_text(stamp_repository(values.read_text(encoding="utf-8"), image))
        out = helm_python.package(copy, destination=dist, version=version, app_version=version)
    return Path(out)


def crds_manifest(dist: Path, version: str, chart: Path = CHART) -> Path:
    """The chart's crds/*.yaml as one multi-document manifest in ``dist``."""
    parts = [p.read_text(encoding="utf-8") for p in sorted((chart / "crds").glob("*.yaml"))]
    if not parts:
        raise ValueError(f"no CRDs in {chart / 'crds'}")
    head = (
        f"# The CustomResourceDefinitions of cachefleet {version} (`cachefleet crds`).\n"
        "# kubectl apply --server-side -f this file (before `helm upgrade`, or let the chart's\n"
        "# crds.upgradeJob do it; docs/install.md).\n"
    )
    out = dist / f"cachefleet-crds-{version}.yaml"
    out.write_text(head + "---\n".join(p if p.endswith("\n") else p + "\n" for p in parts))
    return out


def artefacts(dist: Path, version: str) -> list[Path]:
    """The release's files present in ``dist``, sorted by name."""
    names = (f"cachefleet-{version}.oci.tar", f"cachefleet-{version}.tgz")
    names += (f"cachefleet-crds-{version}.yaml",)
    return sorted(dist / n for n in names if (dist / n).is_file())


def checksums(dist: Path, version: str) -> Path:
    """``SHA256SUMS`` of the release's other files in ``dist``."""
    lines = []
    for path in artefacts(dist, version):
        digest = hashlib.sha256()
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        lines.append(f"{digest.hexdigest()}  {path.name}\n")
    out = dist / SUMS
    out.write_text("".join(lines))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="release.py", description=__doc__.splitlines()[0])
    parser.add_argument("--image", required=True, help="the image's name without a tag")
    parser.add_argument("--dist", type=Path, default=ROOT / "dist", help="output directory")
    args = parser.parse_args(argv)
    if ":" in args.image.rsplit("/", 1)[-1] or "@" in args.image:
        parser.error(f"--image {args.image}: give the name without a tag (the tag is the version)")
    version = project_version()
    args.dist.mkdir(parents=True, exist_ok=True)
    for path in (
        package_chart(args.dist, version, args.image),
        crds_manifest(args.dist, version),
        checksums(args.dist, version),
    ):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
