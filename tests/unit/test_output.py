"""Bounded output capture: head and tail inline, the whole spilled safely into the workspace."""

from __future__ import annotations

import base64
import os
import threading
from pathlib import Path

import anyio

from coderunner.kernel.output_capture import SPILL_DIR, OutputCollector, WorkspaceWriter, strip_ansi


def collector(tmp_path: Path, **overrides: int) -> OutputCollector:
    limits = {"limit_chars": 1_000, "spill_limit_bytes": 1_000_000, "image_limit_bytes": 100}
    limits.update(overrides)
    return OutputCollector(writer=WorkspaceWriter(tmp_path, "/workspace"), **limits)


def host_path(tmp_path: Path, sandbox_path: str) -> Path:
    return tmp_path / sandbox_path.removeprefix("/workspace/")


def test_small_output_is_kept_whole(tmp_path: Path) -> None:
    out = collector(tmp_path)
    out.add_text("hello\n")
    out.add_text("\x1b[31mred\x1b[0m\n")
    assert out.text() == "hello\nred\n"
    assert not out.truncated and out.spill_path is None
    assert not (tmp_path / SPILL_DIR).exists()


def test_large_output_keeps_head_and_tail_and_spills_everything(tmp_path: Path) -> None:
    out = collector(tmp_path)
    lines = [f"line {i}\n" for i in range(5_000)]
    for line in lines:
        out.add_text(line)
    out.close()
    text = out.text()
    assert text.startswith("line 0\n") and text.endswith("line 4999\n")
    assert len(text) < 1_200
    assert out.spill_path is not None and out.spill_path in text
    assert host_path(tmp_path, out.spill_path).read_text() == "".join(lines)


def test_one_huge_chunk_is_bounded_in_memory(tmp_path: Path) -> None:
    out = collector(tmp_path)
    out.add_text("a" * 3_000_000 + "END")
    assert sum(len(part) for part in out.tail) <= 1_000
    assert out.text().endswith("END")


def test_spill_stops_at_its_limit_and_says_so(tmp_path: Path) -> None:
    out = collector(tmp_path, spill_limit_bytes=10_000)
    for _ in range(100):
        out.add_text("x" * 1_000)
    out.close()
    assert out.spill_path is not None
    assert host_path(tmp_path, out.spill_path).stat().st_size == 10_000
    assert "cut at the spill limit" in out.text()


def test_planted_symlink_is_not_followed(tmp_path: Path) -> None:
    """Sandbox code can make .coderunner a link to a host folder; the host must not write through it."""
    victim = tmp_path / "victim"
    victim.mkdir()
    workspace = tmp_path / "ws"
    workspace.mkdir()
    os.symlink(victim, workspace / SPILL_DIR)
    out = OutputCollector(limit_chars=1_000, spill_limit_bytes=10_000, image_limit_bytes=0,
                          writer=WorkspaceWriter(workspace, "/workspace"))  # fmt: skip
    out.add_text("y" * 5_000)
    assert list(victim.iterdir()) == []
    assert out.spill_error is not None and "not saved" in out.text()


def test_images_over_budget_are_saved_as_files(tmp_path: Path) -> None:
    out = collector(tmp_path, image_limit_bytes=100)
    small = base64.b64encode(b"\x89PNG" + b"s" * 20).decode()
    big = base64.b64encode(b"\x89PNG" + b"b" * 500).decode()
    out.add_image("image/png", small)
    out.add_image("image/png", big)
    assert [image.data_b64 for image in out.images] == [small]
    assert len(out.saved_images) == 1 and out.saved_images[0].endswith(".png")
    assert host_path(tmp_path, out.saved_images[0]).read_bytes() == base64.b64decode(big)


def test_strip_ansi_handles_colour_and_cursor_codes() -> None:
    assert strip_ansi("\x1b[0;31mError\x1b[0m \x1b[2K\x1b]0;title\x07done") == "Error done"


def test_deferred_file_writes_wait_for_drain_in_a_worker_thread(tmp_path: Path) -> None:
    """A collector fed on the event loop queues its spill and image files; drain() writes them off the loop."""
    out = collector(tmp_path, image_limit_bytes=0, spill_limit_bytes=10_000)
    out.defer_files = True
    lines = [f"line {i}\n" for i in range(2_000)]
    for line in lines:
        out.add_text(line)
    out.add_image("image/png", base64.b64encode(b"\x89PNG" + b"i" * 50).decode())
    assert out.pending and not (tmp_path / SPILL_DIR).exists()  # nothing touched the disk yet
    writer, creators = out.writer, []
    assert writer is not None
    create = writer.create

    def recording_create(prefix: str, suffix: str) -> tuple[int, str]:
        creators.append(threading.get_ident())
        return create(prefix, suffix)

    writer.create = recording_create  # type: ignore[method-assign]
    anyio.run(out.drain)
    out.close()
    assert creators and threading.get_ident() not in creators  # created in a worker thread
    assert not out.pending and out.spill_path is not None and len(out.saved_images) == 1
    assert host_path(tmp_path, out.spill_path).read_bytes() == "".join(lines).encode()[:10_000]
    assert "cut at the spill limit" in out.text()
    assert host_path(tmp_path, out.saved_images[0]).read_bytes().startswith(b"\x89PNG")
