"""Mount an ext4 image through a loop device by the syscalls themselves, not the `mount` program.

`mount -o loop` costs a fork and exec and libmount's and blkid's start: about 7 ms of wall time and 6 of CPU
on this kind of machine, against about 1 ms here, on every capped workspace (each session's create, each pool
refill). The steps are the ones util-linux takes: ask /dev/loop-control for a free device, bind the image's fd
to it with LOOP_CONFIGURE (autoclear: the device lets go of the image once the file system is unmounted and
the last fd closed), then mount(2) the device. The kernel names the same free device to every asker until one
binds it, so this process's threads take turns at those two steps (a burst of 100 creates found every try
taken otherwise), and a device taken by another process meanwhile is asked for again. Where any step is
unsupported (a kernel before 5.8 has no LOOP_CONFIGURE, a container with no device nodes),
`LoopMountUnsupported` says so and the caller runs the `mount` program instead.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import struct
import threading
import time
from pathlib import Path

#: ioctls of /dev/loop-control and of a loop device (linux/loop.h).
LOOP_CTL_GET_FREE = 0x4C82
LOOP_CONFIGURE = 0x4C0A
LO_FLAGS_AUTOCLEAR = 4
#: struct loop_config: fd, block_size, struct loop_info64 (232 bytes; lo_flags at offset 52 of it), reserved.
LOOP_CONFIG = struct.Struct("<II232s64x")
LO_FLAGS_OFFSET = 52
#: mount(2) flags of a workspace: as `-o nosuid,nodev`.
MS_NOSUID, MS_NODEV = 2, 4
#: How many times a free device taken by another process before it was bound is asked for again, and the pause
#: before each (this process's own threads never race: they take turns, _turns).
TRIES = 32
RETRY_PAUSE_S = 0.002
_libc = ctypes.CDLL(None, use_errno=True)
_turns = threading.Lock()


class LoopMountUnsupported(OSError):
    """This machine cannot do it by syscalls (no loop-control, no LOOP_CONFIGURE): use the `mount` program."""


def _config(image_fd: int) -> bytes:
    info = bytearray(232)
    struct.pack_into("<I", info, LO_FLAGS_OFFSET, LO_FLAGS_AUTOCLEAR)
    return LOOP_CONFIG.pack(image_fd, 0, bytes(info))


def _bound_device(image_fd: int) -> tuple[int, str]:
    """A free loop device now bound to `image_fd` (autoclear): an fd of it, and its path."""
    with _turns:  # the kernel names the same free device to every asker until one binds it
        return _bind_free(image_fd)


def _bind_free(image_fd: int) -> tuple[int, str]:
    try:
        control = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise LoopMountUnsupported(exc.errno, f"no /dev/loop-control: {exc.strerror}") from None
    try:
        for _ in range(TRIES):
            number = fcntl.ioctl(control, LOOP_CTL_GET_FREE)
            path = f"/dev/loop{number}"
            try:
                device = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                raise LoopMountUnsupported(errno.ENOENT, f"no device node {path}") from None
            try:
                fcntl.ioctl(device, LOOP_CONFIGURE, _config(image_fd))
            except OSError as exc:
                os.close(device)
                if exc.errno == errno.EBUSY:
                    time.sleep(RETRY_PAUSE_S)  # taken by another process since it was free: ask again
                    continue
                if exc.errno in (errno.EINVAL, errno.ENOTTY):
                    raise LoopMountUnsupported(exc.errno, "this kernel has no LOOP_CONFIGURE") from None
                raise
            return device, path
        raise OSError(errno.EBUSY, f"every free loop device was taken by another process ({TRIES} tries)")
    finally:
        os.close(control)


def loop_mount(image: Path, point: Path) -> None:
    """Mount the ext4 file system in `image` on `point` (nosuid, nodev) through a free loop device."""
    image_fd = os.open(image, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        device, path = _bound_device(image_fd)
    finally:
        os.close(image_fd)
    try:
        flags = ctypes.c_ulong(MS_NOSUID | MS_NODEV)
        # By the device's path, as `mount` gives it (what /proc/mounts shows); the fd held open meanwhile keeps
        # the binding (autoclear lets go only at the last close).
        if _libc.mount(path.encode(), os.fsencode(point), b"ext4", flags, None):
            code = ctypes.get_errno() or errno.EIO
            raise OSError(code, f"could not mount {image.name} on {point}: {os.strerror(code)}")
    finally:
        os.close(device)  # autoclear: the mount holds the device now, or nothing does and it is free again
