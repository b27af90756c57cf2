"""pdf_ops and image_ops, the seed's document tools: PDFs and images parsed by the guest inside the sandbox.

Both take `input_path`, `op` and `args`, as the seed's table says. `args` is a closed object: its
properties are every argument any op of the tool takes, each declared (free-form objects break
google-genai and OpenAI's strict mode), and the guest, which knows each op's parameters, refuses by
name one the chosen op does not take. Untrusted bytes are parsed in the sandbox, never here; paths
are confined by the session (Session.guest_op) before the guest sees them.
"""

# No `from __future__ import annotations`: the SDK reads tool signatures at runtime.

from typing import Annotated, Any, Literal

from mcp.server.mcpserver import Context
from mcp.types import CallToolResult
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from coderunner.errors import GuestCallError
from coderunner.tools.arguments import OutputPath, Pages, Seconds, SessionId, Text, page_ranges
from coderunner.tools.context import ToolContext, tool

PdfOp = Literal["info", "extract_text", "merge", "split", "rotate", "extract_pages", "to_images", "encrypt", "decrypt"]
ImageOp = Literal["info", "resize", "thumbnail", "crop", "rotate", "flip", "convert", "grayscale", "ocr"]
#: Arguments of the document tools that name sandbox files (besides input_path): confined by the session.
DOCUMENT_PATHS = ("output", "output_prefix", "inputs")


class OpArguments(BaseModel):
    """An op's arguments: closed (a misspelt one is refused by name, not ignored)."""

    model_config = ConfigDict(extra="forbid")

    def given(self) -> dict[str, Any]:
        """The arguments the caller set, away from their defaults: a strict-mode model sends every one,
        and the guest refuses by name an argument the op does not take."""
        return {
            name: value
            for name, value in self.model_dump().items()
            if value != type(self).model_fields[name].get_default(call_default_factory=True)
        }


class PdfArgs(OpArguments):
    pages: Pages = ""
    inputs: Annotated[list[str], Field(description="merge: files after input_path")] = []
    ranges: Annotated[str, BeforeValidator(page_ranges), Field(description="split: e.g. 1-2,3- (a file each)")] = ""
    degrees: Annotated[int | None, Field(description="rotate: a multiple of 90")] = None
    dpi: int = 100
    password: Text = ""
    output: OutputPath = ""
    output_prefix: OutputPath = ""


class ImageArgs(OpArguments):
    width: int | None = None
    height: int | None = None
    keep_aspect: bool = True
    size: int = 256
    box: Annotated[list[int], Field(description="left, top, right, bottom")] = []
    degrees: Annotated[float | None, Field(description="clockwise")] = None
    direction: Literal["horizontal", "vertical"] = "horizontal"
    format: Literal["png", "jpeg", "webp", "gif", "bmp", "tiff"] = "png"
    lang: str = "eng"
    output: OutputPath = ""


def called_as(message: str, helper: str, tool: str) -> str:
    """A guest helper's failure as the tool the model called, its name said once ('pdf_ops: pdf_ops merge
    ...' reads 'pdf_ops: merge ...')."""
    if not message.startswith(helper):
        return message
    rest = message.removeprefix(helper)
    return tool + (": " + rest.removeprefix(f": {tool} ") if rest.startswith(f": {tool} ") else rest)


async def document_op(
    tools: ToolContext, ctx: Context, helper: str, input_path: str, op: str, arguments: dict[str, Any],
    session_id: str, timeout_s: float | None,
) -> CallToolResult:  # fmt: skip
    """Run one op of the guest helper named `helper` (the tool of that name) in the caller's session, under
    the network rules of a call."""
    session = await tools.session(ctx, session_id)
    limit = timeout_s or tools.settings.timeout_s
    async with tools.egress_call(ctx, session) as network:
        try:
            result = await session.guest_op(helper, op, arguments, limit, paths=DOCUMENT_PATHS, input_path=input_path)
        except GuestCallError as exc:
            raise GuestCallError(called_as(str(exc), helper, helper)) from None
    return network.noted(await tools.guest_reply(session, result))


@tool(group="documents")
async def pdf_ops(
    tools: ToolContext,
    ctx: Context,
    input_path: str,
    op: PdfOp,
    args: PdfArgs = PdfArgs(),  # noqa: B008 - immutable in use: only read
    session_id: SessionId = "",
    timeout_s: Seconds = None,
) -> CallToolResult:
    """A PDF in the sandbox; outputs beside the input. args by op: extract_text, extract_pages (pages), merge
    (inputs), split (ranges), rotate (degrees, pages), to_images (pages, dpi), encrypt, decrypt (password;
    it also opens an encrypted input), output or output_prefix."""
    return await document_op(tools, ctx, "pdf_ops", input_path, op, args.given(), session_id, timeout_s)


@tool(group="documents")
async def image_ops(
    tools: ToolContext,
    ctx: Context,
    input_path: str,
    op: ImageOp,
    args: ImageArgs = ImageArgs(),  # noqa: B008 - immutable in use: only read
    session_id: SessionId = "",
    timeout_s: Seconds = None,
) -> CallToolResult:
    """An image in the sandbox, with a preview; output beside the input. args by op: resize (width, height,
    keep_aspect), thumbnail (size), crop (box), rotate (degrees), flip (direction), convert (format),
    ocr (lang), output."""
    return await document_op(tools, ctx, "image_ops", input_path, op, args.given(), session_id, timeout_s)
