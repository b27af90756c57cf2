"""Lowering a running sandbox's limits: what a warm pool's sandbox gets when it is taken with lower ones.

A pooled sandbox starts with the user's default limits, before anyone asks for it; a create that asks
for less memory or CPU than that can still take it, once its limits are lowered to what was asked. Only
lowered, never raised: the pooled sandbox's limits are the most the taker gets, whatever this module
could write. Where a backend holds a sandbox in cgroups (bwrap with cgroups), lowering is:
- the cgroup's memory, pids and cpu limits written again (cgroups.py `write_limits`), and
- the soft RLIMIT_AS of every process in it that still has the one it started with lowered to the new
  memory limit (the kernel's clean MemoryError comes from it; under a memory cgroup the hard limit is
  unlimited, as at a cold start: common.py `rlimit_prefix`).
A process forked between the listing and the writes keeps the old address-space limit, but the cgroup
holds it; a pooled sandbox runs only the server's own warm-up before it is taken.
"""

from __future__ import annotations

import contextlib
import resource

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
    """Lower the running sandbox in `group` from `built` to `asked`: its cgroup, then its processes'
    address-space limit. Blocking (cgroupfs and prlimit): async code calls it through off_loop.
    ValueError for a limit that would rise; OSError for one the kernel refused."""
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
    if built.memory_mb and asked.memory_mb and asked.memory_mb < built.memory_mb:
        lower_address_space(group, built.memory_mb * 2**20, asked.memory_mb * 2**20)


def lower_address_space(group: SessionCgroup, was: int, now: int) -> None:
    """Every process in `group` whose soft RLIMIT_AS is `was` gets `now` (its hard limit kept): a
    process that set its own (the browser lifts it) or never had one (the sandbox's init) keeps its own."""
    pids: set[int] = set()
    for procs in group.procs_files():
        with contextlib.suppress(OSError, ValueError):
            pids.update(int(pid) for pid in procs.read_text().split())
    for pid in sorted(pids):
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            soft, hard = resource.prlimit(pid, resource.RLIMIT_AS)
            if soft == was:
                resource.prlimit(pid, resource.RLIMIT_AS, (now, hard))
