"""Replies as MCP content: a cell's result, a guest tool's answer, and an error the caller can act on."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mcp.types import CallToolResult, ContentBlock, ImageContent, TextContent

from coderunner.kernel.output_capture import MAX_INLINE_IMAGES, OutputCollector, WorkspaceWriter
from coderunner.kernel.run_result import ExecutionResult
from coderunner.tools.file_results import resource_link


def execution_reply(result: ExecutionResult, session_id: str | None = None, *, links: bool = True) -> CallToolResult:
    """Text, then one image per inline image, then links to what was saved in the workspace.

    The text always names the saved files; `links=False` leaves out the resource_link blocks,
    for clients that cannot follow them (the file_links setting).
    """
    output = result.outcome.output
    text = output.text()
    lines: list[str] = []
    if text:
        lines.append(text.rstrip("\n"))
    if result.notice:
        lines.append(f"[{result.notice}]")
    if output.saved_images:
        lines.append("[more images than fit in one reply; saved: " + ", ".join(output.saved_images) + "]")
    if output.dropped_images:
        lines.append(f"[{output.dropped_images:,} more images were neither shown nor saved]")
    count = result.outcome.execution_count
    footer = f"[{result.outcome.status.value} in {result.outcome.duration_s:.3f}s"
    footer += f", cell {count}]" if count is not None else "]"
    lines.append(footer)
    content: list[ContentBlock] = [TextContent(type="text", text="\n".join(lines))]
    content.extend(
        ImageContent(type="image", data=image.data_b64, mime_type=image.mime_type) for image in output.images
    )
    if session_id is not None and links:
        saved = [output.spill_path] if output.spill_path else []
        saved += [path for path in output.saved_images if path.startswith("/")]
        content.extend(resource_link(session_id, path) for path in saved)
    return CallToolResult(content=content, is_error=result.is_error)


#: Keys of guest results that carry base64 PNG previews (shown as images, not as text).
PREVIEW_KEYS = ("preview", "previews")


@dataclass(frozen=True)
class ReplyBounds:
    """What one reply may carry inline: the bounds of cell output (settings), applied to any answer."""

    text_chars: int
    image_bytes: int
    spill_bytes: int
    image_count: int = MAX_INLINE_IMAGES


def guest_tool_result(
    result: dict[str, Any], bounds: ReplyBounds, writer: WorkspaceWriter | None = None
) -> CallToolResult:
    """A guest tool's answer (untrusted: the sandbox wrote it) as compact JSON text plus its previews as images.

    Bounded like cell output: the text keeps head and tail (the whole JSON goes to a workspace file
    when `writer` is given), and previews are shown within the image byte and count budgets. Every
    preview is of a file the tool wrote, so those over budget are only counted, never saved again.
    """
    previews: list[str] = []
    for key in PREVIEW_KEYS:
        value = result.pop(key, None)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str) and item:
                previews.append(item)
    shown: list[str] = []
    used = 0
    for data in previews:
        if len(shown) >= bounds.image_count:
            break
        if used + len(data) > bounds.image_bytes:
            continue  # as in cell output: a smaller one further on may still fit
        shown.append(data)
        used += len(data)
    text = OutputCollector(limit_chars=bounds.text_chars, spill_limit_bytes=bounds.spill_bytes, image_limit_bytes=0,
                           writer=writer)  # fmt: skip
    try:
        text.add_text(json.dumps(result, separators=(",", ":")))
    finally:
        text.close()
    body = text.text()
    if len(shown) < len(previews):
        left = len(previews) - len(shown)
        body += f"\n[{left:,} of {len(previews):,} previews not shown: over the inline image budget]"
    content: list[ContentBlock] = [TextContent(type="text", text=body)]
    content.extend(ImageContent(type="image", data=data, mime_type="image/png") for data in shown)
    return CallToolResult(content=content)  # the text only, once (as json_result)


#: Longest error message a reply carries (some quote what a sandbox said).
MAX_ERROR_CHARS = 4000


def error_result(message: str) -> CallToolResult:
    """A failure the caller can act on: a tool result with isError, never a crash."""
    if len(message) > MAX_ERROR_CHARS:
        half = MAX_ERROR_CHARS // 2
        message = f"{message[:half]}\n[... {len(message) - 2 * half:,} characters omitted ...]\n{message[-half:]}"
    return CallToolResult(content=[TextContent(type="text", text=message)], is_error=True)
