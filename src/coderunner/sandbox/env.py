"""The sandbox's own Python environment: a venv from the system python3, bound read-only inside.

It is built from an interpreter under /usr because only /usr (and the venv) exist inside the
sandbox; a pyenv or conda Python in $HOME would be invisible there.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

from coderunner.errors import CodeRunnerError
from coderunner.sandbox import init_binary

#: Bounds on the two steps of `coderunner setup`; pip of numpy/pandas/matplotlib takes minutes.
VENV_TIMEOUT_S = 300
PIP_TIMEOUT_S = 1800
#: Bound on building the first-use caches (matplotlib's font list: seconds).
CACHE_TIMEOUT_S = 300
#: Where in the environment the first-use caches go (read-only in the sandbox; guest/caches.py copies
#: them into place at each interpreter's start, from this same path under its sys.prefix).
CACHE_DIR = ("share", "coderunner-cache")
#: Run by the environment's own Python (the image build runs it too): the guest folder is the package's.
BUILD_CACHES = Path(__file__).resolve().parent.parent / "guest" / "build_caches.py"


class SetupError(CodeRunnerError):
    """The sandbox environment could not be made; the message names the failing step."""


def requirements_text() -> str:
    return resources.files("coderunner.sandbox").joinpath("requirements.txt").read_text()


def check_interpreter(python: Path) -> None:
    if not python.exists():
        raise SetupError(f"{python} is missing: sudo apt-get install python3 python3-venv")
    if not str(python.resolve()).startswith("/usr/"):
        raise SetupError(f"{python} resolves outside /usr, so the sandbox could not run it; use the system python3")


def create(env_dir: Path, python: Path, *, recreate: bool = False) -> None:
    """Make (or update) the environment; pip's own progress goes to stderr."""
    check_interpreter(python)
    if recreate and env_dir.exists():
        shutil.rmtree(env_dir)
    if not (env_dir / "bin" / "python").exists():
        env_dir.parent.mkdir(parents=True, exist_ok=True)
        _run([str(python), "-m", "venv", str(env_dir)], VENV_TIMEOUT_S, "creating the venv")
    requirements = env_dir / "coderunner-requirements.txt"
    requirements.write_text(requirements_text())
    _run(
        [str(env_dir / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check",
         "--progress-bar", "off", "-r", str(requirements)],
        PIP_TIMEOUT_S,
        "installing the sandbox packages",
    )  # fmt: skip
    build_caches(env_dir)
    init_binary.build(env_dir)


def build_caches(env_dir: Path) -> None:
    """Build the first-use caches into the environment once (today matplotlib's font list), so that no
    session builds its own. A failure only warns: sessions then build theirs, as before."""
    target = env_dir.joinpath(*CACHE_DIR)
    print(f"coderunner setup: building first-use caches into {target}", file=sys.stderr, flush=True)
    try:
        subprocess.run(
            [str(env_dir / "bin" / "python"), "-I", str(BUILD_CACHES), str(target)],
            check=True, timeout=CACHE_TIMEOUT_S, stdout=sys.stderr, stdin=subprocess.DEVNULL,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, cwd="/",
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"coderunner setup: warning: matplotlib's font cache was not built ({exc}); each session "
              "builds its own at its first chart", file=sys.stderr, flush=True)  # fmt: skip


def _run(argv: list[str], timeout_s: float, what: str) -> None:
    print(f"coderunner setup: {what}: {' '.join(argv)}", file=sys.stderr, flush=True)
    try:
        subprocess.run(argv, check=True, timeout=timeout_s, stdout=sys.stderr, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise SetupError(f"{what} took longer than {timeout_s}s; check the network to the package index") from None
    except subprocess.CalledProcessError as exc:
        hint = ""
        if "venv" in argv:
            hint = " (on Debian/Ubuntu: sudo apt-get install python3-venv)"
        raise SetupError(f"{what} failed with exit code {exc.returncode}{hint}") from None
