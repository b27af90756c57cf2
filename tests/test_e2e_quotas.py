"""Per-client quotas: one HTTP client cannot take every session or every one-shot slot from another."""

from __future__ import annotations

import json

import anyio
import pytest

from .conftest import ServerDirs, connect_http, http_server, run, server_env, text_of

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]


def quota_env(dirs: ServerDirs) -> dict[str, str]:
    return server_env(
        dirs,
        CODERUNNER_MAX_SESSIONS="4",
        CODERUNNER_MAX_SESSIONS_PER_CLIENT="2",
        CODERUNNER_MAX_ONESHOT_RUNS="2",
        CODERUNNER_MAX_ONESHOT_RUNS_PER_CLIENT="1",
    )


async def test_one_client_cannot_take_every_session(dirs: ServerDirs) -> None:
    with http_server(quota_env(dirs)) as url:
        async with (
            connect_http(url, headers={"X-CodeRunner-Client": "greedy"}) as greedy,
            connect_http(url, headers={"X-CodeRunner-Client": "bystander"}) as bystander,
        ):
            for _ in range(2):
                made = await greedy.call_tool("create_session", {})
                assert not made.is_error, text_of(made)
            refused = await greedy.call_tool("create_session", {})
            assert refused.is_error and "max_sessions_per_client" in text_of(refused), text_of(refused)
            # Its default session would be a third: refused the same way, plainly.
            assert (await run(greedy, "1")).is_error
            # The other client still gets sessions of its own.
            assert text_of(await run(bystander, "6 * 7")).splitlines()[0] == "42"
            own = await bystander.call_tool("create_session", {})
            assert not own.is_error, text_of(own)
            # Closing one gives the greedy client its share back.
            first = json.loads(text_of(await greedy.call_tool("manage_sessions", {"action": "list"})))["sessions"][0][
                "session_id"
            ]
            assert not (await greedy.call_tool("manage_sessions", {"action": "close", "session_id": first})).is_error
            assert text_of(await run(greedy, "2 + 2")).splitlines()[0] == "4"


async def test_one_client_cannot_hold_every_one_shot_slot(dirs: ServerDirs) -> None:
    """The greedy client's two long runs get one slot (its share); the other's check is not queued behind them."""
    finished: list[str] = []
    with http_server(quota_env(dirs)) as url:
        async with (
            connect_http(url, headers={"X-CodeRunner-Client": "greedy"}) as greedy,
            connect_http(url, headers={"X-CodeRunner-Client": "bystander"}) as bystander,
        ):

            async def long_run() -> None:
                await greedy.call_tool("execute_code", {"language": "bash", "code": "sleep 25", "timeout_s": 60})
                finished.append("greedy")

            async with anyio.create_task_group() as tg:
                tg.start_soon(long_run)
                tg.start_soon(long_run)
                await anyio.sleep(1.5)  # both greedy runs have asked for a slot
                checked = await bystander.call_tool(
                    "execute_code", {"check_only": True, "language": "python", "code": "x = ("}
                )
                assert not checked.is_error and json.loads(text_of(checked))["valid"] is False, text_of(checked)
                finished.append("bystander")
                tg.cancel_scope.cancel()  # the greedy runs have made their point
            # Before per-client shares, the check waited for a greedy run to end (25 s).
            assert finished == ["bystander"], finished
            # The server still runs one-shots for both once the greedy runs are gone.
            done = await greedy.call_tool("execute_code", {"language": "bash", "code": "echo ok"})
            assert json.loads(text_of(done))["stdout"].strip() == "ok", text_of(done)
