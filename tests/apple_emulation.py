"""The Apple `container` stand-in (tests/emulators/container) set up for a test run on Linux.

Each emulated release gets its own `container` on PATH (a two-line wrapper that fixes
CONTAINER_EMULATE_VERSION: the backend hands `container` only an allow-listed environment), and
the sandbox image is built once per sources digest under a tag of its own (so that other test
runs' `coderunner-sandbox` is never replaced), by `coderunner setup --backend apple` itself.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from coderunner.sandbox.image import sources_digest

REPO = Path(__file__).resolve().parents[1]
EMULATOR = REPO / "tests" / "emulators" / "container"
#: One release before 0.10.0 (no `run --init`, the older relay) and one 1.x (install.sh's pin).
VERSIONS = ("0.9.0", "1.2.2")
BASE_IMAGE = "localhost/coderunner-base:bookworm"
BUILD_TIMEOUT_S = 1800
#: Images this test process has built or found current already.
_BUILT: set[str] = set()


def emulation_problem() -> str | None:
    """Why the stand-in cannot run here, or None."""
    if not sys.platform.startswith("linux"):
        return "the `container` stand-in runs on Linux (podman underneath)"
    if os.getuid() != 0:
        return "the `container` stand-in needs root (rootful podman; its relay joins the guest's mount namespace)"
    for tool in ("podman", "runc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed: run ./install.sh"
    return None


def cli_dir(parent: Path, version: str) -> Path:
    """A dir holding a `container` that is the stand-in at `version`."""
    folder = parent / f"container-{version}"
    folder.mkdir(parents=True, exist_ok=True)
    wrapper = folder / "container"
    wrapper.write_text(f'#!/bin/sh\nCONTAINER_EMULATE_VERSION={version} exec {EMULATOR} "$@"\n')
    wrapper.chmod(0o755)
    return folder


def image_tag() -> str:
    return f"localhost/coderunner-apple-test:{sources_digest()}"


def build_image(folder: Path) -> str:
    """The sandbox image for the stand-in, built (or found current) by `coderunner setup --backend apple`.

    Raises RuntimeError with the build's tail when it fails.
    """
    image = image_tag()
    if image in _BUILT:
        return image
    if subprocess.run(["podman", "image", "exists", BASE_IMAGE], timeout=60, check=False).returncode != 0:
        made = subprocess.run([str(REPO / "containers" / "make-base-image.sh"), "podman", BASE_IMAGE],
                              capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)  # fmt: skip
        if made.returncode != 0:
            raise RuntimeError(f"could not make {BASE_IMAGE}:\n{made.stdout[-2000:]}{made.stderr[-2000:]}")
    env = {**os.environ, "PATH": f"{folder}:{os.environ.get('PATH', '/usr/bin:/bin')}", "CODERUNNER_IMAGE": image}
    setup = [sys.executable, "-m", "coderunner.cli", "setup", "--backend", "apple", "--base-image", BASE_IMAGE]
    done = subprocess.run(setup, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(setup)}` failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    _BUILT.add(image)
    return image
