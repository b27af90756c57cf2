"""A capped workspace's image mounted by syscalls (hostfs/loop_mount.py): the mount `mount -o loop,nosuid,nodev`
gave, a device let go at the unmount, a device taken by someone else meanwhile asked for again, and the `mount`
program where the syscalls are not supported."""

from __future__ import annotations

import errno
import fcntl
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from coderunner.hostfs import loop_mount
from coderunner.hostfs.workspaces import Workspace

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="loop-mounted images need root")


def mount_line(point: Path) -> list[str]:
    lines = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    [line] = [fields for fields in lines if fields[1] == str(point)]
    return line


def devices_backed_by(image: Path) -> list[str]:
    found = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            if backing.read_text().strip().removesuffix(" (deleted)") == str(image):
                found.append(backing.parent.parent.name)
        except OSError:
            continue
    return found


def test_a_capped_workspace_is_an_ext4_loop_mount_without_suid_or_devices_and_its_device_goes_with_it(
    tmp_path: Path,
) -> None:
    workspace = Workspace.create(tmp_path / "w", 64, use_quota=True)
    assert workspace.image is not None
    source, _, kind, options = mount_line(workspace.path)[:4]
    assert source.startswith("/dev/loop") and kind == "ext4", (source, kind)
    assert {"nosuid", "nodev", "rw"} <= set(options.split(",")), options
    (workspace.path / "kept").write_text("x")
    assert devices_backed_by(workspace.image) == [source.removeprefix("/dev/")]
    image = workspace.image
    workspace.remove()
    assert not os.path.lexists(workspace.path) and not os.path.lexists(image)
    assert devices_backed_by(image) == [], "the loop device outlived its workspace"


def test_a_free_device_taken_before_it_was_bound_is_asked_for_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = fcntl.ioctl
    configured: list[int] = []

    def racing(fd: int, request: int, *args: Any) -> Any:
        if request == loop_mount.LOOP_CONFIGURE and not configured:
            configured.append(fd)
            raise OSError(errno.EBUSY, "taken by another process")
        return real(fd, request, *args)

    monkeypatch.setattr(loop_mount.fcntl, "ioctl", racing)
    workspace = Workspace.create(tmp_path / "w", 64, use_quota=True)
    try:
        assert configured, "the race was not staged"
        assert mount_line(workspace.path)[2] == "ext4"
    finally:
        workspace.remove()


def test_where_the_syscalls_are_unsupported_the_mount_program_mounts_it_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unsupported(image_fd: int) -> tuple[int, str]:
        raise loop_mount.LoopMountUnsupported(errno.ENOTTY, "this kernel has no LOOP_CONFIGURE")

    monkeypatch.setattr(loop_mount, "_bound_device", unsupported)
    workspace = Workspace.create(tmp_path / "w", 64, use_quota=True)
    try:
        _, _, kind, options = mount_line(workspace.path)[:4]
        assert kind == "ext4" and {"nosuid", "nodev"} <= set(options.split(","))
    finally:
        image = workspace.image
        workspace.remove()
    assert image is not None and devices_backed_by(image) == []


def test_many_threads_mounting_at_once_all_get_a_device(tmp_path: Path) -> None:
    """The kernel names one free device to every asker until it is bound: a burst of creates (100 at once found
    some failing after every try) must not race itself out of devices."""
    images = []
    for number in range(24):
        image = tmp_path / f"{number}.img"
        with open(image, "wb") as handle:
            handle.truncate(16 * 2**20)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-O", "^has_journal", str(image)], check=True, capture_output=True)
        (tmp_path / str(number)).mkdir()
        images.append(image)
    start = threading.Barrier(len(images))
    failures: list[BaseException] = []

    def mount(image: Path) -> None:
        start.wait()
        try:
            loop_mount.loop_mount(image, image.with_suffix(""))
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=mount, args=(image,)) for image in images]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    try:
        assert not failures, failures[:3]
        assert all(mount_line(image.with_suffix(""))[2] == "ext4" for image in images)
    finally:
        for image in images:
            subprocess.run(["umount", str(image.with_suffix(""))], capture_output=True)
    assert all(devices_backed_by(image) == [] for image in images)
