"""The lock and pyproject.toml say the same thing, and the venv is what the lock says.

``requirements/lock.txt`` is written by ``make lock`` (uv pip compile with hashes) from
pyproject.toml's dependencies and the extras the Makefile installs. A dependency added to
one and not the other, a lock entry outside its range, or a venv that drifted from the lock
would make ``make test`` mean something different on the next machine (issue 33).
"""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements" / "lock.txt"
BUILD = ROOT / "requirements" / "build.txt"
BUILD_IN = ROOT / "requirements" / "build.in"
#: The extras the Makefile installs (its EXTRAS), all in the one lock.
EXTRAS = ("dev", "demo", "semantic")
PROJECT = "cachefleet"
#: How uv marks a package pyproject.toml asked for directly.
DIRECT = "cachefleet (pyproject.toml)"

_ENTRY = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==(\S+)")


def parse_lock(text: str) -> dict[str, tuple[str, list[str], list[str]]]:
    """``{name: (version, hashes, via)}`` from a ``uv pip compile --generate-hashes`` file."""
    entries: dict[str, tuple[str, list[str], list[str]]] = {}
    current: str | None = None
    in_via = False
    for raw in text.splitlines():
        line = raw.strip()
        match = _ENTRY.match(raw)
        if match:
            current = canonicalize_name(match.group(1))
            entries[current] = (match.group(3).rstrip("\\").strip(), [], [])
            in_via = False
            continue
        if current is None:
            continue
        if line.startswith("--hash="):
            entries[current][1].append(line.removeprefix("--hash=").rstrip("\\").strip())
        elif line.startswith("# via"):
            rest = line.removeprefix("# via").strip()
            in_via = not rest
            if rest:
                entries[current][2].append(rest)
        elif in_via and line.startswith("#   "):
            entries[current][2].append(line.removeprefix("#").strip())
        elif line and not line.startswith("#"):
            in_via = False
    return entries


def wanted() -> list[Requirement]:
    """pyproject.toml's requirements for this platform, the Makefile's extras included (and
    the project's own extras they name, e.g. dev's ``cachefleet[semantic]``)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    env = default_environment()
    out: list[Requirement] = []
    todo, seen = [*project["dependencies"]], set()
    for extra in EXTRAS:
        todo.extend(project["optional-dependencies"][extra])
        seen.add(extra)
    while todo:
        req = Requirement(todo.pop())
        if canonicalize_name(req.name) == PROJECT:
            for extra in set(req.extras) - seen:
                seen.add(extra)
                todo.extend(project["optional-dependencies"][extra])
        elif req.marker is None or req.marker.evaluate(env):
            out.append(req)
    return out


def _version(text: str) -> Version:
    return Version(text)


@pytest.fixture(scope="module")
def lock() -> dict[str, tuple[str, list[str], list[str]]]:
    return parse_lock(LOCK.read_text(encoding="utf-8"))


def test_every_dependency_of_pyproject_is_locked_within_its_range(
    lock: dict[str, tuple[str, list[str], list[str]]],
) -> None:
    missing, outside = [], []
    for req in wanted():
        name = canonicalize_name(req.name)
        if name not in lock:
            missing.append(req.name)
            continue
        version = lock[name][0]
        if not req.specifier.contains(_version(version), prereleases=True):
            outside.append(f"{req.name}=={version} (pyproject.toml: {req})")
    assert not missing, f"in pyproject.toml, not in {LOCK.name}: {missing}; run `make lock`"
    assert not outside, f"locked outside pyproject.toml's range: {outside}; run `make lock`"


def test_every_package_the_lock_says_pyproject_asked_for_is_in_pyproject(
    lock: dict[str, tuple[str, list[str], list[str]]],
) -> None:
    asked = {canonicalize_name(r.name) for r in wanted()}
    stale = sorted(
        name for name, (_, _, via) in lock.items() if DIRECT in via and name not in asked
    )
    assert not stale, f"{LOCK.name} holds direct dependencies pyproject.toml dropped: {stale}"


def test_every_locked_package_has_an_exact_version_and_a_hash(
    lock: dict[str, tuple[str, list[str], list[str]]],
) -> None:
    assert len(lock) > 50, "the lock parsed to almost nothing: is it a uv --generate-hashes file?"
    unhashed = sorted(name for name, (_, hashes, _) in lock.items() if not hashes)
    assert not unhashed, f"no hash for {unhashed}"
    assert all(h.startswith("sha256:") for _, hashes, _ in lock.values() for h in hashes)


def test_the_build_lock_covers_what_installs_the_project() -> None:
    build = parse_lock(BUILD.read_text(encoding="utf-8"))
    backend = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["build-system"]
    for text in backend["requires"]:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        assert name in build, f"build-system requires {req.name}, {BUILD.name} does not lock it"
        assert req.specifier.contains(_version(build[name][0]), prereleases=True)
    for line in BUILD_IN.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            assert canonicalize_name(Requirement(line).name) in build


def test_the_venv_holds_the_locked_versions(
    lock: dict[str, tuple[str, list[str], list[str]]],
) -> None:
    """`pip freeze` of the venv equals the lock for every locked package installed here."""
    drifted = []
    for name, (version, _, _) in lock.items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue  # locked for another platform (a marker), or not this venv's
        if Version(installed) != Version(version):
            drifted.append(f"{name}: venv {installed}, lock {version}")
    assert not drifted, f"the venv is not the lock (run `make venv`): {drifted}"


def test_the_parser_reads_uv_entries_with_hashes_and_via_lines() -> None:
    text = (
        "# header\n"
        "redis==8.1.0 \\\n"
        "    --hash=sha256:aa \\\n"
        "    --hash=sha256:bb\n"
        "    # via\n"
        "    #   cachefleet (pyproject.toml)\n"
        "    #   kopf\n"
        "torch==2.13.0+cpu \\\n"
        "    --hash=sha256:cc\n"
        "    # via sentence-transformers\n"
    )
    parsed = parse_lock(text)
    assert parsed["redis"] == ("8.1.0", ["sha256:aa", "sha256:bb"], [DIRECT, "kopf"])
    assert parsed["torch"] == ("2.13.0+cpu", ["sha256:cc"], ["sentence-transformers"])


def test_the_overlay_installs_again_exactly_what_the_lock_says(
    lock: dict[str, tuple[str, list[str], list[str]]],
) -> None:
    overlay = parse_lock((ROOT / "requirements" / "overlay.txt").read_text(encoding="utf-8"))
    assert overlay, "requirements/overlay.txt parsed to nothing"
    for name, (version, hashes, _) in overlay.items():
        assert lock[name][0] == version, f"{name}: overlay {version}, lock {lock[name][0]}"
        assert set(hashes) <= set(lock[name][1])


def test_the_otlp_exporter_gets_opentelemetry_protos_own_files() -> None:
    """xds-protos ships an older opentelemetry/proto/ at the same paths: the overlay put
    opentelemetry-proto's back, so the exporter's import works in a fresh venv."""
    common = pytest.importorskip("opentelemetry.proto.common.v1.common_pb2")
    assert hasattr(common, "InstrumentationScope")
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter")
    pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")
