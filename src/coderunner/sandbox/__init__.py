"""Sandbox backends. `make_backend` picks the one the settings name."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import LimitReport, Limits, SandboxBackend, SandboxProcess, SandboxSpec
from .bwrap import BwrapBackend, BwrapUnavailable
from .identity import IdentityError, sandbox_identity

if TYPE_CHECKING:
    from ..config import Settings

__all__ = [
    "BwrapBackend",
    "BwrapUnavailable",
    "LimitReport",
    "Limits",
    "SandboxBackend",
    "SandboxProcess",
    "SandboxSpec",
    "make_backend",
]


def make_backend(settings: Settings) -> SandboxBackend:
    """Raises BwrapUnavailable (with the fix in its message) when the backend cannot work here."""
    try:
        identity = sandbox_identity(settings.sandbox_user)
    except IdentityError as exc:
        raise BwrapUnavailable(str(exc)) from None
    return BwrapBackend(
        settings.sandbox_env, runtime_base=settings.runtime_dir, identity=identity, use_cgroups=settings.cgroups
    )
