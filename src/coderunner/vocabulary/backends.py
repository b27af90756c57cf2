"""Every sandbox backend, one entry each: its name, where its code is, what setup makes for it, where
its doctor probes are, what installs it, and when it is the platform's default.

Everything that once named backends (the settings' valid names and default, doctor, `coderunner
setup`, the image build, the conformance suite) loops over ENTRIES instead. A backend's modules are
named here as text and imported only when that backend is chosen (or probed by doctor:
sandbox/registry.py does both), so a bwrap server never loads the container code, and the settings
read the names without importing any sandbox code. Adding a backend is its own modules plus one
entry below:

    module   has build(settings) -> SandboxBackend (a SandboxBackend subclass, sandbox/base.py)
    probes   has readiness(settings, name) -> (what is missing, the fix) and
             checks(settings, name) -> list[Check] (sandbox/probes.py), for `coderunner doctor`
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum


class Setup(StrEnum):
    """What `coderunner setup` makes for a backend."""

    #: The sandbox's Python environment on the host (sandbox/env.py), bound into each sandbox.
    ENVIRONMENT = "environment"
    #: The sandbox image from the Containerfile (sandbox/image_build.py).
    IMAGE = "image"


def _never() -> bool:
    return False


@dataclass(frozen=True)
class BackendEntry:
    """One backend as the rest of the server knows it (see the module docstring)."""

    name: str
    #: The module whose build(settings) makes the backend (imported only when it is chosen).
    module: str
    #: The module of its doctor probes: readiness(settings, name) and checks(settings, name).
    probes: str
    setup: Setup
    #: What installs what this backend needs (said wherever it is found missing).
    install_hint: str
    #: The command of the engine that builds and holds its image (Setup.IMAGE only).
    engine: str | None = None
    #: The backend whose engine builds the image this one runs, when not its own (gvisor: podman's).
    image_of: str | None = None
    #: Platform default: the lowest rank whose `default_when` holds is the default backend ...
    default_rank: int | None = None
    default_when: Callable[[], bool] = _never
    #: ... else the lowest rank whose `fallback_platform` prefixes sys.platform ("" is any).
    fallback_platform: str | None = None
    #: Why it is the backend in use when no setting chose it (doctor).
    default_reason: str = "the first container engine found (Apple `container` is not installed)"
    #: The module whose kernel_starter(backend) gives its warm kernel template (the kernel_template setting),
    #: or None where it has none.
    kernel_template: str | None = None

    @property
    def image_builder(self) -> BackendEntry:
        """The entry whose engine builds this backend's image (itself, or the one it borrows it from)."""
        return BACKENDS[self.image_of] if self.image_of else self


def _on_linux() -> bool:
    return sys.platform.startswith("linux")


def _found(command: str) -> Callable[[], bool]:
    return lambda: bool(shutil.which(command))


#: Every backend, in the order doctor and refusals list them.
ENTRIES: tuple[BackendEntry, ...] = (
    BackendEntry(
        name="bwrap",
        module="coderunner.sandbox.bwrap",
        probes="coderunner.sandbox.bwrap_doctor",
        setup=Setup.ENVIRONMENT,
        install_hint="sudo apt-get install bubblewrap",
        default_rank=0,
        default_when=_on_linux,
        default_reason="the Linux default: no daemon, no image",
        kernel_template="coderunner.sandbox.template_kernels",
    ),
    BackendEntry(
        name="podman",
        module="coderunner.sandbox.oci",
        probes="coderunner.sandbox.oci_doctor",
        setup=Setup.IMAGE,
        install_hint="sudo apt-get install podman runc",
        engine="podman",
        default_rank=3,
        default_when=_found("podman"),
    ),
    BackendEntry(
        name="docker",
        module="coderunner.sandbox.oci",
        probes="coderunner.sandbox.oci_doctor",
        setup=Setup.IMAGE,
        install_hint="install Docker Engine or Docker Desktop",
        engine="docker",
        default_rank=2,
        default_when=_found("docker"),
        fallback_platform="",
    ),
    BackendEntry(
        name="gvisor",
        module="coderunner.sandbox.gvisor",
        probes="coderunner.sandbox.gvisor_doctor",
        setup=Setup.IMAGE,
        install_hint="sudo apt-get install runsc podman",
        image_of="podman",
    ),
    BackendEntry(
        name="apple",
        module="coderunner.sandbox.apple",
        probes="coderunner.sandbox.apple_doctor",
        setup=Setup.IMAGE,
        install_hint="./install.sh installs it (macOS 26, Apple silicon), or get it from github.com/apple/container",
        engine="container",
        default_rank=1,
        default_when=lambda: sys.platform == "darwin" and bool(shutil.which("container")),
        fallback_platform="darwin",
        default_reason="the macOS default: Apple `container` is installed (one VM per session)",
    ),
)

#: The entries by name.
BACKENDS: dict[str, BackendEntry] = {entry.name: entry for entry in ENTRIES}
#: The names `backend` may be set to.
BACKEND_NAMES: tuple[str, ...] = tuple(BACKENDS)


def entry(name: str) -> BackendEntry:
    """The entry of backend `name` (one of BACKEND_NAMES: the settings allow no other)."""
    return BACKENDS[name]


def install_hint(name: str) -> str:
    return BACKENDS[name].install_hint


def platform_default() -> str:
    """The backend used when no setting names one: Linux bwrap; macOS Apple `container` when it is
    installed; else the first engine found (docker, then podman); else apple on macOS, docker elsewhere."""
    ranked = sorted((entry for entry in ENTRIES if entry.default_rank is not None), key=lambda e: e.default_rank or 0)
    for candidate in ranked:
        if candidate.default_when():
            return candidate.name
    for candidate in ranked:
        if candidate.fallback_platform is not None and sys.platform.startswith(candidate.fallback_platform):
            return candidate.name
    raise AssertionError("some entry falls back on every platform")
