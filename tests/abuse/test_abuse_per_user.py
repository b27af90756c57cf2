"""Per-user kernel limits belong to one sandbox: a root server gives each its own host uid.

The kernel counts inotify instances (fs.inotify.max_user_instances, 128 here) and more per host
uid. When every sandbox ran as one uid, one session holding 128 instances left every other
session and one-shot run with EMFILE. Now the hog exhausts only its own count.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ..conftest import json_of, run, text_of
from .conftest import Arena
from .test_abuse import assert_still_serving

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

HOG = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
held = []
while len(held) < 4096:
    fd = libc.inotify_init1(0)
    if fd < 0:
        break
    held.append(fd)
print(len(held), os.strerror(ctypes.get_errno()))
"""

PROBE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init1(0)
print('inotify', 'ok' if fd >= 0 else os.strerror(ctypes.get_errno()))
"""


@pytest.mark.skipif(os.getuid() != 0, reason="per-sandbox uids exist only where the server is root")
async def test_one_sessions_inotify_hog_leaves_others_theirs(arena: Arena) -> None:
    created = await arena.client.call_tool("create_session", {})
    hog = json.loads(text_of(created))["session_id"]
    try:
        held = await run(arena.client, HOG, session_id=hog)
        count = int(text_of(held).split()[0])
        limit = int(Path("/proc/sys/fs/inotify/max_user_instances").read_text())
        assert count >= limit - 2, f"the hog should reach its own limit ({limit}): {text_of(held)}"
        # While the hog holds every instance its uid may have: a bystander session and a one-shot run.
        probe = await run(arena.client, PROBE, session_id=arena.bystander)
        assert "inotify ok" in text_of(probe), text_of(probe)
        oneshot = await arena.client.call_tool("execute_code", {"language": "python", "code": PROBE})
        assert "inotify ok" in json_of(oneshot)["stdout"], json_of(oneshot)
    finally:
        await arena.client.call_tool("manage_sessions", {"action": "close", "session_id": hog})
    await assert_still_serving(arena)
