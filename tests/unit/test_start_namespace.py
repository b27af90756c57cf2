"""The start namespace's pieces that need no mount (sandbox/start_namespace.py): what a start's argv reads from its
clones, when its clones are let go, and what doctor says. The namespace itself, and what a sandbox gets from it,
are tests/abuse/test_abuse_start_namespace.py's, through a real server."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from coderunner.config import Settings
from coderunner.sandbox import bwrap_doctor, start_namespace
from coderunner.sandbox.base import SandboxSpec
from coderunner.sandbox.start_namespace import Staged, _built, _Releases
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
    assert _built(None), "bwrap made no child: nothing to wait for"
    with subprocess.Popen(["sleep", "30"]) as other:
        try:
            assert _built(other.pid), "a pid 1 that exec'd its init"
        finally:
            other.kill()
    assert _built(other.pid), "a pid 1 that is gone"


class _Namespace:
    """What _Releases calls: release, recorded."""

    def __init__(self) -> None:
        self.released: list[Staged] = []

    def release(self, staged: Staged) -> None:
        self.released.append(staged)


def test_clones_are_let_go_once_built_and_never_before(monkeypatch: pytest.MonkeyPatch) -> None:
    building = {101}
    monkeypatch.setattr(start_namespace, "_built", lambda child: child not in building)
    namespace = _Namespace()
    releases = _Releases(namespace)  # type: ignore[arg-type]
    first, second = Staged(Path("/a"), {}), Staged(Path("/b"), {})
    releases.add(first, 101)
    releases.add(second, None)
    deadline = time.monotonic() + 5
    while namespace.released != [second] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert namespace.released == [second], "a start with no child is let go at once, one still building is not"
    time.sleep(0.3)  # several looks, backing off
    assert namespace.released == [second] and not releases.idle()
    building.clear()
    deadline = time.monotonic() + 5
    while not releases.idle() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert namespace.released == [second, first] and releases.idle()


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
