#!/bin/sh
# Make a Debian bookworm base image without any registry: a minimal root filesystem from Debian's
# own mirror (mmdebstrap), imported into the local image store. Use it as the sandbox image's base
# where Docker Hub cannot be reached:
#   containers/make-base-image.sh podman localhost/coderunner-base:bookworm
#   coderunner setup --backend podman --base-image localhost/coderunner-base:bookworm
set -eu
ENGINE="${1:-podman}"
TAG="${2:-localhost/coderunner-base:bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SECURITY="${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"

command -v mmdebstrap >/dev/null || { echo "make-base-image.sh: needs mmdebstrap (apt-get install mmdebstrap)" >&2; exit 1; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$work/rootfs.tar" \
    "deb $MIRROR bookworm main" "deb $MIRROR bookworm-updates main" "deb $SECURITY bookworm-security main" >&2
"$ENGINE" import --change 'CMD ["/bin/bash"]' "$work/rootfs.tar" "$TAG" >&2
echo "$TAG"
