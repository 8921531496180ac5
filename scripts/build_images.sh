#!/usr/bin/env bash
# Build the images with buildah: no daemon, no image registry (bases are local
# images, --pull=never), vfs storage (by default) and chroot isolation, so it
# runs as root inside a container too. tests/test_images.py runs it.
#   bash scripts/build_images.sh TARGET...
#     base       Debian bookworm (debootstrap --variant=minbase) imported as the
#                local image debian:bookworm-slim, the base of Dockerfile.cpu
#     cpu        Dockerfile.cpu             -> localhost/vllm-kvevict:cpu
#     gpu-check  Dockerfile (GPU) built on a CPU stand-in for its base image:
#                the cpu image without vllm-kvevict (vLLM's CPU build, torch,
#                Python), run as root like vLLM's image
#                                           -> localhost/vllm-kvevict:gpu-check
# Environment:
#   KVEVICT_BUILDAH_DIR  storage root and run root (default /tmp/kvevict-buildah)
#   KVEVICT_BUILDAH_DRIVER
#                        storage driver: vfs (default: works wherever buildah
#                        runs as root, every layer and container a full copy)
#                        or overlay (the kernel's overlayfs, which a container
#                        may not offer: layers hold only their changes, much
#                        faster). A storage root keeps the driver it was
#                        created with.
#   PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS, PIP_CERT
#                        passed to the builds as build arguments (the
#                        Dockerfiles' defaults: PyPI and PyTorch's CPU index);
#                        local directories named in them (/dir, file:///dir;
#                        for a local index .../simple, its parent) are
#                        mounted read-only at the same path, PIP_CERT (a CA
#                        bundle) at /run/pip-ca.crt
#   DEBIAN_MIRROR        for `base` (default http://deb.debian.org/debian)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DIR=${KVEVICT_BUILDAH_DIR:-/tmp/kvevict-buildah}
DRIVER=${KVEVICT_BUILDAH_DRIVER:-vfs}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
BASE=docker.io/library/debian:bookworm-slim
STANDIN=localhost/vllm-kvevict:gpu-standin

[ $# -gt 0 ] || { echo "usage: $0 base|cpu|gpu-check..." >&2; exit 2; }
for tool in buildah debootstrap; do
  command -v "$tool" >/dev/null || { echo "build_images: $tool is not installed (bash scripts/install_deploy_tools.sh)" >&2; exit 1; }
done
case $DRIVER in
  vfs|overlay) ;;
  *) echo "build_images: KVEVICT_BUILDAH_DRIVER=$DRIVER: vfs or overlay" >&2; exit 2 ;;
esac
mkdir -p "$DIR"
bh() { buildah --root "$DIR/storage" --runroot "$DIR/run" --storage-driver "$DRIVER" "$@"; }

# Build arguments and read-only mounts for pip's settings.
BUILD_OPTS=(--isolation chroot --pull=never --format docker)
for var in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS; do
  value=${!var:-}
  [ -n "$value" ] || continue
  BUILD_OPTS+=(--build-arg "$var=$value")
  for item in $value; do
    path=${item#file://}
    path=${path%/}
    # A local index's pages link its files relative to it (../../files/...).
    if [ "${path##*/}" = simple ]; then path=${path%/simple}; fi
    if [ "${path#/}" != "$path" ] && [ -d "$path" ]; then
      BUILD_OPTS+=(-v "$path:$path:ro")
    fi
  done
done
# The CA bundle goes to a path of its own: the image's ca-certificates package
# writes its bundle at the usual one.
if [ -n "${PIP_CERT:-}" ]; then
  [ -f "$PIP_CERT" ] || { echo "build_images: PIP_CERT=$PIP_CERT is not a file" >&2; exit 1; }
  BUILD_OPTS+=(--build-arg PIP_CERT=/run/pip-ca.crt -v "$PIP_CERT:/run/pip-ca.crt:ro")
fi

build_base() {
  local rootfs ctr
  rootfs=$(mktemp -d "$DIR/rootfs.XXXXXX")
  debootstrap --variant=minbase bookworm "$rootfs" "$MIRROR" >"$DIR/debootstrap.log" 2>&1 \
    || { tail -n 20 "$DIR/debootstrap.log" >&2; exit 1; }
  echo "build_images: base: debootstrap in $((SECONDS - start)) s"
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  ctr=$(bh from scratch)
  tar -C "$rootfs" -cf "$DIR/rootfs.tar" .
  rm -rf "$rootfs"
  bh add "$ctr" "$DIR/rootfs.tar" / >/dev/null
  rm -f "$DIR/rootfs.tar"
  bh config --cmd '["bash"]' \
    --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$ctr"
  bh commit --rm --quiet "$ctr" "$BASE" >/dev/null
}

build_gpu_check() {
  local ctr
  ctr=$(bh from --pull=never localhost/vllm-kvevict:cpu)
  bh run --isolation chroot --user root "$ctr" -- sh -c \
    'pip uninstall -q -y vllm-kvevict && rm -rf /opt/vllm-kvevict /usr/local/bin/kvevict-entrypoint'
  bh config --user root --workingdir / --entrypoint '[]' --cmd '["bash"]' --healthcheck NONE \
    --env MODEL- --env KV_EVICTION- --env EXTRA_ARGS- --env KVEVICT_CACHE_DIR- \
    --env KVEVICT_CONFIG_DIR- "$ctr"
  bh commit --rm --quiet "$ctr" "$STANDIN" >/dev/null
  bh bud "${BUILD_OPTS[@]}" --build-arg "BASE_IMAGE=$STANDIN" -f "$ROOT/Dockerfile" \
    -t localhost/vllm-kvevict:gpu-check "$ROOT"
}

for target in "$@"; do
  start=$SECONDS
  case $target in
    base) build_base ;;
    cpu) bh bud "${BUILD_OPTS[@]}" -f "$ROOT/Dockerfile.cpu" -t localhost/vllm-kvevict:cpu "$ROOT" ;;
    gpu-check) build_gpu_check ;;
    *) echo "build_images: unknown target $target (base, cpu, gpu-check)" >&2; exit 2 ;;
  esac
  echo "build_images: $target built in $((SECONDS - start)) s"
done
