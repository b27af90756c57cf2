"""Jobs under abuse: a detached job that floods output and charts stays bounded on the host.

A job outlives the call that started it, so its output is read in pieces by manage_jobs (wait): each piece
must be bounded like a reply (the whole goes to the spill file), the server must keep serving, and
a bystander session must be unharmed. The canary is the arena's own bystander session.
"""

from __future__ import annotations

import json

import pytest

from ..conftest import run, text_of
from .conftest import Arena
from .test_abuse import assert_still_serving

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

#: 256 MiB of text and 300 charts, from a job the caller left running.
FLOOD = """
import base64, sys
png = base64.b64decode(
    'iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=='
)
from IPython.display import Image, display
for _ in range(300):
    display(Image(png))
chunk = 'J' * (1 << 20)
for _ in range(256):
    sys.stdout.write(chunk)
print('flood over')
"""


async def test_a_flooding_job_is_read_in_bounded_pieces(arena: Arena) -> None:
    created = await arena.client.call_tool("create_session", {})
    session_id = json.loads(text_of(created))["session_id"]
    started = await run(arena.client, FLOOD, session_id=session_id, timeout_s=600, detach_after_s=0)
    job_id = (started.meta or {})["coderunner/job"]["job_id"]
    reads = []
    for _ in range(60):
        reply = await arena.client.call_tool("manage_jobs", {"action": "wait", "job_id": job_id, "timeout_s": 10})
        text = text_of(reply)
        assert len(text) < 30_000, "a read must be bounded like a reply"
        assert len([block for block in reply.content if block.type == "image"]) <= 20
        reads.append(text)
        if (reply.meta or {})["coderunner/job"]["status"] != "running":
            break
    assert (reply.meta or {})["coderunner/job"]["status"] == "done", text_of(reply)
    seen = "\n".join(reads)
    assert "flood over" in seen and "characters not shown here; full output: /workspace/.coderunner/output-" in seen
    assert "more images were neither shown nor saved" in seen
    await arena.client.call_tool("manage_sessions", {"action": "close", "session_id": session_id})
    await assert_still_serving(arena)
