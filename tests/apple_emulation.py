"""The Apple `container` stand-in (tests/emulators/container) set up for a test run on Linux.

Each emulated release gets its own `container` on PATH (a two-line wrapper that fixes
CONTAINER_EMULATE_VERSION and marks every process it starts with CONTAINER_EMULATE_CLI_DIR: the
backend hands `container` only an allow-listed environment), and the sandbox image is built once
per sources digest under a tag of its own (so that other test runs' `coderunner-sandbox` is never
replaced), by `coderunner setup --backend apple` itself, always at a release whose `build` takes
the machine's TLS roots (`--secret`, 0.11.0+): where TLS is intercepted, pip in the build needs them,
and podman's layer cache from another test's build must not be what makes it pass.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from coderunner.sandbox.image_build import default_ca_bundle, sources_digest

from .image_lock import image_build_lock

REPO = Path(__file__).resolve().parents[1]
EMULATOR = REPO / "tests" / "emulators" / "container"
#: One release before 0.10.0 (no `run --init`, the older relay) and one 1.x (install.sh's pin).
VERSIONS = ("0.9.0", "1.2.2")
#: The release images are built with: install.sh's pin (`build --secret` exists from 0.11.0).
BUILD_VERSION = "1.2.2"
#: Set in every process a cli_dir wrapper starts, to the wrapper's dir: how leftovers are found.
MARKER = "CONTAINER_EMULATE_CLI_DIR"
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
    run = f'{MARKER}={folder} CONTAINER_EMULATE_VERSION={version} exec {sys.executable} {EMULATOR} "$@"'
    wrapper.write_text(f"#!/bin/sh\n{run}\n")
    wrapper.chmod(0o755)
    return folder


def image_tag() -> str:
    return f"localhost/coderunner-apple-test:{sources_digest()}"


def base_image() -> str:
    """The Debian base the image is built FROM, made from Debian's mirror when missing (no registry)."""
    if subprocess.run(["podman", "image", "exists", BASE_IMAGE], timeout=60, check=False).returncode != 0:
        made = subprocess.run([str(REPO / "containers" / "make-base-image.sh"), "podman", BASE_IMAGE],
                              capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)  # fmt: skip
        if made.returncode != 0:
            raise RuntimeError(f"could not make {BASE_IMAGE}:\n{made.stdout[-2000:]}{made.stderr[-2000:]}")
    return BASE_IMAGE


def build_image(folder: Path) -> str:
    """The sandbox image for the stand-in, built (or found current) by `coderunner setup --backend apple`.

    Built by BUILD_VERSION's CLI (in `folder`'s parent) whatever release `folder` holds: the image
    is the same for every release, and only 0.11.0+ can hand pip the TLS roots. Raises
    RuntimeError with the build's tail when it fails, or when a build ran without the roots.
    """
    image = image_tag()
    if image in _BUILT:
        return image
    folder = cli_dir(folder.parent, BUILD_VERSION)
    with image_build_lock():
        base_image()
        env = {**os.environ, "PATH": f"{folder}:{os.environ.get('PATH', '/usr/bin:/bin')}", "CODERUNNER_IMAGE": image}
        setup = [sys.executable, "-m", "coderunner.cli", "setup", "--backend", "apple", "--base-image", BASE_IMAGE]
        done = subprocess.run(setup, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(setup)}` failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    roots = default_ca_bundle()
    if roots is not None and "building the sandbox image" in done.stderr and f"src={roots}" not in done.stderr:
        raise RuntimeError(f"the apple image was built without the TLS roots ({roots}):\n{done.stderr[-3000:]}")
    _BUILT.add(image)
    return image
