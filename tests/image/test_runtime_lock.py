"""requirements/runtime.txt: what the image installs (no builder needed; fast).

The image installs pyproject.toml's dependencies without extras at exact versions
with hashes (scripts/build-image.sh, Containerfile). That file is compiled with
requirements/lock.txt as constraints (`make lock`), so the image runs the versions
the tests ran; these tests fail when the two drift apart or a dependency is missing.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PIN = re.compile(r"^([A-Za-z0-9._-]+)==(\S+)")


def pins(path: Path) -> dict[str, str]:
    """{name: version} of a uv-compiled requirements file; every pin has its hashes."""
    found = {}
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if m := PIN.match(line):
            found[canonicalize_name(m.group(1))] = m.group(2)
            assert "--hash=sha256:" in lines[i + 1], f"{path.name}: {line} has no hash"
    return found


def test_runtime_lock_pins_every_dependency_at_the_locks_version() -> None:
    runtime = pins(ROOT / "requirements" / "runtime.txt")
    lock = pins(ROOT / "requirements" / "lock.txt")
    with (ROOT / "pyproject.toml").open("rb") as f:
        project = tomllib.load(f)["project"]
    direct = {canonicalize_name(Requirement(r).name) for r in project["dependencies"]}
    assert direct <= set(runtime), sorted(direct - set(runtime))
    drift = {n: (v, lock.get(n)) for n, v in runtime.items() if lock.get(n) != v}
    assert drift == {}, "run `make lock`: runtime.txt and lock.txt disagree"
    # the tools of the dev extra stay out of the image
    dev_only = {"pytest", "mypy", "ruff", "hypothesis", "helm-python-sdk", "uv", "import-linter"}
    assert not dev_only & set(runtime)
