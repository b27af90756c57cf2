"""One-shot runs: a program in a fresh throwaway sandbox (no kernel), then nothing left behind.

Python, JavaScript (Node.js) and bash run with the isolation and limits of a session: the same
backend, namespaces, seccomp filter, memory/pids cgroups and network modes. The source and the
variables travel as files in the sandbox's runtime dir; the program's stdin, stdout and stderr
are pipes, captured within bounds (head and tail kept). At the deadline the whole sandbox is
killed. Syntax checks run the same way, with the checker inside the sandbox.

What a run costs besides the program (bench/oneshot.py --phases measures each part): the
host dirs, whose workspace is a size-capped tmpfs (workspace.py) rather than a loop-mounted
image; the sandbox itself (cgroups, bwrap, the seccomp filter compiled once per process);
and a launcher only where the language needs one: Python gets its variables as globals
from a launcher importing nothing beyond os and sys, bash is started directly (its
variables come from a file it reads through BASH_ENV), Node.js has a preload. A sandbox
started ahead runs bash with the launcher beside it (program.READY_WAITER), so a
run of either skips its interpreter's start.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
from anyio.abc import TaskGroup

from coderunner.offload import off_loop
from coderunner.oneshot.program import (
    LAUNCHER,
    SOURCE_NAMES,
    BoundedBytes,
    Language,
    OneShotError,
    collect,
    program,
)
from coderunner.oneshot.ready import REPLY_FIRST_S, ReadySandbox, ReadySandboxes, Room
from coderunner.oneshot.slots import OneShotSlots
from coderunner.sandbox import SandboxBackend, SandboxProcess
from coderunner.sandbox.cgroups import SessionCgroup
from coderunner.sandbox.common import product_python
from coderunner.sessions.leases import SandboxLease, SandboxLeases
from coderunner.sessions.sandbox_options import SandboxOptions

if TYPE_CHECKING:
    from coderunner.config import Settings
    from coderunner.sessions.egress_wiring import EgressHub, SessionEgress

__all__ = ["ExportTo", "Language", "OneShotError", "OneShotResult", "OneShotRunner"]

#: Bound on a syntax check (node --check of a large file is the slowest).
CHECK_TIMEOUT_S = 30.0
MAX_CHECK_ANSWER_BYTES = 1 << 20

#: Gets (phase name, ms since the previous phase) when set: bench/oneshot.py's breakdown.
PhaseSink = Callable[[str, float], None]


@dataclass(frozen=True)
class OneShotResult:
    language: Language
    success: bool
    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool
    execution_time_ms: float
    memory_peak_mb: float | None
    #: How memory and time were bounded, so the caller knows what the figures mean.
    limits: dict[str, Any]
    truncated: bool = False
    #: What was copied from the export mount to the client's export folder, if anything.
    exported: str | None = None


@dataclass(frozen=True)
class ExportTo:
    """Where a run's outbox goes instead of its client's export folder: a cluster node's host-only folder
    for that run alone (cluster/oneshot_side.py), whose files its answer carries to the front door."""

    folder: Path
    limit_bytes: int


@dataclass
class OneShotRunner:
    """Runs programs in throwaway sandboxes, each on a lease of its own (leases.py), as sessions do."""

    backend: SandboxBackend
    task_group: TaskGroup
    #: Each sandbox's dirs, host uid and mounts (staged as root) with its export outbox.
    leases: SandboxLeases
    #: The output_limit_chars setting. Each stream keeps at most this many bytes (head and tail):
    #: a character is at least one byte in UTF-8, so the text never exceeds this many characters.
    output_limit_chars: int
    #: One-shot sandboxes at once; more wait (within their own timeout) for a slot.
    max_concurrent: int = 4
    #: Of those, how many one caller may hold, so that one client cannot keep the others waiting.
    max_per_caller: int = 2
    #: Network 'allowlist': each run gets a policy proxy of its own (sessions/egress_wiring.py).
    egress: EgressHub | None = None
    #: Where run() reports how long each phase took (None: not measured).
    phases: PhaseSink | None = None
    #: Keep a sandbox started ahead for the options of the last runs (ready.py): a run with
    #: the same options skips the start.
    ready: bool = False
    #: Whether so many sandboxes started ahead fit the user's limits (the manager's room and memory budget).
    ready_room: Room = lambda count, member_mb: True
    #: Finished runs whose cgroup and dirs are being removed after their reply (their processes are gone
    #: before it); at most max_concurrent, beyond which a run removes its own before replying.
    _closing: int = 0
    slots: OneShotSlots = field(init=False)
    #: The sandboxes started ahead (none unless `ready`): one per option set, for as many sets as may run at once.
    ahead: ReadySandboxes = field(init=False)

    def __post_init__(self) -> None:
        self.slots = OneShotSlots(self.max_concurrent, self.max_per_caller)
        self.ahead = ReadySandboxes(self.backend, self.task_group, self.leases, most=self.max_concurrent,
                                    room=self.ready_room, egress=self.egress)  # fmt: skip

    @classmethod
    def for_settings(
        cls, settings: Settings, backend: SandboxBackend, task_group: TaskGroup, leases: SandboxLeases,
        egress: EgressHub | None, ready_room: Room,
    ) -> OneShotRunner:  # fmt: skip
        """A server's runner: its bounds and whether sandboxes start ahead come from `settings`; its
        sandboxes run in the host's task group, on the host's leases, within the room the host grants."""
        return cls(
            backend=backend,
            task_group=task_group,
            leases=leases,
            output_limit_chars=settings.output_limit_chars,
            max_concurrent=settings.max_oneshot_runs,
            max_per_caller=settings.max_oneshot_runs_per_client,
            egress=egress,
            ready=settings.oneshot_ready,
            ready_room=ready_room,
        )

    def ready_counts(self) -> dict[str, int] | None:
        """What the sandboxes started ahead did (get_capabilities), or None when none are kept."""
        return asdict(self.ahead.stats()) if self.ready else None

    async def run(
        self,
        language: Language,
        code: str,
        options: SandboxOptions,
        *,
        stdin: bytes = b"",
        variables: dict[str, Any] | None = None,
        caller: str | None = None,
        on_egress: Callable[[SessionEgress], None] | None = None,
        export_to: ExportTo | None = None,
    ) -> OneShotResult:
        """`on_egress`: given an allowlist run's proxy once it exists (the tool lends it an asker).
        `export_to`: where its outbox goes instead of the client's export folder."""
        async with self.slots.slot(options.timeout_s, caller):
            ready = await self.ahead.take(options) if self.ready else None
            result = await self._run(language, code, options, stdin, variables or {}, ready, on_egress, export_to)
            if self.ready:  # not after a run that failed or was cancelled (a server that stops, a client gone)
                self.ahead.start_ahead(options)
            return result

    async def _run(
        self,
        language: Language,
        code: str,
        options: SandboxOptions,
        stdin: bytes,
        variables: dict[str, Any],
        ready: ReadySandbox | None = None,
        on_egress: Callable[[SessionEgress], None] | None = None,
        export_to: ExportTo | None = None,
    ) -> OneShotResult:
        """One run on its lease (the one started ahead, or its own), which it hands back however it ends."""
        clock = _Clock(self.phases)
        #: The sandbox's cgroup once it is dead and reaped: removed with the lease (after the reply).
        cgroups: list[SessionCgroup] = []
        if ready is not None:
            assert ready.lease is not None and ready.lease.mounts is not None and ready.process is not None
            lease = ready.lease
        else:
            lease = await self.leases.lease(options, throwaway=True)
        clock.mark("dirs")
        try:
            if lease.mounts is None:
                await lease.mount()
            clock.mark("mounts")
            egress = await lease.open_egress(self.egress, self.task_group, f"run-{lease.dirs.key}", options)
            if egress is not None and on_egress is not None:
                on_egress(egress)
            argv = program(self.backend.python, language, code, options, lease.dirs, variables)
            clock.mark("inputs")
            began = time.perf_counter()
            if ready is not None and ready.process is not None:
                # Its inputs are in place: the first line tells it which one to run.
                process, stdin = ready.process, f"{language}\n".encode() + stdin
                if process.cgroup is not None:
                    process.cgroup.reset_peak()  # its launcher's start is not the program's memory
            else:
                process = await self.backend.spawn(lease.spec(options), argv, self.task_group, pipes=True)
            clock.mark("spawn")
            if export_to is not None and lease.mounts is not None and lease.mounts.exporter is not None:
                lease.mounts.exporter.redirect(export_to.folder, export_to.limit_bytes)
            return await self._finish(language, options, lease, process, stdin, began, clock, cgroups)
        finally:
            if ready is not None and ready.process is not None and ready.process.alive:
                with anyio.CancelScope(shield=True):
                    await ready.process.kill()  # the run failed before its program started
            if self._closing < self.max_concurrent:
                # The sandbox is dead and reaped: its cgroup and dirs go after the reply (bounded, like the runs).
                self._closing += 1
                self.task_group.start_soon(self._close_later, lease, cgroups)
            else:
                with anyio.CancelScope(shield=True):  # a cancelled run (client gone, shutdown) must not leak mounts
                    await _close(lease, cgroups)
            clock.mark("close")

    async def _finish(
        self, language: Language, options: SandboxOptions, lease: SandboxLease, process: SandboxProcess,
        stdin: bytes, began: float, clock: _Clock, cgroups: list[SessionCgroup],
    ) -> OneShotResult:  # fmt: skip
        """Feed and read the running program to its end (or deadline), kill it, export; its result.
        The killed sandbox's cgroup goes into `cgroups`, for the caller to remove."""
        stdout, stderr = BoundedBytes(self.output_limit_chars), BoundedBytes(self.output_limit_chars)
        try:
            timed_out = await collect(process, stdout, stderr, stdin, options.timeout_s)
            elapsed_ms = (time.perf_counter() - began) * 1000
            clock.mark("program")
            peak = process.cgroup.memory_peak_bytes() if process.cgroup is not None else None
            oom = process.oom_killed()
        finally:
            if (cgroup := process.take_cgroup()) is not None:
                cgroups.append(cgroup)
            with anyio.CancelScope(shield=True):
                await process.kill()
        clock.mark("reap")
        exit_code = None if timed_out else process.returncode
        mounts = lease.mounts
        assert mounts is not None
        exported = None
        if not mounts.nothing_to_export():  # the sandbox is dead: its outbox no longer changes
            with anyio.CancelScope(shield=True):
                exported = mounts.note(await anyio.to_thread.run_sync(mounts.export))
        clock.mark("export")
        err_text = stderr.text()
        if oom:
            err_text += f"\n[killed: over the memory limit of {options.limits.memory_mb} MiB]"
        return OneShotResult(
            language=language,
            success=exit_code == 0,
            exit_code=exit_code,
            stdout=stdout.text(),
            stderr=err_text + (f"\n[timed out after {options.timeout_s:g}s: killed]" if timed_out else ""),
            timed_out=timed_out,
            execution_time_ms=round(elapsed_ms, 1),
            memory_peak_mb=round(peak / 2**20, 1) if peak else None,
            limits={
                "timeout_s": options.timeout_s,
                **{name: asdict(report) for name, report in self.backend.limit_reports(options.limits).items()},
                "network": options.network,
            },
            truncated=stdout.truncated or stderr.truncated,
            exported=exported,
        )

    async def _close_later(self, lease: SandboxLease, cgroups: list[SessionCgroup]) -> None:
        """Close a finished run's lease a moment after its reply went (at once if cancelled: shutdown)."""
        try:
            await anyio.sleep(REPLY_FIRST_S)
        finally:
            try:
                with anyio.CancelScope(shield=True):
                    await _close(lease, cgroups)
            finally:
                self._closing -= 1

    async def check(
        self, language: Language, code: str, options: SandboxOptions, caller: str | None = None
    ) -> list[dict[str, Any]]:
        """Syntax errors of `code`, found inside a throwaway sandbox: [{line, column, message}]."""
        answer = await self._ask(options, ["check", language], code, SOURCE_NAMES[language], caller)
        errors = answer.get("errors")
        if not isinstance(errors, list):
            raise OneShotError("the syntax check gave no list of errors")
        return [
            {"line": _int(e.get("line")), "column": _int(e.get("column")), "message": str(e.get("message"))[:500]}
            for e in errors[:50]
            if isinstance(e, dict)
        ]

    async def versions(self, options: SandboxOptions) -> dict[str, Any]:
        """The language runtimes' versions, as the sandbox sees them."""
        return await self._ask(options, ["versions"])

    async def _ask(
        self,
        options: SandboxOptions,
        command: list[str],
        code: str | None = None,
        name: str = "",
        caller: str | None = None,
    ) -> dict[str, Any]:
        """Run the guest helper with `command` in a throwaway sandbox; its one JSON answer (untrusted)."""
        async with self.slots.slot(CHECK_TIMEOUT_S, caller):
            return await self._ask_now(options, command, code, name)

    async def _ask_now(
        self, options: SandboxOptions, command: list[str], code: str | None, name: str
    ) -> dict[str, Any]:
        lease = await self.leases.lease(options, throwaway=True)
        try:
            await lease.mount()
            await lease.open_egress(self.egress, self.task_group, f"run-{lease.dirs.key}")
            argv = product_python(self.backend.python, "-c", LAUNCHER, *command)
            if code is not None:
                argv.append(str(lease.dirs.write_host_file(name, code.encode("utf-8", "replace"))))
            answer, problems = BoundedBytes(MAX_CHECK_ANSWER_BYTES), BoundedBytes(4096)
            process = await self.backend.spawn(lease.spec(), argv, self.task_group, pipes=True)
            try:
                await collect(process, answer, problems, b"", CHECK_TIMEOUT_S)
            finally:
                with anyio.CancelScope(shield=True):
                    await process.kill()
            try:
                parsed = json.loads(bytes(answer.head + answer.tail))
            except ValueError:
                parsed = None
            if not isinstance(parsed, dict):
                raise OneShotError(f"the sandbox helper did not answer: {problems.text().strip()[-500:]}")
            return parsed
        finally:
            with anyio.CancelScope(shield=True):
                await lease.close()


async def _close(lease: SandboxLease, cgroups: list[SessionCgroup]) -> None:
    """A finished run's cgroup (its tasks reaped or dying), then its lease."""
    for cgroup in cgroups:
        await off_loop(cgroup.remove)
    await lease.close()


@dataclass
class _Clock:
    """Reports the time since the last mark to `sink` under each mark's name (no-op without a sink)."""

    sink: PhaseSink | None
    last: float = field(default_factory=time.perf_counter)

    def mark(self, name: str) -> None:
        if self.sink is not None:
            now = time.perf_counter()
            self.sink(name, (now - self.last) * 1000)
            self.last = now


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
