"""Client folders that differ only in case: the server's token with `X-CodeRunner-Client: T.alice`
must not get a folder that is token alice's `t.alice` on a case-insensitive file system (macOS).

The test runs on Linux, where `T.alice` and `t.alice` are two folders anyway, so besides checking
that neither canary lands in or overwrites the other's folder it checks what a case-insensitive,
normalising file system would see: the folder names differ after NFKC and casefold.
"""

from __future__ import annotations

import json
import subprocess
import sys
import unicodedata
from typing import Any

import pytest
from mcp import Client

from ..conftest import REPO, ServerDirs, connect_http, http_server, run, server_env, text_of

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

BYSTANDER_VALUE = "alice-bystander-91c3"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def add_token(env: dict[str, str], name: str) -> str:
    done = subprocess.run([sys.executable, "-m", "coderunner.cli", "token", "add", name], env=env, cwd=str(REPO),
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


async def call(client: Client, tool: str, **arguments: Any) -> dict[str, Any]:
    result = await client.call_tool(tool, arguments)
    assert not result.is_error, text_of(result)
    return json.loads(text_of(result))


def folded(name: str) -> str:
    return unicodedata.normalize("NFKC", name).casefold()


async def export_canary(client: Client, name: str, canary: str) -> None:
    """One shared file name for every client: the one that wins a shared folder overwrites the other."""
    code = f"open('/mnt/outputs/{name}', 'w').write({canary!r})"
    assert not (await run(client, code)).is_error


async def test_identities_differing_only_in_case_never_share_an_export_folder(dirs: ServerDirs) -> None:
    out = dirs.root / "exports"
    env = server_env(dirs, CODERUNNER_EXPORT_DIR=str(out))
    alice_token = add_token(env, "alice")
    canaries = {"alice": "canary-of-token-alice-5e1d", "T.alice": "canary-of-T.alice-0b7a",
                "Alice": "canary-of-Alice-77c2", "alice-header": "canary-of-header-alice-3f90"}  # fmt: skip
    with http_server(env) as url:
        async with (
            connect_http(url, token=alice_token) as alice,
            connect_http(url, headers={"X-CodeRunner-Client": "T.alice"}) as mimic,
            connect_http(url, headers={"X-CodeRunner-Client": "Alice"}) as upper,
            connect_http(url, headers={"X-CodeRunner-Client": "alice"}) as lower,
        ):
            bystander = (await call(alice, "create_session"))["session_id"]
            assert not (await run(alice, f"guarded = {BYSTANDER_VALUE!r}", session_id=bystander)).is_error
            for client, who in ((alice, "alice"), (mimic, "T.alice"), (upper, "Alice"), (lower, "alice-header")):
                await export_canary(client, "canary.txt", canaries[who])
            # The server still serves, and alice's bystander session kept its state.
            assert BYSTANDER_VALUE in text_of(await run(alice, "guarded", session_id=bystander))
            assert text_of(await run(mimic, "1 + 1")).splitlines()[0] == "2"
    folders = sorted(path.name for path in out.iterdir())
    assert len(folders) == 4, folders
    assert len({folded(name) for name in folders}) == 4, f"folders collide on a case-insensitive disk: {folders}"
    assert "t.alice" in folders and "alice" in folders  # canonical names keep the folders they had
    found = sorted((out / name / "canary.txt").read_text() for name in folders)
    assert found == sorted(canaries.values())  # each canary in a folder of its own, none overwritten
    assert (out / "t.alice" / "canary.txt").read_text() == canaries["alice"]
    assert (out / "alice" / "canary.txt").read_text() == canaries["alice-header"]
