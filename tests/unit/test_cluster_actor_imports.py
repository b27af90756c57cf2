"""What a cluster node's session actor loads: every cold session pays it in a new Ray worker process.

The MCP SDK (and the HTTP stack under the token check) is the front door's: loading it took about
0.45 s of CPU per session actor, a third of a cold start's, so a burst of creates waited on imports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

#: Packages only a front door uses.
FRONT_DOOR_ONLY = ("mcp", "starlette", "uvicorn", "sse_starlette")

PROBE = """
import json, sys
import coderunner.cluster.actor  # what Ray loads in the actor's worker process to build a SessionActor
print(json.dumps(sorted({name.split(".")[0] for name in sys.modules})))
"""


def test_a_session_actor_loads_no_front_door_package() -> None:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(SRC)}
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert "coderunner" in loaded
    assert not loaded & set(FRONT_DOOR_ONLY), f"a session actor loads {sorted(loaded & set(FRONT_DOOR_ONLY))}"
