#!/usr/bin/env bash
# Set up CodeRunner on this machine: system packages (where apt-get can), the Python package
# in .venv, the sandbox's own Python environment, then `coderunner doctor`.
# Safe to run again: every step skips what is already done.
set -euo pipefail

cd "$(dirname "$0")"
REPO="$(pwd)"
VENV="$REPO/.venv"

say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
die() { printf 'install.sh: %s\n' "$*" >&2; exit 1; }

[ "$(uname -s)" = "Linux" ] || die "this installer covers Linux (bubblewrap); macOS support comes with the Apple container backend"

# 1. System packages: bubblewrap (the sandbox) and the system python3 + venv (the sandbox's interpreter).
APT_PACKAGES=(bubblewrap python3 python3-venv util-linux mount e2fsprogs libseccomp2 slirp4netns tesseract-ocr tesseract-ocr-eng chromium)
# Node.js runs execute_code's JavaScript inside the sandbox (any /usr/bin/node will do, e.g. NodeSource's).
[ -x /usr/bin/node ] || APT_PACKAGES+=(nodejs)
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

# A root server runs its sandboxes as this unprivileged user, never as root.
if [ "$(id -u)" -eq 0 ] && ! id -u coderunner-sandbox >/dev/null 2>&1; then
    say "creating the unprivileged system user coderunner-sandbox (sandboxes of a root server run as it)"
    useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin coderunner-sandbox
fi

# 2. The host side: a Python >= 3.10 for the server (any; the sandbox uses the system python3).
HOST_PYTHON="${CODERUNNER_HOST_PYTHON:-}"
if [ -z "$HOST_PYTHON" ]; then
    for candidate in python3 /usr/bin/python3; do
        if command -v "$candidate" >/dev/null 2>&1 &&
            "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
            HOST_PYTHON="$candidate"
            break
        fi
    done
fi
[ -n "$HOST_PYTHON" ] || die "need Python 3.10 or newer for the server"

if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV with $HOST_PYTHON"
    "$HOST_PYTHON" -m venv "$VENV"
fi
say "installing coderunner into $VENV"
"$VENV/bin/python" -m pip install --disable-pip-version-check -q --upgrade pip
"$VENV/bin/python" -m pip install --disable-pip-version-check -q -e "$REPO[dev]"

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
