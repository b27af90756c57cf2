"""The silent cell a kernel started ahead runs before anyone uses it (a warm pool member, a session's standby).

A fresh ipykernel's first execute pays one-off costs (about 7 ms here): a no-op cell pays them. With
`preload_imports` (the default) the cell also imports numpy, pandas and matplotlib and does their
first-use work (guest/warm_imports.py), so that a new session's first chart or first frame costs
about what it costs in a warm session. Silent: no history, no execution count, no output kept, no
name bound in the user's namespace. A guest without the module (an image built before it) is
warmed with the no-op only. A pool member runs it as its one warm-up cell; a session's standby runs
the no-op at once and the preload only once the session rests (standby.py), since it shares the
session's cores and cgroup.
"""

from __future__ import annotations

NO_OP_CODE = "pass"
#: guest/warm_imports.py's STEPS, in order.
PRELOAD_STEPS = ("numpy", "pandas", "pyplot", "draw")


def preload_code(*steps: str) -> str:
    """The silent cell that runs these steps of the preload (all of them when none is named)."""
    arguments = ", ".join(repr(step) for step in steps)
    return (
        "try:\n"
        f"    __import__('coderunner_guest.warm_imports').warm_imports.run({arguments})\n"
        "except ImportError:\n"
        "    pass"
    )


#: The whole preload in one cell (a warm pool member's warm-up).
PRELOAD_CODE = preload_code()
#: One cell per step (a standby's: a reset waits for one step at most).
PRELOAD_STEP_CODES = tuple(preload_code(step) for step in PRELOAD_STEPS)


def warm_up_code(preload_imports: bool) -> str:
    return PRELOAD_CODE if preload_imports else NO_OP_CODE
