"""Sandbox backends. `make_backend` picks the one the settings name."""

from __future__ import annotations

from ..config import Settings
from .base import LimitReport, Limits, SandboxBackend, SandboxProcess, SandboxSpec
from .bwrap import BwrapBackend, BwrapUnavailable

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
    return BwrapBackend(settings.sandbox_env, use_cgroups=settings.cgroups)
