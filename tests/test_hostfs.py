"""hostfs: what the host may do where a sandbox can write, against planted links, FIFOs and deep trees."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from coderunner.hostfs import dirfd as hostfs


def deep_tree(root: Path, depth: int, link_to: Path) -> None:
    fd = os.open(root, os.O_RDONLY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        child = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.symlink(link_to, "link", dir_fd=child)
        os.close(fd)
        fd = child
    os.close(fd)


def test_remove_tree_takes_any_depth_and_never_follows_links(tmp_path: Path, canary: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    deep_tree(victim, 3000, canary)
    os.symlink(canary, victim / "top-link")
    os.symlink(canary / "keep", victim / "file-link")
    os.mkfifo(victim / "fifo")
    with hostfs.dir_fd(tmp_path) as parent:
        assert hostfs.remove_tree(parent, "victim") == []
    assert not victim.exists()
    assert (canary / "keep").read_text() == "untouched"


def test_remove_tree_on_a_link_removes_the_link_only(tmp_path: Path, canary: Path) -> None:
    os.symlink(canary, tmp_path / "swapped")
    with hostfs.dir_fd(tmp_path) as parent:
        assert hostfs.remove_tree(parent, "swapped") == []
    assert not os.path.lexists(tmp_path / "swapped") and (canary / "keep").exists()


@pytest.mark.skipif(os.getuid() != 0, reason="bind mounts need root")
def test_remove_tree_leaves_a_bind_mount_of_the_same_file_system_alone(tmp_path: Path, canary: Path) -> None:
    """st_dev cannot tell a bind mount of the same file system apart; the mount id can."""
    victim = tmp_path / "victim"
    (victim / "inner" / "mnt").mkdir(parents=True)
    subprocess.run(["mount", "--bind", str(canary), str(victim / "inner" / "mnt")], check=True, timeout=10)
    try:
        with hostfs.dir_fd(tmp_path) as parent:
            left = hostfs.remove_tree(parent, "victim")
        assert left and any("another mount" in item or "busy" in item.lower() for item in left), left
        assert (canary / "keep").read_text() == "untouched"
    finally:
        subprocess.run(["umount", "-l", str(victim / "inner" / "mnt")], check=False, timeout=10)


def test_claim_socket_takes_a_real_socket_and_refuses_everything_else(tmp_path: Path, canary: Path) -> None:
    run, sock = tmp_path / "run", tmp_path / "sock"
    run.mkdir()
    sock.mkdir()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(run / "k0-1"))
    listener.listen(1)
    os.symlink(canary / "keep", run / "k0-2")
    os.mkfifo(run / "k0-3")
    with hostfs.dir_fd(run) as run_fd, hostfs.dir_fd(sock) as sock_fd:
        hostfs.claim_socket(run_fd, "k0-1", sock_fd, os.getuid())
        for name in ("k0-2", "k0-3"):
            with pytest.raises(hostfs.HostFsError):
                hostfs.claim_socket(run_fd, name, sock_fd, os.getuid())
        listener2 = socket.socket(socket.AF_UNIX)
        listener2.bind(str(run / "k0-4"))
        with pytest.raises(hostfs.HostFsError):
            hostfs.claim_socket(run_fd, "k0-4", sock_fd, os.getuid() + 1)  # not the sandbox's
        listener2.close()
    client = socket.socket(socket.AF_UNIX)
    client.connect(str(sock / "k0-1"))  # the renamed socket still reaches its listener
    client.close()
    listener.close()
    assert sorted(os.listdir(sock)) == ["k0-1"]
    assert (canary / "keep").read_text() == "untouched"


def test_tree_size_and_chown_tree_stay_inside_and_are_bounded(tmp_path: Path, canary: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "a" / "b" / "f").write_bytes(b"x" * 100)
    os.symlink(canary / "keep", tree / "link")
    with hostfs.dir_fd(tree) as fd:
        assert hostfs.tree_size(fd) == (100, True)
        assert hostfs.tree_size(fd, max_entries=1) == (0, False)
        if os.getuid() == 0:
            assert hostfs.chown_tree(fd, (4242, 4242))
    if os.getuid() == 0:
        assert os.stat(tree / "a" / "b" / "f").st_uid == 4242
        assert os.lstat(tree / "link").st_uid == 4242 and os.stat(canary / "keep").st_uid == 0


def test_a_socket_not_yet_the_sandbox_users_is_waited_for_not_taken(tmp_path: Path, canary: Path) -> None:
    """gVisor's file proxy binds a socket as root, then chowns it: unowned_socket says to wait;
    links and FIFOs are not sockets to wait for (the claim refuses them)."""
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(tmp_path / "k0-1"))
    os.symlink(canary / "keep", tmp_path / "k0-2")
    os.mkfifo(tmp_path / "k0-3")
    with hostfs.dir_fd(tmp_path) as fd:
        assert hostfs.unowned_socket(fd, "k0-1", os.getuid() + 1)
        assert not hostfs.unowned_socket(fd, "k0-1", os.getuid())
        assert not hostfs.unowned_socket(fd, "k0-2", os.getuid() + 1)
        assert not hostfs.unowned_socket(fd, "k0-3", os.getuid() + 1)
        assert not hostfs.unowned_socket(fd, "k0-9", os.getuid() + 1)
    listener.close()
    assert (canary / "keep").read_text() == "untouched"
