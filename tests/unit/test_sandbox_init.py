"""The sandbox's pid 1, both implementations held to one protocol: guest/sandbox_init.py (the Python one) and
guest/sandbox_init.c (compiled by `coderunner setup` where it finds a C compiler; sandbox/init_binary.py).

Each case runs the init as bwrap runs it (`INIT GATE_FD -- ARGV`, or `--hold`), outside a sandbox, with its gate
at fd 1500: the gate keeps the fd number it had in the server, and a server holding about a hundred sessions has
fds past 1,024, where select() refuses one (every sandbox started then failed: "filedescriptor out of range in
select()", seen in bench/cluster.py's local burst of 100). Containment (nothing in a real sandbox can write its
pid 1, nothing outlives the host's end of it) is tests/abuse/test_abuse_pid1.py's, on whichever init a server uses.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from coderunner.guest import sandbox_init
from coderunner.sandbox import init_binary

PYTHON_INIT = Path(sandbox_init.__file__)
#: Past select()'s FD_SETSIZE (1,024).
HIGH_FD = 1500
WAIT_S = 30
#: An unprivileged uid to run the init as when the tests run as root (its /proc entries then show who owns it).
NOBODY = 65534


@pytest.fixture(scope="module")
def compiled_init(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The C init built as `coderunner setup` builds it, into an environment of the test's own."""
    env_dir = tmp_path_factory.mktemp("env")
    env_dir.chmod(0o755)
    built = init_binary.build(env_dir)
    if built is None:
        pytest.skip("no C compiler on this machine: `coderunner setup` builds no compiled init here either")
    assert built == init_binary.installed(env_dir)
    return built


@pytest.fixture(params=["python", "compiled"])
def init(request: pytest.FixtureRequest) -> list[str]:
    """The init's argv before its gate."""
    if request.param == "python":
        return [sys.executable, "-I", "-S", str(PYTHON_INIT)]
    return [str(request.getfixturevalue("compiled_init"))]


@dataclass
class Gate:
    """The host's side of a sandbox's gate: its read end at HIGH_FD (the init's), its write end (ours)."""

    fd: int
    host_end: int | None

    def go(self, byte: bytes = b"1") -> None:
        assert self.host_end is not None
        os.write(self.host_end, byte)

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


def launch(init: list[str], gate: Gate, *args: str, **popen: object) -> subprocess.Popen[bytes]:
    return subprocess.Popen(  # type: ignore[call-overload, no-any-return]
        [*init, str(gate.fd), *args], pass_fds=(gate.fd,), stderr=subprocess.PIPE, **popen
    )


def start_init(init: list[str], gate: Gate, *argv: str) -> subprocess.Popen[bytes]:
    started = launch(init, gate, "--", *argv)
    gate.go()
    return started


def said(started: subprocess.Popen[bytes]) -> str:
    return started.stderr.read().decode(errors="replace") if started.stderr else ""


def finished(started: subprocess.Popen[bytes]) -> int:
    try:
        return started.wait(timeout=WAIT_S)
    finally:
        if started.poll() is None:
            started.kill()
            started.wait()


def test_the_init_runs_its_program_and_exits_with_its_status_from_a_gate_past_1024(init: list[str], gate: Gate) -> None:
    started = start_init(
        init, gate, sys.executable, "-I", "-S", "-c", "import time; time.sleep(0.2); raise SystemExit(7)"
    )
    assert finished(started) == 7, said(started)


def test_a_signal_that_ends_the_program_is_128_plus_its_number(init: list[str], gate: Gate) -> None:
    started = start_init(init, gate, sys.executable, "-I", "-S", "-c", "import os; os.kill(os.getpid(), 9)")
    assert finished(started) == 128 + signal.SIGKILL, said(started)


def test_the_program_gets_an_empty_signal_mask_and_nothing_ignored(init: list[str], gate: Gate) -> None:
    """What the init changed for itself (SIGCHLD blocked but while it waits) is not the program's, nor what the
    host's side left ignored: here SIGPIPE (Python's own start ignores it) and SIGQUIT, handed on as they are."""
    assert signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN
    quit_was = signal.signal(signal.SIGQUIT, signal.SIG_IGN)
    try:
        started = launch(
            init, gate, "--", "/usr/bin/grep", "-E", "^Sig(Blk|Ign)", "/proc/self/status",
            stdout=subprocess.PIPE, restore_signals=False,
        )  # fmt: skip
    finally:
        signal.signal(signal.SIGQUIT, quit_was)
    gate.go()
    output, _ = started.communicate(timeout=WAIT_S)
    assert started.returncode == 0, said(started)
    assert output.split() == [b"SigBlk:", b"0000000000000000", b"SigIgn:", b"0000000000000000"]


def test_the_program_does_not_get_the_gate(init: list[str], gate: Gate) -> None:
    started = launch(init, gate, "--", "/usr/bin/ls", "/proc/self/fd", stdout=subprocess.PIPE)
    gate.go()
    output, _ = started.communicate(timeout=WAIT_S)
    assert started.returncode == 0, said(started)
    assert b"0" in output.split() and str(HIGH_FD).encode() not in output.split()


def test_a_program_that_cannot_be_started_is_127_and_said(init: list[str], gate: Gate, tmp_path: Path) -> None:
    started = start_init(init, gate, str(tmp_path / "missing"))
    assert finished(started) == 127
    assert "cannot start" in said(started)


def test_the_init_ends_when_the_host_goes_away_from_a_gate_past_1024(init: list[str], gate: Gate) -> None:
    # Outside a pid namespace the program outlives its init: it sleeps only a little longer than the test.
    started = start_init(init, gate, sys.executable, "-I", "-S", "-c", "import time; time.sleep(5)")
    gate.host_goes_away()
    assert finished(started) == sandbox_init.HOST_GONE, said(started)


@pytest.mark.parametrize("gone", ["end of file", "another byte"])
def test_no_go_before_the_program_starts_nothing(init: list[str], gate: Gate, tmp_path: Path, gone: str) -> None:
    marker = tmp_path / "ran"
    started = launch(init, gate, "--", sys.executable, "-I", "-S", "-c", f"open({str(marker)!r}, 'w')")
    if gone == "end of file":
        gate.host_goes_away()
    else:
        gate.go(b"0")
    assert finished(started) == sandbox_init.HOST_GONE, said(started)
    assert not marker.exists()


#: Stands for the gate's fd number in a command line below.
GATE_ARG = "{gate}"


@pytest.mark.parametrize("args", [[], ["x", "--hold"], [GATE_ARG, "--"], [GATE_ARG, "--hold", "extra"]], ids=" ".join)
def test_a_wrong_command_line_is_refused(init: list[str], args: list[str], gate: Gate) -> None:
    argv = [*init, *(arg.format(gate=gate.fd) for arg in args)]
    started = subprocess.Popen(argv, pass_fds=(gate.fd,), stderr=subprocess.PIPE)
    assert finished(started) == sandbox_init.REFUSED
    assert "usage" in said(started)


def test_holding_the_init_says_ready_only_after_go_and_holds_until_the_host_goes_away(
    init: list[str], gate: Gate
) -> None:
    """--hold (a sandbox a template's fork enters): no program; READY on its stdout once the host says go, then it
    waits, reaping, until the gate's end of file."""
    started = launch(init, gate, "--hold", stdout=subprocess.PIPE)
    assert started.stdout is not None
    try:
        os.set_blocking(started.stdout.fileno(), False)
        time.sleep(0.2)
        assert started.stdout.read() is None  # nothing said before go (it waits on the gate)
        os.set_blocking(started.stdout.fileno(), True)
        gate.go()
        assert started.stdout.readline() == sandbox_init.READY
        assert started.poll() is None  # holding
        gate.host_goes_away()
        assert finished(started) == sandbox_init.HOST_GONE, said(started)
    finally:
        if started.poll() is None:
            started.kill()
            started.wait()


def test_the_init_is_sealed_and_named_before_it_waits_on_the_gate(init: list[str], gate: Gate) -> None:
    """Non-dumpable (the kernel then gives its /proc files to root, not to the uid it runs as: nothing of that uid
    may open its memory) and named sandbox-init (what a template's fork looks for as pid 1). Run as nobody when the
    tests are root, from a copy nobody can reach (pytest's own folders are root's alone)."""
    run_as: dict[str, object] = {}
    reachable = Path(tempfile.mkdtemp(prefix="init-for-nobody-", dir="/tmp"))
    if os.getuid() == 0:
        reachable.chmod(0o755)
        copy = reachable / Path(init[-1]).name
        shutil.copy2(init[-1], copy)
        copy.chmod(0o755)
        init = ["/usr/bin/python3", "-I", "-S", str(copy)] if len(init) > 1 else [str(copy)]
        run_as = {"user": NOBODY, "group": NOBODY, "extra_groups": []}
    started = launch(init, gate, "--hold", stdout=subprocess.PIPE, **run_as)
    try:
        deadline = time.monotonic() + WAIT_S
        while Path(f"/proc/{started.pid}/comm").read_text().strip() != "sandbox-init":
            assert started.poll() is None, said(started)
            assert time.monotonic() < deadline, "the init never named itself"
            time.sleep(0.01)
        owner = os.stat(f"/proc/{started.pid}/mem").st_uid
        runs_as = NOBODY if os.getuid() == 0 else os.getuid()
        assert owner == 0 != runs_as, f"/proc/PID/mem belongs to {owner}: the init is dumpable"
    finally:
        gate.host_goes_away()
        finished(started)
        shutil.rmtree(reachable)
