"""pip into this session's own package folder, which the kernel imports from before the base env.

The folder lives in the session's workspace, so other sessions and the shared, read-only
sandbox environment never change; the guest puts it on sys.path once each kernel is up (user_paths).
"""

import importlib
import importlib.metadata
import os
import re
import subprocess
import sys

from .dispatch import GuestError

#: System trust store (bound read-only from the host): honours proxies that re-sign TLS.
SYSTEM_CA = "/etc/ssl/certs/ca-certificates.crt"
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,-]+\])?"
_VERSION = r"[<>=!~]=?[A-Za-z0-9.*+!_-]+"
REQUIREMENT = re.compile(f"{_NAME}({_VERSION}(,{_VERSION})*)?")
#: Modules Python imports by itself at start-up when they are on sys.path.
STARTUP_HOOKS = ("sitecustomize", "usercustomize")


def _name(requirement):
    return re.split(r"[\[<>=!~]", requirement, maxsplit=1)[0]


def run(packages, target, timeout_s):
    if not packages or not all(isinstance(p, str) and REQUIREMENT.fullmatch(p) for p in packages):
        raise GuestError("packages must be requirement specifiers like 'requests' or 'httpx==0.28.1'")
    os.makedirs(target, exist_ok=True)
    argv = [
        sys.executable,
        "-P",  # the kernel's cwd is /workspace: a planted pip/ there must not run as pip
        "-m",
        "pip",
        "install",
        "--target",
        target,
        "--no-input",
        "--disable-pip-version-check",
        "--progress-bar",
        "off",
        "--upgrade",
    ]
    if os.path.exists(SYSTEM_CA):
        argv += ["--cert", SYSTEM_CA]
    try:
        done = subprocess.run([*argv, "--", *packages], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise GuestError(f"pip did not finish within {timeout_s:g}s") from None
    if done.returncode != 0:
        raise GuestError(f"pip failed (exit {done.returncode}): {(done.stderr or done.stdout).strip()[-1500:]}")
    if target not in sys.path:
        sys.path.insert(0, target)
    importlib.invalidate_caches()
    found = {
        dist.metadata["Name"].lower().replace("_", "-"): dist.version
        for dist in importlib.metadata.distributions(path=[target])
    }
    wanted = [_name(p).lower().replace("_", "-") for p in packages]
    result = {
        "installed": {name: found.get(name) for name in wanted},
        "all_in_session": dict(sorted(found.items())),
        "target": target,
    }
    hooks = sorted(name for name in os.listdir(target) if name.split(".", 1)[0] in STARTUP_HOOKS)
    if hooks:
        # Never silent: these run in every new interpreter of this session (the host sets them
        # aside when a persistent workspace is reopened).
        result["startup_hooks"] = hooks
    return result
