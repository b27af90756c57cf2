"""A cluster session's export, both halves, without Ray: the node's listing and reads (NodeOutbox)
and the front door's copy (RemoteExports), joined by a call that runs the node's method in-process.

The outbox is hostile, filled by the test as an attacker would; the export folder is the host's.
The real path (a session actor on a node of a real cluster, its front door elsewhere) is in
tests/cluster/test_cluster_mode.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from coderunner.cluster import node_exports
from coderunner.cluster.node_exports import NodeOutbox
from coderunner.cluster.oneshot_exports import OneShotExports, collect, node_export_folder, write_here
from coderunner.cluster.remote_exports import RemoteExports
from coderunner.cluster.wire import PIECE_BYTES, ExportListing
from coderunner.config import Settings
from coderunner.errors import SessionError
from coderunner.hostfs.exports import Exporter, OutboxScan

from .test_exports import places  # noqa: F401  (the fixture: a hostile outbox, a client folder, a canary)


class Node:
    """The actor's calls, in-process, counted."""

    def __init__(self, outbox: Path) -> None:
        self.outbox = NodeOutbox(OutboxScan(outbox))
        self.calls: list[str] = []
        self.fail_after: int | None = None

    def __call__(self, method: str, arg_lists: list[tuple[Any, ...]]) -> list[Any]:
        answers = []
        for args in arg_lists:
            self.calls.append(method)
            if self.fail_after is not None and len(self.calls) > self.fail_after:
                raise SessionError("the node did not answer read_export_piece within 30s")
            if method == "read_export_piece":
                answers.append(self.outbox.read_piece(*args))
            elif method == "forget_exports":
                answers.append(self.outbox.forget(*args))
            else:
                raise AssertionError(method)
        return answers


@pytest.fixture
def folders(places: tuple[Path, Path, Path]) -> tuple[Path, Path, Path]:  # noqa: F811 (the imported fixture)
    """test_exports_unit's outbox and canary, and the export_dir that holds its client folder 'alice'."""
    outbox, target, canary_dir = places
    return outbox, target.parent, canary_dir


def front_door(export_dir: Path, node: Node, limit_mb: int = 64) -> RemoteExports:
    settings = Settings(export_dir=export_dir, export_limit_mb=limit_mb)
    return RemoteExports(export_dir, settings, "alice", node)


def listing_of(node: Node) -> ExportListing:
    listing = node.outbox.listing()
    assert listing is not None
    return listing


def test_small_files_come_inline_big_ones_in_pieces_and_each_once(folders: tuple[Path, Path, Path]) -> None:
    outbox, export_dir, _ = folders
    (outbox / "chart.png").write_bytes(b"\x89PNG" + bytes(range(256)) * 200)
    (outbox / "sub").mkdir()
    big = os.urandom(2 * PIECE_BYTES + 12345)
    (outbox / "sub" / "big.bin").write_bytes(big)
    node = Node(outbox)
    remote = front_door(export_dir, node)
    note = remote.pull(listing_of(node))
    target = export_dir / "alice"
    assert (target / "chart.png").read_bytes() == (outbox / "chart.png").read_bytes()
    assert (target / "sub" / "big.bin").read_bytes() == big
    assert note is not None and "copied 2 file(s) from /mnt/outputs to" in note and str(target) in note
    assert node.calls.count("read_export_piece") == 3  # the chart came inline; the big file in 3 pieces
    assert node.outbox.listing() is None  # each once
    (outbox / "chart.png").write_bytes(b"changed")
    assert remote.pull(listing_of(node)) is not None
    assert (target / "chart.png").read_bytes() == b"changed"
    assert not [name for name in os.listdir(target) if name.startswith(".")], "no temporary file is left"


def test_links_fifos_and_names_swapped_after_the_listing_are_never_read(
    folders: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    outbox, export_dir, canary_dir = folders
    monkeypatch.setattr(node_exports, "INLINE_BYTES", 0)  # every file read by name after its listing
    os.symlink(canary_dir / "canary.txt", outbox / "link.txt")
    os.mkfifo(outbox / "pipe")
    for name in ("a.txt", "b.txt", "c.txt"):
        (outbox / name).write_text(name)
    (outbox / "d").mkdir()
    (outbox / "d" / "e.txt").write_text("e")
    node = Node(outbox)
    listing = listing_of(node)
    # The sandbox swaps names between the listing and the reads: a link, another file, a linked folder.
    (outbox / "a.txt").unlink()
    os.symlink(canary_dir / "canary.txt", outbox / "a.txt")
    os.rename(outbox / "b.txt", outbox / "b.old")  # kept: the new b.txt cannot reuse its inode
    (outbox / "b.txt").write_text("another inode")
    os.rename(outbox / "d", outbox / "d.old")
    os.symlink(canary_dir, outbox / "d")
    note = front_door(export_dir, node).pull(listing)
    target = export_dir / "alice"
    assert sorted(os.listdir(target)) == ["c.txt"], note
    assert note is not None and "link.txt (not a regular file)" in note and "pipe (not a regular file)" in note
    assert (canary_dir / "canary.txt").read_text() == "untouched"
    # A name no listing gives is refused outright, whatever the caller (a front door) asks.
    info = os.stat(outbox / "c.txt")
    for rel in ("../canary/canary.txt", "d.old/../c.txt", "/c.txt", "./c.txt", ""):
        assert node.outbox.read_piece(rel, info.st_ino, 0, 100) is None, rel


def test_the_export_limit_holds_across_pulls(folders: tuple[Path, Path, Path]) -> None:
    outbox, export_dir, _ = folders
    (outbox / "a.bin").write_bytes(b"a" * (700 * 1024))
    node = Node(outbox)
    remote = front_door(export_dir, node, limit_mb=1)
    remote.pull(listing_of(node))
    (outbox / "b.bin").write_bytes(b"b" * (700 * 1024))
    note = remote.pull(listing_of(node))
    assert note is not None and "b.bin (716,800 bytes: over the export limit, 331,776 left)" in note, note
    assert not (export_dir / "alice" / "b.bin").exists()


def test_an_unusable_export_folder_is_said_and_the_files_are_listed_again(folders: tuple[Path, Path, Path]) -> None:
    outbox, export_dir, _ = folders
    (outbox / "a.txt").write_text("a")
    (export_dir / "alice").write_text("a file where the client's folder goes")
    node = Node(outbox)
    note = front_door(export_dir, node).pull(listing_of(node))
    assert note is not None and "cannot be used" in note, note
    assert [item.rel for item in listing_of(node).items] == ["a.txt"]  # not lost: offered again


def test_a_node_that_stops_answering_ends_the_pull_and_says_what_stayed(
    folders: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    outbox, export_dir, _ = folders
    monkeypatch.setattr(node_exports, "INLINE_BYTES", 0)
    for name in ("a.txt", "b.txt"):
        (outbox / name).write_text(name)
    node = Node(outbox)
    node.fail_after = 1
    note = front_door(export_dir, node).pull(listing_of(node))
    assert note is not None and "b.txt and what followed it (the node did not answer" in note, note
    assert os.listdir(export_dir / "alice") == ["a.txt"]


def test_a_one_shots_files_are_written_here_and_the_note_names_this_folder(folders: tuple[Path, Path, Path]) -> None:
    """A one-shot's node exports into a folder of its task's (Exporter, as one machine); the task's answer
    carries the files, and the front door writes them into its own folder, within its own limit."""
    outbox, export_dir, _ = folders
    (outbox / "a.txt").write_text("a")
    (outbox / "big.bin").write_bytes(b"b" * 2048)
    os.mkfifo(outbox / "pipe")
    node_dir = outbox.parent / "node-exports"
    with node_export_folder(Settings(export_dir=node_dir, export_limit_mb=512)) as chosen:
        assert chosen["export_limit_mb"] == 64 and chosen["export_dir"].parent == node_dir
        node_target = chosen["export_dir"] / "alice"
        note = Exporter(outbox, node_target, limit_bytes=1 << 20).export().note("/mnt/outputs")
        found = collect(chosen["export_dir"], "alice")
    assert os.listdir(node_dir) == []  # the task's folder goes with it
    assert sorted(found.files) == [("a.txt", b"a"), ("big.bin", b"b" * 2048)]
    here = write_here(found, export_dir, "alice", 1024, note)
    assert here is not None and f"to {export_dir / 'alice'}: " in here and str(node_target) not in here, here
    assert "pipe (not a regular file)" in here, here
    assert "not written here: big.bin (2,048 bytes: over the export limit, 1,023 left)" in here, here
    assert sorted(os.listdir(export_dir / "alice")) == ["a.txt"]
    with node_export_folder(Settings(export_dir="")) as none:
        assert none == {}
    # Only a link was there: the note says so, and no folder is made for the client here.
    only_links = write_here(OneShotExports("/node/.oneshot-x/bob"), export_dir, "bob", 1024, "not exported: l (x)")
    assert only_links == "not exported: l (x)" and not (export_dir / "bob").exists()


def test_a_one_shot_folder_left_by_a_killed_worker_goes_with_the_next_run(tmp_path: Path) -> None:
    """An agent killed mid-run leaves its run's folder, until a run on that node finds its lock free."""
    node = Settings(export_dir=tmp_path)
    (tmp_path / "alice").mkdir()  # a client's folder is never touched
    killed = subprocess.run(
        [sys.executable, "-c", HOLD_AND_DIE, str(tmp_path)], env={**os.environ, "PYTHONPATH": str(SRC)},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert killed.returncode == -9, killed.stderr
    [left] = [name for name in os.listdir(tmp_path) if name != "alice"]
    with node_export_folder(node) as chosen:
        with node_export_folder(node) as other:  # a run going on at the same time keeps its folder
            assert other["export_dir"].is_dir()
        assert chosen["export_dir"].is_dir() and not (tmp_path / left).exists()
    assert os.listdir(tmp_path) == ["alice"]


SRC = Path(__file__).resolve().parents[2] / "src"
HOLD_AND_DIE = """
import os, signal, sys
from coderunner.cluster.oneshot_exports import node_export_folder
from coderunner.config import Settings
with node_export_folder(Settings(export_dir=sys.argv[1])) as chosen:
    (chosen["export_dir"] / "alice").mkdir()
    os.kill(os.getpid(), signal.SIGKILL)
"""
