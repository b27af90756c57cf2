"""The compiled pid 1 of a bwrap sandbox (guest/sandbox_init.c): built once into the sandbox environment by
`coderunner setup`, found there by its source's hash.

Why by hash: the binary must speak the protocol of the guest this server ships (sandbox_init.py's), so a binary
built from another version's source is never used; the server then runs the Python init, as it does where no C
compiler was found, and `coderunner doctor` says which one a sandbox gets. The binary lives in the environment
(read-only in every sandbox, never written by one), not in a server's runtime folder: a compile costs about
0.1 CPU-s, once a machine, never on a server's start.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).resolve().parent.parent / "guest" / "sandbox_init.c"
#: The environment's folder of programs that are not Python's (`ENV_MOUNT/libexec` in a sandbox).
LIBEXEC = "libexec"
#: Compilers tried in turn: whichever the machine has.
COMPILERS = ("cc", "gcc", "clang")
#: Static first (no dynamic loader at every sandbox's start: about 0.2 CPU-ms and 25 page faults less), then
#: dynamic where the C library has no static archive (the sandbox binds the host's /usr, its libc included).
FLAG_SETS = (("-O2", "-s", "-static"), ("-O2", "-s"))
COMPILE_TIMEOUT_S = 120


def binary_name() -> str:
    """`sandbox-init-` and the first 12 hex digits of the source's SHA-256."""
    return f"sandbox-init-{hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]}"


def installed(env_dir: Path) -> Path | None:
    """The binary built from this source in `env_dir`, or None (not built: no compiler, or an older setup)."""
    path = env_dir / LIBEXEC / binary_name()
    return path if path.is_file() and os.access(path, os.X_OK) else None


def build(env_dir: Path, compiler: str | None = None) -> Path | None:
    """Compile the init into `env_dir/libexec` (kept if already there); None, with a warning, where it cannot be.
    The server then starts each sandbox's pid 1 with Python (about 5 CPU-ms more a start): containment is the same."""
    if (done := installed(env_dir)) is not None:
        return done
    found = shutil.which(compiler) if compiler else next(filter(None, map(shutil.which, COMPILERS)), None)
    if found is None:
        _warn("no C compiler (cc) here: each sandbox's pid 1 is the Python one (sudo apt-get install gcc, then "
              "coderunner setup, saves about 5 CPU-ms a start)")  # fmt: skip
        return None
    target = env_dir / LIBEXEC / binary_name()
    target.parent.mkdir(mode=0o755, exist_ok=True)
    problem = ""
    for flags in FLAG_SETS:
        with tempfile.TemporaryDirectory(prefix=".init-", dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            argv = [found, *flags, "-o", str(built), str(SOURCE)]
            try:
                subprocess.run(
                    argv, check=True, capture_output=True, stdin=subprocess.DEVNULL, timeout=COMPILE_TIMEOUT_S
                )
            except subprocess.CalledProcessError as exc:
                last = exc.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit {exc.returncode}"]
                problem = f"{' '.join(flags)}: {last[0]}"
                continue
            except (OSError, subprocess.TimeoutExpired) as exc:
                problem = str(exc)
                break
            built.chmod(0o755)
            os.replace(built, target)  # whole or not at all: a server never sees half a binary
        print(f"coderunner setup: built the sandbox's pid 1 ({' '.join(flags)}): {target}", file=sys.stderr, flush=True)
        return target
    _warn(f"the sandbox's pid 1 could not be compiled ({problem}): each sandbox's is the Python one")
    return None


def _warn(text: str) -> None:
    print(f"coderunner setup: warning: {text}", file=sys.stderr, flush=True)
