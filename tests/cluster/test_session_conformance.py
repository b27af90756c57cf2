"""One session contract (session_contract.py), two hosts: the local SessionManager and a cluster front door.

Each case runs over the local SessionManager in this process (real bwrap sandboxes and kernels) and over
ClusterHost in a Ray driver inside the test cluster's namespace (its sessions in the workers' node agents),
with the same settings: create, a run that keeps state, reset, a job's progress read as it comes, cancel,
an egress decision put to the call's asker, files in and out, and a close that leaves nothing. The
cluster's cases run in one driver for the module (a Ray driver's start costs seconds); each test reports
its own case's outcome from it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coderunner.sandbox import make_backend
from coderunner.sessions import SessionManager

from ..conftest import ServerDirs, sandbox_processes_alive, server_env, server_settings
from .conftest import REPO, RayCluster
from .session_contract import CASES, ENV, RAY_DRIVER
from .test_cluster_mode import cluster_env, named_actors

#: Bound on the cluster's driver running every case.
DRIVER_S = 900


@pytest.fixture(scope="module")
def ray_outcomes(ray_cluster: RayCluster) -> Iterator[dict[str, Any]]:
    """Every case over ClusterHost, run once for the module: each case's traceback, None when it passed."""
    root = Path(tempfile.mkdtemp(prefix="crt-", dir="/tmp"))
    root.chmod(0o711)  # a root server's sandbox user passes through (conftest's dirs fixture does the same)
    dirs = ServerDirs(root=root, runtime=root / "r", workspaces=root / "w")
    try:
        env = cluster_env(ray_cluster, dirs, **ENV)
        env["PYTHONPATH"] = f"{env['PYTHONPATH']}:{REPO}"  # the driver imports the contract from tests/
        argv = [*ray_cluster.exec_prefix, ray_cluster.python, "-c", RAY_DRIVER, ray_cluster.address, *CASES]
        done = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=DRIVER_S)
        assert done.returncode == 0, done.stderr[-4000:]
        outcomes: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        outcomes["_left"] = named_actors(ray_cluster)  # what the cluster holds after the driver closed all
        yield outcomes
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.anyio
@pytest.mark.parametrize("case", list(CASES))
async def test_on_the_local_host(case: str, dirs: ServerDirs) -> None:
    settings = server_settings(server_env(dirs, **ENV))
    async with SessionManager(settings, make_backend(settings)) as manager:
        await CASES[case](manager)
        assert manager.list() == [], manager.list()
    assert sandbox_processes_alive(dirs) == []  # no sandbox, kernel or child of theirs left


@pytest.mark.parametrize("case", list(CASES))
def test_on_the_ray_host(case: str, ray_outcomes: dict[str, Any]) -> None:
    failure = ray_outcomes[case]
    assert failure is None, f"{case} over ClusterHost:\n{failure}"
    assert ray_outcomes["_left"] == [], ray_outcomes["_left"]
