"""A scripted kernel for fast tests: what a session sees of a kernel, with no ipykernel behind it.

`FakeKernels` is a KernelFactory (coderunner.kernel.kernel_factory): a SessionManager given one gets a
`FakeKernel` wherever it would start a real one. A FakeKernel is a `Kernel` whose start, execute,
interrupt, checkpoint and shutdown are played from a script, on the event loop, deterministically:
no process, no sockets. Its `process` is a `FakeProcess` that can be killed, die, or be OOM-killed.

A cell is a small line language, one command a line (`;` also separates commands):

    pass              nothing (the warm-up cell of a pooled kernel)
    print TEXT        stream TEXT and a newline
    set NAME VALUE    bind NAME (VALUE read as a Python literal if it is one, else as a string)
    get NAME          its repr as the cell's result; a NameError if unbound
    has NAME          print True or False
    raise ENAME TEXT  the cell raises ENAME(TEXT)
    sleep SECONDS     wait; an interrupt raises KeyboardInterrupt (unless the kernel ignores them)
    hang              wait for ever (the same)
    tick N SECONDS    print `tick i` N times, SECONDS apart, then bind `finished` to N
    die CODE          the sandbox exits with CODE (`die oom`: the OOM killer ends it)
    image MIME        one small image (image/png or image/jpeg)
    lose              a message of this run was dropped (output_lost)
    write FILE TEXT   a file in the workspace; `read FILE` prints it; `ls` prints the names there

A guest call (what Session sends to coderunner_guest.dispatch) is answered by `guest_tools`:
`variables` binds its values; an unknown tool answers as the real dispatcher does. The standby's swap-in
cell (sessions/standby.py) does nothing, as in a real kernel, and is counted (`swap_ins`); so does the
warm-up cell that imports the data stack (sessions/warm_up.py), or one step of it, counted as `preloads`.

Cues (`FakeKernels.cue`) script the next kernels made, oldest first (like FakeBackend's cues).
"""

from __future__ import annotations

import ast
import collections
import enum
import itertools
import json
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup

from coderunner.hostfs.session_dirs import SandboxDirs
from coderunner.kernel.incarnation import (
    CellError,
    CheckpointFailed,
    Kernel,
    KernelStartError,
    ProgressCallback,
    RunOutcome,
    RunStatus,
)
from coderunner.kernel.output_capture import OutputCollector
from coderunner.sandbox import SandboxBackend, SandboxSpec
from coderunner.sessions.standby import SWAP_IN_CODE
from coderunner.sessions.warm_up import PRELOAD_CODE, PRELOAD_STEP_CODES

#: What a kernel cued to die at start says, and the code it exits with.
START_DEATH_MESSAGE = "fake kernel: told to die at start"
START_DEATH_CODE = 3
#: The exit code of a killed sandbox (SIGKILL), as a real one reports it.
KILLED_CODE = -9
#: The resident memory a FakeProcess reports, in MiB (a fixed number: status tests compare it).
FAKE_MEMORY_MB = 80.0
#: A 1x1 PNG, base64: what `image` shows.
TINY_PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
#: How a session phrases a guest call (KernelCalls._guest_call_held): the tool and its JSON arguments.
_GUEST_CALL = re.compile(r"^await __import__\('coderunner_guest\.dispatch', fromlist=\['call'\]\)\.call\((.*)\)$")
_PIDS = itertools.count(4_000_000)  # above any real pid: /proc has none of them


class KernelCue(enum.Enum):
    DIE_AT_START = "die_at_start"  # the sandbox exits at once, saying START_DEATH_MESSAGE
    HANG_AT_START = "hang_at_start"  # never answers: the start ends at its timeout
    IGNORE_INTERRUPTS = "ignore_interrupts"  # a cell that waits ignores interrupts (stuck in C code)


class FakeProcess:
    """The sandbox process of a FakeKernel: alive until killed or told to die."""

    def __init__(self) -> None:
        self.pid = next(_PIDS)
        self.returncode: int | None = None
        self.cgroup = None
        self.helpers: list[Any] = []
        self.memory_mb: float | None = FAKE_MEMORY_MB
        self.oom: bool = False
        self.stderr = ""
        self.exited = anyio.Event()

    @property
    def alive(self) -> bool:
        return self.returncode is None

    def end(self, code: int, stderr: str = "") -> None:
        """The sandbox exits (once: a later end changes nothing)."""
        if self.returncode is None:
            self.returncode = code
            self.stderr = stderr
            self.exited.set()

    def oom_killed(self) -> bool:
        return self.oom

    def memory_used_mb(self) -> float | None:
        return self.memory_mb if self.alive else None

    def stderr_tail(self) -> str:
        return self.stderr

    async def stderr_settled(self, timeout_s: float = 1.0) -> str:
        return self.stderr

    async def wait(self) -> int:
        await self.exited.wait()
        assert self.returncode is not None
        return self.returncode

    async def kill(self) -> None:
        self.end(KILLED_CODE)
        await anyio.lowlevel.checkpoint()


class _Interrupted(Exception):
    """The cell got KeyboardInterrupt."""


class _Raised(Exception):
    def __init__(self, error: CellError) -> None:
        super().__init__(error.ename)
        self.error = error


class _Died(Exception):
    """The sandbox exited while the cell ran."""


GuestTool = Callable[["FakeKernel", dict[str, Any]], Any]


def _guest_variables(kernel: FakeKernel, arguments: dict[str, Any]) -> dict[str, Any]:
    values = arguments.get("values", {})
    kernel.namespace.update(values)
    return {"set": sorted(values)}


@dataclass
class _Cell:
    """One execute while it runs: its output, how it ended, and when."""

    code: str
    output: OutputCollector
    silent: bool
    status: RunStatus = RunStatus.OK
    error: CellError | None = None
    execution_count: int | None = None
    output_lost: bool = False
    guest_payload: dict[str, Any] | None = None
    ended: anyio.Event = field(default_factory=anyio.Event)


@dataclass
class FakeKernel(Kernel):
    """A Kernel played from a script (see the module docstring)."""

    cue: KernelCue | None = None
    #: Guest tools this kernel answers: name -> handler(kernel, arguments) -> result.
    guest_tools: dict[str, GuestTool] = field(default_factory=dict)
    #: The cell's globals: what `set`, `get` and the variables guest tool touch.
    namespace: dict[str, Any] = field(default_factory=dict)
    #: Every cell's code, in order (guest calls included).
    executed: list[str] = field(default_factory=list)
    #: How many interrupts it was sent.
    interrupts: int = 0
    execution_count: int = 0
    #: How often it was swapped in as its session's kernel (a standby).
    swap_ins: int = 0
    #: How many warm-up cells with the common imports (or a step of them) it ran (a pool member, a standby).
    preloads: int = 0
    #: Silent cells that lowered its own address-space limit (a pooled kernel taken with less memory).
    address_space_lowered: int = 0
    #: Checkpoints taken into, and restored from (memory snapshots).
    checkpoints: list[Path] = field(default_factory=list)
    _cell: _Cell | None = None
    _interrupted: anyio.Event = field(default_factory=anyio.Event)

    @property
    def fake_process(self) -> FakeProcess:
        assert isinstance(self.process, FakeProcess)
        return self.process

    async def start(self, timeout_s: float) -> None:
        self.started_at = time.monotonic()
        self.sandbox.process = FakeProcess()  # type: ignore[assignment]
        await self._answer(timeout_s, "start")

    async def restore(self, image_dir: Path, saved: dict[str, Any], timeout_s: float) -> None:
        self.started_at = time.monotonic()
        self.checkpoints.append(image_dir)
        self.sandbox.process = FakeProcess()  # type: ignore[assignment]
        try:
            await self._answer(timeout_s, "restore")
        except KernelStartError as exc:
            raise CheckpointFailed(str(exc)) from None

    async def _answer(self, timeout_s: float, what: str) -> None:
        """Come up as cued: at once, dying with words on stderr, or not before `timeout_s` passed."""
        process = self.fake_process
        try:
            if self.cue is KernelCue.DIE_AT_START:
                process.end(START_DEATH_CODE, START_DEATH_MESSAGE + "\n")
                raise KernelStartError(
                    f"the sandboxed kernel failed to {what} (sandbox exited with code {START_DEATH_CODE}):\n"
                    + START_DEATH_MESSAGE
                )
            if self.cue is KernelCue.HANG_AT_START:
                await anyio.sleep(timeout_s)
                await self.shutdown()
                raise KernelStartError(f"the sandboxed kernel failed to {what} (did not answer in time)")
            await anyio.lowlevel.checkpoint()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.shutdown()
            raise

    def saved_connection(self) -> dict[str, Any]:
        return {"key": "fake", "transport": "ipc", "generation": self.generation}

    async def checkpoint(
        self, image_dir: Path, timeout_s: float, while_stopped: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        self.checkpoints.append(image_dir)
        if while_stopped is not None:
            await while_stopped()

    async def execute(
        self,
        code: str,
        output: OutputCollector,
        timeout_s: float,
        interrupt_grace_s: float,
        progress: ProgressCallback | None = None,
        progress_interval_s: float = 1.0,
        silent: bool = False,
        keep_on_cancel: bool = True,
    ) -> RunOutcome:
        """Run the cell as a task of its own, and wait for it as Kernel.execute waits for a real one."""
        begun = time.monotonic()
        self.executed.append(code)
        cell = _Cell(code=code, output=output, silent=silent)
        if not self.alive:
            cell.status = RunStatus.DIED
            cell.ended.set()
        else:
            self._cell = cell
            self._interrupted = anyio.Event()
            self.task_group.start_soon(self._play, cell)
        try:
            await self._await_end(cell, begun + timeout_s, progress, progress_interval_s, begun)
        except TimeoutError:
            cell.status = await self._settle_after_interrupt(cell, interrupt_grace_s)
        except anyio.get_cancelled_exc_class():
            if not keep_on_cancel:  # the owner discards this kernel: nothing waits for the cell
                self.client.wedged = True
                raise
            with anyio.CancelScope(shield=True):
                if await self._settle_after_interrupt(cell, interrupt_grace_s) is RunStatus.UNRESPONSIVE:
                    self.client.wedged = True
            raise
        return RunOutcome(
            status=cell.status,
            output=output,
            error=cell.error,
            execution_count=cell.execution_count,
            duration_s=time.monotonic() - begun,
            exit_code=self.process.returncode if cell.status is RunStatus.DIED and self.process else None,
            output_lost=cell.output_lost,
            guest_payload=cell.guest_payload,
        )

    async def _await_end(
        self, cell: _Cell, deadline: float, progress: ProgressCallback | None, interval_s: float, begun: float
    ) -> None:
        """Wait for the cell to end by `deadline` (TimeoutError after), reporting progress on the way."""
        while not cell.ended.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            with anyio.move_on_after(min(remaining, interval_s) if progress is not None else remaining):
                await cell.ended.wait()
            if progress is not None and not cell.ended.is_set():
                await progress(time.monotonic() - begun, cell.output)

    async def _settle_after_interrupt(self, cell: _Cell, grace_s: float) -> RunStatus:
        self.interrupt()
        with anyio.move_on_after(grace_s):
            await cell.ended.wait()
        if not cell.ended.is_set():
            return RunStatus.UNRESPONSIVE
        return RunStatus.DIED if cell.status is RunStatus.DIED else RunStatus.INTERRUPTED

    async def _play(self, cell: _Cell) -> None:
        try:
            if not cell.silent:
                self.execution_count += 1
                cell.execution_count = self.execution_count
            guest = _GUEST_CALL.match(cell.code)
            if cell.code == SWAP_IN_CODE:
                self.swap_ins += 1
            elif cell.code == PRELOAD_CODE or cell.code in PRELOAD_STEP_CODES:
                self.preloads += 1
            elif cell.silent and "RLIMIT_AS" in cell.code:  # warm_take.address_space_code
                self.address_space_lowered += 1
            elif guest is not None:
                cell.guest_payload = self._guest_answer(guest.group(1))
            else:
                for command in _commands(cell.code):
                    await self._command(cell, command)
        except _Interrupted:
            self._fail(cell, CellError("KeyboardInterrupt", "", "KeyboardInterrupt"))
        except _Raised as raised:
            self._fail(cell, raised.error)
        except _Died:
            cell.status = RunStatus.DIED
        finally:
            if self._cell is cell:
                self._cell = None
            cell.ended.set()

    @staticmethod
    def _fail(cell: _Cell, error: CellError) -> None:
        cell.status = RunStatus.ERROR
        cell.error = error
        cell.output.add_text(error.traceback + "\n")

    def _guest_answer(self, call: str) -> dict[str, Any]:
        tool, arguments = ast.literal_eval(f"({call})")
        handler = {"variables": _guest_variables, **self.guest_tools}.get(tool)
        if handler is None:
            return {"ok": False, "error": f"unknown guest tool {tool!r}"}
        try:
            return {"ok": True, "result": handler(self, json.loads(arguments))}
        except Exception as exc:
            return {"ok": False, "error": str(exc)}

    async def _command(self, cell: _Cell, command: list[str]) -> None:
        name, args = command[0], command[1:]
        rest = " ".join(args)
        if name == "pass":
            return
        if name == "print":
            cell.output.add_text(rest + "\n")
        elif name == "set":
            self.namespace[args[0]] = _literal(" ".join(args[1:]))
        elif name == "get":
            if args[0] not in self.namespace:
                raise _Raised(_error("NameError", f"name {args[0]!r} is not defined"))
            cell.output.add_text(repr(self.namespace[args[0]]) + "\n")
        elif name == "has":
            cell.output.add_text(f"{args[0] in self.namespace}\n")
        elif name == "raise":
            raise _Raised(_error(args[0], " ".join(args[1:])))
        elif name == "sleep":
            await self._wait(float(args[0]))
        elif name == "hang":
            await self._wait(None)
        elif name == "tick":
            count, every = int(args[0]), float(args[1])
            for i in range(count):
                cell.output.add_text(f"tick {i}\n")
                await self._wait(every)
            self.namespace["finished"] = count
        elif name == "die":
            self.fake_process.oom = args[0] == "oom"
            self.fake_process.end(KILLED_CODE if self.fake_process.oom else int(args[0]))
            raise _Died
        elif name == "image":
            cell.output.add_image(args[0], TINY_PNG)
            if cell.output.pending:
                await cell.output.drain()
        elif name == "lose":
            cell.output_lost = True
        elif name == "write":
            (self.dirs.workspace.path / args[0]).write_text(" ".join(args[1:]))
        elif name == "read":
            cell.output.add_text((self.dirs.workspace.path / args[0]).read_text() + "\n")
        elif name == "ls":
            cell.output.add_text(" ".join(sorted(p.name for p in self.dirs.workspace.path.iterdir())) + "\n")
        else:
            raise _Raised(_error("SyntaxError", f"the fake kernel has no command {name!r}"))

    async def _wait(self, seconds: float | None) -> None:
        """Sleep (None: for ever) until an interrupt (unless ignored) or the sandbox's end cuts it short."""
        process = self.fake_process
        interrupt = self._interrupted
        ignore = self.cue is KernelCue.IGNORE_INTERRUPTS
        with anyio.move_on_after(float("inf") if seconds is None else seconds):
            async with anyio.create_task_group() as group:

                async def on_exit() -> None:
                    await process.exited.wait()
                    group.cancel_scope.cancel()

                async def on_interrupt() -> None:
                    await interrupt.wait()
                    group.cancel_scope.cancel()

                group.start_soon(on_exit)
                if not ignore:
                    group.start_soon(on_interrupt)
                await anyio.sleep_forever()
        if not process.alive:
            raise _Died
        if interrupt.is_set() and not ignore:
            raise _Interrupted

    def interrupt(self) -> None:
        """Interrupt the running cell (a kernel that ignores interrupts counts it and goes on)."""
        self.interrupts += 1
        if self._cell is not None:
            self._interrupted.set()

    async def shutdown(self) -> None:
        if self.process is not None:
            await self.process.kill()


class FakeKernels:
    """The KernelFactory of fast tests: makes FakeKernels as cued, and keeps every one it made."""

    def __init__(self) -> None:
        self.cues: collections.deque[KernelCue] = collections.deque()
        self.made: list[FakeKernel] = []
        #: Guest tools every kernel made from now on answers (beyond `variables`).
        self.guest_tools: dict[str, GuestTool] = {}

    def cue(self, *cues: KernelCue) -> None:
        self.cues.extend(cues)

    def __call__(
        self, backend: SandboxBackend, spec: SandboxSpec, task_group: TaskGroup, dirs: SandboxDirs, *, generation: int
    ) -> FakeKernel:
        cue = self.cues.popleft() if self.cues else None
        kernel = FakeKernel(
            backend, spec, task_group, dirs, generation=generation, cue=cue, guest_tools=dict(self.guest_tools)
        )
        self.made.append(kernel)
        return kernel

    @property
    def processes(self) -> list[FakeProcess]:
        """The sandbox of every kernel that started."""
        return [kernel.fake_process for kernel in self.made if kernel.process is not None]


def _commands(code: str) -> list[list[str]]:
    lines = (part.strip() for line in code.splitlines() for part in line.split(";"))
    return [line.split() for line in lines if line]


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _error(ename: str, evalue: str) -> CellError:
    return CellError(ename, evalue, f"Traceback (most recent call last):\n{ename}: {evalue}")
