"""Doctor's probes of the podman and docker backends (registry.py names this module for both)."""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING

from coderunner.sandbox.probes import Check, Readiness, engine_checks, image_readiness
from coderunner.vocabulary.backends import install_hint

if TYPE_CHECKING:
    from coderunner.config import Settings


def readiness(settings: Settings, name: str) -> Readiness:
    path = shutil.which(name)
    if path is None:
        fix = f"{install_hint(name)} (Linux), or Podman Desktop" if name == "podman" else install_hint(name)
        return f"`{name}` is not installed", fix
    runtime = ["--runtime", settings.oci_runtime] if name == "podman" and settings.oci_runtime else []
    return image_readiness(
        settings, name, name, [path, *runtime, "image", "inspect", "--format", "{{.Id}}", settings.image]
    )


def checks(settings: Settings, name: str) -> list[Check]:
    return engine_checks(settings, name, readiness(settings, name))
