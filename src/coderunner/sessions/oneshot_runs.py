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
variables come from a file it reads through BASH_ENV), Node.js has a preload.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import anyio
from anyio.abc import ByteReceiveStream, TaskGroup

from coderunner.errors import CodeRunnerError
from coderunner.hostfs.leases import SandboxLeases, sandbox_spec
from coderunner.hostfs.sandbox_mounts import SandboxMounts
from coderunner.hostfs.session_dirs import SandboxDirs
from coderunner.policy.sandbox_options import SandboxOptions
from coderunner.sandbox import SandboxBackend, SandboxProcess
from coderunner.sandbox.common import product_python

if TYPE_CHECKING:  # sessions/ imports this module
    from coderunner.egress.gateway import EgressHub, SessionEgress

log = logging.getLogger(__name__)

Language = Literal["python", "javascript", "bash"]
LANGUAGES: tuple[Language, ...] = ("python", "javascript", "bash")
SOURCE_NAMES = {"python": "main.py", "javascript": "main.js", "bash": "main.sh"}
GUEST_MODULE = "coderunner_guest.oneshot"
#: How a Python (or Node.js) run starts its launcher: -c skips runpy, which -m would import first.
LAUNCHER = f"from {GUEST_MODULE.rpartition('.')[0]} import oneshot; oneshot.main()"
#: Bash starts directly. env drops the sandbox's PYTHONPATH (as the launcher did) and points
#: BASH_ENV at the variables file, which a non-interactive bash sources before the script.
BASH_ARGV = ("/usr/bin/env", "-u", "PYTHONPATH")
BASH = "/bin/bash"
BASH_VARIABLES_NAME = "variables.sh"
#: What check_variables lets through for bash; checked again where the names become shell text.
BASH_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
#: After the program ends, how long its pipes may still deliver what it wrote.
DRAIN_WAIT_S = 2.0
#: Bound on a syntax check (node --check of a large file is the slowest).
CHECK_TIMEOUT_S = 30.0
MAX_CHECK_ANSWER_BYTES = 1 << 20
#: A sandbox started ahead (OneShotRunner.ready) is dropped when no run took it this long.
READY_IDLE_S = 60.0
#: How long a run waits for the sandbox being started ahead for it, before starting its own.
READY_WAIT_S = 5.0
#: Bound on a sandbox started ahead saying it is up, and what it says (guest oneshot.READY).
READY_START_S = 30.0
READY_BYTE = b"R"


class OneShotError(CodeRunnerError):
    """The run could not be set up (bad arguments, sandbox failure); the message says why."""


@dataclass
class BoundedBytes:
    """Keeps the first and last `limit // 2` bytes of a stream and counts the rest."""

    limit: int
    head: bytearray = field(default_factory=bytearray)
    tail: bytearray = field(default_factory=bytearray)
    total: int = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.limit // 2 - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk
            del self.tail[: max(0, len(self.tail) - self.limit // 2)]

    @property
    def truncated(self) -> bool:
        return self.total > len(self.head) + len(self.tail)

    def text(self) -> str:
        head = self.head.decode("utf-8", "replace")
        if not self.truncated:
            return head + self.tail.decode("utf-8", "replace")
        omitted = self.total - len(self.head) - len(self.tail)
        return f"{head}\n[... {omitted:,} bytes omitted ...]\n{self.tail.decode('utf-8', 'replace')}"


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


async def _capture(stream: ByteReceiveStream, sink: BoundedBytes, done: anyio.Event) -> None:
    try:
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            async for chunk in stream:
                sink.add(chunk)
    finally:
        done.set()


async def _collect(process: SandboxProcess, stdout: BoundedBytes, stderr: BoundedBytes, stdin: bytes,
                   timeout_s: float) -> bool:  # fmt: skip
    """Feed stdin, capture both outputs, wait for the end within `timeout_s`; True if it timed out."""
    _, out, err = process.streams
    out_done, err_done = anyio.Event(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(_capture, out, stdout, out_done)
        tg.start_soon(_capture, err, stderr, err_done)
        tg.start_soon(_feed, process, stdin)
        with anyio.move_on_after(timeout_s) as deadline:
            await process.wait()
        if deadline.cancelled_caught:
            await process.kill()
        with anyio.move_on_after(DRAIN_WAIT_S):
            await out_done.wait()
            await err_done.wait()
        tg.cancel_scope.cancel()
    return deadline.cancelled_caught


async def _feed(process: SandboxProcess, data: bytes) -> None:
    stdin = process.streams[0]
    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, BrokenPipeError):
        for start in range(0, len(data), 65536):
            await stdin.send(data[start : start + 65536])
    with contextlib.suppress(Exception):
        await stdin.aclose()


def bash_variables(variables: dict[str, Any]) -> bytes:
    """Shell text exporting each variable (single-quoted: nothing in a value is ever expanded)."""
    lines = ["unset BASH_ENV"]
    for name, value in variables.items():
        if not BASH_NAME.match(name):
            raise OneShotError(f"variable name {name!r} cannot be a bash variable")
        text = value if isinstance(value, str) else "" if value is None else json.dumps(value)
        if "\0" in text:
            raise OneShotError(f"variable {name} holds a NUL character, which an environment variable cannot carry")
        quoted = "'" + text.replace("'", "'\\''") + "'"
        lines.append(f"export {name}={quoted}")
    return ("\n".join(lines) + "\n").encode("utf-8", "surrogatepass")


#: Gets (phase name, ms since the previous phase) when set: bench/oneshot.py's breakdown.
PhaseSink = Callable[[str, float], None]


def _ready_key(options: SandboxOptions) -> SandboxOptions:
    """What a sandbox started ahead must match: everything but the timeout (the host keeps that)."""
    return dataclasses.replace(options, timeout_s=0.0)


@dataclass(eq=False)
class _Ready:
    """A throwaway sandbox started ahead for runs with `key` options: used by one run, or dropped.

    Its keeper task owns it while `state` is preparing or ready; a run that sets it to taken
    (no await between the check and the change) owns it from then on.
    """

    key: SandboxOptions
    done: anyio.Event = field(default_factory=anyio.Event)
    #: Set when a run took it or it was dropped: the keeper stops waiting.
    released: anyio.Event = field(default_factory=anyio.Event)
    state: Literal["preparing", "ready", "taken", "gone"] = "preparing"
    dirs: SandboxDirs | None = None
    mounts: SandboxMounts | None = None
    process: SandboxProcess | None = None


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
    #: Network 'allowlist': each run gets a policy proxy of its own (sessions/egress.py).
    egress: EgressHub | None = None
    _limiter: anyio.CapacityLimiter | None = None
    #: Per-caller limiters, kept only while that caller has a run waiting or going.
    _callers: dict[str, tuple[anyio.CapacityLimiter, int]] = field(default_factory=dict)
    #: Where run() reports how long each phase took (None: not measured).
    phases: PhaseSink | None = None
    #: Keep one sandbox started ahead, with the options of the last run, its interpreter up and
    #: waiting for its program (guest `wait`): a run with the same options skips the start. Each
    #: is used once; unused for READY_IDLE_S, it is dropped. Such a run's dirs are removed just
    #: after its reply (its processes are gone before it).
    ready: bool = False
    _next: _Ready | None = None
    #: Dirs of finished runs (with ready) being removed after their reply; at most max_concurrent.
    _closing: int = 0

    @contextlib.asynccontextmanager
    async def _slot(self, wait_s: float, caller: str | None) -> AsyncIterator[None]:
        """The caller's own share first, then a global slot, both within `wait_s`.

        `caller` None is a run of the server's own (the versions probe): it takes no share.
        """
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.max_concurrent)
        share: anyio.CapacityLimiter | None = None
        waiting_for = "share"
        with anyio.move_on_after(wait_s) as waited:
            share = await self._take_share(caller)
            waiting_for = "global"
            try:
                await self._limiter.acquire()
            except BaseException:
                self._give_share(caller, share)
                share = None
                raise
        if waited.cancelled_caught:
            if caller is not None and waiting_for == "share":
                raise OneShotError(
                    f"this client already has {self.max_per_caller} one-shot runs in progress (its share of the "
                    f"server's {self.max_concurrent}); try again when one finishes"
                )
            raise OneShotError(f"{self.max_concurrent} one-shot runs are in progress; try again when one finishes")
        try:
            yield
        finally:
            self._limiter.release()
            self._give_share(caller, share)

    async def _take_share(self, caller: str | None) -> anyio.CapacityLimiter | None:
        if caller is None:
            return None
        limiter, users = self._callers.get(caller) or (anyio.CapacityLimiter(self.max_per_caller), 0)
        self._callers[caller] = (limiter, users + 1)
        try:
            await limiter.acquire()
        except BaseException:
            self._give_share(caller, None)
            raise
        return limiter

    def _give_share(self, caller: str | None, limiter: anyio.CapacityLimiter | None) -> None:
        """Release a share taken (or only waited for: `limiter` None); forget callers with nothing left."""
        if caller is None:
            return
        if limiter is not None:
            limiter.release()
        held, users = self._callers[caller]
        if users <= 1:
            del self._callers[caller]
        else:
            self._callers[caller] = (held, users - 1)

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
    ) -> OneShotResult:
        """`on_egress`: given an allowlist run's proxy once it exists (the tool lends it an asker)."""
        async with self._slot(options.timeout_s, caller):
            ready = await self._take_ready(options) if self.ready else None
            try:
                return await self._run(language, code, options, stdin, variables or {}, ready, on_egress)
            finally:
                if self.ready:
                    self._start_ahead(options)

    async def _run(
        self,
        language: Language,
        code: str,
        options: SandboxOptions,
        stdin: bytes,
        variables: dict[str, Any],
        ready: _Ready | None = None,
        on_egress: Callable[[SessionEgress], None] | None = None,
    ) -> OneShotResult:
        clock = _Clock(self.phases)
        if ready is not None:
            assert ready.dirs is not None and ready.mounts is not None and ready.process is not None
            dirs, mounts = ready.dirs, ready.mounts
        else:
            dirs, mounts = await self.leases.open_dirs(options, throwaway=True), None
        clock.mark("dirs")
        egress = None
        try:
            if mounts is None:
                mounts = await self._mounts(options, dirs)
            clock.mark("mounts")
            egress = await self._egress(options, dirs)
            if egress is not None and on_egress is not None:
                on_egress(egress)
            argv = self._program(language, code, options, dirs, variables)
            spec = sandbox_spec(options, dirs, mounts.mounts)
            stdout, stderr = BoundedBytes(self.output_limit_chars), BoundedBytes(self.output_limit_chars)
            clock.mark("inputs")
            began = time.perf_counter()
            if ready is not None and ready.process is not None:
                # Its inputs are in place: the first line tells it which one to run.
                process, stdin = ready.process, f"{language}\n".encode() + stdin
                if process.cgroup is not None:
                    process.cgroup.reset_peak()  # its launcher's start is not the program's memory
            else:
                process = await self.backend.spawn(spec, argv, self.task_group, pipes=True)
            clock.mark("spawn")
            try:
                timed_out = await _collect(process, stdout, stderr, stdin, options.timeout_s)
                elapsed_ms = (time.perf_counter() - began) * 1000
                clock.mark("program")
                peak = process.cgroup.memory_peak_bytes() if process.cgroup is not None else None
                oom = process.oom_killed()
            finally:
                with anyio.CancelScope(shield=True):
                    await process.kill()
            clock.mark("reap")
            exit_code = None if timed_out else process.returncode
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
        finally:
            if ready is not None and ready.process is not None and ready.process.alive:
                with anyio.CancelScope(shield=True):
                    await ready.process.kill()  # the run failed before its program started
            if ready is not None and self._closing < self.max_concurrent:
                # The sandbox is dead and reaped: its dirs go while the reply does (bounded, like the runs).
                self._closing += 1
                self.task_group.start_soon(self._close_later, dirs, mounts, egress)
            else:
                with anyio.CancelScope(shield=True):  # a cancelled run (client gone, shutdown) must not leak mounts
                    await self._close(dirs, mounts, egress)
            clock.mark("close")

    async def _close_later(self, dirs: SandboxDirs, mounts: SandboxMounts | None, egress: SessionEgress | None) -> None:
        try:
            with anyio.CancelScope(shield=True):
                await self._close(dirs, mounts, egress)
        finally:
            self._closing -= 1

    def _program(
        self, language: Language, code: str, options: SandboxOptions, dirs: SandboxDirs, variables: dict[str, Any]
    ) -> list[str]:
        """Write the inputs to the host-only dir the sandbox sees read-only (never where it can
        write); the argv that runs them."""
        source = str(dirs.write_host_file(SOURCE_NAMES[language], code.encode("utf-8", "replace")))
        if language == "bash":
            argv = list(BASH_ARGV)
            if variables:
                argv.append(f"BASH_ENV={dirs.write_host_file(BASH_VARIABLES_NAME, bash_variables(variables))}")
            return [*argv, BASH, "--norc", "--noprofile", source]
        # Python skips the file (and the json import) when there are none; the Node.js preload wants one.
        variables_file = ""
        if variables or language == "javascript":
            variables_file = str(dirs.write_host_file("variables.json", json.dumps(variables).encode()))
        memory = options.limits.memory_mb or 0
        return product_python(self.backend.python, "-c", LAUNCHER, "run", language, source, variables_file, str(memory))

    async def _take_ready(self, options: SandboxOptions) -> _Ready | None:
        """The sandbox started ahead for these options, waited for (bounded) if still starting; else None."""
        entry = self._next
        if entry is None or entry.key != _ready_key(options):
            return None
        with anyio.move_on_after(READY_WAIT_S):
            await entry.done.wait()
        if entry.state != "ready":
            return None
        entry.state = "taken"
        if self._next is entry:
            self._next = None
        entry.released.set()
        assert entry.process is not None
        if not entry.process.alive:
            with anyio.CancelScope(shield=True):
                await self._drop(entry)
            return None
        return entry

    def _start_ahead(self, options: SandboxOptions) -> None:
        """Have a sandbox for the next run with these options start now (the previous one is dropped)."""
        if options.network == "allowlist":
            return  # its proxy is made per run, with the run (a sandbox started ahead would have none)
        key = _ready_key(options)
        current = self._next
        if current is not None and current.key == key and current.state in ("preparing", "ready"):
            return
        if current is not None:
            self._next = None
            current.released.set()  # its keeper drops it
        entry = _Ready(key)
        self._next = entry
        self.task_group.start_soon(self._keep, entry)

    async def _keep(self, entry: _Ready) -> None:
        """Start `entry`'s sandbox, then keep it until a run takes it, it is replaced, or READY_IDLE_S pass."""
        options = entry.key
        try:
            try:
                entry.dirs = await self.leases.open_dirs(options, throwaway=True)
                entry.mounts = await self._mounts(options, entry.dirs)
                argv = product_python(self.backend.python, "-c", LAUNCHER, "wait", str(entry.dirs.host_dir),
                                      str(options.limits.memory_mb or 0))  # fmt: skip
                spec = sandbox_spec(options, entry.dirs, entry.mounts.mounts)
                entry.process = await self.backend.spawn(spec, argv, self.task_group, pipes=True)
                # Ready once its interpreter is up and says so (the first byte of its stdout, never the program's).
                with anyio.fail_after(READY_START_S):
                    said = await entry.process.streams[1].receive(1)
                if said == READY_BYTE and self._next is entry:
                    entry.state = "ready"
            except Exception as exc:  # a run then starts its own sandbox, and says why if it fails too
                log.info("could not start a one-shot sandbox ahead: %s", exc)
            finally:
                entry.done.set()
            if entry.state == "ready":
                with anyio.move_on_after(READY_IDLE_S):
                    await entry.released.wait()
        finally:
            if entry.state != "taken":
                entry.state = "gone"
                if self._next is entry:
                    self._next = None
                with anyio.CancelScope(shield=True):
                    await self._drop(entry)

    async def _drop(self, entry: _Ready) -> None:
        if entry.process is not None:
            await entry.process.kill()
        if entry.dirs is not None:
            await self._close(entry.dirs, entry.mounts, None)

    async def _mounts(self, options: SandboxOptions, dirs: SandboxDirs) -> SandboxMounts:
        return await anyio.to_thread.run_sync(self.leases.prepare_mounts, options, dirs)

    async def _egress(self, options: SandboxOptions, dirs: SandboxDirs) -> SessionEgress | None:
        if options.network != "allowlist" or self.egress is None:
            return None
        return await self.egress.open(options, dirs, self.task_group, f"run-{dirs.key}")

    async def _close(self, dirs: SandboxDirs, mounts: SandboxMounts | None, egress: SessionEgress | None) -> None:
        if egress is not None:
            await egress.aclose()
        if mounts is not None and not await anyio.to_thread.run_sync(mounts.close):
            return  # a staged mount would not detach: never delete beneath it
        await self.leases.close_dirs(dirs)

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
        async with self._slot(CHECK_TIMEOUT_S, caller):
            return await self._ask_now(options, command, code, name)

    async def _ask_now(
        self, options: SandboxOptions, command: list[str], code: str | None, name: str
    ) -> dict[str, Any]:
        dirs = await self.leases.open_dirs(options, throwaway=True)
        mounts = None
        egress = None
        try:
            mounts = await self._mounts(options, dirs)
            egress = await self._egress(options, dirs)
            argv = product_python(self.backend.python, "-c", LAUNCHER, *command)
            if code is not None:
                argv.append(str(dirs.write_host_file(name, code.encode("utf-8", "replace"))))
            answer, problems = BoundedBytes(MAX_CHECK_ANSWER_BYTES), BoundedBytes(4096)
            spec = sandbox_spec(options, dirs, mounts.mounts)
            process = await self.backend.spawn(spec, argv, self.task_group, pipes=True)
            try:
                await _collect(process, answer, problems, b"", CHECK_TIMEOUT_S)
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
                await self._close(dirs, mounts, egress)


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
