"""What a one-shot sandbox runs, and how its pipes are read.

The source and the variables travel as files in the sandbox's host-only dir (read-only inside it);
the argv depends on the language (a launcher for Python and Node.js, bash started directly). The
program's stdin, stdout and stderr are pipes, captured within bounds: head and tail kept.

Bash sources the script from a `bash -c` ($0 the script, no arguments), started directly or, in a
sandbox started ahead, as READY_WAITER: bash is already up beside the waiting Python launcher, so a
bash run skips an interpreter's start (the launcher is killed) and a Python one skips bash's (bash
hands it the language and waits for it). Either way the script's parent is the sandbox itself.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
from anyio.abc import ByteReceiveStream

from coderunner.errors import CodeRunnerError
from coderunner.hostfs.session_dirs import SandboxDirs
from coderunner.sandbox import SandboxProcess
from coderunner.sandbox.common import product_python
from coderunner.sessions.sandbox_options import SandboxOptions

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
#: How bash runs the script ($0), with no positional arguments: the same started directly or ahead.
BASH_RUN = '. "$0"'
#: A sandbox started ahead (ready.py): bash, with the Python launcher ("$@", `wait`) as its
#: coprocess. The launcher says READY once up and reads the language from the coprocess pipe, the
#: program's stdin as fd 4. Bash reads the first line of stdin (the language, byte by byte: the rest
#: is the program's): for bash it kills the launcher (disowned first: no job left for the script to
#: see, no wait for its exit), closes what it opened, drops its own names and PYTHONPATH and runs the
#: script as BASH_RUN does, after the variables file if there is one; for any other language it
#: passes the line on and exits with the launcher's status.
READY_WAITER = f"""exec 3<&0 5>&1
coproc {{ exec "$@" 4<&3 1>&5 3<&- 5>&-; }}
_cr_pid=$COPROC_PID _cr_to=${{COPROC[1]}} _cr_from=${{COPROC[0]}}
exec 3<&- 5>&-
IFS= read -r _cr_language || exit 1
if [ "$_cr_language" != bash ]; then
    printf '%s\\n' "$_cr_language" >&"$_cr_to"
    wait "$_cr_pid"
    exit
fi
disown "$_cr_pid"
kill -9 "$_cr_pid"
exec {{_cr_to}}>&- {{_cr_from}}<&-
unset _cr_pid _cr_to _cr_from _cr_language COPROC COPROC_PID PYTHONPATH
set --
[ ! -f "${{0%/*}}/{BASH_VARIABLES_NAME}" ] || . "${{0%/*}}/{BASH_VARIABLES_NAME}"
{BASH_RUN}
"""
#: The program's stdin in the launcher a sandbox started ahead runs (READY_WAITER's fd 4).
READY_STDIN_FD = 4
#: What check_variables lets through for bash; checked again where the names become shell text.
BASH_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
#: After the program ends, how long its pipes may still deliver what it wrote.
DRAIN_WAIT_S = 2.0


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
        marker = f"[... {omitted:,} bytes omitted (a one-shot run keeps no copy)]"
        return f"{head}\n{marker}\n{self.tail.decode('utf-8', 'replace')}"


async def _capture(stream: ByteReceiveStream, sink: BoundedBytes, done: anyio.Event) -> None:
    try:
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            async for chunk in stream:
                sink.add(chunk)
    finally:
        done.set()


async def collect(process: SandboxProcess, stdout: BoundedBytes, stderr: BoundedBytes, stdin: bytes,
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


def program(
    python: str, language: Language, code: str, options: SandboxOptions, dirs: SandboxDirs,
    variables: dict[str, Any],
) -> list[str]:  # fmt: skip
    """Write the inputs to the host-only dir the sandbox sees read-only (never where it can
    write); the argv that runs them."""
    source = str(dirs.write_host_file(SOURCE_NAMES[language], code.encode("utf-8", "replace")))
    if language == "bash":
        argv = list(BASH_ARGV)
        if variables:
            argv.append(f"BASH_ENV={dirs.write_host_file(BASH_VARIABLES_NAME, bash_variables(variables))}")
        return [*argv, BASH, "--norc", "--noprofile", "-c", BASH_RUN, source]
    # Python skips the file (and the json import) when there are none; the Node.js preload wants one.
    variables_file = ""
    if variables or language == "javascript":
        variables_file = str(dirs.write_host_file("variables.json", json.dumps(variables).encode()))
    memory = options.limits.memory_mb or 0
    return product_python(python, "-c", LAUNCHER, "run", language, source, variables_file, str(memory))


def ready_argv(python: str, dirs: SandboxDirs, memory_mb: int | None) -> list[str]:
    """What a sandbox started ahead runs: bash waiting beside the Python launcher (READY_WAITER)."""
    launcher = product_python(python, "-c", LAUNCHER, "wait", str(dirs.host_dir), str(memory_mb or 0),
                              str(READY_STDIN_FD))  # fmt: skip
    return [BASH, "--norc", "--noprofile", "-c", READY_WAITER, str(dirs.host_dir / SOURCE_NAMES["bash"]), *launcher]
