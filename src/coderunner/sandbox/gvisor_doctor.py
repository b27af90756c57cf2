"""Doctor's probes of the gvisor backend: podman's image (built and mounted by podman), run by runsc
directly, which needs a root server on Linux."""

from __future__ import annotations

import os
import shutil
import sys
from typing import TYPE_CHECKING

from coderunner.sandbox.probes import Check, Readiness, engine_checks, image_readiness

if TYPE_CHECKING:
    from coderunner.config import Settings


def readiness(settings: Settings, name: str) -> Readiness:
    if not sys.platform.startswith("linux"):
        return "Linux only", None
    if os.getuid() != 0:
        return "runs runsc directly (memory checkpoints) and needs a root server", "run the server as root"
    if shutil.which("runsc") is None:
        return "runsc (gVisor) is not installed", "sudo apt-get install runsc"
    path = shutil.which("podman")
    if path is None:
        return "`podman` is not installed", "sudo apt-get install podman runc runsc"
    return image_readiness(settings, name, "podman", [path, "image", "inspect", "--format", "{{.Id}}", settings.image])


def checks(settings: Settings, name: str) -> list[Check]:
    return engine_checks(settings, name, readiness(settings, name))
