"""sandbox/cpu_wait.py: a thread kept off the CPU is seen waiting; the threads are found by tree and by cgroup."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from coderunner.sandbox.base import SandboxProcess
from coderunner.sandbox.cpu_wait import CpuWaitClock, threads_of

SPIN = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass"


def sandbox_like(pid: int, cgroup: Any = None) -> SandboxProcess:
    return cast(SandboxProcess, SimpleNamespace(pid=pid, program_pid=None, cgroup=cgroup))


def test_a_process_sharing_its_cpu_is_seen_waiting_and_its_threads_are_found_below_the_root() -> None:
    cpu = sorted(os.sched_getaffinity(0))[0]
    # The "sandbox": a shell whose child spins on one CPU; a bystander spins on the same CPU.
    tree = subprocess.Popen(["/bin/sh", "-c", f'"{sys.executable}" -c "$0" {cpu} & wait', SPIN])
    rival = subprocess.Popen([sys.executable, "-c", SPIN, str(cpu)])
    try:
        process = sandbox_like(tree.pid)
        deadline = time.monotonic() + 10
        while len(threads_of(process)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(threads_of(process)) >= 2, "the spinning child below the shell was not found"
        clock = CpuWaitClock.started(process)
        deadline = time.monotonic() + 10
        while clock.waited_s() == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert clock.waited_s() > 0, "two spinners on one CPU, and neither was seen waiting"
    finally:
        with open(f"/proc/{tree.pid}/task/{tree.pid}/children") as handle:
            below = [int(pid) for pid in handle.read().split()]
        for pid in below:
            os.kill(pid, signal.SIGKILL)
        for child in (tree, rival):
            child.kill()
            child.wait()


def test_a_cgroup_lists_the_threads_and_what_is_gone_is_left_out(tmp_path: Path) -> None:
    (tmp_path / "tasks").write_text(f"{os.getpid()}\n999999999\n")
    process = sandbox_like(1, SimpleNamespace(version=1, dirs={"cpu": tmp_path}))
    assert threads_of(process) == [os.getpid(), 999999999]
    clock = CpuWaitClock.started(process)
    assert set(clock.start) == {os.getpid()}  # the thread that does not exist has no reading
    assert clock.waited_s() >= 0


def test_host_threads_on_the_path_are_counted_alongside_and_a_missing_sandbox_is_no_thread() -> None:
    clock = CpuWaitClock.started(None, [threading.get_native_id()])
    assert list(clock.start) == [threading.get_native_id()]
    assert clock.waited_s() >= 0
