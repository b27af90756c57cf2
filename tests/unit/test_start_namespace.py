"""The start namespace's pieces that need no mount (sandbox/start_namespace.py): what a start's argv reads from
its clones, when a build is over (build_slots.py), and what doctor says. The namespace itself, and what a sandbox
gets from it, are tests/abuse/test_abuse_start_namespace.py's, through a real server."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import anyio
import pytest

from coderunner.config import Settings
from coderunner.sandbox import build_slots, bwrap_doctor
from coderunner.sandbox.base import SandboxSpec
from coderunner.sandbox.build_slots import is_built
from coderunner.sandbox.start_namespace import Staged
from coderunner.vocabulary.mounts import Mount


def test_a_start_reads_its_workspace_and_mounts_from_their_clones_and_keeps_every_path_inside() -> None:
    spec = SandboxSpec(
        name="s", workspace=Path("/w/key"), runtime_dir=Path("/r/key/run"), host_dir=Path("/r/key/host"),
        mounts=(
            Mount(Path("/r/key/host/mnt/0"), "/data", False),
            Mount(Path("/r/key/host/mnt/outputs"), "/mnt/outputs", True),
        ),
    )  # fmt: skip
    staged = Staged(Path("/r/.live-x/key-t"), {
        Path("/w/key"): Path("/r/.live-x/key-t/0"), Path("/r/key/host/mnt/0"): Path("/r/.live-x/key-t/1"),
        Path("/r/key/host/mnt/outputs"): Path("/r/.live-x/key-t/2"),
    })  # fmt: skip
    moved = staged.spec(spec)
    assert moved.workspace == Path("/r/.live-x/key-t/0")
    assert [(mount.host, mount.sandbox, mount.writable) for mount in moved.mounts] == [
        (Path("/r/.live-x/key-t/1"), "/data", False), (Path("/r/.live-x/key-t/2"), "/mnt/outputs", True),
    ]  # fmt: skip
    # What is no mount of the host's is bound as it was: its run and host dirs, at the same path inside.
    assert (moved.runtime_dir, moved.host_dir, moved.name) == (spec.runtime_dir, spec.host_dir, spec.name)


def test_a_start_is_built_once_its_pid_1_runs_anything_but_bwrap_or_is_gone() -> None:
    assert is_built(None), "bwrap made no child: nothing to wait for"
    with subprocess.Popen(["sleep", "30"]) as other:
        try:
            assert is_built(other.pid), "a pid 1 that exec'd its init"
        finally:
            other.kill()
    assert is_built(other.pid), "a pid 1 that is gone"


@pytest.mark.anyio
async def test_a_build_is_waited_for_until_built_and_no_longer(monkeypatch: pytest.MonkeyPatch) -> None:
    building = {101}
    looks: list[int | None] = []

    def built(child: int | None) -> bool:
        looks.append(child)
        return child not in building

    monkeypatch.setattr(build_slots, "is_built", built)
    assert await build_slots.wait_built(None) and len(looks) == 1, "a start with no child is over at once"
    looks.clear()
    finished: list[bool] = []
    async with anyio.create_task_group() as group:

        async def wait() -> None:
            finished.append(await build_slots.wait_built(101))

        group.start_soon(wait)
        await anyio.sleep(0.2)
        assert not finished, "a start still building is waited for"
        # Backing off: at a fixed first pause it would have looked about 100 times by now (load only lowers it).
        assert 2 <= len(looks) < 40, f"it looks again, less and less often: {len(looks)} looks"
        building.clear()
    assert finished == [True]
    monkeypatch.setattr(build_slots, "BUILT_WAIT_S", 0.05)
    building.add(102)
    assert not await build_slots.wait_built(102), "a build that never ends is let go of, bounded"


def test_doctor_says_where_bwrap_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    def said(**changes: Any) -> str:
        return bwrap_doctor.check_start_namespace(Settings(**changes)).detail

    monkeypatch.setattr(bwrap_doctor.os, "getuid", lambda: 1000)
    assert said().startswith("not needed")
    monkeypatch.setattr(bwrap_doctor.os, "getuid", lambda: 0)
    monkeypatch.setattr(bwrap_doctor.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert said().startswith("on:")
    assert said(start_namespace=False).startswith("off (start_namespace false)")
    monkeypatch.setattr(bwrap_doctor.shutil, "which", lambda name: None)
    assert said().startswith("nsenter is missing")
