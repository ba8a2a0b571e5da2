#!/usr/bin/env bash
# Build the prefix-sidecar image with podman, from Debian packages only: no container registry.
#
#   deploy/build-image.sh            # or: make image
#
# 1. The base: a minimal Debian with python3 and python3-venv, made by mmdebstrap from the
#    mirrors apt already uses and imported as $BASE_IMAGE. An existing base is reused, so only
#    the first run on a machine pays for it. Set BASE_IMAGE to any other image (for example
#    python:3.11.11-slim-bookworm where a registry is reachable) to build on that instead.
# 2. The image: deploy/Dockerfile, tagged $IMAGE (prefix-sidecar:<version>, the image the
#    manifests in deploy/k8s run). The build reaches the package index through the host's CA
#    bundle, mounted read-only for the RUN steps; nothing of it stays in the image.
#
# It prints the image's size. It leaves behind only the base and the image: the temporary
# root filesystem, the build's containers and the image it replaces are removed.
#
# Environment: IMAGE, BASE_IMAGE, SUITE (bookworm), DEBIAN_MIRROR (default: the host's apt
# sources when the host runs $SUITE, else http://deb.debian.org/debian), CONTAINERS_CONF
# (default: deploy/podman/containers.conf, for machines without systemd).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VERSION="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$ROOT/pyproject.toml" | head -n 1)"
SUITE="${SUITE:-bookworm}"
IMAGE="${IMAGE:-localhost/prefix-sidecar:$VERSION}"
BASE_IMAGE="${BASE_IMAGE:-localhost/debian-python:$SUITE}"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$ROOT/deploy/podman/containers.conf}"
HOST_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt

say() { printf 'build-image: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

command -v podman >/dev/null || die "podman is not installed (apt-get install podman buildah runc mmdebstrap)"

workdir=""
cleanup() { if [ -n "$workdir" ]; then rm -rf "$workdir"; fi; }
trap cleanup EXIT

mirrors() {
    # The host's own mirror lines when it runs the same suite (a proxy or a snapshot mirror
    # keeps working), else Debian's default mirror.
    if [ -n "${DEBIAN_MIRROR:-}" ]; then
        echo "$DEBIAN_MIRROR"
        return
    fi
    local codename="" found=0 file
    if [ -r /etc/os-release ]; then
        # shellcheck source=/dev/null
        codename="$(. /etc/os-release && echo "${VERSION_CODENAME:-}")"
    fi
    if [ "$codename" = "$SUITE" ]; then
        for file in /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
            /etc/apt/sources.list.d/*.sources; do
            if [ -s "$file" ] && grep -q '^[^#]*debian' "$file"; then
                echo "$file"
                found=1
            fi
        done
    fi
    if [ "$found" = 0 ]; then
        echo "http://deb.debian.org/debian"
    fi
}

make_base() {
    command -v mmdebstrap >/dev/null \
        || die "$BASE_IMAGE is missing and mmdebstrap is not installed (apt-get install mmdebstrap)"
    workdir="$(mktemp -d /var/tmp/prefix-sidecar-base.XXXXXX)"
    local -a sources
    mapfile -t sources < <(mirrors)
    say "making $BASE_IMAGE with mmdebstrap from ${sources[*]}"
    # minbase + python3 and its venv module; no docs, man pages or translations (copyright
    # files stay), as in Debian's own slim images.
    mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates \
        --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --dpkgopt='path-exclude=/usr/share/info/*' \
        "$SUITE" "$workdir/rootfs.tar" "${sources[@]}"
    podman import --quiet \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["/bin/bash"]' \
        "$workdir/rootfs.tar" "$BASE_IMAGE" >/dev/null
    rm -rf "$workdir"
    workdir=""
}

size_of() { podman image inspect --format '{{.Size}}' "$1" | awk '{printf "%.0f MB", $1 / 1e6}'; }

if podman image exists "$BASE_IMAGE"; then
    say "reusing $BASE_IMAGE ($(size_of "$BASE_IMAGE"))"
elif [[ "$BASE_IMAGE" == localhost/* ]]; then
    make_base
    say "made $BASE_IMAGE ($(size_of "$BASE_IMAGE"))"
fi

build_args=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
if [[ "$BASE_IMAGE" == localhost/* ]]; then
    build_args+=(--pull=never)
fi
if [ -r "$HOST_CA_BUNDLE" ]; then
    # A TLS-intercepting proxy in front of the index is trusted through the host's bundle.
    build_args+=(-v "$HOST_CA_BUNDLE:$HOST_CA_BUNDLE:ro" --build-arg "PIP_CERT=$HOST_CA_BUNDLE")
fi
if [[ "${PIP_INDEX_URL:-}" == http* ]]; then
    build_args+=(--build-arg "PIP_INDEX_URL=$PIP_INDEX_URL")
fi

previous="$(podman image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)"
say "building $IMAGE on $BASE_IMAGE"
started=$SECONDS
# docker format: the OCI format has no HEALTHCHECK. No layer cache: a build leaves no
# intermediate images behind, and the builder stage is not worth keeping between builds.
podman build --format docker --layers=false --force-rm --network host \
    --ignorefile "$ROOT/deploy/Dockerfile.dockerignore" -f "$ROOT/deploy/Dockerfile" \
    "${build_args[@]}" -t "$IMAGE" "$ROOT" >&2
built="$(podman image inspect --format '{{.Id}}' "$IMAGE")"
if [ -n "$previous" ] && [ "$previous" != "$built" ]; then
    # The image this build replaced, unless something else still uses or names it.
    podman rmi "$previous" >/dev/null 2>&1 || true
fi
say "built $IMAGE in $((SECONDS - started)) s"
echo "$IMAGE $(size_of "$IMAGE")"
