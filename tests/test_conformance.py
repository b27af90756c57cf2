"""One contract, every backend this machine has: what sessions and one-shot runs rely on.

The same scenarios run on the fake backend (tests/fakes) and on each real one that can work here
(every entry of the backend registry: bwrap on Linux; podman, docker or gvisor (runsc on the podman-built
image) when the engine answers and the image is built; Apple `container` on macOS, and on Linux through
its stand-in, tests/emulators/container, at one release before 0.10 and one 1.x). A real backend that
cannot work here is skipped with the reason, except the default on Linux (bwrap), whose absence is a
failure. Containment itself is the e2e and abuse suites' business; this is about the seam: start,
run, interrupt, death, files both ways, guest calls, one-shot pipes, and nothing left behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from coderunner.config import Settings
from coderunner.kernel.incarnation import RunStatus
from coderunner.kernel.run_result import ExecutionResult
from coderunner.oneshot.local import LocalOneShots
from coderunner.oneshot.program import ready_argv
from coderunner.sandbox import SandboxBackend, SandboxProcess, SandboxUnavailable, make_backend
from coderunner.sandbox.container import server_tag
from coderunner.sandbox.identity import sandbox_identity
from coderunner.sessions import Session, SessionManager
from coderunner.sessions.session_snapshots import Seed, takes_memory
from coderunner.vocabulary.backends import BACKEND_NAMES, Setup, platform_default
from coderunner.vocabulary.backends import entry as registry_entry
from coderunner.vocabulary.sandbox_request import SandboxRequest

from . import apple_emulation
from .fakes.backend import FakeBackend, kernel_python
from .test_e2e_podman import podman_image  # noqa: F401  (the session's image fixture)

pytestmark = [pytest.mark.anyio, pytest.mark.conformance]

#: Backends that run here through a stand-in when their platform is not this one: their lanes.
EMULATED = {"apple": tuple(f"apple@{v}" for v in apple_emulation.VERSIONS)} if sys.platform != "darwin" else {}
#: Every backend in the registry (each emulated one at each emulated release), and the fake; which of
#: them this machine has is found out per test run.
BACKENDS = ("fake", *(lane for name in BACKEND_NAMES for lane in EMULATED.get(name, (name,))))
#: Bound on asking an engine whether it and the image are there.
PROBE_TIMEOUT_S = 60
#: This machine's podman cannot use crun (hybrid cgroups); runc works (see the podman e2e tests).
OCI_RUNTIMES = {"podman": "runc"}
LONG_CELL = "import time\nfor _ in range(1200): time.sleep(0.05)"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="crc-", dir="/tmp"))  # short: ipc socket paths < 107 bytes
    path.chmod(0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _settings(name: str, root: Path) -> Settings:
    extra: dict[str, Any] = {}
    if name in OCI_RUNTIMES:
        extra["oci_runtime"] = OCI_RUNTIMES[name]
    if name.startswith("apple@"):
        extra["image"] = apple_emulation.image_tag()
    if name != "fake":
        extra["backend"] = name.split("@")[0]
    return Settings(
        runtime_dir=root / "r",
        workspaces_dir=root / "w",
        token_file=root / "token",
        export_dir=None,
        workspace_quota=False,
        interrupt_grace_s=1.5,
        **extra,
    )


def _engine_problem(name: str, image: str) -> str | None:
    """Why the container engine `name` cannot run sessions here, or None."""
    engine = shutil.which(name)
    if engine is None:
        return f"{name} is not installed"
    try:
        probe = subprocess.run([engine, "image", "inspect", image], capture_output=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"{name} did not answer within {PROBE_TIMEOUT_S}s"
    if probe.returncode != 0:
        detail = probe.stderr.decode(errors="replace").strip()[-300:]
        return f"{name} cannot run {image} here (engine down, or run `coderunner setup --backend {name}`): {detail}"
    return None


def _backend(name: str, settings: Settings, root: Path) -> SandboxBackend:
    if name == "fake":
        python = kernel_python(settings.sandbox_env)
        if python is None:
            pytest.fail("no interpreter with ipykernel: run `coderunner setup`")
        (root / "f").mkdir(mode=0o711)
        return FakeBackend(python, root / "f", sandbox_identity(settings.sandbox_user))
    if name.startswith("apple@"):
        return _emulated_apple(name.split("@")[1], settings, root)
    found = registry_entry(name)
    if found.setup is Setup.IMAGE:
        builder = found.image_builder
        if problem := _engine_problem(builder.engine or builder.name, settings.image):
            pytest.skip(problem if builder is found else f"{name} runs the image {builder.name} builds: {problem}")
    try:
        return make_backend(settings)
    except SandboxUnavailable as exc:
        if name == platform_default() and sys.platform.startswith("linux"):
            pytest.fail(f"the default backend cannot work here: {exc}")
        pytest.skip(f"{name}: {exc}")


_APPLE_IMAGE: dict[str, str] = {}


def _emulated_apple(version: str, settings: Settings, root: Path) -> SandboxBackend:
    """The Apple backend on the `container` stand-in at `version` (podman underneath)."""
    from coderunner.sandbox.apple import AppleBackend

    if problem := apple_emulation.emulation_problem():
        pytest.skip(problem)
    folder = apple_emulation.cli_dir(root / "bin", version)
    if "image" not in _APPLE_IMAGE:
        try:
            _APPLE_IMAGE["image"] = apple_emulation.build_image(folder)
        except RuntimeError as exc:
            pytest.fail(str(exc))
    return AppleBackend(_APPLE_IMAGE["image"], settings.runtime_dir, cli=str(folder / "container"))


def _needs_podman_image(name: str) -> bool:
    """A lane that runs the image podman builds (podman itself, gvisor): built here if missing, so the
    lane never depends on which test happened to build it first (the suite runs on two workers)."""
    if name == "fake" or name.startswith("apple@"):
        return False
    found = registry_entry(name)
    if found.setup is not Setup.IMAGE:
        return False
    builder = found.image_builder
    return (builder.engine or builder.name) == "podman" and shutil.which("podman") is not None


@pytest.fixture(params=BACKENDS)
async def manager(request: pytest.FixtureRequest, root: Path) -> AsyncIterator[SessionManager]:
    if _needs_podman_image(request.param):
        request.getfixturevalue("podman_image")  # session-scoped: built once per worker, under a lock
    settings = _settings(request.param, root)
    backend = _backend(request.param, settings, root)
    async with SessionManager(settings, backend) as running:
        yield running
    # Closed with its warm pool's starts under way (every test here): nothing of it runs on, its engine's own
    # processes included (a container's name carries the server's tag). The container watcher is the one
    # process that stays: it lives as long as the server process, to clean up should that die.
    markers = (str(root), f"coderunner-{server_tag(settings.runtime_dir)}-")
    assert await _eventually(lambda: not _left_running(markers)), _left_running(markers)


async def run(session: Session, code: str, timeout_s: float | None = None, **kwargs: Any) -> ExecutionResult:
    return await session.run(code, timeout_s, None, **kwargs)


def text(result: ExecutionResult) -> str:
    return result.outcome.output.text()


async def test_the_backend_describes_itself(manager: SessionManager) -> None:
    backend = manager.backend
    assert backend.name and backend.describe_isolation().strip()
    assert backend.channels in ("ipc", "tcp") and backend.workspace_path.startswith("/")
    reports = backend.limit_reports(manager.options().limits)
    assert {"memory_mb", "cpus", "pids", "tmp_mb"} <= set(reports)
    assert backend.network_problem("none") is None
    assert "unknown network mode" in (backend.network_problem("bogus") or "")


async def test_a_kernel_keeps_state_and_knows_the_guest_package(manager: SessionManager) -> None:
    session = await manager.create()
    await run(session, "x = 20")
    result = await run(session, "import coderunner_guest\nx * 2 + 2", variables={"y": 1})
    assert result.outcome.status is RunStatus.OK, text(result)
    assert "42" in text(result)
    assert "[1]" in text(await run(session, "[y]"))


async def test_files_cross_both_ways_through_the_workspace(manager: SessionManager) -> None:
    session = await manager.create()
    written = await anyio.to_thread.run_sync(lambda: session.files.write("from_host.txt", b"host"))
    assert written == f"{manager.backend.workspace_path}/from_host.txt"
    result = await run(session, "open('from_kernel.txt', 'w').write(open('from_host.txt').read() + '+kernel')")
    assert result.outcome.status is RunStatus.OK, text(result)
    data, _size, _path = await anyio.to_thread.run_sync(lambda: session.files.read("from_kernel.txt"))
    assert data == b"host+kernel"


async def test_a_timeout_interrupts_and_keeps_state(manager: SessionManager) -> None:
    session = await manager.create()
    await run(session, "kept = 7")
    result = await run(session, LONG_CELL, timeout_s=1)
    assert result.outcome.status is RunStatus.INTERRUPTED and not result.state_lost
    assert "7" in text(await run(session, "kept"))


async def test_death_is_noticed_and_the_next_kernel_is_fresh(manager: SessionManager) -> None:
    session = await manager.create()
    await run(session, "kept = 7")
    died = await run(session, "import os\nos._exit(9)")
    assert died.outcome.status is RunStatus.DIED and died.state_lost
    assert "False" in text(await run(session, "'kept' in dir()"))
    assert session.kernel is not None and session.kernel.process is not None
    await session.kernel.process.kill()  # from the host, between calls
    assert not session.kernel.alive
    assert "2" in text(await run(session, "1 + 1"))
    assert session.restarts == 2


async def test_closing_leaves_nothing_behind(manager: SessionManager) -> None:
    session = await manager.create()
    results: list[ExecutionResult] = []
    async with anyio.create_task_group() as tg:

        async def long_run() -> None:
            results.append(await run(session, LONG_CELL, timeout_s=120))

        tg.start_soon(long_run)
        with anyio.fail_after(60):
            while not session.busy:
                await anyio.sleep(0.02)
        process = session.kernel.process if session.kernel is not None else None
        await manager.close(session.session_id)
    assert results[0].notice == "the session was closed during this call"
    assert process is not None and not process.alive
    assert not session.workspace.path.exists() and not session.dirs.top.exists()


async def test_a_start_cancelled_part_way_leaves_no_sandbox_process(manager: SessionManager) -> None:
    """A server stopping while a sandbox starts (one started ahead for the next one-shot, say): the start
    is cancelled at several points, and each time nothing it began is left running. A backend that has
    no one-shot sandboxes (Apple's, for now) refuses the start before anything runs."""
    options = manager.options()
    refusal = manager.backend.pipes_refusal
    # Every 50 ms of a start: podman's client killed 0.15 s in (its engine still making the container) once left
    # the container's monitor and init running, unknown to the engine (container.py, ContainerProcess._kill).
    for delay in (0.0, 0.02, *(step / 20 for step in range(1, 13))):
        lease = await manager.leases.lease(options, throwaway=True)
        await lease.mount()
        argv = ready_argv(manager.backend.python, lease.dirs, options.limits.memory_mb)
        started: list[SandboxProcess] = []
        with anyio.move_on_after(delay):
            start = manager.backend.spawn(lease.spec(), argv, manager.task_group, pipes=True)
            if refusal is None:
                started.append(await start)
            else:
                with pytest.raises(SandboxUnavailable, match=re.escape(refusal)):
                    await start
        for process in started:  # it won the race: it is the caller's to kill, as a start that answered
            await process.kill()
        marker = lease.spec().name  # in the argv of what the start ran (its binds; a container's name and label)
        await lease.close()
        assert await _eventually(lambda: not _processes_naming(marker)), (delay, _processes_naming(marker))  # noqa: B023
    if refusal is None:  # and it still serves
        assert (await LocalOneShots.for_manager(manager).runner.run("python", "print(6 * 7)", options)).stdout == "42\n"


def _processes_naming(marker: str) -> list[str]:
    """The live processes whose argv names `marker`: this process's children (a sandbox's own, or its engine's
    client) and any other (an engine's monitor, conmon, is nobody's child once its client is gone)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                argv = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if state != "Z" and marker in argv:
                    found.append(argv)
    return found


def _left_running(markers: tuple[str, ...]) -> list[str]:
    """Processes naming any of `markers`, but the container watcher (sandbox/watcher.py)."""
    found = [argv for marker in markers for argv in _processes_naming(marker) if "sandbox/watcher.py" not in argv]
    return [argv[-400:] for argv in found]


async def _eventually(done: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    with anyio.move_on_after(timeout_s):
        while not done():
            await anyio.sleep(0.1)
    return done()


async def test_one_shot_runs_use_pipes_and_exit_codes(manager: SessionManager) -> None:
    options, oneshot = manager.options(), LocalOneShots.for_manager(manager).runner
    if manager.backend.name == "apple":  # not there yet: the refusal must say what to use instead
        refusal = "not available on the Apple container backend yet: use run_python"
        with pytest.raises(SandboxUnavailable, match=refusal):
            await oneshot.run("python", "print(1)", options)
        return
    result = await oneshot.run("python", "import sys\nprint(6 * 7)\nsys.exit(4)", options)
    assert result.stdout.strip() == "42" and result.exit_code == 4 and not result.timed_out
    slept = await oneshot.run("bash", "sleep 60", manager.options(SandboxRequest(timeout_s=1)))
    assert slept.timed_out


async def test_a_snapshot_restores_variables_and_files_into_a_new_sandbox(manager: SessionManager) -> None:
    if manager.backend.name == "fake":
        pytest.skip("the fake backend runs kernels on the host: its workspace is not at /workspace inside")
    session = await manager.create()
    cell = (
        "import threading\nimport numpy as np\ndata = np.arange(10)\n"
        "def scaled(k):\n    return int(data.sum()) * k\n"
        "guard = threading.Lock()\nopen('kept.txt', 'w').write('files too')"
    )
    assert (await run(session, cell)).outcome.status is RunStatus.OK
    taken = await manager.snapshots.take(session, name="conformance")
    # gvisor checkpoints the whole sandbox (a lock travels too); elsewhere the namespace is pickled.
    memory = takes_memory(manager.backend)
    assert memory == ("memory" in taken.meta.state_report) == (manager.backend.name == "gvisor")
    if not memory:
        assert "guard" in [item["name"] for item in taken.meta.state_report["skipped"]]
    # The state folder the guest wrote is gone from the workspace, and nothing holds it open
    # (under gVisor a file deleted only by the host stayed allocated while the sandbox ran).
    assert not (session.workspace.path / ".coderunner" / "snapshot").exists()
    assert await anyio.to_thread.run_sync(_deleted_but_open, session.dirs.sandbox_uid) == []
    restored = await manager.create(manager.options(), seed=Seed(session.options.client, taken.meta.snapshot_id))
    assert restored.session_id != session.session_id and restored.restored_from == taken.meta.snapshot_id
    result = await run(restored, "print(scaled(2), np.__name__, open('kept.txt').read(), 'guard' in dir())")
    assert f"90 numpy files too {memory}" in text(result), text(result)
    assert "45" in text(await run(session, "int(data.sum())")), "the original runs on"
    # The staged state is gone from the new sandbox's host dir once loaded.
    assert not (restored.dirs.host_dir / "snapshot").exists()


def _deleted_but_open(uid: int) -> list[str]:
    """Deleted files of the sandbox's host user that some process (its own, or gVisor's file proxy,
    which sees them under other paths) still holds open: space a deletion did not give back."""
    found = []
    for fds in Path("/proc").glob("[0-9]*/fd"):
        try:
            entries = list(fds.iterdir())
        except OSError:
            continue
        for entry in entries:
            try:
                info = entry.stat()
            except OSError:
                continue
            if info.st_nlink == 0 and info.st_uid == uid and stat.S_ISREG(info.st_mode) and info.st_size > 0:
                found.append(f"{entry} -> {os.readlink(entry)}")
    return found
