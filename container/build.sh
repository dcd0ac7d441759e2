#!/usr/bin/env bash
# Build the exporter's container image from Containerfile (docs/container.md), or with
# IMAGE=probe the probe's from container/Containerfile.probe on top of it: first the wheels,
# here, with this machine's pip (the image installs them offline: no pip download, no private
# CA, no compiler inside the build), then the image with buildah, podman or docker.
#
#   container/build.sh [BUILD-OPTION...]
#
# BUILD-OPTIONs go to the builder's build command as they are, e.g. `--isolation chroot`
# (buildah as root without a container runtime) or `--pull=never`.
#
# Environment (all optional):
#   IMAGE          exporter (default) or probe: the exporter's image with the `probe` extra
#                  (PyTorch: some GBs with CUDA), FROM the exporter's image of the same version
#                  (EXPORTER, default gpunet-exporter:VERSION), which must be built first
#   BUILDER        buildah, podman or docker (default: the first of them installed)
#   TAG            the image's name (default gpunet-exporter:VERSION, VERSION the project's;
#                  gpunet-exporter-probe:VERSION for IMAGE=probe)
#   BASE           the base image (default: the Containerfile's, debian:bookworm-slim)
#   PYTHON         the Python whose pip makes the wheels here (default python3)
#   IMAGE_PYTHON   the base image's Python, X.Y (default 3.11: Debian 12's)
#   ARCH           the image's architecture, amd64 or arm64 (default: this machine's); give the
#                  builder the same one (`--platform linux/arm64`)
#   BUILD_CONTEXT  where the wheels go (BUILD_CONTEXT/build/wheels) and the build context
#                  (default: the repository root, whose .dockerignore keeps only the wheels)
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
context=${BUILD_CONTEXT:-$repo}
python=${PYTHON:-python3}
image_python=${IMAGE_PYTHON:-3.11}

case "${IMAGE:-exporter}" in
  exporter) containerfile=$repo/Containerfile; extra= ; name=gpunet-exporter ;;
  probe) containerfile=$repo/container/Containerfile.probe; extra=[probe]
    name=gpunet-exporter-probe ;;
  *) echo "build.sh: IMAGE must be exporter or probe, not $IMAGE" >&2; exit 2 ;;
esac

case "${ARCH:-$(uname -m)}" in
  amd64 | x86_64) arch=x86_64 ;;
  arm64 | aarch64) arch=aarch64 ;;
  *) echo "build.sh: unsupported architecture ${ARCH:-$(uname -m)} (amd64 or arm64)" >&2; exit 2 ;;
esac

builder=${BUILDER:-}
if [ -z "$builder" ]; then
  for b in buildah podman docker; do
    if command -v "$b" >/dev/null; then builder=$b; break; fi
  done
fi
case "$builder" in
  buildah) build=(buildah bud) ;;
  podman | docker) build=("$builder" build) ;;
  "") echo "build.sh: none of buildah, podman, docker is installed" >&2; exit 2 ;;
  *) echo "build.sh: BUILDER must be buildah, podman or docker, not $builder" >&2; exit 2 ;;
esac

# 1. The wheels. The project's own is pure Python; its dependencies' (PyYAML and bcrypt have
# compiled parts) are the ones published for the image's CPython and glibc, whatever Python and
# architecture this machine has: bookworm's glibc 2.36 runs every manylinux wheel up to 2_36.
wheels=$context/build/wheels
rm -rf "$wheels"
mkdir -p "$wheels"
"$python" -m pip wheel --quiet --no-deps --wheel-dir "$wheels" "$repo"
found=("$wheels"/gpunet_exporter-*.whl)
project_wheel=${found[0]}
platforms=()
for minor in $(seq 36 -1 17); do platforms+=(--platform "manylinux_2_${minor}_${arch}"); done
platforms+=(--platform "manylinux2014_${arch}")
abi=cp${image_python/./}
"$python" -m pip download --quiet --only-binary=:all: --dest "$wheels" \
  --implementation cp --python-version "$image_python" --abi "$abi" --abi abi3 --abi none \
  "${platforms[@]}" "$project_wheel$extra"
echo "build.sh: wheels for CPython $image_python on $arch in $wheels:"
for w in "$wheels"/*.whl; do echo "  ${w##*/}"; done

# 2. The image.
version=$(basename "$project_wheel" | cut -d- -f2)
tag=${TAG:-$name:$version}
args=(-f "$containerfile" -t "$tag" --build-arg "VERSION=$version")
if [ -n "${BASE:-}" ]; then args+=(--build-arg "BASE=$BASE"); fi
if [ "$name" = gpunet-exporter-probe ]; then
  args+=(--build-arg "EXPORTER=${EXPORTER:-gpunet-exporter:$version}")
fi
echo "build.sh: ${build[*]} ${args[*]} $* $context"
"${build[@]}" "${args[@]}" "$@" "$context"
echo "build.sh: built $tag"
