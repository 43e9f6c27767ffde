#!/usr/bin/env bash
# Build the cachefleet image (Containerfile) with whichever builder is here:
# docker (with a running daemon), podman, or buildah. `make image` runs this.
#
#   IMAGE    the image's name without a tag (the Makefile's IMAGE; default: the chart's
#            image.repository); the tag is always the version in pyproject.toml
#   BASE     base image of both stages (default: python:3.11-slim-bookworm for
#            docker/podman; for buildah without BASE, a Debian bookworm base made
#            from Debian packages by mmdebstrap, as no registry image may be reachable)
#   BUILDER  force docker | podman | buildah
#
# The wheelhouse (build/wheels) is made on the host with pip: the project's wheel and
# requirements/runtime.txt's exact versions, checked against its hashes; the image installs
# it with --no-index --require-hashes, so the build itself needs no network and installs
# what the lock says. Prints the image reference NAME:VERSION.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)
NAME=${IMAGE:-$(sed -n 's/^  repository: //p' charts/cachefleet/values.yaml | head -1)}
case "${NAME##*/}" in
  *:* | *@*) echo "IMAGE=$NAME: give the name without a tag; the tag is the version ($VERSION)" >&2; exit 2 ;;
esac
IMAGE=$NAME:$VERSION
RUNTIME=requirements/runtime.txt
LOCAL_BASE=localhost/cachefleet-base:bookworm
WHEELS=build/wheels

# shellcheck source=scripts/builder.sh
. scripts/builder.sh
log() { printf '[image] %3ss %s\n' "$SECONDS" "$*" >&2; }

apt_install() {
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo=sudo
  log "installing Debian packages: $*"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

builder=$(pick_builder)
if [ "$builder" = none ]; then
  apt_install buildah mmdebstrap
  builder=buildah
fi
if [ "$builder" = buildah ]; then
  # rootless-friendly, daemonless defaults; the default local store (no custom root)
  export STORAGE_DRIVER=${STORAGE_DRIVER:-vfs} BUILDAH_ISOLATION=${BUILDAH_ISOLATION:-chroot}
fi

if [ -z "${BASE:-}" ]; then
  if [ "$builder" = buildah ]; then
    BASE=$LOCAL_BASE
    if ! buildah images -q "$BASE" >/dev/null 2>&1; then
      command -v mmdebstrap >/dev/null 2>&1 || apt_install mmdebstrap
      # essential packages + python3 (libstdc++ for numpy's and other manylinux wheels)
      log "base $BASE: Debian bookworm + python3 from Debian packages (mmdebstrap)"
      tmp=$(mktemp -d)
      trap 'rm -rf "$tmp"' EXIT
      mmdebstrap --quiet --variant=essential --include=python3,python3-venv,ca-certificates,libstdc++6 \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
        bookworm "$tmp/base.tar"
      c=$(buildah from scratch)
      buildah add --quiet "$c" "$tmp/base.tar" / >/dev/null
      buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$c"
      buildah commit --quiet --rm "$c" "$BASE" >/dev/null
    fi
  else
    BASE=docker.io/library/python:3.11-slim-bookworm
  fi
fi

# The base's Python decides the wheels (markers such as python_full_version <
# "3.11.3" differ between the host's 3.11 and Debian bookworm's 3.11.2).
case "$builder" in
  buildah)
    c=$(buildah from --quiet "$BASE")
    pyver=$(buildah run "$c" -- python3 -c 'import platform; print(platform.python_version())')
    buildah rm "$c" >/dev/null ;;
  *)
    pyver=$("$builder" run --rm --entrypoint python3 "$BASE" \
      -c 'import platform; print(platform.python_version())') ;;
esac
log "wheelhouse for Python $pyver: $WHEELS"
rm -rf "$WHEELS"
mkdir -p "$WHEELS"
quiet() { grep -v "^WARNING: Location" >&2 || true; }
"$PY" -m pip wheel -q --disable-pip-version-check --no-deps --wheel-dir "$WHEELS" . 2>&1 | quiet
wheel=$(ls "$WHEELS"/cachefleet-*.whl)
# The lock is resolved for Python 3.11 with no environment markers left in it, so
# --python-version only picks the wheels' ABI tags.
"$PY" -m pip download -q --disable-pip-version-check --no-deps --require-hashes \
  --only-binary=:all: --python-version "$pyver" --dest "$WHEELS" -r "$RUNTIME" 2>&1 | quiet
ls "$WHEELS"/redis-*.whl >/dev/null  # the download worked (its output is filtered)
cp "$RUNTIME" "$WHEELS/runtime.txt"
cp requirements/overlay.txt "$WHEELS/overlay.txt"  # installed again last (Containerfile)

log "building $IMAGE with $builder on $BASE"
previous=""
[ "$builder" != buildah ] || previous=$(buildah images -q "$IMAGE" 2>/dev/null || true)
case "$builder" in
  docker | podman)
    "$builder" build --build-arg "BASE=$BASE" -f Containerfile -t "$IMAGE" . ;;
  buildah)
    buildah bud --quiet --layers=false --build-arg "BASE=$BASE" -f Containerfile -t "$IMAGE" . >/dev/null ;;
  *)
    echo "unknown builder $builder" >&2; exit 2 ;;
esac
if [ -n "$previous" ] && [ "$previous" != "$(buildah images -q "$IMAGE")" ]; then
  buildah rmi "$previous" >/dev/null 2>&1 || true  # the image this tag named before (vfs: a full copy)
fi
log "built $IMAGE"
echo "$IMAGE"
