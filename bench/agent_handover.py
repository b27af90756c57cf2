"""What a node agent's death costs its sessions, with the hand-over and without, on a real Ray cluster.

    sudo .venv/bin/python bench/agent_handover.py [--rounds 5] [--sessions 4]   (BENCH_LOG_LEVEL=INFO: say more)

The cluster is tests/cluster/conftest.py's (a head and two workers in a network namespace of their own). Two
front doors (pool_size 0, every session on worker w1 by its node label): one with agent_handover_s 60 (the
default: a dead agent's sessions wait for the node's next agent, sessions/adoption.py) and one with 0 (they end
with it, as before this existed). Each round, the two lanes in a random order, each:
- `--sessions` sessions on w1's agent, each given state by a cell (numpy and pandas imported, a 1000x10 frame
  summed: what an agent's session holds after a while);
- the agent SIGKILLed (found by the sessions it holds), then after KILL_SETTLE_S every session asked at once:
  - hand-over lane: for its state (`kept`); timed from the asks until every session answered with the value it
    had (the first asks pay the next agent's start and the take-over);
  - baseline lane: each ask answers that its session was lost, so as many new sessions are made and given the
    same state again, all at once; timed from the asks until every new one answered.
Beside both, the server-side CPU the node's agents spent is not separated out: the figures are wall time to
"the user's sessions hold what they held", which is what an agent's death costs them.

No timing assertions: figures only. Every wait is bounded; the front doors and the cluster are gone at the end.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio
from cluster import call, door_env, front_door  # bench/cluster.py
from mcp import Client

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.cluster.conftest import NODE_LABEL, RayCluster, ray_cluster_running, unavailable  # noqa: E402
from tests.cluster.test_cluster_mode import agents_held  # noqa: E402

#: The state every session is given, and what reading it back answers.
STATE = (
    "import numpy as np, pandas as pd\n"
    "frame = pd.DataFrame(np.arange(10_000).reshape(1000, 10))\n"
    "kept = int(frame.values.sum())"
)
KEPT = str(sum(range(10_000)))
#: After the kill, before the asks: the dead agent's channel is seen closed (an ask right at the kill is the
#: call under way of tests/cluster, which answers that its end is unknown).
KILL_SETTLE_S = 1.0
#: Bound on one lane's round.
ROUND_S = 300.0


async def made_with_state(client: Client, count: int) -> list[str]:
    """`count` new sessions, each given STATE, all at once; their ids."""
    ids: list[str] = []

    async def one() -> None:
        made = await call(client, "create_session", cpus=0.25, memory_mb=512)
        await call(client, "run_python", code=STATE, session_id=made["session_id"])
        ids.append(made["session_id"])

    async with anyio.create_task_group() as group:
        for _ in range(count):
            group.start_soon(one)
    return ids


def holder_of(cluster: RayCluster, session_ids: list[str]) -> int:
    """The pid of the node agent holding all of `session_ids`."""
    for holds in agents_held(cluster).values():
        if holds is not None and set(session_ids) <= set(holds["sessions"]):
            return int(holds["pid"])
    raise RuntimeError(f"no one agent holds {session_ids}")


async def round_of(cluster: RayCluster, client: Client, handover: bool, count: int) -> float:
    """One lane's round: sessions with state, their agent killed, the time until they hold that state again."""
    ids = await made_with_state(client, count)
    agent = holder_of(cluster, ids)
    os.kill(agent, signal.SIGKILL)
    await anyio.sleep(KILL_SETTLE_S)
    began = time.perf_counter()
    if handover:
        answers: list[str] = []

        async def ask(session_id: str) -> None:
            answers.append((await call(client, "run_python", code="kept", session_id=session_id)).get("text", ""))

        async with anyio.create_task_group() as group:
            for session_id in ids:
                group.start_soon(ask, session_id)
        spent = time.perf_counter() - began
        if not all(KEPT in answer for answer in answers):
            raise RuntimeError(f"a session did not keep its state: {answers}")
    else:
        for session_id in ids:  # each says it was lost with its agent (and is forgotten by the front door)
            said = await client.call_tool("run_python", {"code": "kept", "session_id": session_id})
            if not said.is_error:
                raise RuntimeError("a session outlived its agent with agent_handover_s 0")
        ids = await made_with_state(client, count)
        spent = time.perf_counter() - began
    for session_id in ids:
        await call(client, "manage_sessions", action="close", session_id=session_id)
    return spent


async def run(cluster: RayCluster, root: Path, rounds: int, count: int) -> dict[str, list[float]]:
    label = f'{{"{NODE_LABEL}": "w1"}}'
    lanes = {"hand-over (agent_handover_s 60)": True, "no hand-over (agent_handover_s 0)": False}
    spent: dict[str, list[float]] = {name: [] for name in lanes}
    log_level = os.environ.get("BENCH_LOG_LEVEL", "WARNING")  # INFO: the front doors say each take-over
    envs = {
        name: door_env(cluster, root / str(index), CODERUNNER_RAY_NODE_LABELS=label,
                       CODERUNNER_AGENT_HANDOVER_S="60" if handover else "0", CODERUNNER_LOG_LEVEL=log_level)
        for index, (name, handover) in enumerate(lanes.items())
    }  # fmt: skip
    async with (
        front_door(cluster, envs[next(iter(lanes))], True) as first,
        front_door(cluster, envs[list(lanes)[1]], True) as second,
    ):
        clients = dict(zip(lanes, (first, second), strict=True))
        for name, client in clients.items():  # warm-up: each lane's agent and template started, untimed
            with anyio.fail_after(ROUND_S):
                await round_of(cluster, client, lanes[name], 1)
        for number in range(rounds):
            order = random.sample(list(lanes), len(lanes))
            for name in order:
                with anyio.fail_after(ROUND_S):
                    spent[name].append(await round_of(cluster, clients[name], lanes[name], count))
            print(f"round {number + 1}: " + ", ".join(f"{name} {spent[name][-1]:.2f} s" for name in order), flush=True)
    return spent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="rounds (each kills each lane's agent once)")
    parser.add_argument("--sessions", type=int, default=4, help="sessions the killed agent holds")
    args = parser.parse_args()
    if reason := unavailable():
        print(f"bench/agent_handover.py {reason}", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="crh-", dir="/tmp"))  # short: ipc socket paths stay under 107 bytes
    root.chmod(0o711)
    try:
        with ray_cluster_running() as cluster:
            spent = anyio.run(run, cluster, root, args.rounds, args.sessions)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{args.sessions} sessions with state, their agent SIGKILLed: time until they hold that state again")
    for name, samples in spent.items():
        print(
            f"  {name:34s} median {statistics.median(samples):6.2f} s  (min {min(samples):.2f}, max {max(samples):.2f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
