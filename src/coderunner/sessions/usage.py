"""What a session uses, in the units of its limits: memory, peak memory, processes, disk.

Read from the sandbox's cgroup where it has one, else from /proc (the kernel's process tree)
and the workspace's file system. One reading per status call: /proc is walked once.
"""

from __future__ import annotations

import os
from pathlib import Path

from coderunner.hostfs import dirfd as hostfs
from coderunner.hostfs.workspaces import Workspace
from coderunner.kernel.incarnation import Kernel


def session_usage(kernel: Kernel | None, workspace: Workspace) -> dict[str, float | None]:
    """memory_mb, memory_peak_mb, pids and disk_mb of a session whose kernel is `kernel`."""
    process = kernel.process if kernel is not None else None
    cgroup = process.cgroup if process is not None else None
    try:
        disk = os.statvfs(workspace.path)
        disk_used: float | None = round((disk.f_blocks - disk.f_bfree) * disk.f_frsize / 2**20, 1)
    except OSError:
        disk_used = None
    if workspace.image is None:
        disk_used = dir_size_mb(workspace.path)
    return {
        "memory_mb": memory_used_mb(kernel) if kernel is not None and kernel.alive else None,
        "memory_peak_mb": round(peak / 2**20, 1) if cgroup and (peak := cgroup.memory_peak_bytes()) else None,
        "pids": cgroup.pids_current() if cgroup is not None else None,
        "disk_mb": disk_used,
    }


def memory_used_mb(kernel: Kernel) -> float | None:
    """The sandbox's cgroup usage where there is one, else the resident memory of its process tree (and of
    its program's, where that is not a descendant: a kernel forked from the template)."""
    process = kernel.process
    if process is None:
        return None
    if used := process.memory_used_mb():
        return used
    trees = [tree_rss_mb(pid) for pid in (process.pid, process.program_pid) if pid is not None]
    found = [mb for mb in trees if mb is not None]
    return round(sum(found), 1) if found else None


def dir_size_mb(path: Path) -> float | None:
    """Bytes under `path`, walked by fds without following links (bounded by hostfs.walk)."""
    try:
        with hostfs.dir_fd(path) as fd:
            total, _complete = hostfs.tree_size(fd)
    except OSError:
        return None
    return round(total / 2**20, 1)


def tree_rss_mb(pid: int) -> float | None:
    """Resident memory of a process and all its descendants, from /proc."""
    total_kb = 0
    pending = [pid]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        try:
            with open(f"/proc/{current}/status") as handle:
                for line in handle:
                    if line.startswith("VmRSS:"):
                        total_kb += int(line.split()[1])
                        break
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as handle:
                    pending.extend(int(child) for child in handle.read().split())
        except (OSError, ValueError):
            continue
    return round(total_kb / 1024, 1) if seen else None
