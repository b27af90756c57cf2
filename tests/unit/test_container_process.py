"""An engine sandbox's kill (ContainerProcess): the client first, then the container's removal.

The engine here is two shell commands: a client that "creates its container" (a file) a moment after it
starts, as `podman run` or `container run` makes the container before starting it, and a removal that
looks for that file at once and then takes a while to exit, as an engine's `rm` looks the name up first.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import anyio
import pytest

from coderunner.sandbox.container import ContainerProcess

#: The client makes its container this long after it starts (a removal run first looks before that).
CREATES_AFTER_S = 1.0
#: How long the removal takes after its lookup: the client, if still alive, makes its container meanwhile.
REMOVAL_TAKES_S = 2.0


@pytest.mark.anyio
async def test_a_start_killed_at_once_leaves_no_container(tmp_path: Path) -> None:
    """A start cancelled at once: the client is killed before it could make its container, so nothing is
    made after the removal looked. (Removing first found nothing yet, and the container the still-living
    client made then was left behind: podman containers in state Created, from the `container` stand-in.)"""
    container = tmp_path / "container"
    client = ["sh", "-c", f'sleep {CREATES_AFTER_S}; touch "{container}"; sleep 60']
    removal = ["sh", "-c", f'rm -f "{container}"; sleep {REMOVAL_TAKES_S}']
    async with anyio.create_task_group() as group:
        process = await anyio.open_process(
            client, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True,
        )  # fmt: skip
        sandbox = ContainerProcess(process, group, cleanup=[removal], engine_env=dict(os.environ))
        await sandbox.kill()
    assert process.returncode is not None
    await anyio.sleep(CREATES_AFTER_S + 0.5)  # past the moment a client left alive would have made it
    assert not container.exists(), "the engine's client made its container after the removal looked"
