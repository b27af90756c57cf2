"""Fixtures of the fast suite: a SessionManager on the fake backend, in this process.

`manager`/`make_manager` start real ipykernels (unconfined); `scripted`/`make_scripted` start
scripted FakeKernels instead (tests/fakes/kernel.py: no process at all), for the session and
manager state machines. `pytest tests/unit` runs this suite alone. Every test gets its own runtime and workspace
folders under /tmp (short: ipc socket paths must stay under 107 bytes).
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from coderunner.config import Settings
from coderunner.sandbox.identity import sandbox_identity
from coderunner.sessions import SessionManager
from tests.fakes.backend import FakeBackend, kernel_python
from tests.fakes.kernel import FakeKernels

#: Settings every fast test starts from: no quota images, no cgroups, no export folder, short waits.
FAST_SETTINGS: dict[str, Any] = {
    "workspace_quota": False,
    "cgroups": False,
    "export_dir": None,
    "interrupt_grace_s": 1.0,
    "startup_timeout_s": 30.0,
    "progress_interval_s": 0.2,
    # No warm pool unless a test asks: cues script "the next sandbox started", and a pool starts its own.
    "pool_size": 0,
    # Every tool group: the in-memory tests reach sessions and snapshots as a user who turned them on would.
    "tools": ["all"],
}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def python() -> Path:
    found = kernel_python(Settings().sandbox_env)
    if found is None:
        pytest.fail("no interpreter with ipykernel: run `coderunner setup` (it makes the sandbox environment)")
    return found


@pytest.fixture
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cru-", dir="/tmp"))
    path.chmod(0o711)  # a root server's sandbox users pass through to their own dirs
    yield path
    shutil.rmtree(path, ignore_errors=True)


ManagerFactory = Callable[..., contextlib.AbstractAsyncContextManager[SessionManager]]


@pytest.fixture
def make_manager(root: Path, request: pytest.FixtureRequest) -> ManagerFactory:
    """`async with make_manager(**settings) as manager`: a running manager on a fresh FakeBackend;
    `kernels=FakeKernels()` makes its kernels scripted ones (no ipykernel, no interpreter needed)."""

    @contextlib.asynccontextmanager
    async def make(kernels: FakeKernels | None = None, **overrides: Any) -> AsyncIterator[SessionManager]:
        settings = Settings(
            runtime_dir=root / "r",
            workspaces_dir=root / "w",
            token_file=root / "token",
            **{**FAST_SETTINGS, **overrides},
        )
        fake_root = Path(tempfile.mkdtemp(prefix="f", dir=root))  # one per manager: a restart is a new one
        fake_root.chmod(0o711)
        python = Path(sys.executable) if kernels is not None else request.getfixturevalue("python")
        backend = FakeBackend(python, fake_root, sandbox_identity(settings.sandbox_user))
        manager = SessionManager(settings, backend) if kernels is None else SessionManager(settings, backend, kernels)
        async with manager:
            yield manager

    return make


@pytest.fixture
async def manager(make_manager: ManagerFactory) -> AsyncIterator[SessionManager]:
    async with make_manager() as running:
        yield running


@pytest.fixture
def kernels() -> FakeKernels:
    """The scripted kernels `scripted` managers make: cue them, and look at each one made."""
    return FakeKernels()


@pytest.fixture
def make_scripted(make_manager: ManagerFactory, kernels: FakeKernels) -> ManagerFactory:
    """`async with make_scripted(**settings) as manager`: make_manager, its kernels from `kernels`."""

    def make(**overrides: Any) -> contextlib.AbstractAsyncContextManager[SessionManager]:
        # A scripted kernel answers an interrupt at once: a short grace only shortens the runs it ignores.
        return make_manager(kernels=kernels, **{"interrupt_grace_s": 0.3, **overrides})

    return make


@pytest.fixture
async def scripted(make_scripted: ManagerFactory) -> AsyncIterator[SessionManager]:
    async with make_scripted() as running:
        yield running
