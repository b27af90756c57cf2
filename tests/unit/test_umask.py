"""What sandbox users must pass through keeps its mode whatever the server's umask, and no server
takes search permission away from a shared runtime dir (issue 38, point 4).

A server started with umask 077 (or 027) made the guest package folder 0700 (every later start on
that runtime dir refused: the sandbox user cannot reach it) and each staged mount point 0700, so its
sandboxes died at start with "bwrap: Can't find source path <runtime>/<id>/mnt/outputs: Permission
denied" while a server beside it (umask 022) ran on. And a server asking for its runtime dir at 0700
took away the search bit the other servers' sandbox users were passing through."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from coderunner.hostfs import staging
from coderunner.hostfs.private_dirs import ensure_private_dir
from coderunner.hostfs.sandbox_mounts import ExportPlan, prepare_mounts
from coderunner.hostfs.session_dirs import open_sandbox_dirs
from coderunner.hostfs.workspaces import Workspace
from coderunner.sandbox.bwrap import install_guest
from coderunner.vocabulary.host_identity import IdentityError


@pytest.fixture
def strict_umask() -> Iterator[None]:
    before = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(before)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_shared_dir_gets_its_mode_whatever_the_umask(tmp_path: Path, strict_umask: None) -> None:
    ensure_private_dir(tmp_path / "new" / "runtime", 0o711)
    assert mode(tmp_path / "new" / "runtime") == 0o711


def test_no_server_takes_search_permission_away_from_a_shared_runtime_dir(tmp_path: Path) -> None:
    runtime = tmp_path / "runtime"
    ensure_private_dir(runtime, 0o711)  # a server whose sandboxes run as other uids
    ensure_private_dir(runtime, 0o700)  # another, whose sandboxes run as itself
    assert mode(runtime) == 0o711, "the first server's sandbox users were locked out"
    os.chmod(runtime, 0o777)
    ensure_private_dir(runtime, 0o700)
    assert mode(runtime) == 0o711, "read and write for others go; passing stays"


def test_a_link_in_place_of_the_dir_is_refused(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "runtime")
    with pytest.raises(IdentityError):
        ensure_private_dir(tmp_path / "runtime", 0o711)


def test_the_guest_package_is_readable_by_every_sandbox_user_whatever_the_umask(
    tmp_path: Path, strict_umask: None
) -> None:
    guest = install_guest(tmp_path)
    assert mode(guest) == 0o755
    assert all(mode(path) == 0o644 for path in guest.iterdir() if path.is_file())


@pytest.mark.skipif(not staging.available(), reason="staging mounts needs root")
def test_staged_mount_points_stay_passable_whatever_the_umask(tmp_path: Path, strict_umask: None) -> None:
    host, workspace, exports = tmp_path / "host", tmp_path / "ws", tmp_path / "exports"
    for folder in (host, workspace, exports):
        folder.mkdir()
    plan = ExportPlan(mount="/mnt/outputs", target=exports / "client", limit_bytes=1 << 20, owner=None)
    mounts = prepare_mounts((), host, workspace, (61_234, 61_234), plan)
    try:
        assert mounts.staged_dir is not None
        assert mode(mounts.staged_dir) == 0o711
        outbox = os.stat(mounts.staged_dir / "outputs")  # the workspace's outbox, given to the sandbox user
        assert outbox.st_uid == 61_234 and stat.S_IMODE(outbox.st_mode) & 0o700 == 0o700
    finally:
        assert mounts.close()


def test_a_runtime_dir_that_lost_its_search_bit_gets_it_back_before_a_sandbox_needs_it(tmp_path: Path) -> None:
    """Another process (a server of another version, say) chmods the shared runtime dir to 0700 after this
    server started: the next sandbox's dirs are made with the search bit given back, by fd."""
    runtime, workspaces = tmp_path / "runtime", tmp_path / "workspaces"
    ensure_private_dir(runtime, 0o711)
    workspaces.mkdir()
    os.chmod(runtime, 0o700)
    dirs = open_sandbox_dirs(
        runtime, network="none", dir_mode=0o711, user=None,
        make_workspace=lambda key, _owner: Workspace.create(workspaces / key, None, False),
    )  # fmt: skip
    try:
        assert mode(runtime) == 0o711
    finally:
        dirs.close()
