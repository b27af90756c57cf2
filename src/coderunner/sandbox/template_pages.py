"""Which of the kernel template's pages a forked kernel's start copies: learned by the host from one kernel (issue 41).

guest/page_plan.py has each fork copy these pages while its sandbox is built, instead of one page fault at a
time on the way to its first result. They are learned here, once per template, from the page tables of one
kernel forked from it that has run only the server's own cells (a pool member after its first, silent cell): a
page the template holds (present) that the kernel now holds alone (exclusively mapped: its own copy) is one
its start wrote to. /proc/PID/pagemap gives both bits without privilege.

The kernel is a process of a sandbox, so it is read through a directory fd of its /proc entry, checked to be a
child of the template (a kernel of this template, whatever its pid's fate), and what comes back is only
addresses, which the template checks against its own mappings before it keeps any (page_plan.take).
"""

from __future__ import annotations

import os
import struct

#: pagemap's entry per page, and the two bits read (Documentation/admin-guide/mm/pagemap.rst).
ENTRY = struct.Struct("<Q")
PRESENT = 1 << 63
EXCLUSIVE = 1 << 56
PAGE = os.sysconf("SC_PAGE_SIZE")
#: The most addresses handed over (guest/page_plan.py keeps no more: MAX_PAGES).
MAX_PAGES = 8192
#: Bound on one mapping read (a template's heap is a few hundred MiB at most; larger ones are skipped).
MAX_MAPPING_BYTES = 1 << 30


def writable_private_mappings(maps_text: str) -> list[tuple[int, int]]:
    """(start, end) of each private writable mapping in a /proc/PID/maps text."""
    found = []
    for line in maps_text.splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[1].startswith("rw") and fields[1].endswith("p"):
            start, end = (int(value, 16) for value in fields[0].split("-"))
            if end - start <= MAX_MAPPING_BYTES:
                found.append((start, end))
    return found


def _entries(pagemap: int, start: int, end: int) -> tuple[int, ...]:
    size = (end - start) // PAGE * ENTRY.size
    data = os.pread(pagemap, size, start // PAGE * ENTRY.size)
    return tuple(value for (value,) in ENTRY.iter_unpack(data[: len(data) - len(data) % ENTRY.size]))


def parent_of(proc_dir: int) -> int:
    """The parent pid in a /proc/PID directory's stat (its fourth field, after the parenthesised name)."""
    fd = os.open("stat", os.O_RDONLY | os.O_CLOEXEC, dir_fd=proc_dir)
    try:
        stat = os.read(fd, 4096)
    finally:
        os.close(fd)
    return int(stat.rsplit(b")", 1)[1].split()[1])


def copied_pages(kernel_pid: int, template_pid: int) -> list[int]:
    """The addresses of the template's pages that the kernel holds a copy of, at most MAX_PAGES; OSError if
    either process is gone or is not what it should be (the kernel not the template's child)."""
    with open(f"/proc/{template_pid}/maps") as handle:
        mappings = writable_private_mappings(handle.read())
    kernel_dir = os.open(f"/proc/{kernel_pid}", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if parent_of(kernel_dir) != template_pid:
            raise ProcessLookupError(f"process {kernel_pid} is not a kernel of the template {template_pid}")
        kernel = os.open("pagemap", os.O_RDONLY | os.O_CLOEXEC, dir_fd=kernel_dir)
    finally:
        os.close(kernel_dir)
    template = os.open(f"/proc/{template_pid}/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    try:
        pages: list[int] = []
        for start, end in mappings:
            ours, theirs = _entries(template, start, end), _entries(kernel, start, end)
            for index, (held, copy) in enumerate(zip(ours, theirs, strict=False)):
                if held & PRESENT and copy & PRESENT and copy & EXCLUSIVE:
                    pages.append(start + index * PAGE)
                    if len(pages) >= MAX_PAGES:
                        return pages
        return pages
    finally:
        os.close(kernel)
        os.close(template)
