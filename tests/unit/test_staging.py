"""Staging mounts on their own (root only: attaching a mount needs CAP_SYS_ADMIN on the host)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from coderunner.hostfs import staging

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="only a root server stages mounts")

OWNER = (1234, 1234)
SANDBOX = (4321, 4321)


def _points(under: Path) -> list[str]:
    with open("/proc/self/mountinfo") as handle:
        return [line.split()[4] for line in handle if line.split()[4].startswith(str(under) + "/")]


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """Passable (0711), unlike pytest's own: the sandbox's host user must reach the staged point."""
    base = Path(tempfile.mkdtemp(prefix="crs-stage-", dir="/tmp"))
    base.chmod(0o711)
    yield base
    for line in _points(base):
        staging.detach(Path(line))
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    project = private / "project"
    project.mkdir(mode=0o700)
    (project / "data.txt").write_text("owner's")
    for path in (project, project / "data.txt"):
        os.chown(path, *OWNER)
    return project


def test_an_id_mapped_stage_shows_the_owner_as_the_sandbox_and_detaches(tmp_path: Path, folder: Path) -> None:
    stage_dir = tmp_path / "mnt"
    stage_dir.mkdir(mode=0o711)
    point = stage_dir / "0"
    point.mkdir()
    fd = staging.open_folder(folder)
    try:
        mapped = staging.stage(fd, point, read_only=False, idmap=staging.IdMap(OWNER, SANDBOX))
    finally:
        os.close(fd)
    if not mapped:
        pytest.fail("this kernel and file system support id-mapped mounts; the mapping did not take")
    assert (os.stat(point / "data.txt").st_uid, os.stat(point / "data.txt").st_gid) == SANDBOX
    pid = os.fork()
    if pid == 0:  # write as the sandbox's host user through the staged point
        try:
            os.setgroups([])
            os.setgid(SANDBOX[1])
            os.setuid(SANDBOX[0])
            (point / "made.txt").write_text("sandbox's")
            os._exit(0)
        except BaseException:
            os._exit(1)
    assert os.waitpid(pid, 0)[1] == 0
    made = folder / "made.txt"
    assert (made.stat().st_uid, made.stat().st_gid) == OWNER, "what the sandbox writes belongs to the owner"
    assert _points(stage_dir) == [str(point)]
    assert staging.release_all(stage_dir)
    assert _points(stage_dir) == [] and not stage_dir.exists()
    assert (folder / "data.txt").read_text() == "owner's"


def test_release_never_follows_a_link_to_another_mount(tmp_path: Path, folder: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    fd = staging.open_folder(folder)
    try:
        staging.stage(fd, elsewhere, read_only=True)
    finally:
        os.close(fd)
    stage_dir = tmp_path / "mnt"
    stage_dir.mkdir()
    os.symlink(elsewhere, stage_dir / "0")
    try:
        assert staging.release_all(stage_dir)
        assert _points(tmp_path) == [str(elsewhere)], "a link in the staging dir must not detach its target"
    finally:
        staging.detach(elsewhere)
    assert _points(tmp_path) == []


def test_a_read_only_stage_refuses_writes(tmp_path: Path, folder: Path) -> None:
    point = tmp_path / "point"
    point.mkdir()
    fd = staging.open_folder(folder)
    try:
        staging.stage(fd, point, read_only=True)
    finally:
        os.close(fd)
    try:
        with pytest.raises(OSError, match="Read-only file system"):
            (point / "x.txt").write_text("x")
    finally:
        assert staging.detach(point)


def test_a_link_is_never_staged(tmp_path: Path, folder: Path) -> None:
    link = tmp_path / "link"
    os.symlink(folder, link)
    with pytest.raises(OSError):
        staging.open_folder(link)
