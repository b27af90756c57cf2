"""Sandbox backends behind one face: the protocol, its errors, and `make_backend`.

Everything outside this package imports from here. A backend is found by name in BACKENDS and
its module imported only when chosen, so a bwrap server never loads the container code, and a
new backend is one entry in the registry:

    bwrap           bwrap.py      Linux default, no daemon
    podman, docker  oci.py        one container per kernel, from the CodeRunner image
    gvisor          gvisor.py     runsc directly on podman's image: a kernel of its own per sandbox,
                                  checkpointable (runsc.py builds its argv and OCI config)
    apple           apple.py      one lightweight VM per kernel (macOS `container`)

Shared paths, environment and limits live in common.py; building the sandbox's Python
environment (env.py) sits beside building the image (image.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from coderunner.sandbox.base import (
    LimitReport,
    Limits,
    Mount,
    SandboxBackend,
    SandboxProcess,
    SandboxSpec,
    SandboxUnavailable,
)
from coderunner.sandbox.common import SESSION_PACKAGES, WORKSPACE, etc_files
from coderunner.sandbox.identity import (
    HostIdentity,
    IdentityError,
    UidPool,
    ensure_private_dir,
    per_sandbox_uids,
    sandbox_identity,
)

if TYPE_CHECKING:
    from coderunner.config import Settings

__all__ = [
    "BACKENDS",
    "SESSION_PACKAGES",
    "WORKSPACE",
    "HostIdentity",
    "LimitReport",
    "Limits",
    "Mount",
    "SandboxBackend",
    "SandboxProcess",
    "SandboxSpec",
    "SandboxUnavailable",
    "UidPool",
    "ensure_private_dir",
    "etc_files",
    "make_backend",
    "per_sandbox_uids",
]


def _identity(settings: Settings) -> HostIdentity | None:
    try:
        return sandbox_identity(settings.sandbox_user)
    except IdentityError as exc:
        raise SandboxUnavailable(str(exc)) from None


def _bwrap(settings: Settings) -> SandboxBackend:
    from coderunner.sandbox.bwrap import BwrapBackend

    identity = _identity(settings)
    backend = BwrapBackend(
        settings.sandbox_env, runtime_base=settings.runtime_dir, identity=identity, use_cgroups=settings.cgroups
    )
    if backend.cgroups is not None:
        backend.cgroups.cpu_weight = settings.session_cpu_weight
    return backend


def _oci(settings: Settings) -> SandboxBackend:
    from coderunner.sandbox.oci import OciBackend

    return OciBackend(
        settings.backend,
        settings.image,
        settings.runtime_dir,
        identity=_identity(settings),
        runtime=settings.oci_runtime,
        channels=settings.kernel_channels,
    )


def _gvisor(settings: Settings) -> SandboxBackend:
    from coderunner.sandbox.gvisor import GvisorBackend

    return GvisorBackend(settings.image, settings.runtime_dir, identity=_identity(settings))


def _apple(settings: Settings) -> SandboxBackend:
    from coderunner.sandbox.apple import AppleBackend

    return AppleBackend(settings.image, settings.runtime_dir, channels=settings.kernel_channels)


#: Backends by the name `backend` is set to; each builder imports its module when called.
BACKENDS: dict[str, Callable[[Settings], SandboxBackend]] = {
    "bwrap": _bwrap,
    "podman": _oci,
    "docker": _oci,
    "gvisor": _gvisor,
    "apple": _apple,
}


def make_backend(settings: Settings) -> SandboxBackend:
    """Raises SandboxUnavailable (with the fix in its message) when the backend cannot work here."""
    builder = BACKENDS.get(settings.backend)
    if builder is None:
        raise SandboxUnavailable(f"unknown backend {settings.backend!r}: use one of {', '.join(BACKENDS)}")
    return builder(settings)
