"""How many sandboxes bwrap builds at once: BUILDS_AT_ONCE per server (event loop), and when a build is over.

Why a bound: a build is CPU work (namespaces, about 27 binds, the init's Python), so on a machine with few cores
a hundred builds in flight together finish no sooner than a few at a time. They cost more, though. Each build
under a root server holds clones of its workspace and outbox in the start namespace (start_namespace.py) until
its pid 1 runs, and bwrap reads the whole mount table once per bind: with a hundred builds in flight, every
build reads every other's clones, 27 times. Measured in bursts of 100 creates on 2 cores (template kernels,
one server): unbounded, bwrap's reads of /proc/self/mountinfo were 13-14% of all the
machine's CPU and the burst answered in 4.5-4.9 s; with 2, 4 or 8 builds at once, 3.7% and 3.9-4.1 s.

A build holds its slot from before its clones are made until its pid 1 runs something other than bwrap (the
sandbox's init: every mount is made by then) or is gone. Only the build: a forked or a cold kernel starts
outside it, and the start returns as soon as bwrap reports its pid 1, so a template fork still overlaps the
build. A start waiting for a slot holds nothing but its cgroup.
"""

from __future__ import annotations

import os

import anyio
from anyio.lowlevel import RunVar

from coderunner.offload import loop_local

#: Builds in flight at once: the cores, at least 2 (one waits on the disk while another runs) and at most 8.
#: 2, 4 and 8 measured alike on 2 cores (module docstring).
BUILDS_AT_ONCE = max(2, min(8, os.cpu_count() or 2))
#: How long a build's end is waited for: looked at after BUILT_POLL_S, then twice as long each time up to
#: BUILT_POLL_MAX_S (a build takes about 10 ms alone, and tens of ms beside a burst's kernels), or
#: BUILT_WAIT_S at most (a pid 1 stuck in bwrap that long is let go of, with its slot).
BUILT_POLL_S = 0.002
BUILT_POLL_MAX_S = 0.02
BUILT_WAIT_S = 60.0

_slots: RunVar[anyio.Semaphore] = RunVar("coderunner_sandbox_builds")


def build_slots() -> anyio.Semaphore:
    """This event loop's bound on builds in flight (per loop, as anyio's own thread limiter is)."""
    return loop_local(_slots, lambda: anyio.Semaphore(BUILDS_AT_ONCE))


def is_built(child: int | None) -> bool:
    """Has bwrap's child exec'd the sandbox's init (or ended)? Its name is bwrap's until then (--as-pid-1: it
    execs the init itself). A pid reused after it ended names another program: built then too, as it should be.
    One small read of /proc, fit for the event loop."""
    if child is None:
        return True
    try:
        with open(f"/proc/{child}/comm", "rb") as handle:
            return handle.read().strip() != b"bwrap"
    except OSError:
        return True


async def wait_built(child: int | None) -> bool:
    """Until `child` (bwrap's, the sandbox's pid 1; None: bwrap made none) has built its sandbox; False if it
    had not after BUILT_WAIT_S."""
    pause = BUILT_POLL_S
    with anyio.move_on_after(BUILT_WAIT_S):
        while not is_built(child):
            await anyio.sleep(pause)
            pause = min(pause * 2, BUILT_POLL_MAX_S)
        return True
    return False
