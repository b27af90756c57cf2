"""Sandbox backends. `make_backend` picks the one the settings name."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import LimitReport, Limits, SandboxBackend, SandboxProcess, SandboxSpec, SandboxUnavailable
from .bwrap import BwrapBackend, BwrapUnavailable
from .container import ContainerUnavailable
from .identity import IdentityError, sandbox_identity

if TYPE_CHECKING:
    from ..config import Settings

__all__ = [
    "BwrapBackend",
    "BwrapUnavailable",
    "ContainerUnavailable",
    "LimitReport",
    "Limits",
    "SandboxBackend",
    "SandboxProcess",
    "SandboxSpec",
    "SandboxUnavailable",
    "make_backend",
]


def make_backend(settings: Settings) -> SandboxBackend:
    """Raises SandboxUnavailable (with the fix in its message) when the backend cannot work here."""
    if settings.backend == "apple":
        from .apple import AppleBackend

        return AppleBackend(settings.image, settings.runtime_dir, channels=settings.kernel_channels)
    try:
        identity = sandbox_identity(settings.sandbox_user)
    except IdentityError as exc:
        raise SandboxUnavailable(str(exc)) from None
    if settings.backend in ("podman", "docker"):
        from .oci import OciBackend

        return OciBackend(
            settings.backend,
            settings.image,
            settings.runtime_dir,
            identity=identity,
            runtime=settings.oci_runtime,
            channels=settings.kernel_channels,
        )
    backend = BwrapBackend(
        settings.sandbox_env, runtime_base=settings.runtime_dir, identity=identity, use_cgroups=settings.cgroups
    )
    if backend.cgroups is not None:
        backend.cgroups.cpu_weight = settings.session_cpu_weight
    return backend
