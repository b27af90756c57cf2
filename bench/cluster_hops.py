"""Where a cluster session's warm run and pooled create spend their time, hop by hop (issue 40).

    sudo .venv/bin/python bench/cluster_hops.py [--rounds 60] [--creates 10]

A Ray driver in the test cluster's namespace (tests/cluster/conftest.py: a head and two workers) drives a
ClusterHost and a local SessionManager side by side, interleaved, both with a warm pool of 2. Inside the
session's node agent, its steps are stamped (a `__ray_call__` wraps SessionSide.start_run, the manager's
create and the open's status with clock readings; CLOCK_MONOTONIC is one clock for every process of a
machine), so a warm run splits into: the front door to the agent's start_run, the agent's own part (its
kernel's run), and the answer back to a built job. A pooled create splits into the front door's node
table, its placement and the open. A round's first cluster create is placed by the agents' answers of a few
seconds before (agents.USABLE_LOAD_S: asked again behind it); each round then makes a second one with those
answers dropped ("agents asked first": two agents asked at once, as a front door pays after 10 s without a
placement). Beside them: a bare actor call (`ping`), and a session's smallest call (`generation`) by the
session channel its calls take (cluster/session_channel.py; Ray when the channel is not there).

No timing assertions: figures only (medians; the cluster is torn down at the end, also after a failure).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.cluster.conftest import ray_cluster_running, unavailable  # noqa: E402 - needs the repo root on sys.path

DRIVER = r'''
import json, statistics, sys, time
import anyio, ray
from coderunner.cluster.host import ClusterHost
from coderunner.config import load_settings
from coderunner.sandbox import make_backend
from coderunner.sessions.manager import SessionManager

ROUNDS, CREATES = int(sys.argv[2]), int(sys.argv[3])
now = time.monotonic


def stamp_steps(agent):
    """On the agent: wrap the steps of a run and of an open with clock readings (kept in `agent._stamps`)."""
    import functools
    from coderunner.cluster.session_side import SessionSide
    from coderunner.sessions.manager import SessionManager
    stamps = agent._stamps = []

    def wrap(owner, name):
        original = getattr(owner, name)

        @functools.wraps(original)
        async def stamped(*args, **kwargs):
            began = time.monotonic()
            answer = await original(*args, **kwargs)
            stamps.append((name, began, time.monotonic()))
            return answer

        setattr(owner, name, stamped)

    wrap(SessionSide, "start_run")
    wrap(SessionSide, "status")
    wrap(SessionManager, "create")


def take_stamps(agent):
    taken, agent._stamps[:] = list(agent._stamps), []
    return taken


def ms(samples):
    return round(statistics.median(samples) * 1000, 2) if samples else None


async def run_once(session):
    update = await session.start_run("1+1", None, None, 1.0)
    while update.running:
        update = await session.wait_job(update.job_id, 1.0)


async def warm(cluster, local, agent):
    rows = {"cluster": [], "local": [], "to agent": [], "agent": [], "back": [], "ping": [], "generation": []}
    for session in (cluster, local):
        for _ in range(10):
            await run_once(session)
    await agent.__ray_call__.remote(take_stamps)
    for index in range(ROUNDS):
        for lane in ("cluster", "local") if index % 2 else ("local", "cluster"):
            session = cluster if lane == "cluster" else local
            began = now()
            await run_once(session)
            rows[lane].append(now() - began)
            if lane == "cluster":
                (_, entered, left), = [s for s in await agent.__ray_call__.remote(take_stamps) if s[0] == "start_run"]
                rows["to agent"].append(entered - began)
                rows["agent"].append(left - entered)
                rows["back"].append(began + rows[lane][-1] - left)
        began = now()
        await agent.ping.remote()
        rows["ping"].append(now() - began)
        began = now()
        await cluster.acall("generation")
        rows["generation"].append(now() - began)
    figures = {name: ms(samples) for name, samples in rows.items()}
    figures["cluster - local, paired"] = ms([c - l for c, l in zip(rows["cluster"], rows["local"])])
    return figures


def timed(owner, name, samples):
    """Wrap `owner.name` (a coroutine method of an object in this driver) to add its durations to `samples`."""
    original = getattr(owner, name)

    async def wrapper(*args, **kwargs):
        began = now()
        try:
            return await original(*args, **kwargs)
        finally:
            samples.append(now() - began)

    setattr(owner, name, wrapper)


async def creates(host, local, agents):
    rows = {"cluster": [], "local": [], "node table": [], "placement": [], "open": [], "agent: take": [],
            "agent: status": []}
    timed(host._nodes, "current", rows["node table"])
    timed(host._agents, "place", rows["placement"])
    timed(host, "_open", rows["open"])
    steps = ("node table", "placement", "open")
    asked = "agents asked first"
    for step in ("cluster", *steps):
        rows[f"{step}, {asked}"] = []
    for index in range(CREATES):
        await anyio.sleep(2.5)  # the pools refill; the agents' answers are aging (over KNOWN_LOAD_S)
        for lane in ("cluster", "local") if index % 2 else ("local", "cluster"):
            began = now()
            session = await (host.create(host.options()) if lane == "cluster" else local.create(local.options()))
            rows[lane].append(now() - began)
            await (host if lane == "cluster" else local).close(session.session_id)
        await anyio.sleep(2.5)
        # A second cluster create with no answer kept: its placement asks two agents first.
        counted = {step: len(rows[step]) for step in steps}
        host._agents._known.clear()
        began = now()
        session = await host.create(host.options())
        rows[f"cluster, {asked}"].append(now() - began)
        await host.close(session.session_id)
        for step in steps:
            rows[f"{step}, {asked}"] += rows[step][counted[step]:]
            del rows[step][counted[step]:]
    for agent in agents:
        for name, began, left in await agent.__ray_call__.remote(take_stamps):
            if name in ("create", "status"):
                rows["agent: take" if name == "create" else "agent: status"].append(left - began)
    return {name: ms(samples) for name, samples in rows.items()}


async def main():
    async with ClusterHost(load_settings(ray_address=sys.argv[1])) as host:
        settings = load_settings()
        async with SessionManager(settings, make_backend(settings)) as local:
            await anyio.sleep(8)  # the pools fill
            cluster_session = await host.create(host.options())
            local_session = await local.create(local.options())
            agents = [ray.get_actor(a["name"], namespace="coderunner") for a in ray.util.list_named_actors(True)
                      if a["namespace"] == "coderunner" and a["name"].startswith("agent-")]
            for agent in agents:
                await agent.__ray_call__.remote(stamp_steps)
            found = {"warm": await warm(cluster_session, local_session, cluster_session.agent)}
            await host.close(cluster_session.session_id)
            await local.close(local_session.session_id)
            found["create"] = await creates(host, local, agents)
    print(json.dumps(found))


anyio.run(main)
'''


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=60, help="warm rounds (one run per lane each)")
    parser.add_argument("--creates", type=int, default=10, help="pooled create rounds (one per lane each)")
    args = parser.parse_args()
    if reason := unavailable():
        print(f"bench/cluster_hops.py {reason}", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="crh-", dir="/tmp"))  # short: ipc socket paths stay under 107 bytes
    root.chmod(0o711)
    try:
        with ray_cluster_running() as cluster:
            env = {
                "PATH": cluster.env["PATH"], "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8",
                "CODERUNNER_CONFIG": os.devnull, "CODERUNNER_RUNTIME_DIR": str(root / "r"),
                "CODERUNNER_WORKSPACES_DIR": str(root / "w"), "CODERUNNER_TOKEN_FILE": str(root / "token"),
                "CODERUNNER_BACKEND": "bwrap", "CODERUNNER_POOL_SIZE": "2", "CODERUNNER_EXPORT_DIR": "",
                "CODERUNNER_LOG_LEVEL": "WARNING", "RAY_USAGE_STATS_ENABLED": "0",
                "PYTHONPATH": str(REPO / "src"), **cluster.auth_env,
            }  # fmt: skip
            argv = [*cluster.exec_prefix, cluster.python, "-c", DRIVER, cluster.address, str(args.rounds),
                    str(args.creates)]  # fmt: skip
            done = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                print(done.stderr[-3000:], file=sys.stderr)
                return 1
            found = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"warm run_python('1+1'), {args.rounds} rounds, interleaved with a local session (ms, medians):")
    for name, value in found["warm"].items():
        print(f"  {name:40s} {value}")
    print(f"pooled create, {args.creates} rounds, interleaved with a local one (ms, medians; first run not counted):")
    for name, value in found["create"].items():
        print(f"  {name:40s} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
