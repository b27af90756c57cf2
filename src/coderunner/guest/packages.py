"""pip into this session's own package folder, which the kernel imports from before the base env.

The folder lives in the session's workspace, so other sessions and the shared, read-only sandbox
environment never change; the guest puts it on sys.path once each kernel is up (user_paths). An
allowlist sandbox whose proxy refuses the package index is told so before pip runs (index_probe.py).
"""

import importlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys

from .errors import GuestError
from .index_probe import unreachable as index_unreachable

#: System trust store (bound read-only from the host): honours proxies that re-sign TLS.
SYSTEM_CA = "/etc/ssl/certs/ca-certificates.crt"
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,-]+\])?"
_VERSION = r"[<>=!~]=?[A-Za-z0-9.*+!_-]+"
REQUIREMENT = re.compile(f"{_NAME}({_VERSION}(,{_VERSION})*)?")
#: Modules Python imports by itself at start-up when they are on sys.path.
STARTUP_HOOKS = ("sitecustomize", "usercustomize")


def _name(requirement):
    return re.split(r"[\[<>=!~]", requirement, maxsplit=1)[0]


def _drop_stale_metadata(target):
    """Keep one metadata folder per project: pip --target --upgrade moves the new six-1.17.0.dist-info in
    beside the old six-1.16.0.dist-info (the code itself is replaced), and the report, and
    importlib.metadata, would then read either. The newest, moved in by this run, stays."""
    projects: dict[str, list[os.DirEntry[str]]] = {}
    with os.scandir(target) as entries:
        for entry in entries:
            if entry.name.endswith(".dist-info") and entry.is_dir(follow_symlinks=False):
                project = entry.name[: -len(".dist-info")].rsplit("-", 1)[0]
                projects.setdefault(re.sub(r"[-_.]+", "-", project).lower(), []).append(entry)
    for folders in projects.values():
        folders.sort(key=lambda entry: entry.stat(follow_symlinks=False).st_mtime_ns)
        for stale in folders[:-1]:
            shutil.rmtree(stale.path, ignore_errors=True)


def run(packages, target, timeout_s, started=None):
    """Install; `started` is called once pip is about to run (%pip prints a line for the wait)."""
    if not packages or not all(isinstance(p, str) and REQUIREMENT.fullmatch(p) for p in packages):
        raise GuestError("packages must be requirement specifiers like 'requests' or 'httpx==0.28.1'")
    refused = index_unreachable()
    if refused:
        raise GuestError(refused)
    os.makedirs(target, exist_ok=True)
    if started is not None:
        started()
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
    _drop_stale_metadata(target)
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
