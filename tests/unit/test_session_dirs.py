"""Session dirs shared by several servers: a dir appears only whole and locked, and a server's
stale sweep removes only what it can prove dead (security issue 25, finding 6).

Real files, real flocks, the real sweep; the "other server" is another open file description
(flock locks conflict between those even in one process). With other processes (servers of their own,
a mount namespace holding a workspace image): tests/test_session_dirs_processes.py.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from coderunner.hostfs import dirfd as hostfs
from coderunner.hostfs import session_dirs
from coderunner.hostfs.session_dirs import (
    LOCK_NAME,
    NEW_PREFIX,
    SandboxDirs,
    claim_dead,
    open_sandbox_dirs,
    remove_stale_dirs,
)
from coderunner.hostfs.workspaces import Workspace


def plain_workspace(workspaces: Path) -> Callable[[str, tuple[int, int] | None], Workspace]:
    """A workspace as a server without quota makes it: a plain dir WORKSPACES/<key>."""

    def make(key: str, owner: tuple[int, int] | None) -> Workspace:
        return Workspace.create(workspaces / key, None, False)

    return make


def open_dirs(runtime: Path, workspaces: Path) -> SandboxDirs:
    return open_sandbox_dirs(runtime, network="none", dir_mode=0o700, user=None,
                             make_workspace=plain_workspace(workspaces))  # fmt: skip


def sweep(runtime: Path, workspaces: Path, swept: list[str] | None = None, **kwargs: float) -> int:
    return remove_stale_dirs(runtime, workspaces, (swept if swept is not None else []).append, **kwargs)


def whole(dirs: SandboxDirs) -> bool:
    """Are this live sandbox's dirs all still there (none removed under it)?"""
    return (
        (dirs.host_dir / "etc" / "passwd").is_file()
        and all(os.fstat(fd).st_nlink > 0 for fd in (dirs.host_fd, dirs.run_fd, dirs.sock_fd))
        and (dirs.top / LOCK_NAME).is_file()
        and dirs.workspace.path.is_dir()
    )


@pytest.fixture
def base(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    runtime, workspaces = tmp_path / "r", tmp_path / "w"
    runtime.mkdir(mode=0o700)
    workspaces.mkdir(mode=0o700)
    yield runtime, workspaces


def dead_dir(runtime: Path, workspaces: Path, name: str, *, lock: bool = True) -> None:
    """What a SIGKILLed server leaves: a dir (with a lock file nobody holds) and its workspace."""
    (runtime / name / "host" / "etc").mkdir(parents=True)
    (runtime / name / "host" / "etc" / "passwd").write_text("x")
    if lock:
        (runtime / name / LOCK_NAME).write_text("")
    if not name.startswith(NEW_PREFIX):
        (workspaces / name).mkdir()
        (workspaces / name / "file").write_text("x")


def test_a_dir_is_made_and_locked_in_one_step(base: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Another server sweeps right after each dir of a starting sandbox is made (the window of
    finding 6: between a dir and its lock): the start still succeeds and its dirs stay whole."""
    runtime, workspaces = base
    real = hostfs.make_private_dir
    sweeps: list[int] = []

    def make_then_sweep(parent_fd: int, name: str, mode: int, owner: tuple[int, int] | None = None) -> int:
        fd = real(parent_fd, name, mode, owner)
        sweeps.append(sweep(runtime, workspaces))
        return fd

    monkeypatch.setattr(session_dirs.hostfs, "make_private_dir", make_then_sweep)
    dirs = open_dirs(runtime, workspaces)
    monkeypatch.undo()
    try:
        assert sweeps and set(sweeps) == {0}, "a sweep removed the starting sandbox's dir"
        assert whole(dirs)
        assert sorted(os.listdir(runtime)) == [dirs.key], "no temporary name is left once it is made"
        assert sorted(os.listdir(dirs.top)) == ["host", LOCK_NAME, "run", "sock"]
        with hostfs.dir_fd(runtime) as base_fd:
            assert claim_dead(base_fd, dirs.key) is None, "its lock is held for its life"
    finally:
        dirs.close()
    assert os.listdir(runtime) == [] and os.listdir(workspaces) == []


def test_the_sweep_removes_what_it_can_prove_dead_and_leaves_the_rest(base: tuple[Path, Path], canary: Path) -> None:
    runtime, workspaces = base
    live = open_dirs(runtime, workspaces)
    making_key = "0000abcd"
    with hostfs.dir_fd(runtime) as base_fd:
        making_fd, making_lock = hostfs.make_locked_dir(base_fd, making_key, 0o700)
    os.close(making_fd)
    dead_dir(runtime, workspaces, "0000dead")  # its server was SIGKILLed
    dead_dir(runtime, workspaces, NEW_PREFIX + "000dead0")  # its creator died while making it
    dead_dir(runtime, workspaces, "0000aaaa", lock=False)  # no lock file: cannot be proven dead
    dead_dir(runtime, workspaces, NEW_PREFIX + "0000bbbb", lock=False)
    (workspaces / "000dead0").mkdir()  # a workspace of that key is not a half-made dir's: kept
    os.symlink(canary, runtime / "0000cccc")  # never followed
    os.symlink(canary, runtime / (NEW_PREFIX + "0000dddd"))
    swept: list[str] = []
    try:
        assert sweep(runtime, workspaces, swept) == 2
        assert swept == ["0000dead"], "only a session dir that was whole gets the backend's sweep"
        assert sorted(os.listdir(runtime)) == sorted(
            [
                live.key,
                NEW_PREFIX + making_key,
                "0000aaaa",
                NEW_PREFIX + "0000bbbb",
                "0000cccc",
                NEW_PREFIX + "0000dddd",
            ]
        )
        assert sorted(os.listdir(workspaces)) == sorted([live.key, "0000aaaa", "000dead0"])
        assert whole(live)
        # Without a lock file, only an old one is provably abandoned (its age is its mtime/ctime).
        assert sweep(runtime, workspaces, swept, abandoned_after_s=-1.0) == 2
        assert sorted(os.listdir(runtime)) == sorted(
            [live.key, NEW_PREFIX + making_key, "0000cccc", NEW_PREFIX + "0000dddd"]
        )
        assert sorted(os.listdir(workspaces)) == sorted([live.key, "000dead0"])
        assert whole(live) and (canary / "keep").read_text() == "untouched"
    finally:
        os.close(making_lock)
        live.close()
    # Their owners are gone now: both go, the one its creator never finished as well.
    assert sweep(runtime, workspaces) == 1
    assert sorted(os.listdir(runtime)) == sorted(["0000cccc", NEW_PREFIX + "0000dddd"])


def test_the_sweep_holds_a_dead_dirs_lock_until_it_is_removed(base: tuple[Path, Path]) -> None:
    """Two servers starting at once never both remove one dead dir: the first keeps its lock."""
    runtime, workspaces = base
    dead_dir(runtime, workspaces, "0000dead")
    taken: list[bool] = []

    def second_server_tries(name: str) -> None:
        fd = os.open(runtime / name / LOCK_NAME, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            taken.append(True)
        except BlockingIOError:
            taken.append(False)
        finally:
            os.close(fd)

    assert remove_stale_dirs(runtime, workspaces, second_server_tries) == 1
    assert taken == [False], "a second sweep could take the lock of a dir being removed"
    assert os.listdir(runtime) == [] and os.listdir(workspaces) == []


def test_a_closing_dir_keeps_its_lock_until_the_rest_is_gone(
    base: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Removal takes the lock file last: a dir never lies lockless with anything in it."""
    runtime, workspaces = base
    dirs = open_dirs(runtime, workspaces)
    real = hostfs.remove_tree
    lock_present: list[bool] = []

    def remove_and_look(parent_fd: int, name: str) -> list[str]:
        left = real(parent_fd, name)
        lock_present.append((dirs.top / LOCK_NAME).exists())
        return left

    monkeypatch.setattr(session_dirs.hostfs, "remove_tree", remove_and_look)
    assert dirs.close() == []
    assert lock_present and all(lock_present)
    assert os.listdir(runtime) == []


def stack_mounts(path: Path, count: int) -> None:
    for _ in range(count):
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)], check=True, timeout=10)


def unmount_all(path: Path) -> None:
    for _ in range(8):
        if not os.path.ismount(path):
            return
        subprocess.run(["umount", "-l", str(path)], check=False, timeout=10)


@pytest.mark.skipif(os.getuid() != 0, reason="mounts need root")
def test_a_dead_sandboxs_workspace_still_mounted_is_retried_and_never_lost(base: tuple[Path, Path]) -> None:
    """A workspace the first unmount does not free (a dying sandbox's mount on top of it) is
    tried again after ending the sandbox again; one that outlasts every try keeps its session
    dir, so a later start finds it instead of leaving it behind for good."""
    runtime, workspaces = base
    dead_dir(runtime, workspaces, "0000dead")
    (workspaces / "0000dead.img").write_text("")
    dead_dir(runtime, workspaces, "0000beef")
    try:
        stack_mounts(workspaces / "0000dead", session_dirs.DEAD_SANDBOX_TRIES - 1)
        stack_mounts(workspaces / "0000beef", session_dirs.DEAD_SANDBOX_TRIES + 1)
        swept: list[str] = []
        found = session_dirs.sweep_stale_dirs(runtime, workspaces, swept.append)
        assert found == session_dirs.StaleSweep(removed=1, left=1), found  # the dirs sweeper sweeps again on `left`
        assert sorted(swept) == ["0000beef"] * session_dirs.DEAD_SANDBOX_TRIES + ["0000dead"] * 2
        assert sorted(os.listdir(workspaces)) == ["0000beef"]
        assert sorted(os.listdir(runtime)) == ["0000beef"]
        assert (runtime / "0000beef" / LOCK_NAME).is_file(), "kept whole, lock and all, for the next start"
        assert sweep(runtime, workspaces) == 1, "the next start removes it"
        assert os.listdir(runtime) == [] and os.listdir(workspaces) == []
    finally:
        unmount_all(workspaces / "0000dead")
        unmount_all(workspaces / "0000beef")
