"""Kernels forked from the warm template (issue 41), for one server process's bwrap backend.

`TemplateKernels` owns the template (sandbox/bwrap_template.py) while its SessionManager is open: it starts
it in the background (a server never waits for the template's warm-up), starts it again after it died
(after RESTART_DELAY_S, so a template that cannot live here is not restarted in a loop), and ends it with
the server. It is the backend's `kernel_starter`: KernelProcess asks it first, and a kernel starts cold
as before when it raises, the reason then shown in the session's status (`kernel_start`).

A kernel from the template is not the sandbox's own child: the template reaps it. So the host learns of its
exit from the pidfd the fork's reply carries, its exit code from the status pipe the template writes the
wait status to once it reaped it, and then kills the sandbox by the handles the backend holds (its init
would otherwise hold it on). Its stdout and stderr go to a pipe kept as the sandbox's
stderr tail (a start's failure says what the kernel said).

Every network mode is covered: the backend builds the sandbox as around a cold kernel, with no program
(its init holds it) or in 'allowlist' a placeholder its forwarder starts (bwrap_argv.py wraps any program in
egress_launcher), and 'internet''s slirp4netns attached before its init ran; the fork joins that network
namespace. What a fork cannot give starts cold and says why: an environment too large for a request, a fork
the template refused, the template not running (starting, or dead and not yet started again).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import struct

import anyio
import anyio.to_thread
from anyio.abc import ByteReceiveStream, TaskGroup

from coderunner.sandbox.base import SandboxBackend, SandboxProcess, SandboxSpec
from coderunner.sandbox.bwrap import BwrapBackend
from coderunner.sandbox.bwrap_template import (
    STALE,
    STALE_PREFIX,
    STALE_REASON_BYTES,
    KernelTemplate,
    TemplateUnavailable,
    template_unavailable,
)
from coderunner.sandbox.template_pages import copied_pages

log = logging.getLogger(__name__)

#: How long after a template died (or could not start) before it is started again.
RESTART_DELAY_S = 30.0
#: How long a kernel's start waits for a template that is starting (its warm-up costs about what a cold
#: kernel's first imports would) before it starts cold instead.
STARTING_WAIT_S = 10.0
#: Bound on the template writing a kernel's wait status once its pidfd said it exited.
STATUS_WAIT_S = 2.0
#: A template whose first this-many forks all failed is given up for the server's life (its kernels start cold,
#: saying why): a machine where no fork can enter a sandbox (a kernel without setns on a pidfd, a policy in the
#: way) would otherwise build and throw away a sandbox before every cold start. One fork that worked shows the
#: machine can: later failures (a loaded machine's timeouts) never give it up.
NEVER_FORKED_LIMIT = 3
#: How many kernels the pages a fork copies are learned from at most, per template (the first that works counts).
LESSONS = 3
#: The wait status's size on the status pipe (an int, as waitpid gives it).
STATUS = struct.Struct("<i")


def exit_code(status: int) -> int:
    """A forked kernel's wait status as a cold kernel's sandbox reports it (guest/sandbox_init.py: 128 + a signal)."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.waitstatus_to_exitcode(status)


def unavailable_here() -> str | None:
    """Why no template can run for this server process (None: it can): the registry's entry point."""
    return template_unavailable()


def kernel_starter(backend: SandboxBackend, preload_imports: bool = True) -> TemplateKernels:
    """The template owner of `backend` (not yet open): the registry's entry point (vocabulary/backends.py)."""
    assert isinstance(backend, BwrapBackend), backend
    return TemplateKernels(backend, preload_imports=preload_imports)


class TemplateKernels:
    """The template of one server process's bwrap backend, and the kernels forked from it."""

    def __init__(self, backend: BwrapBackend, *, freeze: bool = True, preload_imports: bool = True) -> None:
        self.backend = backend
        self.freeze = freeze
        #: Whether the template imports numpy, pandas and matplotlib (the preload_imports setting: a forked
        #: kernel has what its template imported, so without it a user's kernel must not have them either).
        self.preload_imports = preload_imports
        self.template: KernelTemplate | None = None
        #: Why there is no template to fork from now (None once it is ready).
        self.why_not: str | None = "the kernel template is starting"
        self.ready = anyio.Event()
        #: Whether a start of the template is under way (a kernel's start waits for it, up to STARTING_WAIT_S).
        self.starting = False
        self._scope: anyio.CancelScope | None = None
        #: Kernels forked, and kernels that started cold because a fork failed.
        self.forked = 0
        self.refused = 0
        #: Set once its first NEVER_FORKED_LIMIT forks all failed: no template for this server's life.
        self.given_up = False
        #: How many pages the running template's forks copy ahead (guest/page_plan.py), once learned; None before.
        self.plan_pages: int | None = None
        #: Lessons tried for the running template (a learning under way counts): at most LESSONS.
        self._lessons = 0

    def open(self, task_group: TaskGroup) -> None:
        """Start the template in the background of `task_group` (the manager's), and be the backend's starter."""
        self.backend.kernel_starter = self
        task_group.start_soon(self._keep)

    async def _keep(self) -> None:
        """Start the template, wait for it to exit, start it again after RESTART_DELAY_S; until cancelled."""
        with anyio.CancelScope() as self._scope:
            while True:
                self.starting, self.why_not = True, "the kernel template is starting"
                try:
                    self.template = await KernelTemplate.start(
                        self.backend.command, self.backend.seccomp_filter, freeze=self.freeze,
                        preload_imports=self.preload_imports,
                    )  # fmt: skip
                except Exception as exc:  # whatever it met, kernels start cold meanwhile: never the server's end
                    self.starting = False
                    self.ready.set()  # those waiting for it start cold now; the next start has an event of its own
                    self.ready = anyio.Event()
                    self.why_not = f"the kernel template could not start: {exc}"
                    log.warning("%s; kernels start cold", self.why_not)
                else:
                    self.starting, self.why_not = False, None
                    self.plan_pages, self._lessons = None, 0  # a new template: its pages are learned anew
                    self.ready.set()
                    code = await self.template.process.wait()
                    self.why_not = f"the kernel template exited (code {code}); it is started again"
                    log.warning("%s in %gs", self.why_not, RESTART_DELAY_S)
                    await self._drop()
                await anyio.sleep(RESTART_DELAY_S)

    async def _drop(self) -> None:
        template, self.template, self.ready = self.template, None, anyio.Event()
        if template is not None:
            with anyio.CancelScope(shield=True):
                await template.close()

    async def close(self) -> None:
        """End the template (its kernels live on in their sandboxes, each ended by its own session)."""
        if self.backend.kernel_starter is self:
            self.backend.kernel_starter = None
        if self._scope is not None:
            self._scope.cancel()
        self.why_not = "the server is closing"
        self.starting = False
        self.ready.set()  # whoever waits for a start that will not end (settled, spawn_kernel) goes on now
        await self._drop()

    def stale_imports(self, sandbox: SandboxProcess) -> str | None:
        return stale_reason(sandbox)

    def wants_pages_from(self, sandbox: SandboxProcess) -> bool:
        """Whether `sandbox`'s kernel, forked from the running template, is one to learn its forks' pages from."""
        return (
            self.template is not None and self.plan_pages is None and self._lessons < LESSONS
            and sandbox.program_pid is not None and sandbox.alive
        )  # fmt: skip

    async def learn_pages(self, sandbox: SandboxProcess) -> None:
        """Learn from `sandbox`'s kernel, which has run only the server's own cells, which of the template's pages
        a kernel's start copies (template_pages.py), and have the template's later forks copy them while their
        sandboxes are built. Best effort: if it fails, forks fault their pages in as before."""
        template = self.template
        if template is None or not self.wants_pages_from(sandbox):
            return
        self._lessons += 1
        assert sandbox.program_pid is not None
        try:
            pages = await anyio.to_thread.run_sync(copied_pages, sandbox.program_pid, template.pid)
            if self.template is template and pages:
                self.plan_pages = await template.give_plan(pages)
                log.info("kernel template: its forks copy %d pages ahead", self.plan_pages)
        except (OSError, ValueError, TemplateUnavailable) as exc:  # a /proc entry not as expected, too: best effort
            log.info("kernel template: its forks' pages could not be learned (%s); they fault in as they go", exc)

    async def _give_up(self, last: str) -> None:
        """No fork ever worked here: end the template and its restarts; kernels start cold from now on."""
        self.given_up = True
        if self._scope is not None:
            self._scope.cancel()
        await self._drop()
        self.why_not = f"the kernel template is off for this server: its first {self.refused} forks all failed ({last})"
        log.warning("%s; kernels start cold", self.why_not)

    async def settled(self) -> None:
        """Once the template's start under way ended (bounded: its start has START_TIMEOUT_S); at once if none is."""
        while self.starting:
            await self.ready.wait()

    async def spawn_kernel(self, spec: SandboxSpec, task_group: TaskGroup) -> SandboxProcess:
        """A kernel forked into a sandbox built from `spec`; raises TemplateUnavailable saying why not."""
        if self.given_up:
            raise TemplateUnavailable(self.why_not or "the kernel template is off for this server")
        if self.starting:
            with anyio.move_on_after(STARTING_WAIT_S):
                await self.ready.wait()
        if self.template is None:
            raise TemplateUnavailable(self.why_not or "the kernel template is not running")
        output_read, output_write = os.pipe2(os.O_CLOEXEC)
        status_read, status_write = os.pipe2(os.O_CLOEXEC)
        output = PipeReceiveStream(output_read)
        try:
            try:
                sandbox, answer = await self.template.spawn_entered(
                    self.backend, spec, task_group, output_write, status_fd=status_write
                )
            except (TimeoutError, anyio.EndOfStream, anyio.BrokenResourceError, OSError) as exc:
                # Its sandbox's placeholder never said it was ready, or the template's socket broke: start cold.
                raise TemplateUnavailable(f"a kernel could not be forked from the template: {exc!r}") from None
        except BaseException as exc:
            self.refused += 1
            os.close(status_read)
            with anyio.CancelScope(shield=True):
                await output.aclose()
                if self.forked == 0 and self.refused >= NEVER_FORKED_LIMIT and not self.given_up:
                    await self._give_up(str(exc))
            raise
        finally:
            os.close(output_write)
            os.close(status_write)
        self.forked += 1
        assert answer.pidfd is not None
        follow_program(sandbox, task_group, answer.pid, answer.pidfd, output, status_read)
        return sandbox


def stale_reason(sandbox: SandboxProcess) -> str | None:
    """Why a forked kernel exited with STALE (the line it wrote on its stderr just before), or None."""
    if sandbox.returncode != STALE:
        return None
    said = sandbox.stderr_tail()
    start = said.rfind(STALE_PREFIX)
    line = (said[start + len(STALE_PREFIX) :].splitlines() or [""])[0].strip() if start >= 0 else ""
    return line[:STALE_REASON_BYTES] or "the kernel did not say why"


def follow_program(
    sandbox: SandboxProcess, task_group: TaskGroup, pid: int, pidfd: int, output: PipeReceiveStream,
    status_read: int | None,
) -> None:  # fmt: skip
    """Follow a kernel forked into `sandbox` (not its own child): its output kept as the sandbox's stderr tail, its
    exit relayed to it. `status_read`: where its template writes its wait status (None: a kernel handed over by a
    dead predecessor, whose template is gone). Takes the fds."""
    assert output.fd is not None
    sandbox.keep_stderr_of(output)
    sandbox.program_pid = pid
    sandbox.program_fds = (pidfd, output.fd)
    task_group.start_soon(relay_exit, sandbox, pidfd, status_read, output)


async def relay_exit(sandbox: SandboxProcess, pidfd: int, status_read: int | None, output: ByteReceiveStream) -> None:
    """Once the forked kernel exited (its pidfd): its exit code to `sandbox`, then end the sandbox."""
    try:
        await anyio.wait_readable(pidfd)
        if sandbox.ending:
            return  # killed from outside: the kernel ended with its sandbox
        code = 128 + signal.SIGKILL  # the template died before it said
        if status_read is not None:
            with anyio.move_on_after(STATUS_WAIT_S), contextlib.suppress(OSError):
                await anyio.wait_readable(status_read)
                said = os.read(status_read, STATUS.size)
                if len(said) == STATUS.size:
                    code = exit_code(STATUS.unpack(said)[0])
        await sandbox.stderr_settled()
        if not sandbox.ending:
            sandbox.program_exited(code)
            await sandbox.kill()
    finally:
        sandbox.program_fds = None
        os.close(pidfd)
        if status_read is not None:
            os.close(status_read)
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await output.aclose()


class PipeReceiveStream(ByteReceiveStream):
    """The read end of a pipe, read as the event loop says it is readable (no worker thread held per kernel)."""

    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self.fd: int | None = fd

    async def receive(self, max_bytes: int = 65536) -> bytes:
        while True:
            if self.fd is None:
                raise anyio.ClosedResourceError
            try:
                data = os.read(self.fd, max_bytes)
            except BlockingIOError:
                await anyio.wait_readable(self.fd)
                continue
            if not data:
                raise anyio.EndOfStream
            return data

    async def aclose(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            anyio.notify_closing(fd)
            os.close(fd)
