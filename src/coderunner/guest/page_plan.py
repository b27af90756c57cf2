"""The pages of the kernel template a fork will copy anyway, copied while it waits for its sandbox (issue 41).

A fork shares the template's memory copy on write. Its kernel's boot and first cell then write to a few
thousand of those pages (reference counts, allocator lists, the objects a start touches), and each first write
is a page fault: a trap and a copy, paid one page at a time on the path to the kernel's first result. The same
pages, copied at once with one madvise(MADV_POPULATE_WRITE) per run of them, cost less, and the fork does it
while bwrap still builds its sandbox (kernel_template.py: after it joined the sandbox's cgroups, so the copies
are charged to the sandbox, before "go"), so the wait hides them.

Which pages: the host learns them once per template (sandbox/template_pages.py) from one kernel of its own,
forked from this template, that has run only the server's own cells; it sends their addresses here as plain
data (KIND_PLAN, little-endian u64 addresses in a memfd). The template trusts none of it: an address is kept
only if it is page-aligned and inside one of the template's own private writable mappings, and at most
MAX_PAGES are kept. So a plan can make a fork copy at most MAX_PAGES of the template's own pages early, and
nothing else: it is read by no one but the template, and never from a sandbox.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import struct

#: One address: little-endian u64.
ADDRESS = struct.Struct("<Q")
#: The most pages a plan may make a fork copy (32 MiB): a kernel's start copies a few thousand.
MAX_PAGES = 8192
#: The most bytes read from a plan's memfd.
MAX_BYTES = MAX_PAGES * ADDRESS.size
#: Linux 5.14 and later; older kernels answer EINVAL and the fork faults its pages in as before.
MADV_POPULATE_WRITE = 23
PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)

#: The runs (start address, bytes) a fork copies before "go"; empty until the host sent a plan.
runs: tuple[tuple[int, int], ...] = ()


def writable_private_mappings(maps_text: str) -> list[tuple[int, int]]:
    """(start, end) of each private writable mapping in a /proc/PID/maps text (as sandbox/template_pages.py
    reads the template's: the host cannot import the guest, nor the guest the host)."""
    found = []
    for line in maps_text.splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[1].startswith("rw") and fields[1].endswith("p"):
            start, end = (int(value, 16) for value in fields[0].split("-"))
            found.append((start, end))
    return found


def to_runs(
    addresses: list[int], mappings: list[tuple[int, int]], limit: int = MAX_PAGES
) -> tuple[tuple[int, int], ...]:
    """The page-aligned addresses inside `mappings`, at most `limit` of them, merged into (start, bytes) runs."""
    ordered = sorted(mappings)
    starts = [start for start, _ in ordered]
    kept: list[int] = []
    for address in sorted(set(addresses)):
        if len(kept) >= limit:
            break
        at = bisect.bisect_right(starts, address) - 1  # the last mapping starting at or below it (they never overlap)
        if address % PAGE == 0 and at >= 0 and address < ordered[at][1]:
            kept.append(address)
    merged: list[list[int]] = []
    for address in kept:
        if merged and merged[-1][0] + merged[-1][1] == address:
            merged[-1][1] += PAGE
        else:
            merged.append([address, PAGE])
    return tuple((start, size) for start, size in merged)


def read_plan(fd: int) -> list[int]:
    """The addresses in a plan's memfd (read from its start, at most MAX_BYTES); ValueError if torn."""
    data = os.pread(fd, MAX_BYTES + 1, 0)
    if len(data) > MAX_BYTES or len(data) % ADDRESS.size:
        raise ValueError("a page plan is too long or not whole addresses")
    return [value for (value,) in ADDRESS.iter_unpack(data)]


def take(fd: int) -> int:
    """In the template: the plan in `fd` becomes what every later fork copies ahead; how many pages it kept."""
    global runs
    with open("/proc/self/maps") as handle:
        mappings = writable_private_mappings(handle.read())
    runs = to_runs(read_plan(fd), mappings)
    return sum(size for _, size in runs) // PAGE


def prefault() -> None:
    """In a fork: copy the plan's pages now. Best effort: a run the kernel refuses (an old kernel, a mapping
    gone) is left to fault in as before."""
    for start, size in runs:
        _libc.madvise(start, size, MADV_POPULATE_WRITE)
