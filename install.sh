#!/usr/bin/env bash
# Set up CodeRunner on this machine, then run `coderunner doctor`.
#   Linux: system packages (where apt-get can), the Python package in .venv, the sandbox's own
#          Python environment (bubblewrap backend); podman, runc and mmdebstrap for the podman backend.
#   macOS: Apple `container`, its system service, the sandbox image, the Python package in .venv.
# Safe to run again: every step skips what is already done.
set -euo pipefail

cd "$(dirname "$0")"
REPO="$(pwd)"
VENV="$REPO/.venv"

say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
die() { printf 'install.sh: %s\n' "$*" >&2; exit 1; }

# The host side needs a Python >= 3.11 for the server (the sandbox has its own).
find_host_python() {
    local candidate
    for candidate in ${CODERUNNER_HOST_PYTHON:-} python3.13 python3.12 python3.11 python3 /usr/bin/python3; do
        if command -v "$candidate" >/dev/null 2>&1 &&
            "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}

install_venv() {
    local host_python="$1"
    if [ ! -x "$VENV/bin/python" ]; then
        say "creating $VENV with $host_python"
        "$host_python" -m venv "$VENV"
    fi
    say "installing coderunner into $VENV"
    "$VENV/bin/python" -m pip install --disable-pip-version-check -q --upgrade pip
    # The `ray` extra is the cluster mode (docs/cluster.md); its tests run a real cluster.
    "$VENV/bin/python" -m pip install --disable-pip-version-check -q -e "$REPO[dev,ray]"
}

# --- macOS: Apple `container` (one lightweight Linux VM per session) --------------------------------
# Needs macOS 26 and Apple silicon. Installs one known-good `container` release on either path:
# Homebrew when its formula is that release, else Apple's signed package of it. Then starts its
# system service (with the default Linux kernel), builds the sandbox image from the Containerfile,
# creates .venv, and runs doctor. Keep the pin in step with PINNED_VERSION in sandbox/apple.py
# (and the oldest release the server accepts, MIN_VERSION, with CONTAINER_MIN below).
CONTAINER_VERSION="${CODERUNNER_CONTAINER_VERSION:-1.2.2}"
CONTAINER_MIN="0.6.0"
# "container CLI version 1.2.2 (build: release, commit: ...)" -> 1.2.2
container_version() { container --version 2>/dev/null | sed -n 's/.*version \([0-9][0-9]*\.[0-9][0-9]*\.[0-9][0-9]*\).*/\1/p'; }
# true when version $1 is older than $2
version_lt() { [ "$1" != "$2" ] && [ "$(printf '%s\n%s\n' "$1" "$2" | sort -t. -k1,1n -k2,2n -k3,3n | head -n1)" = "$1" ]; }
install_container_pkg() {
    pkg="container-${CONTAINER_VERSION}-installer-signed.pkg"
    say "installing Apple container $CONTAINER_VERSION (Apple's signed package from github.com/apple/container; asks for your password)"
    tmp="$(mktemp -d)"
    curl -fsSL --max-time 600 -o "$tmp/$pkg" "https://github.com/apple/container/releases/download/${CONTAINER_VERSION}/${pkg}"
    pkgutil --check-signature "$tmp/$pkg" | grep -q "Apple" || die "$pkg is not signed as expected"
    sudo installer -pkg "$tmp/$pkg" -target /
    rm -rf "$tmp"
}
if [ "$(uname -s)" = "Darwin" ]; then
    [ "$(uname -m)" = "arm64" ] || die "Apple container needs Apple silicon (this Mac is $(uname -m)); use Docker Desktop: coderunner setup --backend docker"
    macos="$(sw_vers -productVersion)"
    [ "${macos%%.*}" -ge 26 ] || die "Apple container needs macOS 26 or newer (this Mac runs $macos)"
    # Homebrew's prefix on Apple silicon; Apple's package installs to /usr/local/bin.
    export PATH="/opt/homebrew/bin:/usr/local/bin:$PATH"
    if ! command -v container >/dev/null 2>&1; then
        brewed="$(command -v brew >/dev/null 2>&1 && brew info container 2>/dev/null | sed -n '1s/.*stable \([0-9.]*\).*/\1/p')"
        if [ -n "$brewed" ] && [ "$brewed" = "$CONTAINER_VERSION" ]; then
            say "installing Apple container $CONTAINER_VERSION with Homebrew"
            brew install container
        else
            [ -n "$brewed" ] && say "Homebrew offers container $brewed, not the tested $CONTAINER_VERSION: using Apple's package"
            install_container_pkg
        fi
    fi
    command -v container >/dev/null 2>&1 || die "container is still not on PATH (Homebrew: /opt/homebrew/bin, Apple's package: /usr/local/bin)"
    have="$(container_version)"
    [ -n "$have" ] || die "cannot read \`container --version\`"
    if version_lt "$have" "$CONTAINER_MIN"; then
        say "Apple container $have is older than $CONTAINER_MIN, the oldest CodeRunner supports: upgrading"
        if command -v brew >/dev/null 2>&1 && brew list container >/dev/null 2>&1; then
            brew upgrade container
        else
            # Apple's package: its uninstaller keeps your images and data (-k), then the pinned release.
            sudo /usr/local/bin/uninstall-container.sh -k
            install_container_pkg
        fi
        have="$(container_version)"
        ! version_lt "$have" "$CONTAINER_MIN" || die "Apple container is still $have: install $CONTAINER_VERSION from github.com/apple/container/releases"
    fi
    [ "$have" = "$CONTAINER_VERSION" ] || say "using the installed Apple container $have (tested: $CONTAINER_VERSION)"
    say "starting the container system service"
    container system start --enable-kernel-install
    HOST_PYTHON="$(find_host_python)" || die "need Python 3.11 or newer for the server (Apple's is 3.9): brew install python@3.12"
    install_venv "$HOST_PYTHON"
    say "building the sandbox image with container build (minutes the first time)"
    "$VENV/bin/coderunner" setup --backend apple
    say "checking: coderunner doctor"
    "$VENV/bin/coderunner" doctor
    cat >&2 <<EOF

CodeRunner is ready (Apple container backend). Add it to Claude Code with:
    claude mcp add coderunner -- $VENV/bin/coderunner serve
EOF
    exit 0
fi

[ "$(uname -s)" = "Linux" ] || die "this installer covers Linux and macOS; elsewhere use podman or docker: coderunner setup --backend docker"

# 1. System packages: bubblewrap (the sandbox) and the system python3 + venv (the sandbox's interpreter).
APT_PACKAGES=(bubblewrap python3 python3-venv util-linux mount e2fsprogs libseccomp2 slirp4netns tesseract-ocr tesseract-ocr-eng chromium)
# mkfs.xfs: tests/test_snapshot_reflink.py makes a reflink=1 XFS to prove snapshots clone, not copy.
APT_PACKAGES+=(xfsprogs)
# A C compiler: `coderunner setup` builds each sandbox's pid 1 from guest/sandbox_init.c (about 5 CPU-ms less a
# start than the Python init, which serves where there is none).
APT_PACKAGES+=(gcc libc6-dev)
# Node.js runs execute_code's JavaScript inside the sandbox (any /usr/bin/node will do, e.g. NodeSource's).
[ -x /usr/bin/node ] || APT_PACKAGES+=(nodejs)
# The podman backend and its tests: podman with runc (crun fails on hybrid cgroup hosts), and
# mmdebstrap to make a base image from Debian's mirror where no registry is reachable.
# CODERUNNER_NO_PODMAN=1 skips them (the bwrap backend needs none of these).
[ -n "${CODERUNNER_NO_PODMAN:-}" ] || APT_PACKAGES+=(podman runc mmdebstrap)
# The gvisor backend (root servers): podman builds and mounts the image, runsc (gVisor) runs it
# directly, a kernel of its own per sandbox, checkpointable.
[ -n "${CODERUNNER_NO_PODMAN:-}" ] || APT_PACKAGES+=(runsc)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
# npm only for the test suite (it installs the pinned MCP Inspector CLI); any npm will do.
command -v npm >/dev/null 2>&1 || missing+=(npm)
if [ "${#missing[@]}" -gt 0 ]; then
    if command -v apt-get >/dev/null 2>&1; then
        SUDO=""
        [ "$(id -u)" -eq 0 ] || SUDO="sudo"
        say "installing system packages: ${missing[*]}"
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
    else
        die "please install with your package manager: ${missing[*]} (bwrap, python3 with venv, prlimit)"
    fi
fi

# 2. The host side: a Python >= 3.11 for the server (any; the sandbox uses the system python3).
HOST_PYTHON="$(find_host_python)" || die "need Python 3.11 or newer for the server"
install_venv "$HOST_PYTHON"

# 3. The sandbox's Python environment (ipykernel, numpy, pandas, matplotlib).
say "setting up the sandbox environment"
"$VENV/bin/coderunner" setup

# 4. Prove it works here.
say "checking: coderunner doctor"
"$VENV/bin/coderunner" doctor

cat >&2 <<EOF

CodeRunner is ready. Add it to Claude Code with:
    claude mcp add coderunner -- $VENV/bin/coderunner serve
EOF
case "$REPO" in
    */.claude/skills/*) say "this folder is also a Claude Code skill (SKILL.md): it tells the agent which tool to use when" ;;
esac
