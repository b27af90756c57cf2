"""The sandbox's pid 1 (guest/sandbox_init.py) waits on a gate whatever its number.

The gate keeps the fd number it had in the server, and a server holding about a hundred sessions has
fds past 1,024, where select() refuses one: every sandbox started then failed ("filedescriptor out of
range in select()", seen in bench/cluster.py's local burst of 100). The init is run here as bwrap runs
it (`python -I -S sandbox_init.py GATE_FD -- ARGV`, or `--hold`), outside a sandbox, with its gate at fd 1500.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from coderunner.guest import sandbox_init

INIT = Path(sandbox_init.__file__)
#: Past select()'s FD_SETSIZE (1,024).
HIGH_FD = 1500
WAIT_S = 30


@dataclass
class Gate:
    """The host's side of a sandbox's gate: its read end at HIGH_FD (the init's), its write end (ours)."""

    fd: int
    host_end: int | None

    def host_goes_away(self) -> None:
        assert self.host_end is not None
        os.close(self.host_end)
        self.host_end = None


@pytest.fixture
def gate() -> Iterator[Gate]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, HIGH_FD + 64), hard))
    read_end, write_end = os.pipe()
    os.dup2(read_end, HIGH_FD, inheritable=True)
    os.close(read_end)
    held = Gate(HIGH_FD, write_end)
    try:
        yield held
    finally:
        os.close(HIGH_FD)
        if held.host_end is not None:
            os.close(held.host_end)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def start_init(gate: Gate, *argv: str) -> subprocess.Popen[bytes]:
    assert gate.host_end is not None
    init = subprocess.Popen(
        [sys.executable, "-I", "-S", str(INIT), str(gate.fd), "--", *argv], pass_fds=(gate.fd,),
        stderr=subprocess.PIPE,
    )  # fmt: skip
    os.write(gate.host_end, b"1")  # go
    return init


def said(init: subprocess.Popen[bytes]) -> str:
    return init.stderr.read().decode(errors="replace") if init.stderr else ""


def test_the_init_runs_its_program_and_exits_with_its_status_from_a_gate_past_1024(gate: Gate) -> None:
    init = start_init(gate, sys.executable, "-I", "-S", "-c", "import time; time.sleep(0.2); raise SystemExit(7)")
    assert init.wait(timeout=WAIT_S) == 7, said(init)


def test_the_init_ends_when_the_host_goes_away_from_a_gate_past_1024(gate: Gate) -> None:
    # Outside a pid namespace the program outlives its init: it sleeps only a little longer than the test.
    init = start_init(gate, sys.executable, "-I", "-S", "-c", "import time; time.sleep(5)")
    gate.host_goes_away()
    assert init.wait(timeout=WAIT_S) == sandbox_init.HOST_GONE, said(init)


def test_holding_the_init_says_ready_only_after_go_and_holds_until_the_host_goes_away(gate: Gate) -> None:
    """--hold (a sandbox a template's fork enters): no program; READY on its stdout once the host says go, then it
    waits, reaping, until the gate's end of file."""
    assert gate.host_end is not None
    init = subprocess.Popen(
        [sys.executable, "-I", "-S", str(INIT), str(gate.fd), "--hold"], pass_fds=(gate.fd,),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert init.stdout is not None
    try:
        os.set_blocking(init.stdout.fileno(), False)
        assert init.stdout.read() is None  # nothing said before go (it waits on the gate)
        os.set_blocking(init.stdout.fileno(), True)
        os.write(gate.host_end, b"1")  # go
        assert init.stdout.readline() == sandbox_init.READY
        assert init.poll() is None  # holding
        gate.host_goes_away()
        assert init.wait(timeout=WAIT_S) == sandbox_init.HOST_GONE, said(init)
    finally:
        if init.poll() is None:
            init.kill()
            init.wait()
