"""ExecutionResult: what one run_python call produced, and its shape as MCP content."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mcp.types import CallToolResult, ContentBlock, ImageContent, TextContent

from .file_results import resource_link
from .kernel import RunOutcome, RunStatus


@dataclass
class ExecutionResult:
    """A RunOutcome plus what the session did about it (restart, state kept or lost)."""

    outcome: RunOutcome
    notice: str | None = None
    state_lost: bool = False

    @property
    def is_error(self) -> bool:
        return self.outcome.status is not RunStatus.OK

    def to_call_result(self, session_id: str | None = None) -> CallToolResult:
        """Text, then one image per inline image, then links to what was saved in the workspace."""
        output = self.outcome.output
        text = output.text()
        lines: list[str] = []
        if text:
            lines.append(text.rstrip("\n"))
        if self.notice:
            lines.append(f"[{self.notice}]")
        if output.saved_images:
            lines.append("[more images than fit in one reply; saved: " + ", ".join(output.saved_images) + "]")
        count = self.outcome.execution_count
        footer = f"[{self.outcome.status.value} in {self.outcome.duration_s:.3f}s"
        footer += f", cell {count}]" if count is not None else "]"
        lines.append(footer)
        content: list[ContentBlock] = [TextContent(type="text", text="\n".join(lines))]
        content.extend(
            ImageContent(type="image", data=image.data_b64, mime_type=image.mime_type) for image in output.images
        )
        if session_id is not None:
            saved = [output.spill_path] if output.spill_path else []
            saved += [path for path in output.saved_images if path.startswith("/")]
            content.extend(resource_link(session_id, path) for path in saved)
        return CallToolResult(content=content, is_error=self.is_error)


#: Keys of guest results that carry base64 PNG previews (shown as images, not as text).
PREVIEW_KEYS = ("preview", "previews")


def guest_tool_result(result: dict[str, Any]) -> CallToolResult:
    """A guest tool's answer: its JSON as text, and every preview as an image."""
    previews = []
    for key in PREVIEW_KEYS:
        value = result.pop(key, None)
        previews.extend(value if isinstance(value, list) else [value] if isinstance(value, str) else [])
    content: list[ContentBlock] = [TextContent(type="text", text=json.dumps(result, indent=2))]
    content.extend(ImageContent(type="image", data=data, mime_type="image/png") for data in previews)
    return CallToolResult(content=content, structured_content=result)


def error_result(message: str) -> CallToolResult:
    """A failure the caller can act on: a tool result with isError, never a crash."""
    return CallToolResult(content=[TextContent(type="text", text=message)], is_error=True)
