"""Capped workspaces' images from one blank per size (hostfs/blank_images.py): a sparse copy, a sound file system,
and a blank that is not what it should be made again."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from coderunner.hostfs import blank_images
from coderunner.hostfs.blank_images import blank_name, copy_blank, sparse_copy

MIB = 2**20

needs_mkfs = pytest.mark.skipif(shutil.which("mkfs.ext4") is None or shutil.which("e2fsck") is None,
                                reason="e2fsprogs' mkfs.ext4 and e2fsck")  # fmt: skip


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blank_images, "_made", {})


def test_a_sparse_copy_keeps_the_data_and_leaves_the_holes(tmp_path: Path) -> None:
    source = tmp_path / "source"
    with open(source, "wb") as handle:
        handle.truncate(64 * MIB)
        for offset, data in ((0, b"head" * 1024), (17 * MIB, b"middle" * 2000), (63 * MIB, b"tail")):
            handle.seek(offset)
            handle.write(data)
    target = tmp_path / "target"
    with open(source, "rb") as src, open(target, "wb") as dst:
        sparse_copy(src.fileno(), dst.fileno(), 64 * MIB)
    assert target.stat().st_size == 64 * MIB
    assert target.read_bytes() == source.read_bytes()
    assert target.stat().st_blocks * 512 < MIB, "the holes were written"


@needs_mkfs
def test_each_image_is_a_sound_empty_file_system_of_its_size_and_one_blank_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = []
    run = subprocess.run

    def counted(argv: list[str], **kwargs: object) -> object:
        made.append(argv[0])
        return run(argv, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(blank_images.subprocess, "run", counted)
    for name in ("a.img", "b.img"):
        copy_blank(tmp_path, 64, tmp_path / name)
    assert made == ["mkfs.ext4"], "formatted once"
    for name in ("a.img", "b.img"):
        image = tmp_path / name
        assert image.stat().st_size == 64 * MIB and image.stat().st_blocks * 512 < 4 * MIB
        checked = subprocess.run(["e2fsck", "-fn", str(image)], capture_output=True, text=True, timeout=60)
        assert checked.returncode == 0, checked.stdout + checked.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == [blank_name(64), "a.img", "b.img"]
    with pytest.raises(FileExistsError):
        copy_blank(tmp_path, 64, tmp_path / "a.img")  # never over an existing file


@needs_mkfs
@pytest.mark.parametrize("bad", ["link", "size", "readable", "gone"])
def test_a_blank_that_is_not_ours_is_made_again(tmp_path: Path, bad: str) -> None:
    copy_blank(tmp_path, 32, tmp_path / "first.img")
    blank = tmp_path / blank_name(32)
    canary = tmp_path / "canary"
    canary.write_bytes(b"canary" * 100)
    if bad == "link":
        blank.unlink()
        blank.symlink_to(canary)
    elif bad == "size":
        os.truncate(blank, 16 * MIB)
    elif bad == "readable":
        blank.chmod(0o644)
    else:
        blank.unlink()
    if bad != "gone":
        blank_images._made.clear()  # a server started since: it finds the blank as it is now
    copy_blank(tmp_path, 32, tmp_path / "second.img")
    assert not blank.is_symlink() and blank.stat().st_size == 32 * MIB and blank.stat().st_mode & 0o777 == 0o600
    assert canary.read_bytes() == b"canary" * 100
    checked = subprocess.run(["e2fsck", "-fn", str(tmp_path / "second.img")], capture_output=True, timeout=60)
    assert checked.returncode == 0


@needs_mkfs
def test_past_the_bound_on_blanks_an_image_is_formatted_in_place(tmp_path: Path) -> None:
    for size in range(16, 16 + blank_images.MAX_BLANKS):
        copy_blank(tmp_path, size, tmp_path / f"{size}.img")
    copy_blank(tmp_path, 40, tmp_path / "40.img")
    blanks = sorted(path.name for path in tmp_path.iterdir() if blank_images.BLANK.fullmatch(path.name))
    assert len(blanks) == blank_images.MAX_BLANKS and blank_name(40) not in blanks
    checked = subprocess.run(["e2fsck", "-fn", str(tmp_path / "40.img")], capture_output=True, timeout=60)
    assert checked.returncode == 0 and (tmp_path / "40.img").stat().st_size == 40 * MIB
