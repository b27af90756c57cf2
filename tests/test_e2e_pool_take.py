"""A pooled sandbox taken by a create with options of its own, on the real backend (sessions/warm_take.py):
lower limits are really held once taken (an allocation under the default but over the asked memory fails,
the cgroup holds the asked CPU quota), an allowlist session taken warm reaches its own hosts only, and no
pooled sandbox is ever served with another session's allowlist. What a running sandbox cannot be given
starts cold, and every session's status says which way it went and why."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client

from coderunner.sandbox.cgroups import CgroupManager, CgroupsUnavailable
from coderunner.sessions.pool import NONE_READY

from .conftest import ServerDirs, memory_client, run, server_env, text_of
from .netns_servers import BODY, NetnsServers
from .test_e2e_client_tokens import call
from .test_e2e_egress import BLOCKED, DENIED_HOST, fetch
from .test_e2e_pool import POOL_WAIT_S, workspace_holding

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

#: Bound on a warm create: a pooled start under this machine's load (sandboxes get only idle CPU) may take
#: a minute, and each create that found none ready starts one more sandbox cold.
WARM_WAIT_S = POOL_WAIT_S + 60.0
#: Pause before asking again: room for the pool's start.
RETRY_PAUSE_S = 3.0


async def started(client: Client, session_id: str) -> dict[str, Any]:
    status = await call(client, "manage_sessions", action="status", session_id=session_id)
    return status["started"]  # type: ignore[no-any-return]


async def warm_create(client: Client, **options: object) -> str:
    """A create_session with `options` that took a pooled sandbox; one that found none ready is closed and
    asked again (within WARM_WAIT_S), one that started cold for any other reason fails the test."""
    with anyio.move_on_after(WARM_WAIT_S):
        while True:
            session_id = (await call(client, "create_session", **options))["session_id"]
            how = await started(client, session_id)
            if how["sandbox"] == "warm pool":
                return session_id
            assert how["why"].startswith(NONE_READY), how  # the only reason a warm create may start cold
            await client.call_tool("manage_sessions", {"action": "close", "session_id": session_id})
            await anyio.sleep(RETRY_PAUSE_S)
    pytest.fail(f"no create_session with {options} took a pooled sandbox within {WARM_WAIT_S:g}s")


def session_cgroup(dirs: ServerDirs, session_id_marker: str, controller: str) -> Path | None:
    """The cgroup dir (`controller`'s, on v1) of the in-process server's sandbox whose workspace holds
    the marker file; None where this machine gives sandboxes no cgroups."""
    try:
        manager = CgroupManager.detect()
    except CgroupsUnavailable:
        return None
    parent = manager.parents["unified" if manager.version == 2 else controller]
    key = workspace_holding(dirs, session_id_marker).name
    return parent / manager.server_group / key


async def test_a_warm_session_with_less_memory_and_cpu_holds_them(dirs: ServerDirs) -> None:
    async with memory_client(server_env(dirs, CODERUNNER_POOL_SIZE="1")) as client:
        session = await warm_create(client, memory_mb=512, cpus=0.5, timeout_s=30)
        how = await started(client, session)
        assert "memory_mb 512" in how["why"] and "cpus 0.5" in how["why"] and "timeout_s 30" in how["why"], how
        status = await call(client, "manage_sessions", action="status", session_id=session)
        assert status["memory_mb"] == 512 and status["cpus"] == 0.5 and status["timeout_s"] == 30, status
        # 1 GiB: within the default 2048 MiB the pooled sandbox started with, above the 512 asked for.
        result = await run(client, "hog = bytearray(1024**3)", session_id=session)
        assert result.is_error and "MemoryError" in text_of(result), text_of(result)
        assert text_of(await run(client, "open('m-low', 'w').write('x'); 'alive'", session_id=session)).startswith(
            "'alive'"
        )
        memory, cpu = session_cgroup(dirs, "m-low", "memory"), session_cgroup(dirs, "m-low", "cpu")
        if memory is not None and cpu is not None:
            if (memory / "memory.limit_in_bytes").exists():  # v1
                assert int((memory / "memory.limit_in_bytes").read_text()) == 512 * 2**20
                assert (cpu / "cpu.cfs_quota_us").read_text().strip() == "50000"
            else:
                assert int((memory / "memory.max").read_text()) == 512 * 2**20
                assert (cpu / "cpu.max").read_text().split()[0] == "50000"
        # The default session beside it still has the default: the same allocation succeeds there.
        default = await warm_create(client)
        assert not (await run(client, "hog = bytearray(1024**3); del hog", session_id=default)).is_error


async def test_what_a_running_sandbox_cannot_be_given_starts_cold_and_says_why(dirs: ServerDirs) -> None:
    async with memory_client(server_env(dirs, CODERUNNER_POOL_SIZE="1")) as client:
        await warm_create(client)  # the pool works here
        for options, why in (
            ({"memory_mb": 4096}, "memory_mb 4096: above the warm pool's sandboxes (2048)"),
            ({"name": "proj"}, "a named session's workspace is its own from the start"),
        ):
            session = (await call(client, "create_session", **options))["session_id"]
            how = await started(client, session)
            assert how["sandbox"] == "cold start" and why in how["why"], (options, how)
        bigger = (await call(client, "create_session", memory_mb=4096))["session_id"]
        # Really the limit asked for (not the pool's): 3 GiB fits under 4096 MiB.
        assert not (await run(client, "hog = bytearray(3 * 1024**3); del hog", session_id=bigger)).is_error


def allowlist_env(dirs: ServerDirs, servers: NetnsServers) -> dict[str, str]:
    return server_env(
        dirs,
        CODERUNNER_POOL_SIZE="2",
        CODERUNNER_NETWORK="allowlist",
        CODERUNNER_ALLOWED_DOMAINS=json.dumps([servers.public_ip, "localhost"]),
        CODERUNNER_EGRESS_AUDIT_LOG=str(dirs.root / "egress.jsonl"),
    )


async def test_an_allowlist_session_taken_warm_reaches_its_own_hosts_only(
    dirs: ServerDirs, servers: NetnsServers
) -> None:
    async with memory_client(allowlist_env(dirs, servers)) as client:
        session = await warm_create(client, allow=[servers.public_ip])
        assert f"allow ['{servers.public_ip}']" in (await started(client, session))["why"]
        reached = text_of(await run(client, fetch(f"http://{servers.public_ip}/"), session_id=session))
        assert f"200 {BODY}" in reached, reached
        denied = text_of(await run(client, fetch(f"http://{DENIED_HOST}/"), session_id=session))
        assert BLOCKED in denied, denied
        audit = (dirs.root / "egress.jsonl").read_text()
        assert session in audit  # its decisions are its own, under its own id, from the take on


async def test_a_pooled_sandbox_never_serves_another_sessions_allowlist(
    dirs: ServerDirs, servers: NetnsServers
) -> None:
    """The canary (the public test server) is allowed for A only; B and C, taken warm with another
    allowlist (B beside A, C after A closed and the pool refilled), never reach it."""
    canary = f"http://{servers.public_ip}/"
    async with memory_client(allowlist_env(dirs, servers)) as client:
        first = await warm_create(client, allow=[servers.public_ip])
        assert f"200 {BODY}" in text_of(await run(client, fetch(canary), session_id=first))
        beside = await warm_create(client, allow=["localhost"])
        await client.call_tool("manage_sessions", {"action": "close", "session_id": first})
        after = await warm_create(client, allow=["localhost"])
        for session in (beside, after):
            seen = text_of(await run(client, fetch(canary), session_id=session))
            assert BLOCKED in seen and BODY not in seen, seen
            assert "not in this session's allowlist" in seen, seen
