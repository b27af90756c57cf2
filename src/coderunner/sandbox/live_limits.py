"""Lowering a running sandbox's limits: what a warm pool's sandbox gets when it is taken with lower ones.

A pooled sandbox starts with the user's default limits, before anyone asks for it; a create that asks
for less memory or CPU than that can still take it, once its limits are lowered to what was asked. Only
lowered, never raised: the pooled sandbox's limits are the most the taker gets. Where a backend holds a
sandbox in cgroups (bwrap with cgroups), its cgroup's memory, pids and cpu limits are written again
(cgroups.py `write_limits`): they bound everything in the sandbox, whatever it forks.

The kernel's own soft address-space limit (RLIMIT_AS, the source of a clean MemoryError; the cgroup is
the bound) is lowered by the kernel itself at take (sessions/warm_take.py): setting another uid's rlimit
needs CAP_SYS_RESOURCE, which a server in a container may lack, and a process may always lower its own.
"""

from __future__ import annotations

from coderunner.sandbox.base import Limits
from coderunner.sandbox.cgroups import CgroupLimits, SessionCgroup


def cgroup_limits(limits: Limits) -> CgroupLimits:
    """A sandbox's limits as its cgroup holds them."""
    return CgroupLimits(
        memory_bytes=limits.memory_mb * 2**20 if limits.memory_mb else None,
        pids_max=limits.pids,
        cpus=limits.cpus,
    )


def raised(built: Limits, asked: Limits) -> list[str]:
    """The limits `asked` holds above what a sandbox was `built` with (None is no limit: the most)."""
    names = []
    for name in ("memory_mb", "cpus", "pids", "disk_mb", "tmp_mb"):
        was, now = getattr(built, name), getattr(asked, name)
        if was is not None and (now is None or now > was):
            names.append(name)
    return names


def lower_limits(group: SessionCgroup, built: Limits, asked: Limits) -> None:
    """Lower the cgroup of the running sandbox in `group` from `built` to `asked`. Blocking (cgroupfs): async
    code calls it through off_loop. ValueError for a limit that would rise; OSError for one the kernel refused."""
    above = raised(built, asked)
    if above:
        raise ValueError(f"limits only go down in a running sandbox: {', '.join(above)} would rise")
    if asked.disk_mb != built.disk_mb or asked.tmp_mb != built.tmp_mb:
        raise ValueError("disk_mb and tmp_mb are sizes of filesystems made when the sandbox starts")
    group.write_limits(
        CgroupLimits(
            memory_bytes=asked.memory_mb * 2**20 if asked.memory_mb != built.memory_mb and asked.memory_mb else None,
            pids_max=asked.pids if asked.pids != built.pids else None,
            cpus=asked.cpus if asked.cpus != built.cpus else None,
        )
    )
