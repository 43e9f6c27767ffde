# Sourced by build-image.sh and release.sh: which image builder is here (BUILDER forces one).
# docker (with a running daemon), else podman, else buildah; "none" when none is installed.
pick_builder() {
  if [ -n "${BUILDER:-}" ]; then echo "$BUILDER"; return; fi
  if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then echo docker; return; fi
  if command -v podman >/dev/null 2>&1; then echo podman; return; fi
  if command -v buildah >/dev/null 2>&1; then echo buildah; return; fi
  echo none
}
