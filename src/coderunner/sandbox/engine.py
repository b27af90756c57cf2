"""Bounded calls to a container engine's command line (podman, docker, Apple `container`).

Engines hang in ways a server must survive (a stuck daemon, a VM that will not stop), so every
call has a timeout and every failure names the command that failed and what it said.
"""

from __future__ import annotations

import shlex
import subprocess
from dataclasses import dataclass

import anyio

#: Bound on quick engine calls (inspect, list, ps).
QUERY_TIMEOUT_S = 20.0
#: Bound on stopping and removing one container.
REMOVE_TIMEOUT_S = 30.0
#: Bound on building the sandbox image (apt Chromium + pip of the data stack).
BUILD_TIMEOUT_S = 1800.0
#: The engine's own environment: nothing of the server's (secrets, proxies) reaches it.
ENGINE_ENV_KEYS = ("PATH", "HOME", "XDG_RUNTIME_DIR", "DOCKER_HOST", "CONTAINER_HOST", "TMPDIR", "USER", "LOGNAME")


class EngineError(RuntimeError):
    """An engine call failed or timed out; the message names the command."""


@dataclass(frozen=True)
class EngineResult:
    returncode: int
    stdout: str
    stderr: str


def engine_env(environ: dict[str, str]) -> dict[str, str]:
    """Only what the engine needs to find itself and its daemon/socket."""
    env = {key: environ[key] for key in ENGINE_ENV_KEYS if key in environ}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin:/opt/homebrew/bin")
    env["LANG"] = "C.UTF-8"
    return env


def _describe(argv: list[str]) -> str:
    text = shlex.join(argv)
    return text if len(text) <= 300 else text[:297] + "..."


def run_sync(
    argv: list[str], timeout_s: float, *, check: bool = True, env: dict[str, str] | None = None
) -> EngineResult:
    """Run an engine command to completion within `timeout_s` (for setup, doctor and cleanup)."""
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout_s, check=False, stdin=subprocess.DEVNULL, env=env
        )
    except subprocess.TimeoutExpired:
        raise EngineError(f"`{_describe(argv)}` did not finish within {timeout_s:g}s") from None
    except OSError as exc:
        raise EngineError(f"`{_describe(argv)}` could not run: {exc}") from None
    result = EngineResult(done.returncode, done.stdout, done.stderr)
    if check and done.returncode != 0:
        raise EngineError(f"`{_describe(argv)}` failed (exit {done.returncode}): {done.stderr.strip()[-800:]}")
    return result


async def run_async(
    argv: list[str], timeout_s: float, *, check: bool = True, env: dict[str, str] | None = None
) -> EngineResult:
    """Like run_sync, without blocking the event loop; the process is killed at the timeout."""
    try:
        with anyio.fail_after(timeout_s):
            done = await anyio.run_process(argv, check=False, stdin=subprocess.DEVNULL, env=env)
    except TimeoutError:
        raise EngineError(f"`{_describe(argv)}` did not finish within {timeout_s:g}s") from None
    except OSError as exc:
        raise EngineError(f"`{_describe(argv)}` could not run: {exc}") from None
    stdout = done.stdout.decode("utf-8", "replace")
    stderr = done.stderr.decode("utf-8", "replace")
    if check and done.returncode != 0:
        raise EngineError(f"`{_describe(argv)}` failed (exit {done.returncode}): {stderr.strip()[-800:]}")
    return EngineResult(done.returncode, stdout, stderr)
