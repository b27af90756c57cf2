"""An empty ext4 image per size, formatted once and copied for each capped workspace (issue 41).

A capped workspace is a sparse ext4 image, loop-mounted. mkfs.ext4 made each one: an exec and about 2.5 CPU-ms of
every session's start, the largest of the helpers a start runs. What it writes for a given size is the same every
time but for the file system's UUID and directory hash seed, so it runs once per size: the result is kept in the
workspaces folder (host-only: no sandbox sees anything of it but its own workspace), and a new workspace's image is
a sparse copy of it, its few hundred KiB of data copied in the kernel (copy_file_range) and its holes left holes.

So the workspaces of one machine share a UUID and a hash seed. Nothing here reads the UUID; the seed keys the hash
of large directories, and each workspace is a file system of its own, so a sandbox that could guess it (it cannot
read its file system's superblock) could slow down its own directories only.

The blank is made under a temporary name and renamed into place, so a server that dies while it formats leaves no
half-made blank; one found there is used only if it is a regular file of root's, not linked elsewhere, of its size.
A folder holds at most MAX_BLANKS (an agent may ask for any size below the user's); past them mkfs formats the
workspace's own image, as before. They stay between servers, as a cache: 2 GiB each in size, a few hundred KiB on
disk.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
import subprocess
import threading
from pathlib import Path

#: What each blank is formatted with: no reserved blocks, no journal (a workspace lives as long as its session, or
#: is synced when a named one closes), inode tables and journal initialised lazily (a sparse file reads zeros).
MKFS_ARGS = ("-q", "-F", "-m", "0", "-O", "^has_journal", "-E", "lazy_itable_init=1,lazy_journal_init=1")
#: Bound on one mkfs run.
MKFS_TIMEOUT_S = 30
#: Bound on the data extents a blank may have (mkfs writes a few dozen; more means it is not one of ours).
MAX_EXTENTS = 4096
#: Bound on the blanks one folder holds (one per size; the user's disk_mb is the common one).
MAX_BLANKS = 4
BLANK = re.compile(r"\.blank-[0-9]+m\.img")

_made: dict[tuple[Path, int], Path] = {}
_making = threading.Lock()


class BlankImageError(OSError):
    """A workspace image could not be made; the message says why (internal: Workspace.create reports it)."""


def blank_name(size_mb: int) -> str:
    """Its name in the workspaces folder (the .img suffix keeps it out of the named workspaces' list)."""
    return f".blank-{size_mb}m.img"


def copy_blank(folder: Path, size_mb: int, image: Path) -> None:
    """Make `image` (a new file) an empty ext4 file system of `size_mb` MiB: a copy of the blank of that size in
    `folder`, or, where `folder` holds MAX_BLANKS of other sizes already, formatted by mkfs itself. Blocking."""
    blank = _blank(folder, size_mb)
    if blank is None:
        _format(image, size_mb, replace=False)
        return
    try:
        source = os.open(blank, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:  # removed since this process made or found it: made again
        with _making:
            _made.pop((folder, size_mb), None)
        copy_blank(folder, size_mb, image)
        return
    try:
        target = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            sparse_copy(source, target, size_mb * 2**20)
        finally:
            os.close(target)
    finally:
        os.close(source)


def sparse_copy(source: int, target: int, size: int) -> None:
    """Copy `source`'s data extents to the same offsets of `target` (in the kernel), then size it: holes stay holes."""
    offset = extents = 0
    while offset < size:
        try:
            data = os.lseek(source, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # no data after `offset`
                break
            raise
        end = min(os.lseek(source, data, os.SEEK_HOLE), size)
        extents += 1
        if extents > MAX_EXTENTS:
            raise BlankImageError(f"the blank image has more than {MAX_EXTENTS} extents: not one of ours")
        at = data
        while at < end:
            copied = os.copy_file_range(source, target, end - at, at, at)
            if copied == 0:
                raise BlankImageError("the blank image ended before its size")
            at += copied
        offset = end
    os.ftruncate(target, size)


def _blank(folder: Path, size_mb: int) -> Path | None:
    """The blank of `size_mb` in `folder`: this process's, one a server made before, or a new one; None when the
    folder holds MAX_BLANKS of other sizes (an agent may ask for any size below the user's: bounded on disk)."""
    key = (folder, size_mb)
    with _making:
        made = _made.get(key)
        if made is not None:
            return made
        path = folder / blank_name(size_mb)
        if not _usable(path, size_mb):
            others = [name for name in os.listdir(folder) if BLANK.fullmatch(name) and name != path.name]
            if len(others) >= MAX_BLANKS:
                return None
            _format(path, size_mb, replace=True)
        _made[key] = path
        return path


def _usable(path: Path, size_mb: int) -> bool:
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return False
    return (
        stat.S_ISREG(found.st_mode) and found.st_uid == os.getuid() and found.st_nlink == 1
        and found.st_size == size_mb * 2**20 and not found.st_mode & 0o077
    )  # fmt: skip


def _format(path: Path, size_mb: int, *, replace: bool) -> None:
    """mkfs an image of `size_mb` MiB at `path`: a new file; with `replace`, made under a temporary name beside it
    and renamed into place (atomically: over any bad one there)."""
    target = path.with_name(f"{path.name}.{secrets.token_hex(4)}.tmp") if replace else path
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size_mb * 2**20)
        finally:
            os.close(fd)
        subprocess.run(["mkfs.ext4", *MKFS_ARGS, str(target)], check=True, capture_output=True,
                       timeout=MKFS_TIMEOUT_S, stdin=subprocess.DEVNULL)  # fmt: skip
        if replace:
            os.rename(target, path)
    except subprocess.CalledProcessError as exc:
        raise BlankImageError(f"mkfs.ext4 failed: {exc.stderr.decode(errors='replace').strip()}") from None
    except subprocess.TimeoutExpired:
        raise BlankImageError(f"mkfs.ext4 did not finish in {MKFS_TIMEOUT_S}s") from None
    except FileExistsError:
        raise
    except OSError as exc:
        raise BlankImageError(f"could not make a workspace image: {exc}") from None
    finally:
        if replace:
            with contextlib.suppress(FileNotFoundError):
                target.unlink()
