"""The container image as a user gets it: `make release`, then the image run for real.

Builds with whichever builder `make image` picks (here buildah with the vfs
driver and chroot isolation, on a Debian base made by mmdebstrap; both are
installed with apt when missing), through `make release` (which runs `make
image` first), then checks the image's metadata (numeric non-root user,
`cachefleet` entry point), runs `cachefleet --help` in it, checks the final
stage carries no compiler, runs the sidecar from the image in front of a
stand-in model server on the host's loopback, answering a request through it (a
miss, then the same request as an L1 hit), checks it holds exactly the
distributions of requirements/runtime.txt, and checks the release: the OCI
archive holds this image under NAME:VERSION and the packaged chart asks for
exactly that reference.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import helm_python
import httpx
import pytest
import yaml
from packaging.utils import canonicalize_name

from cachefleet_e2e.fake_upstream import FakeUpstream
from cachefleet_e2e.services import free_port

pytestmark = [pytest.mark.image, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
FOUND = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M)
VERSION = FOUND.group(1) if FOUND else "dev"
#: `make release IMAGE=...`: the name without a tag; the tag is the version.
NAME = "localhost/cachefleet"
IMAGE = f"{NAME}:{VERSION}"
#: Safety net on the whole build (a cold build is a few minutes on a loaded 2-core box).
BUILD_TIMEOUT_S = 840
#: Bound on one command run in the image.
RUN_TIMEOUT_S = 120
UID = 10001
BODY = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}


def builder() -> str:
    if os.environ.get("BUILDER"):
        return os.environ["BUILDER"]
    if (
        shutil.which("docker")
        and subprocess.run(
            ["docker", "info"], capture_output=True, check=False, timeout=30
        ).returncode
        == 0
    ):
        return "docker"
    return "podman" if shutil.which("podman") else "buildah"


ENV = {**os.environ, "STORAGE_DRIVER": "vfs", "BUILDAH_ISOLATION": "chroot"}


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    result = subprocess.run(
        ["make", "release", f"IMAGE={NAME}", f"DIST={out}"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    if result.returncode != 0:
        pytest.fail(f"make release failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return out


@pytest.fixture(scope="module")
def image(dist: Path) -> str:
    return IMAGE


class Container:
    """One container from the image; ``run`` executes a command in it (host network)."""

    def __init__(self, image: str, kind: str) -> None:
        self.image, self.kind = image, kind
        self.id = ""
        if kind == "buildah":
            self.id = subprocess.run(
                ["buildah", "from", "--quiet", image],
                env=ENV,
                capture_output=True,
                text=True,
                check=True,
                timeout=RUN_TIMEOUT_S,
            ).stdout.strip()

    def argv(self, *command: str) -> list[str]:
        if self.kind == "buildah":
            return ["buildah", "run", self.id, "--", *command]
        return [
            self.kind,
            "run",
            "--rm",
            "--network",
            "host",
            "--entrypoint",
            "",
            self.image,
            *command,
        ]

    def run(self, *command: str) -> str:
        result = subprocess.run(
            self.argv(*command),
            env=ENV,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    def remove(self) -> None:
        if self.id:
            subprocess.run(["buildah", "rm", self.id], env=ENV, capture_output=True, check=False)


@pytest.fixture(scope="module")
def container(image: str) -> Iterator[Container]:
    box = Container(image, builder())
    try:
        yield box
    finally:
        box.remove()


def config_of(image: str, kind: str) -> dict[str, object]:
    if kind == "buildah":
        out = subprocess.run(
            ["buildah", "inspect", "--type", "image", image],
            env=ENV,
            capture_output=True,
            text=True,
            check=True,
            timeout=RUN_TIMEOUT_S,
        ).stdout
        return dict(json.loads(out)["OCIv1"]["config"])
    out = subprocess.run(
        [kind, "image", "inspect", image], capture_output=True, text=True, check=True
    ).stdout
    config = json.loads(out)[0]["Config"]
    return {"User": config["User"], "Entrypoint": config["Entrypoint"]}


def test_image_runs_cachefleet_as_a_numeric_non_root_user(image: str) -> None:
    config = config_of(image, builder())
    assert config["User"] == f"{UID}:{UID}"
    assert config["Entrypoint"] == ["cachefleet"]


def test_help_and_no_compiler_in_the_final_stage(container: Container) -> None:
    out = container.run("cachefleet", "--help")
    assert "sidecar" in out
    assert "operator" in out
    assert container.run("id", "-u").strip() == str(UID)
    probe = "for c in gcc cc c++ g++ clang; do command -v $c; done; echo end"
    assert container.run("sh", "-c", probe).strip() == "end"
    assert "operator" in container.run("cachefleet", "operator", "--help")


def test_sidecar_from_the_image_answers_through_the_cache(container: Container) -> None:
    port, admin = free_port(), free_port()
    with FakeUpstream() as upstream:
        proc = subprocess.Popen(
            container.argv(
                "cachefleet",
                "sidecar",
                "--listen",
                f"127.0.0.1:{port}",
                "--admin-listen",
                f"127.0.0.1:{admin}",
                "--upstream",
                upstream.url,
                # the test names its tenant by header, from loopback
                "--trusted-proxies",
                "127.0.0.1/32",
            ),
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while True:
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                try:
                    if httpx.get(f"http://127.0.0.1:{admin}/healthz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "the sidecar in the image never got ready"
                time.sleep(0.2)
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            headers = {"X-Tenant-ID": "acme"}
            first = httpx.post(url, json=BODY, headers=headers, timeout=30)
            second = httpx.post(url, json=BODY, headers=headers, timeout=30)
            assert first.status_code == 200
            assert (first.headers["x-cache"], second.headers["x-cache"]) == ("MISS", "HIT-L1")
            assert second.json() == first.json()
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def blob(archive: tarfile.TarFile, digest: str) -> dict[str, object]:
    member = archive.extractfile("blobs/" + digest.replace(":", "/"))
    assert member is not None
    data = member.read()
    assert "sha256:" + hashlib.sha256(data).hexdigest() == digest
    return dict(json.loads(data))


def test_release_archive_is_the_image_and_the_chart_asks_for_it(dist: Path) -> None:
    names = {p.name for p in dist.iterdir()}
    assert names == {
        f"cachefleet-{VERSION}.oci.tar",
        f"cachefleet-{VERSION}.tgz",
        f"cachefleet-crds-{VERSION}.yaml",
        "SHA256SUMS",
    }
    sums = (dist / "SHA256SUMS").read_text()
    assert f"  cachefleet-{VERSION}.oci.tar\n" in sums
    check = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=dist, capture_output=True)
    assert check.returncode == 0, check.stdout
    with tarfile.open(dist / f"cachefleet-{VERSION}.oci.tar") as archive:
        index_file = archive.extractfile("index.json")
        assert index_file is not None
        index = json.load(io.TextIOWrapper(index_file))
        (manifest_ref,) = index["manifests"]
        ref_name = manifest_ref["annotations"]["org.opencontainers.image.ref.name"]
        manifest = blob(archive, manifest_ref["digest"])
        config = blob(archive, manifest["config"]["digest"])  # type: ignore[index]
    assert ref_name == IMAGE
    assert config["config"]["User"] == "10001:10001"  # type: ignore[index]
    assert config["config"]["Entrypoint"] == ["cachefleet"]  # type: ignore[index]
    # the packaged chart, rendered with its defaults, runs that reference
    chart = helm_python.Chart.load(str(dist / f"cachefleet-{VERSION}.tgz"))
    out = chart.render({}, name="cf", namespace="cf", is_install=True)
    (deployment,) = [
        d
        for path, text in out.items()
        if not path.endswith("NOTES.txt")
        for d in yaml.safe_load_all(text)
        if isinstance(d, dict) and d.get("kind") == "Deployment"
    ]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == ref_name


FREEZE = (
    "import importlib.metadata as m\n"
    "for d in m.distributions(): print(d.metadata['Name'], d.version)"
)


def test_the_image_holds_exactly_the_runtime_lock(container: Container) -> None:
    installed = {}
    for line in container.run("python3", "-c", FREEZE).splitlines():
        name, version = line.split()
        installed[canonicalize_name(name)] = version
    locked = {}
    for line in (ROOT / "requirements" / "runtime.txt").read_text().splitlines():
        if found := re.match(r"^([A-Za-z0-9._-]+)==(\S+)", line):
            locked[canonicalize_name(found.group(1))] = found.group(2)
    assert installed.pop("cachefleet") == VERSION
    assert installed == locked
