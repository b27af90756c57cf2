"""A file read from the sandbox, shaped as MCP content: text, an image, a small blob, or a link.

The host does not parse file contents: images are recognised by their first bytes and passed
through as they are; anything too big for one reply becomes a resource link the client can
read on demand (sandbox://SESSION/PATH).
"""

from __future__ import annotations

import base64
import mimetypes
import os
import posixpath
from collections.abc import Iterator

from mcp.types import BlobResourceContents, CallToolResult, EmbeddedResource, ImageContent, ResourceLink, TextContent

from coderunner.hostfs.sandbox_files import SandboxFiles

#: First bytes of the image types a client can show.
IMAGE_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
)
#: Bytes looked at to tell text from binary.
SNIFF_BYTES = 8192


def image_type(head: bytes) -> str | None:
    for signature, mime in IMAGE_SIGNATURES:
        if head.startswith(signature):
            return mime
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    return None


def looks_like_text(head: bytes) -> bool:
    if b"\x00" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.start >= len(head) - 4  # a character cut at the sniff boundary
    return True


def resource_contents(sandbox_path: str, data: bytes) -> tuple[str | bytes, str]:
    """A sandbox:// resource's bytes as MCP contents: UTF-8 text as text, the rest as bytes (a blob),
    each with its MIME type (images by their first bytes, the rest by name, text/plain for unnamed text)."""
    mime = image_type(data[:SNIFF_BYTES])
    if mime is not None:
        return data, mime
    guessed = mimetypes.guess_type(sandbox_path)[0]
    if looks_like_text(data[:SNIFF_BYTES]):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            pass  # text-like at the start only: served as the bytes it is
        else:
            media = guessed is not None and guessed.startswith(("image/", "audio/", "video/"))
            if guessed is None or (media and "svg" not in guessed):
                return text, "text/plain"
            return text, guessed
    if guessed is None or guessed.startswith("text/"):
        guessed = "application/octet-stream"
    return data, guessed


def resource_uri(session_id: str, sandbox_path: str) -> str:
    return f"sandbox://{session_id}{sandbox_path}"


def resource_link(session_id: str, sandbox_path: str, size: int | None = None, mime: str | None = None) -> ResourceLink:
    mime = mime or mimetypes.guess_type(sandbox_path)[0] or "application/octet-stream"
    return ResourceLink(
        type="resource_link",
        uri=resource_uri(session_id, sandbox_path),
        name=posixpath.basename(sandbox_path) or sandbox_path,
        mime_type=mime,
        size=size,
    )


def read_file_result(
    files: SandboxFiles,
    session_id: str,
    path: str,
    *,
    limit: int,
    text_limit: int,
    image_limit: int,
    offset: int = 0,
    length: int | None = None,
    start_line: int | None = None,
    end_line: int | None = None,
    links: bool = True,
) -> CallToolResult:
    """`limit`: bytes sent inline (binary); text keeps within `text_limit` too (the cap of cell output), and a
    note says how to read the next range. `links=False`: what is too big to send inline is named in the text,
    without a resource_link."""
    with files.open_read(path) as (fd, size, sandbox_path):
        head = os.pread(fd, SNIFF_BYTES, 0)
        mime = image_type(head)
        if mime is not None:
            if size <= image_limit:
                encoded = base64.b64encode(os.pread(fd, size, 0)).decode()
                caption = TextContent(type="text", text=f"{sandbox_path}: {mime}, {size:,} bytes")
                return CallToolResult(content=[caption, ImageContent(type="image", data=encoded, mime_type=mime)])
            return _linked(session_id, sandbox_path, size, mime, "an image too big to show inline", links)
        if not looks_like_text(head):
            if size <= limit:
                blob = BlobResourceContents(
                    uri=resource_uri(session_id, sandbox_path),
                    blob=base64.b64encode(os.pread(fd, size, 0)).decode(),
                    mime_type=mimetypes.guess_type(sandbox_path)[0] or "application/octet-stream",
                )
                caption = TextContent(type="text", text=f"{sandbox_path}: binary, {size:,} bytes (base64 below)")
                return CallToolResult(content=[caption, EmbeddedResource(type="resource", resource=blob)])
            return _linked(session_id, sandbox_path, size, None, "binary and over the inline limit", links)
        text_limit = min(limit, text_limit)
        if start_line is not None or end_line is not None:
            text, note = _line_range(fd, start_line or 1, end_line, text_limit, sandbox_path)
        else:
            want = min(length if length is not None else text_limit, text_limit)
            data = os.pread(fd, want, offset)
            shown_to = offset + len(data)
            if shown_to < size:
                data = _whole_characters(data)  # the next range starts on a character
                shown_to = offset + len(data)
            text = data.decode("utf-8", "replace")
            note = ""
            if shown_to < size:
                then = f"next: read_file path={sandbox_path} offset={shown_to}"
                note = f"[bytes {offset:,}-{shown_to:,} of {size:,}; {then}]"
            elif offset:
                note = f"[bytes {offset:,}-{shown_to:,} of {size:,}; end of file]"
    body = f"{text}\n{note}" if note else text
    return CallToolResult(content=[TextContent(type="text", text=body)])


def _whole_characters(data: bytes) -> bytes:
    """`data` without a UTF-8 character cut at its end (at most 3 bytes go)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80:
            return data  # ASCII: nothing cut
        if byte >= 0xC0:  # a lead byte: keep its character if all its bytes are here
            needed = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return data if back >= needed or back == len(data) else data[:-back]
    return data  # not UTF-8 there: sent as it is


def _line_range(fd: int, start: int, end: int | None, limit: int, path: str) -> tuple[str, str]:
    """Lines start..end (1-based, inclusive), read sequentially, keeping at most `limit` bytes."""
    kept: list[bytes] = []
    kept_bytes = 0
    number = 0
    for line in _lines(fd, limit):
        number += 1
        if number < start:
            continue
        if end is not None and number > end:
            return _joined(kept), _range_note(start, number - 1)
        if kept_bytes + len(line) + 1 > limit:
            if not kept:
                return "", f"[line {number} is over the size limit: read it with offset/length]"
            return _joined(kept), _range_note(start, number - 1, truncated=True, path=path)
        kept.append(line)
        kept_bytes += len(line) + 1
    return _joined(kept), _range_note(start, number, at_end=True)


def _lines(fd: int, limit: int) -> Iterator[bytes]:
    """The file's lines; a line longer than `limit` is yielded cut (the caller stops there)."""
    position, pending = 0, b""
    while chunk := os.pread(fd, 1 << 20, position):
        position += len(chunk)
        *complete, pending = (pending + chunk).split(b"\n")
        yield from complete
        if len(pending) > limit:
            yield pending
            return
    if pending:
        yield pending


def _joined(lines: list[bytes]) -> str:
    return b"\n".join(lines).decode("utf-8", "replace")


def _range_note(start: int, last: int, *, truncated: bool = False, at_end: bool = False, path: str = "") -> str:
    if last < start:
        return f"[no lines from {start}: the file has {last} lines]"
    note = f"[lines {start}-{last}"
    if truncated:
        note += f"; stopped at the size limit; next: read_file path={path} start_line={last + 1}"
    return note + ("; end of file]" if at_end else "]")


def _linked(session_id: str, path: str, size: int, mime: str | None, why: str, links: bool) -> CallToolResult:
    if not links:
        advice = "work with it in run_python, or copy it to the export folder with transfer_file (download)"
        return CallToolResult(content=[TextContent(type="text", text=f"{path}: {size:,} bytes, {why}; {advice}")])
    text = TextContent(type="text", text=f"{path}: {size:,} bytes, {why}; read the linked resource instead")
    return CallToolResult(content=[text, resource_link(session_id, path, size, mime)])
