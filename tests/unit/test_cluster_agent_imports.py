"""What a cluster node's agent loads: each agent pays it once, in its own Ray worker process.

The MCP SDK (and the HTTP stack under the token check) is the front door's: loading it took about
0.45 s of CPU per process (a third of a cold start's when every session was an actor of its own).
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
import coderunner.cluster.agent  # what Ray loads in the agent's worker process to build a NodeAgent
print(json.dumps(sorted({name.split(".")[0] for name in sys.modules})))
"""


def test_a_node_agent_loads_no_front_door_package() -> None:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(SRC)}
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert "coderunner" in loaded
    assert not loaded & set(FRONT_DOOR_ONLY), f"a node agent loads {sorted(loaded & set(FRONT_DOOR_ONLY))}"
