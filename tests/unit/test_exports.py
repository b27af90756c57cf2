"""The copy-out from a sandbox's outbox to a client's export folder, on plain host folders.

The outbox is hostile (links, FIFOs, deep trees, files that change); the export folder is the
host's. These run without a sandbox: the outbox is just a folder the test fills as an attacker.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from coderunner.hostfs import exports
from coderunner.hostfs.exports import Exporter


@pytest.fixture
def places(tmp_path: Path) -> tuple[Path, Path, Path]:
    outbox, export_dir, canary_dir = tmp_path / "outbox", tmp_path / "exports", tmp_path / "canary"
    for folder in (outbox, export_dir, canary_dir):
        folder.mkdir()
    (canary_dir / "canary.txt").write_text("untouched")
    return outbox, export_dir / "alice", canary_dir


def test_new_and_changed_files_are_copied_once(places: tuple[Path, Path, Path]) -> None:
    outbox, target, _ = places
    (outbox / "a.csv").write_text("1")
    (outbox / "sub").mkdir()
    (outbox / "sub" / "b.txt").write_text("2")
    exporter = Exporter(outbox, target, limit_bytes=1 << 20)
    first = exporter.export()
    assert sorted(first.copied) == ["a.csv", "sub/b.txt"]
    assert (target / "a.csv").read_text() == "1" and (target / "sub" / "b.txt").read_text() == "2"
    assert exporter.export().copied == []
    (outbox / "a.csv").write_text("changed")
    assert exporter.export().copied == ["a.csv"]
    assert (target / "a.csv").read_text() == "changed"
    assert not [name for name in os.listdir(target) if name.startswith(".")], "no temporary file is left"


def test_links_fifos_and_sockets_are_not_exported(places: tuple[Path, Path, Path]) -> None:
    outbox, target, canary_dir = places
    os.symlink(canary_dir / "canary.txt", outbox / "link.txt")
    os.symlink(canary_dir, outbox / "linkdir")
    os.mkfifo(outbox / "pipe")
    report = Exporter(outbox, target, limit_bytes=1 << 20).export()
    assert report.copied == []
    assert sorted(report.skipped) == [f"{name} (not a regular file)" for name in ("link.txt", "linkdir", "pipe")]
    assert not target.exists()  # nothing to copy: the export folder is not even opened
    assert (canary_dir / "canary.txt").read_text() == "untouched"


def test_a_link_in_the_export_folder_is_replaced_never_written_through(places: tuple[Path, Path, Path]) -> None:
    outbox, target, canary_dir = places
    target.mkdir()
    os.symlink(canary_dir / "canary.txt", target / "x.txt")
    os.symlink(canary_dir, target / "sub")
    (outbox / "x.txt").write_text("new")
    (outbox / "sub").mkdir()
    (outbox / "sub" / "canary.txt").write_text("overwritten?")
    report = Exporter(outbox, target, limit_bytes=1 << 20).export()
    assert report.copied == ["x.txt"]
    assert not (target / "x.txt").is_symlink() and (target / "x.txt").read_text() == "new"
    assert [entry for entry in report.skipped if entry.startswith("sub/canary.txt")], report.skipped
    assert (canary_dir / "canary.txt").read_text() == "untouched"


def test_the_byte_limit_holds_over_a_session(places: tuple[Path, Path, Path]) -> None:
    outbox, target, _ = places
    exporter = Exporter(outbox, target, limit_bytes=10_000)
    for index in range(5):
        (outbox / f"part{index}.bin").write_bytes(b"x" * 3000)
    report = exporter.export()
    assert report.copied == ["part0.bin", "part1.bin", "part2.bin"]
    assert len(report.skipped) == 2 and all("over the export limit" in entry for entry in report.skipped)
    (outbox / "part0.bin").write_bytes(b"y" * 3000)  # rewriting counts again
    again = exporter.export()
    assert again.copied == [] and "part0.bin" in again.skipped[0]
    assert sum(path.stat().st_size for path in target.iterdir()) <= 10_000
    assert exporter.export().skipped == [], "a refused file is reported once, not after every call"


def test_entries_and_depth_are_bounded(places: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    outbox, target, _ = places
    monkeypatch.setattr(exports, "MAX_ENTRIES", 50)
    for index in range(200):
        (outbox / f"f{index:03}").write_text("x")
    report = Exporter(outbox, target, limit_bytes=1 << 20).export()
    assert len(report.copied) <= 50 and any("more than 50 entries" in entry for entry in report.skipped)
    deep = outbox / "deep"
    deep.mkdir()
    (outbox / "f000").unlink()
    path = deep
    for _ in range(exports.MAX_DEPTH + 5):
        path = path / "d"
        path.mkdir()
    (path / "bottom.txt").write_text("x")
    monkeypatch.setattr(exports, "MAX_ENTRIES", 10_000)
    report = Exporter(outbox, target, limit_bytes=1 << 20).export()
    assert not any(name.endswith("bottom.txt") for name in report.copied)
    assert any("deeper than" in entry for entry in report.skipped)


def test_a_reopened_outbox_is_not_exported_again(places: tuple[Path, Path, Path]) -> None:
    outbox, target, _ = places
    (outbox / "old.csv").write_text("from last time")
    exporter = Exporter(outbox, target, limit_bytes=1 << 20)
    exporter.baseline()
    (outbox / "new.csv").write_text("today")
    assert exporter.export().copied == ["new.csv"]
    assert not (target / "old.csv").exists()


def test_a_client_folder_name_must_be_canonical(tmp_path: Path) -> None:
    """Only lowercase one-component names: `T.alice` and `t.alice` must never be asked for as two folders."""
    assert exports.client_folder(tmp_path, "t.alice") == tmp_path / "t.alice"
    for bad in ["T.alice", "Alice", "é", "..", "a/b", "", ".hidden", "x" * 65]:
        with pytest.raises(exports.ExportError):
            exports.client_folder(tmp_path, bad)


def test_an_empty_outbox_is_told_apart_without_a_walk(places: tuple[Path, Path, Path]) -> None:
    """A one-shot skips the export's worker thread only when export() would copy nothing."""
    outbox, target, canary_dir = places
    exporter = Exporter(outbox, target, limit_bytes=1 << 20)
    assert exporter.outbox_empty() and exporter.export().copied == []
    (outbox / "empty-dir").mkdir()
    assert not exporter.outbox_empty()  # an entry: export() walks it (and finds nothing to copy)
    (outbox / "empty-dir" / "late.txt").write_text("x")
    assert not exporter.outbox_empty() and exporter.export().copied == ["empty-dir/late.txt"]
    # A link in the outbox's place is never followed: like export(), nothing is there.
    linked = Exporter(outbox.parent / "link", target, limit_bytes=1 << 20)
    (outbox.parent / "link").symlink_to(canary_dir)
    assert linked.outbox_empty() and linked.export().copied == []
    assert Exporter(outbox.parent / "missing", target, limit_bytes=1 << 20).outbox_empty()
