"""How long a sandbox's threads were kept waiting for a CPU: the part of a wait that was not theirs to use.

A grace period (the time an interrupted kernel gets to stop before it is restarted) is a promise of time
to act. Sessions share only otherwise idle CPU (sandbox/cgroups.py: a low weight), so on a loaded
machine a kernel may wait seconds in the run queue before its interrupt handler runs, and a grace counted
in wall time restarts a kernel that would have stopped, losing its state. The kernel counts that wait per
thread (/proc/<tid>/schedstat's second field, run_delay in ns, kept whatever the sandbox does), so a
grace can be counted in time the sandbox was able to run. The host threads on the interrupt's path (the
server's event loop, which reads the kernel's answer) are counted alongside: they wait on a loaded machine too.

The threads are found in the sandbox's cgroup where it has one (every thread it ever forks), else by
walking the process tree from the sandbox's process and its program's. Reads only, bounded in threads;
a pid reused meanwhile can only lengthen a wait that its caller bounds.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

from coderunner.sandbox.base import SandboxProcess

#: Most threads read per look: a fork bomb's are capped by its pids limit, but a look must stay cheap.
MAX_THREADS = 2048


def _cgroup_threads(process: SandboxProcess) -> list[int] | None:
    cgroup = process.cgroup
    if cgroup is None:
        return None
    folder = cgroup.dirs.get("cpu") or next(iter(cgroup.dirs.values()), None)
    if folder is None:
        return None
    name = "tasks" if cgroup.version == 1 else "cgroup.threads"
    try:
        with open(folder / name, encoding="ascii") as handle:
            return [int(line) for _, line in zip(range(MAX_THREADS), handle, strict=False)]
    except (OSError, ValueError):
        return None


def _tree_threads(roots: list[int]) -> list[int]:
    """Every thread of `roots` and their descendants, from /proc (at most MAX_THREADS)."""
    found: list[int] = []
    pending = list(roots)
    seen: set[int] = set()
    while pending and len(found) < MAX_THREADS:
        pid = pending.pop()
        if pid in seen:
            continue
        seen.add(pid)
        with contextlib.suppress(OSError, ValueError):
            for task in os.listdir(f"/proc/{pid}/task"):
                found.append(int(task))
                with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as handle:
                    pending.extend(int(child) for child in handle.read().split())
    return found[:MAX_THREADS]


def threads_of(process: SandboxProcess) -> list[int]:
    """The host thread ids of everything running in the sandbox (see the module docstring)."""
    from_cgroup = _cgroup_threads(process)
    if from_cgroup is not None:
        return from_cgroup
    return _tree_threads([pid for pid in (process.pid, process.program_pid) if pid is not None])


def run_delays(threads: list[int]) -> dict[int, int]:
    """Each thread's total time waiting on a run queue, in ns (threads gone meanwhile left out)."""
    delays: dict[int, int] = {}
    for tid in threads:
        with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{tid}/schedstat", "rb") as handle:
            delays[tid] = int(handle.read().split()[1])
    return delays


@dataclass
class CpuWaitClock:
    """Counts, from its start, how long the most delayed thread of the sandbox (`process`, None: none) and
    of `also` (host threads on the same path, e.g. the server's event loop) waited for a CPU."""

    process: SandboxProcess | None
    also: list[int] = field(default_factory=list)
    start: dict[int, int] = field(default_factory=dict)

    @classmethod
    def started(cls, process: SandboxProcess | None, also: list[int] | None = None) -> CpuWaitClock:
        clock = cls(process, list(also or ()))
        clock.start = run_delays(clock.threads())
        return clock

    def threads(self) -> list[int]:
        return [*(threads_of(self.process) if self.process is not None else ()), *self.also]

    def waited_s(self) -> float:
        """The longest run-queue wait of any thread since the start (a thread born since: all of its)."""
        now = run_delays(self.threads())
        longest = max((delay - self.start.get(tid, 0) for tid, delay in now.items()), default=0)
        return max(longest, 0) / 1e9
