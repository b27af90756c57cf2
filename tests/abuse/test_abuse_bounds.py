"""Abuse cases for the server's bounds: a hostile guest-tool answer, and a session that spins forever.

Same arena as test_abuse.py (one stdio server, a bystander session made before any attack).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from coderunner.sandbox.cgroups import CgroupManager, CgroupsUnavailable

from ..conftest import images_of, run, sandbox_processes_alive, text_of
from .conftest import Arena
from .test_abuse import assert_still_serving

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]


@pytest.fixture
def canary_dir() -> Iterator[Path]:
    """A host folder anyone may write: a host that followed a planted link would leave files here."""
    path = Path(tempfile.mkdtemp(prefix="crc-", dir="/tmp"))
    path.chmod(0o777)
    (path / "canary.txt").write_text("untouched")
    yield path
    for entry in path.iterdir():
        entry.unlink()
    path.rmdir()


def flood_answer(canary: Path) -> str:
    """Swap a guest op for one answering far over every bound, and point the spill folder at the canary."""
    return f"""
import base64, io, os, shutil
import coderunner_guest.image as guest
from PIL import Image
buffer = io.BytesIO(); Image.new('RGB', (4, 4), 'red').save(buffer, 'PNG')
tiny = base64.b64encode(buffer.getvalue()).decode()
big = base64.b64encode(os.urandom(400_000)).decode()
guest.run = lambda **_: {{"previews": [big, big] + [tiny] * 20000, "text": "A" * 3_000_000}}
Image.new('RGB', (8, 8)).save('x.png')
shutil.rmtree('.coderunner', ignore_errors=True)
os.symlink({str(canary)!r}, '.coderunner')
'armed'
"""


async def test_a_guest_answer_over_every_bound_is_cut_and_its_spill_never_follows_a_link(
    arena: Arena, canary_dir: Path
) -> None:
    """boundary: output. A guest tool answers 20,002 previews and 3 MB of text into a planted spill link."""
    created = await arena.client.call_tool("create_session", {})
    session_id = json.loads(text_of(created))["session_id"]
    try:
        assert "armed" in text_of(await run(arena.client, flood_answer(canary_dir), session_id=session_id))
        result = await arena.client.call_tool(
            "image_ops", {"input_path": "x.png", "op": "info", "session_id": session_id}
        )
        text = text_of(result)
        assert len(text) < 30_000 and "characters omitted" in text, text[:500]
        assert "not saved" in text and "previews not shown" in text, text[-800:]
        images = images_of(result)
        assert len(images) <= 20 and sum(len(image) for image in images) <= 600_000
        assert sorted(path.name for path in canary_dir.iterdir()) == ["canary.txt"]
        assert (canary_dir / "canary.txt").read_text() == "untouched"
    finally:
        await arena.client.call_tool("manage_sessions", {"action": "close", "session_id": session_id})
    await assert_still_serving(arena)


SPIN_IN_BACKGROUND = """
import threading, subprocess, sys
def burn():
    while True:
        pass
for _ in range(2):
    threading.Thread(target=burn, daemon=True).start()
spinners = [subprocess.Popen([sys.executable, '-c', 'while True: pass']) for _ in range(3)]
'spinning after return'
"""


async def test_a_session_that_spins_after_its_call_returned_leaves_the_server_served(arena: Arena) -> None:
    """boundary: CPU. Threads and processes keep spinning after the call; the server and bystander stay served."""
    created = await arena.client.call_tool("create_session", {})
    session_id = json.loads(text_of(created))["session_id"]
    try:
        spun = await run(arena.client, SPIN_IN_BACKGROUND, session_id=session_id)
        assert "spinning after return" in text_of(spun), text_of(spun)
        try:
            CgroupManager.detect()
        except CgroupsUnavailable:
            pass  # no weight to check; serving is checked below all the same
        else:
            # Every sandbox (and so whatever it forks) sits in its own group below its server's low-weight parent.
            groups = {_cpu_group(pid) for pid in sandbox_processes_alive(arena.dirs)} - {None}
            assert groups and all(group.split("/")[-2].startswith("coderunner-server-") for group in groups), groups
        for _ in range(5):
            await assert_still_serving(arena)
    finally:
        await arena.client.call_tool("manage_sessions", {"action": "close", "session_id": session_id})


def _cpu_group(pid: int) -> str | None:
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return path
    return next((line.split(":", 2)[2] for line in lines if line.startswith("0::")), None)
