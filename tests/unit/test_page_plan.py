"""The kernel template's page plan (guest/page_plan.py), and the host's lesson it comes from (template_pages.py)."""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import time

import pytest

from coderunner.guest import page_plan
from coderunner.sandbox import template_pages

MAPS = """\
55d0c0000000-55d0c0002000 r--p 00000000 08:01 1 /usr/bin/python3
55d0c0002000-55d0c0010000 r-xp 00002000 08:01 1 /usr/bin/python3
55d0c0200000-55d0c0400000 rw-p 00000000 00:00 0 [heap]
7f0000000000-7f0000004000 rw-s 00000000 00:05 2 /dev/shm/x
7f0000010000-7f0000020000 rw-p 00000000 00:00 0
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0 [stack]
"""
PAGE = page_plan.PAGE


def test_host_and_template_read_maps_and_bound_plans_alike() -> None:
    # The host cannot import the guest (it runs on the sandbox's Python), so each side has its own copy.
    assert page_plan.writable_private_mappings(MAPS) == template_pages.writable_private_mappings(MAPS)
    assert page_plan.writable_private_mappings(MAPS) == [
        (0x55D0C0200000, 0x55D0C0400000), (0x7F0000010000, 0x7F0000020000), (0x7FFD00000000, 0x7FFD00021000),
    ]  # fmt: skip
    assert page_plan.MAX_PAGES == template_pages.MAX_PAGES
    assert page_plan.PAGE == template_pages.PAGE


def test_a_plan_keeps_only_aligned_pages_of_the_templates_own_private_writable_mappings_merged_into_runs() -> None:
    mappings = page_plan.writable_private_mappings(MAPS)
    heap = 0x55D0C0200000
    addresses = [
        heap, heap + PAGE, heap + 2 * PAGE, heap + 5 * PAGE, heap + 5 * PAGE,  # a run of three, one page, a repeat
        heap + 1,  # misaligned
        0x55D0C0002000,  # the code
        0x7F0000000000,  # shared, not private
        0x7F0000020000,  # one past a mapping's end
        0xFFFFFFFFFF600000, 0,  # the kernel's, nothing
    ]  # fmt: skip
    assert page_plan.to_runs(addresses, mappings) == ((heap, 3 * PAGE), (heap + 5 * PAGE, PAGE))
    assert page_plan.to_runs([heap + index * PAGE for index in range(10)], mappings, limit=4) == ((heap, 4 * PAGE),)


def test_a_plan_not_whole_addresses_or_over_its_bound_is_refused() -> None:
    fd = os.memfd_create("plan")
    try:
        os.write(fd, page_plan.ADDRESS.pack(PAGE) + b"\0\0\0")
        with pytest.raises(ValueError):
            page_plan.read_plan(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, page_plan.ADDRESS.pack(PAGE) * (page_plan.MAX_PAGES + 1), 0)
        with pytest.raises(ValueError):
            page_plan.read_plan(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, page_plan.ADDRESS.pack(PAGE) * 3, 0)
        assert page_plan.read_plan(fd) == [PAGE] * 3
    finally:
        os.close(fd)


def test_the_lesson_reads_only_a_child_of_the_template() -> None:
    # A process that is not the template's child (here: not its own) is not read.
    with pytest.raises(ProcessLookupError, match="not a kernel of the template"):
        template_pages.copied_pages(os.getpid(), os.getpid())


def test_the_lesson_finds_the_pages_a_fork_wrote_to_and_no_other() -> None:
    """A fork of this process writes to half of a private buffer of ours: that half is learned, the rest not."""
    buffer = mmap.mmap(-1, 64 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer.write(b"x" * len(buffer))  # every page present here
    start = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover (the fork)
        for index in range(0, 32 * PAGE, PAGE):
            buffer[index] = 1
        os.write(write, b"1")
        time.sleep(60)
        os._exit(0)
    try:
        os.close(write)
        assert os.read(read, 1) == b"1"
        learned = set(template_pages.copied_pages(child, os.getpid()))
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        os.close(read)
    written = {start + index * PAGE for index in range(32)}
    untouched = {start + index * PAGE for index in range(32, 64)}
    assert written <= learned
    assert not untouched & learned
