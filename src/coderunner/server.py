"""The MCP surface: tool registrations that parse arguments and shape results, nothing more."""

# No `from __future__ import annotations`: tool signatures are read at runtime and use closures.

import base64
import binascii
import functools
import inspect
import json
import posixpath
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict
from typing import Annotated, Any, Literal, TypeVar

import anyio
import anyio.to_thread
from mcp.server.lowlevel.helper_types import ReadResourceContents
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ResourceError
from mcp.types import CallToolResult, InputRequiredResult, TextContent, ToolAnnotations
from pydantic import AnyUrl, BeforeValidator, Field

from . import __version__
from .callers import LOCAL_CALLER, caller_key, on_connection_close
from .capabilities import Capabilities
from .config import MIN_MEMORY_MB
from .file_results import read_file_result, resource_contents
from .files import FileAccessError, copy
from .kernel import KernelStartError
from .mounts import MountError, MountSpec
from .oneshot import OneShotError
from .output import OutputCollector, WorkspaceWriter
from .owners import client_of
from .packages import PackagesError, check_requirements
from .results import ReplyBounds, error_result, guest_tool_result
from .sandbox import SandboxUnavailable
from .sessions import Session, SessionError, SessionManager
from .tool_schemas import finish_tools
from .toolsets import selected_tools
from .transfers import export_target, import_source
from .variables import VariablesError, check_variables, parse_variables
from .workspace import WorkspaceError, delete_named, list_named

INSTRUCTIONS = """\
CodeRunner runs Python in a persistent Jupyter kernel inside a sandbox on the user's machine.
Variables, imports and files in the workspace persist across run_python calls until kernel_reset.
The sandbox has no network and sees none of the user's files: only its own workspace
(the current directory, /workspace). Charts (matplotlib) come back as images.
Files saved under /mnt/outputs are copied to the user's export folder after each call.
Without session_id every call uses one default session; create_session gives an independent one."""

#: URIs of files in a session (see the sandbox-file resource template).
SANDBOX_SCHEME = "sandbox://"
#: Default bound on pip in install_packages.
PIP_TIMEOUT_S = 300.0
#: Default wait for a page, and the extra allowance for starting the browser on first use.
BROWSER_TIMEOUT_S = 30.0
BROWSER_START_S = 30.0
#: Arguments of guest tools that name a file: resolved (and confined) by the host first.
PATH_ARGUMENTS = ("output", "output_prefix")


def _none_as_empty(value: Any) -> Any:
    """A client that sends null for an optional text argument means "not given", as '' does."""
    return "" if value is None else value


#: Optional text: '' (or null, from lenient clients) means "not given".
Text = Annotated[str, BeforeValidator(_none_as_empty)]


def _object_as_text(value: Any) -> Any:
    """A client that still sends an object for `variables` is served: it becomes the JSON text."""
    return json.dumps(value) if isinstance(value, dict) else _none_as_empty(value)


VariablesArg = Annotated[
    str,
    BeforeValidator(_object_as_text),
    Field(description="JSON object text, e.g. '{\"n\": 3}'; keys become variables."),
]
LanguageArg = Literal["python", "javascript", "bash"]
PdfOp = Literal["info", "extract_text", "merge", "split", "rotate", "extract_pages", "to_images", "encrypt", "decrypt"]
ImageOp = Literal["info", "resize", "thumbnail", "crop", "rotate", "flip", "convert", "grayscale", "ocr"]
#: Largest stdin execute_code passes on.
MAX_STDIN_CHARS = 4 * 2**20
#: Worker threads for file copies and /proc or workspace walks: up to 512 MiB each, never on the event loop.
FILE_WORKERS = 4

T = TypeVar("T")

#: Optional text arguments are plain strings where '' means "not given": no null to wrap, and a strict-mode
#: model (which must send every argument) has an obvious value to send. session_id is explained once, in
#: create_session's description and the server instructions, not in every tool.
SessionId = Text
Seconds = Annotated[float | None, Field(ge=1)]
#: Optional path of an output file, for the guest tools.
OutputPath = Text


class CodeRunnerServer(MCPServer):
    """MCPServer whose sandbox:// reads carry the file's own MIME type, and text as text.

    A resource template declares one MIME type for all its reads; a workspace holds PNGs, CSVs and
    anything else, so the type of each read is decided here from the bytes read (never parsed).
    """

    async def read_resource(
        self, uri: AnyUrl | str, context: Context | None = None
    ) -> Iterable[ReadResourceContents] | InputRequiredResult:
        results = await super().read_resource(uri, context)
        if not str(uri).startswith(SANDBOX_SCHEME) or isinstance(results, InputRequiredResult):
            return results
        typed: list[ReadResourceContents] = []
        for item in results:
            data = item.content.encode() if isinstance(item.content, str) else item.content
            content, mime = resource_contents(posixpath.basename(str(uri)), data)
            typed.append(ReadResourceContents(content=content, mime_type=mime, meta=item.meta))
        return typed


def _json_result(payload: dict[str, Any], is_error: bool = False) -> CallToolResult:
    return CallToolResult(
        content=[TextContent(type="text", text=json.dumps(payload, indent=2))],
        structured_content=payload,
        is_error=is_error,
    )


def _decoded(content: str, encoding: str) -> bytes:
    return base64.b64decode(content, validate=True) if encoding == "base64" else content.encode()


def _session_summary(session: Session, manager: SessionManager) -> dict[str, Any]:
    status = asdict(session.status())
    status["default"] = manager.is_default(session)
    return status


#: Arguments of pdf_ops and image_ops that are not the op's own.
_NOT_OP_ARGUMENTS = frozenset({"ctx", "input_path", "op", "session_id", "timeout_s"})


def _op_arguments(tool: Callable[..., Any], values: dict[str, Any]) -> dict[str, Any]:
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


def _with_export_note(reply: CallToolResult, session: Session) -> CallToolResult:
    """Say what the call's copy-out put in the client's export folder (or refused), if anything."""
    if session.export_note:
        reply.content.append(TextContent(type="text", text=f"[{session.export_note}]"))
    return reply


async def _guarded(call: Callable[[], Awaitable[CallToolResult]]) -> CallToolResult:
    """Errors a caller can act on become isError results with a plain message."""
    try:
        return await call()
    except (
        SessionError,
        KernelStartError,
        FileAccessError,
        VariablesError,
        PackagesError,
        OneShotError,
        SandboxUnavailable,
    ) as exc:
        return error_result(str(exc))


def build_server(manager: SessionManager) -> MCPServer:
    server = CodeRunnerServer("coderunner", version=__version__, instructions=INSTRUCTIONS)
    settings = manager.settings
    capabilities = Capabilities()  # caches the versions it reads from a sandbox
    reply_bounds = ReplyBounds(settings.output_limit_chars, settings.image_limit_bytes, settings.spill_limit_bytes)
    file_workers = anyio.CapacityLimiter(FILE_WORKERS)

    async def _off_loop(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Blocking file or /proc work in a bounded pool of threads, so other calls keep being served."""
        return await anyio.to_thread.run_sync(functools.partial(function, *args, **kwargs), limiter=file_workers)

    async def _guest_reply(session: Session, result: dict[str, Any]) -> CallToolResult:
        """A guest tool's answer under the bounds of cell output; an oversized answer spills to the workspace."""
        writer = WorkspaceWriter(session.workspace.path, manager.backend.workspace_path, session.dirs.owner)
        return await _off_loop(guest_tool_result, result, reply_bounds, writer)

    def _caller(ctx: Context) -> str:
        """Which client this call is from: each has its own default session (see callers.py)."""
        key = caller_key(ctx.request_context.request)
        on_connection_close(ctx.request_context.session, key, manager.release_caller)
        return key

    def _client(ctx: Context) -> str:
        """Which client owns this call's exports and persistent names (see owners.py)."""
        return client_of(ctx.request_context.request)

    async def _resolve(ctx: Context, session_id: str | None) -> Session:
        return await manager.resolve(session_id or None, _caller(ctx), _client(ctx))

    def _share(ctx: Context) -> str | None:
        """Whose share of the one-shot slots a call takes: none over stdio, where one client has them all."""
        key = caller_key(ctx.request_context.request)
        return None if key == LOCAL_CALLER else key

    @server.tool(structured_output=False)  # not closed-world: a session may have network internet
    async def run_python(
        code: Annotated[str, Field(description="The last expression's value is shown.")],
        ctx: Context,
        session_id: SessionId = "",
        timeout_s: Annotated[
            float | None,
            Field(ge=1, description=f"Seconds (default: the session's, {settings.timeout_s:g} unless set)."),
        ] = None,
        variables: VariablesArg = "",
    ) -> CallToolResult:
        """Run Python in the session's persistent sandboxed Jupyter kernel. Returns text output, charts as
        images. On timeout the cell is interrupted, state kept (or the kernel restarted: the reply says)."""

        async def progress(elapsed_s: float, output: OutputCollector) -> None:
            limit = timeout_s or settings.timeout_s
            await ctx.report_progress(elapsed_s, limit, f"running {elapsed_s:.0f}s: {output.tail_text(200)}")

        async def call() -> CallToolResult:
            values = check_variables(parse_variables(variables), "python")
            session = await _resolve(ctx, session_id)
            result = await session.run(code, timeout_s, progress, values)
            reply = result.to_call_result(session.session_id, links=settings.file_links == "resource_link")
            return _with_export_note(reply, session)

        return await _guarded(call)

    @server.tool(structured_output=False)
    async def kernel_reset(ctx: Context, session_id: SessionId = "") -> CallToolResult:
        """Restart the session's kernel: fresh state, files kept."""

        async def call() -> CallToolResult:
            session = await _resolve(ctx, session_id)
            await session.reset()
            return _json_result({"reset": True, **_session_summary(session, manager)})

        return await _guarded(call)

    @server.tool(structured_output=False)
    async def create_session(
        ctx: Context,
        network: Annotated[
            Literal["none", "internet"],
            Field(description="internet: outbound only; code can then send data anywhere."),
        ] = settings.network,
        memory_mb: Annotated[int, Field(ge=MIN_MEMORY_MB)] = settings.memory_mb,
        cpus: Annotated[float | None, Field(ge=0.1)] = None,
        timeout_s: Annotated[float, Field(ge=1, description="run_python's default, seconds.")] = settings.timeout_s,
        name: Text = "",
        persistent: Annotated[
            bool,
            Field(description="Keep the named workspace's files; the same name reopens them."),
        ] = False,
        mounts: Annotated[
            list[str],
            Field(description="'HOST:SANDBOX[:ro|rw]' under allowed roots."),
        ] = [],  # noqa: B006 - read only, and the schema shows it
    ) -> CallToolResult:
        """New session (own kernel and workspace). Other tools take its session_id; without one they use your
        default session."""

        async def call() -> CallToolResult:
            try:
                specs = [MountSpec.parse(text) for text in mounts or []]
            except MountError as exc:
                return error_result(str(exc))
            options = manager.options(
                network=network, memory_mb=memory_mb, cpus=cpus, timeout_s=timeout_s, mounts=specs, name=name or None,
                persistent=persistent, client=_client(ctx),
            )  # fmt: skip
            session = await manager.create(options, owner=_caller(ctx))
            summary = _session_summary(session, manager)
            if session.startup is not None:
                summary["startup_files"] = session.startup
            return _json_result(summary)

        return await _guarded(call)

    @server.tool(structured_output=False)
    async def close_session(
        session_id: str,
        ctx: Context,
    ) -> CallToolResult:
        """Stop a session's kernel and delete its workspace."""

        async def call() -> CallToolResult:
            await manager.close(session_id, _caller(ctx))
            return _json_result({"closed": session_id})

        return await _guarded(call)

    @server.tool(structured_output=False)
    async def session_status(ctx: Context, session_id: SessionId = "") -> CallToolResult:
        """A session's state, uptime, memory, limits and network."""

        async def call() -> CallToolResult:
            session = await _resolve(ctx, session_id)
            return _json_result(await _off_loop(_session_summary, session, manager))

        return await _guarded(call)

    @server.tool(structured_output=False)
    async def list_sessions(ctx: Context) -> CallToolResult:
        """Your open sessions."""

        async def call() -> CallToolResult:
            sessions = manager.list(_caller(ctx))
            summaries = await _off_loop(lambda: [_session_summary(s, manager) for s in sessions])
            return _json_result({"sessions": summaries})

        return await _guarded(call)

    @server.tool(structured_output=False)
    async def list_files(
        ctx: Context,
        path: str = "/workspace",
        depth: Annotated[int, Field(ge=1, le=5)] = 1,
        session_id: SessionId = "",
    ) -> CallToolResult:
        """List a folder of the sandbox (workspace or mounts)."""

        async def call() -> CallToolResult:
            session = await _resolve(ctx, session_id)
            entries = await _off_loop(session.files.list, path, depth)
            return _json_result({"path": path, "entries": [asdict(entry) for entry in entries]})

        return await _guarded(call)

    @server.tool(structured_output=False)
    async def read_file(
        path: str,
        ctx: Context,
        session_id: SessionId = "",
        offset: Annotated[int, Field(ge=0)] = 0,
        length: Annotated[int | None, Field(ge=1)] = None,
        start_line: Annotated[int | None, Field(ge=1)] = None,
        end_line: Annotated[int | None, Field(ge=1)] = None,
    ) -> CallToolResult:
        """Read a sandbox file: text (byte offset/length or 1-based lines), images as images; big files as links."""

        async def call() -> CallToolResult:
            session = await _resolve(ctx, session_id)
            return await _off_loop(
                read_file_result, session.files, session.session_id, path, limit=settings.read_limit_bytes,
                image_limit=settings.image_limit_bytes, offset=offset, length=length,
                start_line=start_line, end_line=end_line, links=settings.file_links == "resource_link",
            )  # fmt: skip

        return await _guarded(call)

    @server.tool(structured_output=False)
    async def write_file(
        path: str,
        content: str,
        ctx: Context,
        encoding: Literal["text", "base64"] = "text",
        overwrite: bool = True,
        session_id: SessionId = "",
    ) -> CallToolResult:
        """Write a file in the workspace or a rw mount."""

        async def call() -> CallToolResult:
            session = await _resolve(ctx, session_id)
            try:
                data = await _off_loop(_decoded, content, encoding)
            except binascii.Error:
                return error_result("content is not valid base64")
            written = await _off_loop(session.files.write, path, data, overwrite=overwrite)
            await session.copy_out()  # a file written to the export mount leaves now, as after a run
            payload: dict[str, Any] = {"path": written, "bytes": len(data)}
            if session.export_note:
                payload["exported"] = session.export_note
            return _json_result(payload)

        return await _guarded(call)

    @server.tool(structured_output=False)
    async def upload_file(
        host_path: str,
        ctx: Context,
        sandbox_path: Annotated[Text, Field(description="Default /workspace/NAME.")] = "",
        overwrite: bool = False,
        session_id: SessionId = "",
    ) -> CallToolResult:
        """Copy a file from a host import folder into the sandbox."""

        async def call() -> CallToolResult:
            session = await _resolve(ctx, session_id)
            source = import_source(settings.import_dirs, host_path)
            target = sandbox_path or posixpath.basename(source.path)
            copied, _, written = await _off_loop(copy, source.view, source.path, session.files, target,
                                                 limit=settings.transfer_limit_bytes, overwrite=overwrite)  # fmt: skip
            return _json_result({"host_path": str(source.host_path(source.path)), "sandbox_path": written,
                                 "bytes": copied})  # fmt: skip

        return await _guarded(call)

    @server.tool(structured_output=False)
    async def download_file(
        sandbox_path: str,
        ctx: Context,
        host_path: Annotated[Text, Field(description="Name in the export folder.")] = "",
        overwrite: bool = False,
        session_id: SessionId = "",
    ) -> CallToolResult:
        """Copy a sandbox file to the user's export folder on the host."""

        async def call() -> CallToolResult:
            session = await _resolve(ctx, session_id)
            sandbox_uid = session.dirs.user.uid if session.dirs.user is not None else None
            target = export_target(settings.export_dir, session.options.client, host_path or None,
                                   posixpath.basename(sandbox_path), sandbox_uid)  # fmt: skip
            copied, read_from, written = await _off_loop(
                copy, session.files, sandbox_path, target.view, target.path,
                limit=settings.transfer_limit_bytes, overwrite=overwrite,
            )  # fmt: skip
            return _json_result({"sandbox_path": read_from, "host_path": str(target.host_path(written)),
                                 "bytes": copied})  # fmt: skip

        return await _guarded(call)

    async def guest_tool(
        ctx: Context,
        tool: str,
        session_id: str | None,
        input_path: str,
        op: str,
        arguments: dict[str, Any],
        timeout_s: float | None,
    ) -> CallToolResult:
        async def call() -> CallToolResult:
            session = await _resolve(ctx, session_id)
            # Confinement is the host's: every path goes through the session's file view first.
            for key in PATH_ARGUMENTS:
                if isinstance(arguments.get(key), str):
                    arguments[key] = session.files.resolve(arguments[key]).sandbox_path
            if isinstance(arguments.get("inputs"), list):
                arguments["inputs"] = [session.files.resolve(str(item)).sandbox_path for item in arguments["inputs"]]
            payload = {"op": op, "input_path": session.files.resolve(input_path).sandbox_path, "args": arguments}
            result = await session.call_guest(tool, payload, timeout_s or settings.timeout_s)
            if session.export_note:
                result["exported"] = session.export_note
            return await _guest_reply(session, result)

        return await _guarded(call)

    @server.tool(structured_output=False)
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
        arguments = _op_arguments(pdf_ops, locals())
        return await guest_tool(ctx, "pdf_ops", session_id, input_path, op, arguments, timeout_s)

    @server.tool(structured_output=False)
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
        arguments = _op_arguments(image_ops, locals())
        return await guest_tool(ctx, "image_ops", session_id, input_path, op, arguments, timeout_s)

    async def browser(
        ctx: Context, session_id: str | None, op: str, args: dict[str, Any], timeout_s: float | None
    ) -> CallToolResult:
        async def call() -> CallToolResult:
            session = await _resolve(ctx, session_id)
            if isinstance(args.get("output"), str):
                args["output"] = session.files.resolve(args["output"]).sandbox_path
            limit = (timeout_s or BROWSER_TIMEOUT_S) + BROWSER_START_S
            result = await session.call_guest("browser", {"op": op, "args": args}, limit)
            if session.export_note:
                result["exported"] = session.export_note
            return await _guest_reply(session, result)

        return await _guarded(call)

    @server.tool(structured_output=False, annotations=ToolAnnotations(open_world_hint=True))
    async def browser_navigate(
        ctx: Context,
        url: str,
        wait_for: Annotated[Text, Field(description="CSS selector.")] = "",
        timeout_s: Annotated[float | None, Field(ge=1, le=300)] = None,
        session_id: SessionId = "",
    ) -> CallToolResult:
        """Open a page in the session's Chromium (offline: file:///workspace/... or sandbox servers only):
        url, status, title, text."""
        args = {"url": url, "wait_for": wait_for or None, "timeout_s": timeout_s or BROWSER_TIMEOUT_S}
        return await browser(ctx, session_id, "navigate", args, timeout_s)

    @server.tool(structured_output=False)
    async def browser_extract(
        ctx: Context,
        selector: str,
        format: Literal["text", "html", "json", "table", "links"] = "text",
        attribute: Annotated[Text, Field(description="Instead: this attribute of each match.")] = "",
        session_id: SessionId = "",
    ) -> CallToolResult:
        """Matches of a CSS selector on the current page as text, html, JSON, table rows or links."""
        return await browser(
            ctx, session_id, "extract", {"selector": selector, "format": format, "attribute": attribute or None}, None
        )

    @server.tool(structured_output=False)
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

    @server.tool(structured_output=False)
    async def browser_interact(
        ctx: Context,
        action: Literal["click", "fill", "press", "select", "scroll", "wait_for"],
        selector: str,
        value: Annotated[Text, Field(description="Text to fill, key to press, option to select.")] = "",
        timeout_s: Annotated[float | None, Field(ge=1, le=300)] = None,
        session_id: SessionId = "",
    ) -> CallToolResult:
        """Act on an element of the current page (CSS selector)."""
        args = {"action": action, "selector": selector, "value": value or None, "timeout_s": timeout_s or 10}
        return await browser(ctx, session_id, "interact", args, timeout_s)

    @server.tool(structured_output=False)  # not closed-world: it may run with network internet
    async def execute_code(
        language: LanguageArg,
        code: str,
        ctx: Context,
        stdin: str = "",
        variables: VariablesArg = "",
        timeout_s: Annotated[float, Field(ge=1)] = settings.timeout_s,
        memory_mb: Annotated[int, Field(ge=MIN_MEMORY_MB)] = settings.memory_mb,
        network: Literal["none", "internet"] = settings.network,
    ) -> CallToolResult:
        """Run a whole program once in a fresh sandbox, nothing kept (javascript: Node.js). Returns exit_code,
        stdout, stderr, timed_out, time and memory used."""

        async def call() -> CallToolResult:
            if len(stdin) > MAX_STDIN_CHARS:
                return error_result(f"stdin is {len(stdin):,} characters; at most {MAX_STDIN_CHARS:,} (use a file)")
            values = check_variables(parse_variables(variables), language)
            options = manager.options(network=network, memory_mb=memory_mb, timeout_s=timeout_s, client=_client(ctx))
            result = await manager.oneshot.run(
                language, code, options, stdin=stdin.encode(), variables=values, caller=_share(ctx)
            )
            return _json_result(asdict(result), is_error=not result.success)

        return await _guarded(call)

    @server.tool(structured_output=False, annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False))
    async def validate_code(language: LanguageArg, code: str, ctx: Context) -> CallToolResult:
        """Syntax errors (line, column) of code, without running it."""

        async def call() -> CallToolResult:
            errors = await manager.oneshot.check(
                language, code, manager.options(client=_client(ctx)), caller=_share(ctx)
            )
            return _json_result({"language": language, "valid": not errors, "errors": errors})

        return await _guarded(call)

    @server.tool(structured_output=False, annotations=ToolAnnotations(open_world_hint=True))
    async def install_packages(
        ctx: Context,
        packages: list[str],
        session_id: SessionId = "",
        timeout_s: Annotated[float, Field(ge=1, le=1800)] = PIP_TIMEOUT_S,
    ) -> CallToolResult:
        """pip install into this session only (kept across kernel_reset). Needs network internet."""

        async def call() -> CallToolResult:
            wanted = check_requirements(packages)
            session = await _resolve(ctx, session_id)
            return _json_result(await session.install_packages(wanted, timeout_s))

        return await _guarded(call)

    @server.tool(structured_output=False, annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False))
    async def list_workspaces(ctx: Context) -> CallToolResult:
        """Your persistent workspaces: name, size, in use."""

        async def call() -> CallToolResult:
            found = list_named(settings.workspaces_dir, _client(ctx))
            return _json_result({"workspaces": [asdict(entry) for entry in found]})

        return await _guarded(call)

    @server.tool(structured_output=False, annotations=ToolAnnotations(destructive_hint=True, open_world_hint=False))
    async def delete_workspace(
        ctx: Context,
        name: Annotated[str, Field(description="From list_workspaces.")],
    ) -> CallToolResult:
        """Delete a persistent workspace and its files (not while in use)."""

        async def call() -> CallToolResult:
            try:
                delete_named(settings.workspaces_dir, _client(ctx), name)
            except WorkspaceError as exc:
                return error_result(str(exc))
            return _json_result({"deleted": name})

        return await _guarded(call)

    @server.tool(structured_output=False, annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False))
    async def get_capabilities() -> CallToolResult:
        """This server's languages, isolation, limits, network policy, packages and tools."""

        async def call() -> CallToolResult:
            tools = sorted(tool.name for tool in await server.list_tools())
            return _json_result(await capabilities.describe(manager, tools))

        return await _guarded(call)

    @server.resource(
        "sandbox://{session_id}/{+path}",
        name="sandbox-file",
        description="A file in a session's workspace or mounts, e.g. sandbox://SESSION/workspace/out.csv",
    )
    async def sandbox_file(session_id: str, path: str, ctx: Context) -> bytes:
        try:
            session = await manager.resolve(session_id, _caller(ctx))
        except SessionError as exc:
            raise ResourceError(str(exc)) from None  # the SDK shows a ResourceError's own words
        data, size, _ = await _off_loop(session.files.read, "/" + path, limit=settings.resource_limit_bytes + 1)
        if size > settings.resource_limit_bytes:
            raise ResourceError(f"/{path} is {size:,} bytes, over the resource limit; use download_file")
        return data

    finish_tools(server, selected_tools(settings.tools))
    return server
