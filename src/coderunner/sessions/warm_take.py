"""Whether a create may take a warm pool's sandbox, and what the sandbox is given when it is taken.

A pooled sandbox starts with the user's defaults before anyone asks for it (pool.py). A create whose
options differ still takes one when every difference can be given to the running sandbox:
- lower limits (memory_mb, cpus): written into its cgroup where the backend can (SandboxBackend.lower_limits),
  and the kernel lowers its own soft address-space limit in a silent cell (`address_space_code`: a cold
  kernel's MemoryError comes from it); never higher, since the pooled sandbox was built with the user's
  defaults and a running sandbox's limits only go down;
- its own allowlist: the pooled sandbox's proxy socket waits unserved until the take, then serves that
  session's policy under its id (egress_wiring.py EgressHub.reserve), so a pooled sandbox never holds
  another session's allowlist;
- its run limit (timeout_s) and its client: the host's alone.
What is fixed when a sandbox starts (its network mode, its mounts, a named or persistent workspace, its
filesystem sizes) cannot be changed, and such a create starts cold. Every session says which way it went
and why (`StartedFrom`, in manage_sessions status).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from coderunner.sandbox import Limits
from coderunner.sandbox.live_limits import raised
from coderunner.sessions.sandbox_options import SandboxOptions


@dataclass(frozen=True)
class StartedFrom:
    """How a session's sandbox started: taken warm from the pool, or cold, and why."""

    warm: bool
    why: str

    def describe(self) -> dict[str, Any]:
        return {"sandbox": "warm pool" if self.warm else "cold start", "why": self.why}


def take_problem(pooled: SandboxOptions, asked: SandboxOptions, live_limits: str | None) -> str | None:
    """Why a create asking for `asked` may not take a sandbox started with `pooled` (None: it may);
    `live_limits`: why the backend cannot lower a running sandbox's limits (None: it can)."""
    if asked.network != pooled.network:
        return (
            f"network {asked.network!r}: the warm pool's sandboxes have {pooled.network!r}, and a sandbox's "
            "network is set when it starts"
        )
    if asked.mounts != pooled.mounts:
        return "its mounts are bound when a sandbox starts"
    if (asked.name, asked.persistent, asked.keep_state) != (pooled.name, pooled.persistent, pooled.keep_state):
        return "a named session's workspace is its own from the start"
    if asked.limits != pooled.limits:
        problem = limits_problem(pooled.limits, asked.limits, live_limits)
        if problem is not None:
            return problem
    given = dataclasses.replace(asked, limits=pooled.limits, allow=pooled.allow, timeout_s=pooled.timeout_s,
                                client=pooled.client)  # fmt: skip
    if given != pooled:  # an option this module does not know: never given to a running sandbox
        return "its options differ from the warm pool's in what is set when a sandbox starts"
    return None


def limits_problem(pooled: Limits, asked: Limits, live_limits: str | None) -> str | None:
    """Why `asked` limits cannot be given to a sandbox started with `pooled` ones (None: they can)."""
    above = raised(pooled, asked)
    if above:
        said = ", ".join(f"{name} {getattr(asked, name) or 'unlimited'}" for name in above)
        most = ", ".join(f"{getattr(pooled, name)}" for name in above)
        return f"{said}: above the warm pool's sandboxes ({most}), and a running sandbox's limits are only lowered"
    if (asked.disk_mb, asked.tmp_mb) != (pooled.disk_mb, pooled.tmp_mb):
        return "disk_mb and tmp_mb are sizes of filesystems made when a sandbox starts"
    return live_limits


def given_at_take(pooled: SandboxOptions, asked: SandboxOptions) -> list[str]:
    """What a taken sandbox is given beyond the pool's defaults, in words (for StartedFrom.why)."""
    given = [
        f"{name} {getattr(asked.limits, name)}"
        for name in ("memory_mb", "cpus", "pids")
        if getattr(asked.limits, name) != getattr(pooled.limits, name)
    ]
    if asked.allow != pooled.allow:
        given.append(f"allow {list(asked.allow)}")
    if asked.timeout_s != pooled.timeout_s:
        given.append(f"timeout_s {asked.timeout_s:g}")
    return given


def warm_why(pooled: SandboxOptions, asked: SandboxOptions) -> str:
    """StartedFrom.why of a session taken from the pool."""
    given = given_at_take(pooled, asked)
    return f"taken with {', '.join(given)} given at take" if given else "taken with the pool's own options"


def address_space_code(pooled: Limits, asked: Limits) -> str | None:
    """The silent cell a taken kernel runs to lower its own soft RLIMIT_AS from the pool's memory limit to
    the one asked (its hard limit kept: unlimited under a memory cgroup, as a cold kernel's); None when the
    memory limit is the pool's. It binds no name in the user's namespace."""
    if asked.memory_mb is None or pooled.memory_mb is None or asked.memory_mb >= pooled.memory_mb:
        return None
    was, now = pooled.memory_mb * 2**20, asked.memory_mb * 2**20
    return (
        f"(lambda r: r.setrlimit(r.RLIMIT_AS, ({now}, r.getrlimit(r.RLIMIT_AS)[1]))"
        f" if r.getrlimit(r.RLIMIT_AS)[0] == {was} else None)(__import__('resource'))"
    )
