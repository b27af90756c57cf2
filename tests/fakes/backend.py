"""A sandbox backend for fast tests: a real ipykernel, unconfined, that can misbehave on cue.

It lives under tests/ on purpose: no setting can select it, so no server ever runs user code
without a sandbox. What it keeps of a real backend is what the session and kernel code rely on:
the kernel binds its ipc sockets in the sandbox's run dir, runs as the sandbox's host user (a
root server's per-sandbox uid, so the host's owner checks on sockets and files are the real
ones), starts in its workspace, imports the guest package as `coderunner_guest`, and is a
process group the host can kill. What it drops is the confinement: no namespaces, no seccomp,
no limits, and the workspace is only at its host path (the cwd), not at `workspace_path`.

Cues (`FakeBackend.cue`) script the next sandbox it starts:
- `DIE_AT_START`: exits at once with a message on stderr, as a broken sandbox would;
- `HANG_AT_START`: never binds its sockets, as a kernel stuck in start-up would;
- `IGNORE_INTERRUPTS`: an ipykernel on which SIGINT does nothing, so an interrupted run keeps
  running (a cell stuck in C code); the kernel is otherwise normal.
"""

from __future__ import annotations

import collections
import enum
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import anyio
from anyio.abc import TaskGroup

import coderunner
from coderunner.kernel.process import KERNEL_LAUNCHER
from coderunner.sandbox import (
    SESSION_PACKAGES,
    HostIdentity,
    KernelChannels,
    LimitReport,
    Limits,
    SandboxBackend,
    SandboxProcess,
    SandboxSpec,
)
from coderunner.sandbox.identity import shared_dir_mode
from coderunner.vocabulary.network import NetworkMode

#: What a sandbox started on DIE_AT_START says before it exits.
DIE_MESSAGE = "fake sandbox: told to die at start"
DIE_EXIT_CODE = 3
#: The guest package's source (imported inside as `coderunner_guest`).
GUEST_SOURCE = Path(coderunner.__file__).resolve().parent / "guest"

#: Runs ipykernel with SIGINT ignored for good: ipykernel sets its own handler around each
#: execute, so the wrapper also makes later attempts to handle SIGINT do nothing.
_IGNORE_INTERRUPTS = """\
import runpy, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
_set = signal.signal
signal.signal = lambda signum, handler: None if signum == signal.SIGINT else _set(signum, handler)
sys.argv = ["{launcher}", *sys.argv[1:]]
runpy.run_module("{launcher}", run_name="__main__", alter_sys=True)
"""


class Cue(enum.Enum):
    DIE_AT_START = "die_at_start"
    HANG_AT_START = "hang_at_start"
    IGNORE_INTERRUPTS = "ignore_interrupts"


def kernel_python(env_dir: Path) -> Path | None:
    """An interpreter that has ipykernel: the sandbox environment's, else this one's; None if neither."""
    for python in (env_dir / "bin" / "python", Path(sys.executable)):
        if python.exists():
            probe = subprocess.run(
                [str(python), "-c", "import ipykernel"], capture_output=True, timeout=30, check=False
            )
            if probe.returncode == 0:
                return python
    return None


class FakeBackend(SandboxBackend):
    """A SandboxBackend without the sandbox (see the module docstring)."""

    name = "fake"
    workspace_path = "/workspace"
    channels = KernelChannels.IPC
    network_modes = frozenset({NetworkMode.NONE, NetworkMode.INTERNET})

    def __init__(self, python: Path, root: Path, identity: HostIdentity | None = None) -> None:
        """`root`: a folder of the test's own; `identity`: the kind of user sandboxes run as (as the
        real backends get it from sandbox_identity)."""
        self.python = str(python)
        self.identity = identity
        self.dir_mode = shared_dir_mode(identity)
        self.root = root
        # The guest package under the name the kernel imports it by, readable by any sandbox user.
        self.lib = root / "lib"
        shutil.copytree(GUEST_SOURCE, self.lib / "coderunner_guest", ignore=shutil.ignore_patterns("__pycache__"))
        for path in [self.lib, *self.lib.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        #: Cues for the next sandboxes started, oldest first.
        self.cues: collections.deque[Cue] = collections.deque()
        #: Every sandbox started, in order.
        self.spawned: list[SandboxProcess] = []

    def cue(self, *cues: Cue) -> None:
        self.cues.extend(cues)

    def host_dir_inside(self, spec: SandboxSpec) -> str:
        """The host-only dir is bound read-only at its own path."""
        return str(spec.host_dir)

    def describe_isolation(self) -> str:
        return "none: a fake backend for tests (unconfined ipykernel)"

    def limit_reports(self, limits: Limits) -> dict[str, LimitReport]:
        return {
            "memory_mb": LimitReport(limits.memory_mb, None),
            "cpus": LimitReport(limits.cpus, None),
            "pids": LimitReport(limits.pids, None),
            "tmp_mb": LimitReport(limits.tmp_mb, None),
        }

    def refusal(self, mode: NetworkMode) -> str:
        return "the fake backend has no egress proxy wiring: use 'none' or 'internet'"

    def remove_stale(self, name: str) -> None:
        """Nothing of a fake sandbox lives outside its dirs."""

    async def start(self, spec: SandboxSpec, argv: list[str], task_group: TaskGroup, *, pipes: bool) -> SandboxProcess:
        cue = self.cues.popleft() if self.cues else None
        # Its HOME and TMPDIR: gone with `root`, which the test that made it removes.
        home = Path(tempfile.mkdtemp(prefix=f"home-{spec.name}-", dir=self.root))
        if spec.owner is not None:
            os.chown(home, *spec.owner)
        if cue is Cue.DIE_AT_START:
            argv = ["/bin/sh", "-c", f"echo '{DIE_MESSAGE}' >&2; exit {DIE_EXIT_CODE}"]
        elif cue is Cue.HANG_AT_START:
            argv = ["/bin/sh", "-c", "exec sleep 3600"]
        elif cue is Cue.IGNORE_INTERRUPTS:
            launcher = argv.index("-m")
            assert argv[launcher : launcher + 2] == ["-m", KERNEL_LAUNCHER], argv
            wrapper = _IGNORE_INTERRUPTS.replace("{launcher}", KERNEL_LAUNCHER)
            argv = [*argv[:launcher], "-c", wrapper, *argv[launcher + 2 :]]
        if spec.user is not None:
            argv = [*spec.user.setpriv_prefix(), *argv]
        env = {
            "PATH": f"{Path(self.python).parent}:/usr/local/bin:/usr/bin:/bin",
            "HOME": str(home),
            "TMPDIR": str(home),
            "LANG": "C.UTF-8",
            "MPLBACKEND": "module://matplotlib_inline.backend_inline",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYDEVD_DISABLE_FILE_VALIDATION": "1",
            "PYTHONPATH": f"{self.lib}:{spec.workspace}/{SESSION_PACKAGES}",
        }
        process = await anyio.open_process(
            argv,
            cwd=spec.workspace,
            env=env,
            stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
            stdout=subprocess.PIPE if pipes else subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        sandbox = SandboxProcess(process, task_group, pipes=pipes)
        self.spawned.append(sandbox)
        return sandbox
