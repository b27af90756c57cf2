"""read_file (a file, or a folder's listing), write_file, transfer_file (upload, download) and the
sandbox:// resource.

Every path goes through the session's file view (files.py): the host never follows what the
sandbox wrote. Copies and walks run off the event loop.
"""

# No `from __future__ import annotations`: the SDK reads tool signatures at runtime.

import base64
import binascii
import posixpath
from dataclasses import asdict
from typing import Annotated, Any, Literal

from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ResourceError
from mcp.types import CallToolResult
from pydantic import Field

from coderunner.errors import CodeRunnerError
from coderunner.hostfs.sandbox_files import FileAccessError, copy
from coderunner.hostfs.transfers import export_target, import_source
from coderunner.tools.arguments import SessionId, Text
from coderunner.tools.context import ToolContext, json_result, resource, tool
from coderunner.tools.file_results import read_file_result


def decoded(content: str, encoding: str) -> bytes:
    """write_file's content as bytes; FileAccessError for base64 that is not."""
    try:
        return base64.b64decode(content, validate=True) if encoding == "base64" else content.encode()
    except binascii.Error:
        raise FileAccessError("content is not valid base64") from None


@tool(group="files")
async def read_file(
    tools: ToolContext,
    path: str,
    ctx: Context,
    session_id: SessionId = "",
    offset: Annotated[int, Field(ge=0)] = 0,
    length: Annotated[int | None, Field(ge=1)] = None,
    start_line: Annotated[int | None, Field(ge=1)] = None,
    end_line: Annotated[int | None, Field(ge=1)] = None,
    depth: Annotated[int, Field(ge=1, le=5, description="Of a folder.")] = 1,
) -> CallToolResult:
    """Read a sandbox file (text by byte offset/length or lines; images; big files as links) or list a
    folder."""
    session = await tools.session(ctx, session_id)
    try:
        return await tools.off_loop(
            read_file_result, session.files, session.session_id, path, limit=tools.settings.read_limit_bytes,
            text_limit=tools.settings.output_limit_chars, image_limit=tools.settings.image_limit_bytes, offset=offset,
            length=length, start_line=start_line, end_line=end_line, links=tools.settings.file_links == "resource_link",
        )  # fmt: skip
    except FileAccessError as refused:  # a folder is listed; anything else is refused as the read said
        try:
            entries = await tools.off_loop(session.files.list, path, depth)
        except FileAccessError:
            raise refused from None
    return json_result({"path": path, "entries": [asdict(entry) for entry in entries]})


@tool(group="files")
async def write_file(
    tools: ToolContext,
    path: str,
    content: str,
    ctx: Context,
    encoding: Literal["text", "base64"] = "text",
    overwrite: bool = True,
    session_id: SessionId = "",
) -> CallToolResult:
    """Write a file in the workspace or a rw mount."""
    session = await tools.session(ctx, session_id)
    data = await tools.off_loop(decoded, content, encoding)
    written = await tools.off_loop(session.files.write, path, data, overwrite=overwrite, bulk=True)
    await session.copy_out()  # a file written to the export mount leaves now, as after a run
    payload: dict[str, Any] = {"path": written, "bytes": len(data)}
    if session.export_note:
        payload["exported"] = session.export_note
    return json_result(payload)


async def upload(
    tools: ToolContext, ctx: Context, host_path: str, sandbox_path: str, overwrite: bool, session_id: str
) -> CallToolResult:
    """transfer_file upload: a host file from an import folder into the sandbox."""
    session = await tools.session(ctx, session_id)
    source = await tools.off_loop(import_source, tools.settings.import_dirs, host_path)  # resolves: stats
    target = sandbox_path or posixpath.basename(source.path)
    try:
        copied, _, written = await tools.off_loop(
            copy, source.view, source.path, session.files, target, bulk=True,
            limit=tools.settings.transfer_limit_bytes, overwrite=overwrite,
        )  # fmt: skip
    except FileAccessError as refused:
        raise source.in_host_words(refused) from None
    return json_result({"host_path": str(source.host_path(source.path)), "sandbox_path": written,
                        "bytes": copied})  # fmt: skip


async def download(
    tools: ToolContext, ctx: Context, host_path: str, sandbox_path: str, overwrite: bool, session_id: str
) -> CallToolResult:
    """transfer_file download: a sandbox file into the caller's own export folder."""
    session = await tools.session(ctx, session_id)
    target = await tools.off_loop(
        export_target, tools.settings.export_dir, session.options.client,  # mkdir, open
        host_path or None, posixpath.basename(sandbox_path), session.sandbox_uid,
    )  # fmt: skip
    try:
        copied, read_from, written = await tools.off_loop(
            copy, session.files, sandbox_path, target.view, target.path, bulk=True,
            limit=tools.settings.transfer_limit_bytes, overwrite=overwrite,
        )  # fmt: skip
    except FileAccessError as refused:  # named as the user knows the export folder, not as the view does
        raise target.in_host_words(refused) from None
    return json_result({"sandbox_path": read_from, "host_path": str(target.host_path(written)),
                        "bytes": copied})  # fmt: skip


@tool(group="files")
async def transfer_file(
    tools: ToolContext,
    direction: Literal["upload", "download"],
    ctx: Context,
    host_path: Text = "",
    sandbox_path: Text = "",
    overwrite: bool = False,
    session_id: SessionId = "",
) -> CallToolResult:
    """upload: host_path (from an import folder) into the sandbox; download: sandbox_path to the export
    folder. The other path defaults to the name."""
    given, side = (host_path, "host_path") if direction == "upload" else (sandbox_path, "sandbox_path")
    if not given:
        raise FileAccessError(f"transfer_file direction {direction!r} needs {side}")
    move = upload if direction == "upload" else download
    return await move(tools, ctx, host_path, sandbox_path, overwrite, session_id)


@resource(
    "sandbox://{session_id}/{+path}",
    name="sandbox-file",
    description="A file in a session's workspace or mounts, e.g. sandbox://SESSION/workspace/out.csv",
)
async def sandbox_file(tools: ToolContext, session_id: str, path: str, ctx: Context) -> bytes:
    """A sandbox:// read: the file's bytes, within resource_limit_bytes."""
    limit = tools.settings.resource_limit_bytes
    try:
        session = await tools.host.resolve(session_id, tools.caller(ctx))
        data, size, _ = await tools.off_loop(session.files.read, "/" + path, limit=limit + 1, bulk=True)
    except CodeRunnerError as exc:
        raise ResourceError(str(exc)) from None  # the SDK shows a ResourceError's own words
    if size > limit:
        raise ResourceError(tools.say(f"/{path} is {size:,} bytes, over the resource limit; use transfer_file"))
    return data
