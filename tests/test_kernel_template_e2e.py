"""A real ipykernel forked from the kernel template (issue 41, route A), end to end, before any wiring.

The template (sandbox/bwrap_template.py, guest/kernel_template.py) forks a kernel into a bwrap sandbox built
as today around its placeholder; the kernel reads its connection file (its key) from that sandbox's private
root, binds its ipc sockets in the sandbox's run dir; the host claims them (KernelProcess.claim_sockets) and
runs cells through the product's own KernelClient. The kernel answers with its own key only, has numpy,
pandas and pyplot imported already (the template's), draws a chart, and is the sandbox's user under its
seccomp filter.
Root only (the template joins user namespaces), bwrap only.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from coderunner.config import load_settings
from coderunner.hostfs.private_dirs import ensure_private_dir
from coderunner.hostfs.session_dirs import dump_connection
from coderunner.kernel.client import KernelClient
from coderunner.kernel.connection_info import connection_info
from coderunner.kernel.host_channels import Deadline
from coderunner.kernel.output_capture import OutputCollector
from coderunner.kernel.process import KernelProcess
from coderunner.sandbox import PRIVATE_CONNECTION, make_backend
from coderunner.sandbox.bwrap import BwrapBackend
from coderunner.sandbox.bwrap_template import KernelTemplate, TemplateReply
from coderunner.sandbox.pid1 import SandboxHold
from coderunner.sessions.leases import SandboxLeases, sandbox_spec
from coderunner.sessions.sandbox_options import sandbox_options

from .conftest import fresh_dirs

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

CELL = """
import os, sys
import matplotlib.pyplot as plt
fig, ax = plt.subplots()
ax.plot([0, 1, 2], [0, 1, 4])
fig.savefig("/workspace/chart.png")
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
print(os.getuid(), status["Seccomp"].strip(), status["CapEff"].strip(), open("/proc/1/comm").read().strip(),
      "numpy" in sys.modules, "pandas" in sys.modules, sep=",")
"""


@contextlib.asynccontextmanager
async def kernels_from_a_template() -> AsyncIterator[Any]:
    if os.getuid() != 0 or shutil.which("bwrap") is None:
        pytest.skip("the kernel template needs root and bwrap")
    with fresh_dirs("cte-") as made:  # nothing of its sandboxes may stay mounted, whatever a test did
        settings = load_settings(
            Path(os.devnull), runtime_dir=made.runtime, workspaces_dir=made.workspaces, backend="bwrap"
        )
        backend = make_backend(settings)
        assert isinstance(backend, BwrapBackend)
        ensure_private_dir(settings.runtime_dir, backend.dir_mode)
        ensure_private_dir(settings.workspaces_dir, backend.dir_mode)
        leases = SandboxLeases(settings, backend, None)
        options = sandbox_options(settings, backend, [])
        template = await KernelTemplate.start(backend.command, backend.seccomp_filter)
        try:
            async with anyio.create_task_group() as tg:

                async def start() -> tuple[KernelProcess, dict[str, Any], Any, TemplateReply]:
                    dirs = await leases.open_dirs(options, throwaway=True)
                    try:
                        spec = sandbox_spec(options, dirs, (), settings.network_ceiling)
                        kernel = KernelProcess(backend, spec, tg, dirs)
                        info = connection_info(secrets.token_hex(32), "ipc", str(spec.runtime_dir / "k0"))
                        kernel.info = info
                        spec = replace(spec, private_files=((PRIVATE_CONNECTION, dump_connection(info)),))
                        kernel.process, answer = await template.spawn_entered(backend, spec, tg, 2)
                        await kernel.claim_sockets(Deadline(time.monotonic() + 120))
                    except BaseException:  # a start that failed or was cancelled leaves nothing mounted
                        with anyio.CancelScope(shield=True):
                            await leases.close_dirs(dirs)
                        raise
                    return kernel, kernel.host_side(), dirs, answer

                yield start, leases, template
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await template.close()
            backend.close_starts()  # as a manager does as it ends


async def run_cell(kernel: KernelProcess, info: dict[str, Any], code: str, within_s: float = 120) -> tuple[str, str]:
    """(output, status) of one cell, through the product's own KernelClient with `info` (its key included)."""
    async with anyio.create_task_group() as tg:
        client = KernelClient(kernel, tg)
        try:
            await client.connect(info, Deadline(time.monotonic() + within_s))
            output = OutputCollector(limit_chars=10_000, spill_limit_bytes=0, image_limit_bytes=0)
            outcome = await client.execute(code, output, timeout_s=within_s, interrupt_grace_s=5)
            return output.text(), outcome.status.value
        finally:
            client.close()
            tg.cancel_scope.cancel()


async def test_a_kernel_from_the_template_runs_cells_in_its_own_sandbox() -> None:
    async with kernels_from_a_template() as (start, leases, _):
        kernel, info, dirs, answer = await start()
        assert answer.pidfd is not None
        try:
            with open(f"/proc/self/fdinfo/{answer.pidfd}") as handle:
                assert f"Pid:\t{answer.pid}\n" in handle.read()  # the handle is the kernel's
            out, status = await run_cell(kernel, info, CELL)
            assert status == "ok", out
            assert out.strip() == "1000,2,0000000000000000,sandbox-init,True,True"
            assert (dirs.workspace.path / "chart.png").stat().st_size > 1000
            # Another key does not reach it (neither side takes what it cannot verify).
            wrong = {**info, "key": secrets.token_hex(32)}
            timed_out = False
            try:
                await run_cell(kernel, wrong, "1", within_s=5)
            except* TimeoutError:
                timed_out = True
            assert timed_out
            await kernel.kill()
            with anyio.fail_after(10):  # the sandbox's end is the kernel's: its handle says so
                await anyio.wait_readable(answer.pidfd)
        finally:
            await kernel.kill()
            os.close(answer.pidfd)
            await leases.close_dirs(dirs)


async def test_a_template_closed_at_any_moment_of_its_start_leaves_no_process() -> None:
    """A server that closes while its template starts (cancelled within its first milliseconds, or mid
    warm-up) ends all of it: bwrap killed alone that early left its child blocked for ever before it ran
    anything, holding the template's bwrap argv (seen here: 21 of them after a day of cluster tests); so did
    a cancel inside open_process, after the fork (asyncio then kills the outer bwrap alone; seen in CI)."""
    if os.getuid() != 0 or shutil.which("bwrap") is None:
        pytest.skip("the kernel template needs root and bwrap")
    with fresh_dirs("ctc-") as made:
        settings = load_settings(
            Path(os.devnull), runtime_dir=made.runtime, workspaces_dir=made.workspaces, backend="bwrap"
        )
        backend = make_backend(settings)
        assert isinstance(backend, BwrapBackend)
        ensure_private_dir(settings.runtime_dir, backend.dir_mode)

        async def start_and_close() -> None:
            template = await KernelTemplate.start(backend.command, backend.seccomp_filter)
            await template.close()  # ready before the cancel (a fast machine): closed as a server would

        for turns in range(12):  # cancelled at each of its first awaits, whatever this machine's speed: the
            async with anyio.create_task_group() as group:  # first is inside open_process, after the fork
                group.start_soon(start_and_close)
                for _ in range(turns):
                    await anyio.lowlevel.checkpoint()
                group.cancel_scope.cancel()
        for delay_s in [*(step / 10_000 for step in range(40)), 0.01, 0.03, 0.1, 0.5, 1.5]:
            with anyio.move_on_after(delay_s):
                await start_and_close()
        deadline = time.monotonic() + 10
        while (left := processes_naming(made.runtime)) and time.monotonic() < deadline:
            await anyio.sleep(0.1)
        assert not left, left


def pid_of(pidfd: int) -> int:
    """The pid a pidfd holds (its fdinfo says)."""
    with open(f"/proc/self/fdinfo/{pidfd}") as handle:
        return int(next(line for line in handle if line.startswith("Pid:")).split()[1])


def processes_naming(path: Path) -> list[str]:
    """The processes whose command line names `path` (a template's bwrap names its guest copy there)."""
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and str(path).encode() in (entry / "cmdline").read_bytes():
                found.append(f"{entry.name}: {(entry / 'cmdline').read_bytes()[:200]!r}")
    return found


async def test_a_fork_cancelled_while_the_template_works_on_it_leaves_the_next_exchange_in_step() -> None:
    """A start cancelled after its fork was asked for (its session closed, its client gone) must not leave the
    template's reply on the socket: the next request would read it as its own, a fork handed another fork's
    pid and pidfd, whose exit then ends the wrong sandbox. After it, a counters request gets a counters reply,
    and the next kernel's handle is its own and runs cells."""
    async with kernels_from_a_template() as (start, leases, template):
        original = template._answer
        asked = anyio.Event()

        async def answer_once_asked() -> TemplateReply:
            asked.set()
            return await original()

        template._answer = answer_once_asked  # type: ignore[method-assign]
        async with anyio.create_task_group() as group:
            group.start_soon(start)
            await asked.wait()  # the fork's request is with the template
            group.cancel_scope.cancel()
        template._answer = original  # type: ignore[method-assign]
        counters = await template.counters()
        assert (counters.error, counters.pid, counters.pidfd) == (0, 0, None), counters
        kernel, info, dirs, answer = await start()
        assert answer.pidfd is not None
        try:
            assert pid_of(answer.pidfd) == answer.pid
            hold = kernel.process.hold
            assert isinstance(hold, SandboxHold) and hold.init is not None
            # The kernel the reply names is the one in this start's sandbox (its pid namespace is its init's).
            assert os.readlink(f"/proc/{answer.pid}/ns/pid") == os.readlink(f"/proc/{pid_of(hold.init)}/ns/pid")
            out, status = await run_cell(kernel, info, "print(6 * 7)")
            assert (status, out.strip()) == ("ok", "42"), out
        finally:
            await kernel.kill()
            os.close(answer.pidfd)
            await leases.close_dirs(dirs)


async def test_a_start_abandoned_while_its_fork_waits_for_go_leaves_no_fork() -> None:
    """The fork is made while bwrap still builds the sandbox and waits for "go". A start cancelled then (its
    client gone) must not leave it waiting: it exits (the end of "go", or its sandbox's end), and the template
    serves the next start."""
    async with kernels_from_a_template() as (start, leases, template):
        original = template.finish_fork
        waiting = anyio.Event()
        forks: list[int] = []

        async def stop_before_go(pending: Any) -> TemplateReply:
            forks.append(os.dup(pending.reply.pidfd))
            waiting.set()
            await anyio.sleep_forever()
            raise AssertionError("unreachable")

        template.finish_fork = stop_before_go  # type: ignore[method-assign]
        async with anyio.create_task_group() as group:
            group.start_soon(start)
            await waiting.wait()
            group.cancel_scope.cancel()
        template.finish_fork = original  # type: ignore[method-assign]
        assert len(forks) == 1
        try:
            with anyio.fail_after(10):
                await anyio.wait_readable(forks[0])  # a pidfd is readable once its process exited
        finally:
            os.close(forks[0])
        kernel, info, dirs, answer = await start()
        try:
            out, status = await run_cell(kernel, info, "print(6 * 7)")
            assert (status, out.strip()) == ("ok", "42"), out
        finally:
            await kernel.kill()
            if answer.pidfd is not None:
                os.close(answer.pidfd)
            await leases.close_dirs(dirs)
