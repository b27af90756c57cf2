"""document_ops (PDFs and images) and use_browser: work done by the guest helpers inside the sandbox.

Untrusted bytes (PDFs, images, web pages) are parsed in the sandbox, never here. Paths are confined
by the session (Session.guest_op) before the guest sees them; answers are bounded like cell output.
"""

# No `from __future__ import annotations`: the SDK reads tool signatures at runtime.

import inspect
import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

from mcp.server.mcpserver import Context
from mcp.types import CallToolResult
from pydantic import Field

from coderunner.egress.ceiling import NetworkMode, more_network
from coderunner.errors import GuestCallError
from coderunner.tools.arguments import BrowserSeconds, OutputPath, Pages, Seconds, SessionId, Text
from coderunner.tools.context import ToolContext

PDF_OPS = ("info", "extract_text", "merge", "split", "rotate", "extract_pages", "to_images", "encrypt", "decrypt")
IMAGE_OPS = ("info", "resize", "thumbnail", "crop", "rotate", "flip", "convert", "grayscale", "ocr")
DocumentOp = Literal[
    "info", "extract_text", "extract_pages", "rotate", "to_images", "merge", "split", "encrypt", "decrypt",
    "resize", "thumbnail", "crop", "flip", "convert", "grayscale", "ocr",
]  # fmt: skip
#: Arguments of the document tools that name sandbox files (besides input_path).
DOCUMENT_PATHS = ("output", "output_prefix", "inputs")
#: Default wait for a page, and the extra allowance for starting the browser on first use.
BROWSER_TIMEOUT_S = 30.0
BROWSER_START_S = 30.0
#: The arguments each use_browser action takes: navigate, extract and screenshot are guest/browser.py's ops of
#: those names; every other action is its `interact` op.
BROWSER_TAKES = {
    "navigate": ("url", "selector", "timeout_s"),
    "extract": ("selector", "format", "attribute"),
    "screenshot": ("full_page", "selector", "output"),
}
INTERACT_TAKES = ("selector", "value", "timeout_s")
BrowserAction = Literal["navigate", "extract", "screenshot", "click", "fill", "press", "select", "scroll", "wait_for"]
#: Arguments of document_ops that are not the op's own.
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


def called_as(message: str, helper: str, tool: str) -> str:
    """A guest helper's failure as the tool the model called: the session names the helper it ran, and
    the guest's own text may name the tool again ('pdf_ops: document_ops merge ...'): said once."""
    if not message.startswith(helper):
        return message
    rest = message.removeprefix(helper)
    return tool + (": " + rest.removeprefix(f": {tool} ") if rest.startswith(f": {tool} ") else rest)


def document_kind(op: str, input_path: str) -> str:
    """Which guest helper does `op`: the PDF one or the image one (info and rotate: as the input's name says)."""
    if op not in IMAGE_OPS:
        return "pdf_ops"
    if op not in PDF_OPS:
        return "image_ops"
    return "pdf_ops" if input_path.lower().endswith(".pdf") else "image_ops"


def register(tools: ToolContext) -> None:
    # Over 80 lines on purpose: one short nested function per tool, registered by its decorator here.
    settings = tools.settings

    @tools.tool(group="documents")
    async def document_ops(
        ctx: Context,
        input_path: str,
        op: DocumentOp,
        pages: Pages = "",
        inputs: list[str] = [],  # noqa: B006 - read only; no null for a strict-mode model to send
        ranges: Annotated[list[str], Field(description="e.g. 1-2, 3-")] = [],  # noqa: B006 - as inputs
        degrees: float | None = None,
        dpi: int = 100,
        password: Text = "",
        width: int | None = None,
        height: int | None = None,
        keep_aspect: bool = True,
        size: int = 256,
        box: Annotated[list[int], Field(description="left, top, right, bottom")] = [],  # noqa: B006 - as inputs
        direction: Literal["horizontal", "vertical"] = "horizontal",
        format: Literal["png", "jpeg", "webp", "gif", "bmp", "tiff"] = "png",
        lang: str = "eng",
        output: OutputPath = "",
        output_prefix: OutputPath = "",
        session_id: SessionId = "",
        timeout_s: Seconds = None,
    ) -> CallToolResult:
        """PDFs and images in the sandbox, output beside input. PDF: info, extract_text, extract_pages, rotate,
        to_images (pages, dpi), merge (inputs), split (ranges), encrypt, decrypt (password). Image:
        info, resize (width, height, keep_aspect), thumbnail (size), crop (box), rotate (degrees), flip
        (direction), convert (format), grayscale, ocr (lang)."""
        kind = document_kind(op, input_path)
        arguments = op_arguments(document_ops, locals())
        if kind == "pdf_ops" and isinstance(degrees, float) and degrees.is_integer():
            arguments["degrees"] = int(degrees)  # pdf pages turn in whole quarter turns
        session = await tools.session(ctx, session_id)
        limit = timeout_s or settings.timeout_s
        async with tools.egress_call(ctx, session) as network:
            try:
                result = await session.guest_op(kind, op, arguments, limit, paths=DOCUMENT_PATHS, input_path=input_path)
            except GuestCallError as exc:
                raise GuestCallError(called_as(str(exc), kind, "document_ops")) from None
        return network.noted(await tools.guest_reply(session, result))

    async def browser(
        ctx: Context, session_id: str, op: str, args: dict[str, Any], timeout_s: float | None
    ) -> CallToolResult:
        session = await tools.session(ctx, session_id)
        limit = (timeout_s or BROWSER_TIMEOUT_S) + BROWSER_START_S
        async with tools.egress_call(ctx, session) as network:
            try:
                result = await session.guest_op("browser", op, args, limit, paths=("output",))
            except GuestCallError as failed:
                exc = GuestCallError(called_as(str(failed), "browser", "use_browser"))
                # The guest says only that the network is off; the way out depends on the user's ceiling.
                if session.options.network == NetworkMode.NONE and "network is off" in str(exc):
                    way_out = more_network(tools.settings.network_ceiling)
                    raise GuestCallError(f"{exc}; to browse the web: {way_out}") from None
                raise exc from None
        return network.noted(await tools.guest_reply(session, result))

    @tools.tool(group="browser")
    async def use_browser(
        ctx: Context,
        action: BrowserAction,
        url: Text = "",
        selector: Annotated[Text, Field(description="CSS; navigate waits for it")] = "",
        value: Annotated[Text, Field(description="fill, press, select")] = "",
        format: Literal["text", "html", "json", "table", "links"] = "text",
        attribute: Annotated[Text, Field(description="extract it instead")] = "",
        full_page: bool = False,
        output: Annotated[Text, Field(description="screenshot.png")] = "",
        timeout_s: BrowserSeconds = None,
        session_id: SessionId = "",
    ) -> CallToolResult:
        """The session's Chromium: navigate (url; offline only file:///workspace/...), extract (selector's
        matches), screenshot, click, fill, press, select, scroll, wait_for (selector)."""
        given = {name: item for name, item in locals().items() if name in _BROWSER_ARGUMENTS}
        op, args = browser_call(action, given)
        return await browser(ctx, session_id, op, args, timeout_s)


#: use_browser's own arguments, each with the value that means "not given".
_BROWSER_ARGUMENTS = {
    "url": "", "selector": "", "value": "", "format": "text", "attribute": "", "full_page": False, "output": "",
    "timeout_s": None,
}  # fmt: skip


def browser_call(action: str, given: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The guest op and its arguments for a use_browser action; an argument the action does not take, or a
    missing url or selector, is refused by name."""
    takes = BROWSER_TAKES.get(action, INTERACT_TAKES)
    stray = [name for name, value in given.items() if name not in takes and value != _BROWSER_ARGUMENTS[name]]
    if stray:
        raise GuestCallError(f"use_browser action {action!r} takes no {', '.join(stray)} (it takes {', '.join(takes)})")
    needed = "url" if action == "navigate" else "selector" if action != "screenshot" else None
    if needed and not given[needed]:
        raise GuestCallError(f"use_browser action {action!r} needs a {needed}")
    timeout_s = given["timeout_s"]
    if action == "navigate" and not absolute_url(given["url"]):
        raise GuestCallError(
            f"use_browser navigate needs an absolute URL (http://..., https://... or file:///workspace/...), "
            f"not {given['url'][:200]!r}"
        )
    if action == "navigate":
        return "navigate", {"url": given["url"], "wait_for": given["selector"] or None,
                            "timeout_s": timeout_s or BROWSER_TIMEOUT_S}  # fmt: skip
    if action == "extract":
        return "extract", {"selector": given["selector"], "format": given["format"],
                           "attribute": given["attribute"] or None}  # fmt: skip
    if action == "screenshot":
        return "screenshot", {"full_page": given["full_page"], "selector": given["selector"] or None,
                              "output": given["output"] or "screenshot.png"}  # fmt: skip
    return "interact", {"action": action, "selector": given["selector"], "value": given["value"] or None,
                        "timeout_s": timeout_s or 10}  # fmt: skip


def absolute_url(url: str) -> bool:
    """A URL the browser can open as it is: a scheme and '//' (http, https, file), or about: and data:."""
    return bool(re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*://", url)) or url.startswith(("about:", "data:"))
