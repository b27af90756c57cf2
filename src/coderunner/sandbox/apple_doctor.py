"""Doctor's probes of the Apple `container` backend: the release (too old a one is refused, an old
one has caveats), its system service, the image, and how the kernel's channels cross."""

from __future__ import annotations

import os
import shutil
import sys
from typing import TYPE_CHECKING

from coderunner.sandbox.apple_version import UPGRADE_HINT, ContainerVersion, version_caveat, version_problem
from coderunner.sandbox.engine import QUERY_TIMEOUT_S, EngineError, engine_env, run_sync
from coderunner.sandbox.probes import Check, Readiness, image_readiness

if TYPE_CHECKING:
    from coderunner.config import Settings


def readiness(settings: Settings, name: str) -> Readiness:
    if sys.platform != "darwin":
        return "macOS 26 on Apple silicon only", None
    path = shutil.which("container")
    if path is None:
        return "`container` is not installed", "macOS 26 on Apple silicon: ./install.sh installs it"
    if (refused := container_version(path)[1]) is not None:
        return refused
    try:
        status = run_sync([path, "system", "status"], QUERY_TIMEOUT_S, check=False, env=engine_env(dict(os.environ)))
    except EngineError as exc:
        return f"`container system status` does not answer ({exc})", None
    if status.returncode != 0:
        return "the container system service is not running", "container system start --enable-kernel-install"
    return image_readiness(settings, name, "container", [path, "image", "inspect", settings.image])


def checks(settings: Settings, name: str) -> list[Check]:
    missing, fix = readiness(settings, name)
    if missing is not None:
        return [Check(f"{name} backend", False, missing, fix)]
    version, _ = container_version(shutil.which("container") or "container")
    caveat = "supported" not in version
    return [
        Check("apple backend", True, f"{version}, image {settings.image} built", UPGRADE_HINT, degraded=caveat),
        channels_check(settings),
    ]


def container_version(path: str) -> tuple[str, Readiness | None]:
    """(`container`'s version and whether it is supported, or (problem, fix) when it is refused)."""
    try:
        done = run_sync([path, "--version"], QUERY_TIMEOUT_S, check=False, env=engine_env(dict(os.environ)))
        version = ContainerVersion.parse(done.stdout)
    except EngineError:
        version = None
    if (problem := version_problem(version)) is not None:
        return "", (problem, UPGRADE_HINT)
    assert version is not None
    caveat = version_caveat(version)
    return f"Apple container {version} ({'supported' if caveat is None else caveat})", None


def channels_check(settings: Settings) -> Check:
    """The TCP fallback, told as it is: not loopback-only, and it needs the container network."""
    if settings.kernel_channels != "tcp":
        return Check("apple kernel channels", True, "ipc: kernel sockets relayed over vsock, the VM has no network")
    return Check(
        "apple kernel channels",
        True,
        "tcp: kernel ports are published on the host's 127.0.0.1 and are also reachable at the VM's address "
        "from this Mac and from other containers on the container network; every session gets the container "
        "network (internet). macOS may ask to let `container` find devices on the Local Network: until that is "
        "allowed, publishing can fail",
        'kernel_channels = "ipc" (the default) needs no network at all',
        degraded=True,
    )
