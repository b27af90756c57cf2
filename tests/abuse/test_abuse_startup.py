"""Abuse case: modules planted in the workspace must not run before the user's code asks for them.

Sandboxed code writes, at the top of /workspace and in the session's package folder, modules
named like ipykernel's launcher, the standard library and the guest tools' libraries; each one,
if imported, appends its name to a marker file. Every interpreter the product then starts in
that workspace (the kernel after a reset, on reopening the workspace, in a restored
snapshot; a guest tool; a one-shot run) must come up without importing one, the start-up report
must name them, user code must still import its own workspace modules, the server must still
serve, and the bystander keeps its state.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from ..conftest import run, text_of
from .conftest import Arena
from .test_abuse import assert_still_serving

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

MARKER = "/workspace/PLANTED_RAN"
#: Where each planted module goes: at the top of /workspace (the kernel's cwd) or in the package folder.
PLANTED = (
    "ipykernel_launcher.py",
    "json.py",
    "runpy.py",
    "encodings/__init__.py",
    "PIL.py",
    "cloudpickle/__init__.py",
    "coderunner_guest/__init__.py",
    ".coderunner/site-packages/ipykernel_launcher.py",
    ".coderunner/site-packages/zmq.py",
    ".coderunner/site-packages/encodings/__init__.py",
)
PLANT = f"""
import os
from PIL import Image
Image.new('RGB', (8, 8), 'red').save('/workspace/pic.png')
open('/workspace/mine.py', 'w').write('OWN = 42\\n')
for path in {PLANTED!r}:
    os.makedirs(os.path.dirname('/workspace/' + path) or '/workspace', exist_ok=True)
    open('/workspace/' + path, 'w').write("open({MARKER!r}, 'a').write(__name__ + ' ')\\n")
kept = 'state'
"""
#: What the user's own code sees: its own module imports, nothing planted ran.
PROBE = f"import os, mine\nprint('ran:', open({MARKER!r}).read() if os.path.exists({MARKER!r}) else None, mine.OWN)"
CLEAN = "ran: None 42"


async def call(arena: Arena, tool: str, **arguments: Any) -> dict[str, Any]:
    result = await arena.client.call_tool(tool, arguments)
    assert not result.is_error, (tool, text_of(result))
    return json.loads(text_of(result))


async def probe(arena: Arena, session: str) -> str:
    return text_of(await run(arena.client, PROBE, session_id=session)).splitlines()[0]


async def guest_tool_is_clean(arena: Arena, session: str) -> None:
    """image_ops imports PIL in the kernel: never the workspace's PIL.py."""
    result = await arena.client.call_tool("image_ops", {"input_path": "pic.png", "op": "info", "session_id": session})
    assert not result.is_error and "8" in text_of(result), text_of(result)


async def test_planted_modules_do_not_run_before_user_code(arena: Arena) -> None:
    """boundary: start-up. A kernel, a guest tool and a one-shot never import a planted module by themselves."""
    first = (await call(arena, "create_session", name="planted", persistent=True))["session_id"]
    planted = await run(arena.client, PLANT, session_id=first)
    assert not planted.is_error, text_of(planted)

    reset = await arena.client.call_tool("kernel_reset", {"session_id": first})
    assert not reset.is_error, text_of(reset)
    await guest_tool_is_clean(arena, first)
    assert await probe(arena, first) == CLEAN
    await call(arena, "manage_sessions", action="close", session_id=first)

    reopened = await call(arena, "create_session", name="planted", persistent=True)
    shadowing = (reopened.get("startup_files") or {}).get("shadowing", [])
    for name in ("ipykernel_launcher.py", "json.py", "runpy.py", "encodings/", "PIL.py", "cloudpickle/"):
        assert name in shadowing, reopened
    again = reopened["session_id"]
    await guest_tool_is_clean(arena, again)
    assert await probe(arena, again) == CLEAN

    await run(arena.client, "kept = 'state'", session_id=again)
    taken = await call(arena, "manage_snapshots", action="save", session_id=again)
    restored = (await call(arena, "manage_snapshots", action="restore", snapshot=taken["snapshot"]))["session_id"]
    assert await probe(arena, restored) == CLEAN
    looked = await run(arena.client, "print(kept)", session_id=restored)
    assert text_of(looked).splitlines()[0] == "state", text_of(looked)
    for session in (again, restored):
        await call(arena, "manage_sessions", action="close", session_id=session)
    await call(arena, "manage_workspaces", action="delete", name="planted")
    await assert_still_serving(arena)


async def test_a_one_shot_launcher_imports_nothing_from_its_working_directory(arena: Arena) -> None:
    """boundary: start-up. The launcher (json for the variables) runs with -P; the program still imports its own."""
    code = (
        "import json, os, sys\n"
        "open('mod_here.py', 'w').write('X = 7\\n')\n"
        "import mod_here\n"
        "print(sys.flags.safe_path, json.__file__.startswith('/usr/'), mod_here.X, os.getcwd(), n)"
    )
    ran = await call(arena, "execute_code", language="python", code=code, variables='{"n": 3}')
    assert ran["exit_code"] == 0 and ran["stdout"].split() == ["True", "True", "7", "/workspace", "3"], ran
    await assert_still_serving(arena)
