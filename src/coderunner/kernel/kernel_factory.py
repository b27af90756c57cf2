"""Where a session gets its kernels: the real `Kernel` in the server, a scripted one in tests.

A session starts a fresh kernel on create, on a death, on a timeout it ignores and on reset;
each comes from the `KernelFactory` its manager was given. Nothing but tests passes another.
"""

from __future__ import annotations

from typing import Protocol

from anyio.abc import TaskGroup

from coderunner.hostfs.session_dirs import SandboxDirs
from coderunner.kernel.incarnation import Kernel
from coderunner.sandbox import SandboxBackend, SandboxSpec


class KernelFactory(Protocol):
    """Makes one kernel incarnation, not yet started (the `Kernel` class itself is one)."""

    def __call__(
        self, backend: SandboxBackend, spec: SandboxSpec, task_group: TaskGroup, dirs: SandboxDirs, *, generation: int
    ) -> Kernel: ...
