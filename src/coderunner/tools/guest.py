"""pdf_ops, image_ops and the browser tools: work done by the guest helpers inside the sandbox.

Untrusted bytes (PDFs, images, web pages) are parsed in the sandbox, never here. Paths are confined
by the session (Session.guest_op) before the guest sees them; answers are bounded like cell output.
"""

# No `from __future__ import annotations`: the SDK reads tool signatures at runtime.

import inspect
from collections.abc import Callable
from typing import Annotated, Any, Literal

from mcp.server.mcpserver import Context
from mcp.types import CallToolResult, ToolAnnotations
from pydantic import Field

from coderunner.egress.ceiling import NetworkMode, more_network
from coderunner.errors import GuestCallError
from coderunner.tools.arguments import BrowserSeconds, OutputPath, Seconds, SessionId, Text
from coderunner.tools.context import ToolContext

PdfOp = Literal["info", "extract_text", "merge", "split", "rotate", "extract_pages", "to_images", "encrypt", "decrypt"]
ImageOp = Literal["info", "resize", "thumbnail", "crop", "rotate", "flip", "convert", "grayscale", "ocr"]
#: Arguments of the document tools that name sandbox files (besides input_path).
DOCUMENT_PATHS = ("output", "output_prefix", "inputs")
#: Default wait for a page, and the extra allowance for starting the browser on first use.
BROWSER_TIMEOUT_S = 30.0
BROWSER_START_S = 30.0
#: Arguments of pdf_ops and image_ops that are not the op's own.
_NOT_OP_ARGUMENTS = frozenset({"ctx", "input_path", "op", "session_id", "timeout_s"})


def op_arguments(tool: Callable[..., Any], values: dict[str, Any]) -> dict[str, Any]:
    """The op arguments the caller set (those away from their default), for the guest to check against the op.

    The schema is flat (one optional field per argument of any op), so the guest, which knows each op's
    parameters, refuses by name an argument the chosen op does not take.
    """
    parameters = inspect.signature(tool).parameters
    return {
        name: values[name]
        for name, parameter in parameters.items()
        if name not in _NOT_OP_ARGUMENTS and values[name] != parameter.default
    }


def register(tools: ToolContext) -> None:
    # Over 80 lines on purpose: one short nested function per tool, registered by its decorator here.
    settings = tools.settings

    async def document(
        ctx: Context,
        tool: str,
        session_id: str,
        input_path: str,
        op: str,
        args: dict[str, Any],
        timeout_s: float | None,
    ) -> CallToolResult:
        session = await tools.session(ctx, session_id)
        limit = timeout_s or settings.timeout_s
        async with tools.egress_call(ctx, session) as network:
            result = await session.guest_op(tool, op, args, limit, paths=DOCUMENT_PATHS, input_path=input_path)
        return network.noted(await tools.guest_reply(session, result))

    @tools.tool(group="documents")
    async def pdf_ops(
        ctx: Context,
        input_path: str,
        op: PdfOp,
        pages: Annotated[Text, Field(description="e.g. '1-3,5'; default all.")] = "",
        inputs: list[str] | None = None,
        ranges: Annotated[list[str] | None, Field(description="e.g. ['1-2','3-']")] = None,
        degrees: int | None = None,
        dpi: int = 100,
        password: Text = "",
        output: OutputPath = "",
        output_prefix: OutputPath = "",
        session_id: SessionId = "",
        timeout_s: Seconds = None,
    ) -> CallToolResult:
        """PDF ops in the sandbox. pages: extract_text, extract_pages, rotate, to_images; merge: inputs; split:
        ranges; rotate: degrees (90s); to_images: dpi; encrypt, decrypt: password (also opens encrypted
        input). Outputs default beside the input."""
        arguments = op_arguments(pdf_ops, locals())
        return await document(ctx, "pdf_ops", session_id, input_path, op, arguments, timeout_s)

    @tools.tool(group="documents")
    async def image_ops(
        ctx: Context,
        input_path: str,
        op: ImageOp,
        width: int | None = None,
        height: int | None = None,
        keep_aspect: bool = True,
        size: int = 256,
        box: Annotated[list[int] | None, Field(description="[left, top, right, bottom]")] = None,
        degrees: float | None = None,
        direction: Literal["horizontal", "vertical"] = "horizontal",
        format: Literal["png", "jpeg", "webp", "gif", "bmp", "tiff"] = "png",
        lang: str = "eng",
        output: OutputPath = "",
        session_id: SessionId = "",
        timeout_s: Seconds = None,
    ) -> CallToolResult:
        """Image ops in the sandbox, with a preview. resize: width/height, keep_aspect; thumbnail: size; crop:
        box; rotate: degrees (clockwise); flip: direction; convert: format; ocr: lang. output defaults beside
        the input."""
        arguments = op_arguments(image_ops, locals())
        return await document(ctx, "image_ops", session_id, input_path, op, arguments, timeout_s)

    async def browser(
        ctx: Context, session_id: str, op: str, args: dict[str, Any], timeout_s: float | None
    ) -> CallToolResult:
        session = await tools.session(ctx, session_id)
        limit = (timeout_s or BROWSER_TIMEOUT_S) + BROWSER_START_S
        async with tools.egress_call(ctx, session) as network:
            try:
                result = await session.guest_op("browser", op, args, limit, paths=("output",))
            except GuestCallError as exc:
                # The guest says only that the network is off; the way out depends on the user's ceiling.
                if session.options.network == NetworkMode.NONE and "network is off" in str(exc):
                    way_out = more_network(tools.settings.network_ceiling)
                    raise GuestCallError(f"{exc}; to browse the web: {way_out}") from None
                raise
        return network.noted(await tools.guest_reply(session, result))

    @tools.tool(group="browser", annotations=ToolAnnotations(open_world_hint=True))
    async def browser_navigate(
        ctx: Context,
        url: str,
        wait_for: Annotated[Text, Field(description="CSS selector.")] = "",
        timeout_s: BrowserSeconds = None,
        session_id: SessionId = "",
    ) -> CallToolResult:
        """Open a page in the session's Chromium (offline: file:///workspace/... or sandbox servers only):
        url, status, title, text."""
        args = {"url": url, "wait_for": wait_for or None, "timeout_s": timeout_s or BROWSER_TIMEOUT_S}
        return await browser(ctx, session_id, "navigate", args, timeout_s)

    @tools.tool(group="browser")
    async def browser_extract(
        ctx: Context,
        selector: str,
        format: Literal["text", "html", "json", "table", "links"] = "text",
        attribute: Annotated[Text, Field(description="Instead: this attribute of each match.")] = "",
        session_id: SessionId = "",
    ) -> CallToolResult:
        """Matches of a CSS selector on the current page as text, html, JSON, table rows or links."""
        args = {"selector": selector, "format": format, "attribute": attribute or None}
        return await browser(ctx, session_id, "extract", args, None)

    @tools.tool(group="browser")
    async def browser_screenshot(
        ctx: Context,
        full_page: bool = False,
        selector: Annotated[Text, Field(description="Only this element.")] = "",
        output: str = "screenshot.png",
        session_id: SessionId = "",
    ) -> CallToolResult:
        """Screenshot of the current page or an element, as an image; also saved to output."""
        args = {"full_page": full_page, "selector": selector or None, "output": output}
        return await browser(ctx, session_id, "screenshot", args, None)

    @tools.tool(group="browser")
    async def browser_interact(
        ctx: Context,
        action: Literal["click", "fill", "press", "select", "scroll", "wait_for"],
        selector: str,
        value: Annotated[Text, Field(description="Text to fill, key to press, option to select.")] = "",
        timeout_s: BrowserSeconds = None,
        session_id: SessionId = "",
    ) -> CallToolResult:
        """Act on an element of the current page (CSS selector)."""
        args = {"action": action, "selector": selector, "value": value or None, "timeout_s": timeout_s or 10}
        return await browser(ctx, session_id, "interact", args, timeout_s)
