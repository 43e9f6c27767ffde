#!/usr/bin/env bash
# The release artefacts (`make release`, after `make image`), in DIST (default dist/; earlier
# artefacts of these four kinds are removed first, anything else there is left alone):
#
#   cachefleet-VERSION.oci.tar     the image IMAGE:VERSION as an OCI archive whose reference
#                                  name is IMAGE:VERSION (buildah/podman: oci-archive; docker:
#                                  `docker save`, an OCI image layout since Docker 25)
#   cachefleet-VERSION.tgz         the chart, packaged, image.repository=IMAGE, version and
#                                  appVersion VERSION: its default image is the archive's
#   cachefleet-crds-VERSION.yaml   the CRDs as one manifest
#   SHA256SUMS                     `sha256sum -c SHA256SUMS` checks the other three
#
# VERSION is pyproject.toml's; IMAGE the image's name without a tag (the Makefile's IMAGE).
# The last three come from scripts/release.py. Installing them: docs/install.md.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)
NAME=${IMAGE:?IMAGE: the image name without a tag, as for make image}
DIST=${DIST:-dist}
REF=$NAME:$VERSION
# shellcheck source=scripts/builder.sh
. scripts/builder.sh

builder=$(pick_builder)
[ "$builder" != buildah ] || export STORAGE_DRIVER=${STORAGE_DRIVER:-vfs} BUILDAH_ISOLATION=${BUILDAH_ISOLATION:-chroot}
mkdir -p "$DIST"
rm -f "$DIST"/cachefleet-*.oci.tar "$DIST"/cachefleet-*.tgz "$DIST"/cachefleet-crds-*.yaml "$DIST"/SHA256SUMS
archive=$DIST/cachefleet-$VERSION.oci.tar
case "$builder" in
  buildah) buildah push --quiet "$REF" "oci-archive:$archive:$REF" ;;
  podman) podman save --quiet --format oci-archive -o "$archive" "$REF" ;;
  docker) docker save -o "$archive" "$REF" ;;
  *) echo "no image builder (docker, podman, buildah): run make image first" >&2; exit 2 ;;
esac
"$PY" scripts/release.py --image "$NAME" --dist "$DIST" >/dev/null
ls -l "$DIST" >&2
(cd "$DIST" && sha256sum -c --quiet SHA256SUMS)
echo "$DIST"
