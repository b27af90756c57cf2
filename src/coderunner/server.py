"""The MCP surface: tool registrations that parse arguments and shape results, nothing more."""

# No `from __future__ import annotations`: tool signatures are read at runtime and use closures.

import base64
import binascii
import functools
import json
import posixpath
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Annotated, Any, Literal, TypeVar

import anyio
import anyio.to_thread
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ResourceError
from mcp.types import CallToolResult, TextContent, ToolAnnotations
from pydantic import Field

from . import __version__
from .callers import LOCAL_CALLER, caller_key, on_connection_close
from .capabilities import Capabilities
from .file_results import read_file_result
from .files import FileAccessError, copy
from .kernel import KernelStartError
from .mounts import MountError, MountSpec
from .oneshot import OneShotError
from .output import OutputCollector, WorkspaceWriter
from .owners import client_of
from .packages import PackagesError, check_requirements
from .results import ReplyBounds, error_result, guest_tool_result
from .sandbox import SandboxUnavailable
from .sessions import SESSION_NAME, Session, SessionError, SessionManager
from .transfers import export_target, import_source
from .variables import VariablesError, check_variables
from .workspace import WorkspaceError, delete_named, list_named

INSTRUCTIONS = """\
CodeRunner runs Python in a persistent Jupyter kernel inside a sandbox on the user's machine.
Variables, imports and files in the workspace persist across run_python calls until kernel_reset.
The sandbox has no network and sees none of the user's files: only its own workspace
(the current directory, /workspace). Charts (matplotlib) come back as images.
Files saved under /mnt/outputs are copied to the user's export folder after each call.
Without session_id every call uses one default session; create_session gives an independent one."""

#: Default bound on pip in install_packages.
PIP_TIMEOUT_S = 300.0
#: Default wait for a page, and the extra allowance for starting the browser on first use.
BROWSER_TIMEOUT_S = 30.0
BROWSER_START_S = 30.0
#: Arguments of guest tools that name a file: resolved (and confined) by the host first.
PATH_ARGUMENTS = ("output", "output_prefix")

VariablesArg = Annotated[
    dict[str, Any] | None,
    Field(
        description="Name -> JSON value, set before the code runs (Python/JavaScript globals, bash environment "
        "variables). Names must be identifiers; values are passed as data, never as source."
    ),
]
LanguageArg = Annotated[
    Literal["python", "javascript", "bash"], Field(description="python, javascript (Node.js) or bash")
]
#: Largest stdin execute_code passes on.
MAX_STDIN_CHARS = 4 * 2**20
#: Worker threads for file copies and /proc or workspace walks: up to 512 MiB each, never on the event loop.
FILE_WORKERS = 4

T = TypeVar("T")

SessionId = Annotated[
    str | None,
    Field(description="Session handle from create_session; omit to use the default session."),
]


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


def _close_schemas(server: MCPServer, names: tuple[str, ...]) -> None:
    """Declare that these tools take no arguments beyond their own (strict clients require it).

    mcp 2.3 has no public way to set this on a decorated tool, hence the guarded private access;
    without it the schema is merely open, which the SDK's own validation tolerates.
    """
    manager = getattr(server, "_tool_manager", None)
    for name in names:
        tool = manager.get_tool(name) if manager is not None else None
        if tool is not None and isinstance(tool.parameters, dict):
            tool.parameters["additionalProperties"] = False


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
    server = MCPServer("coderunner", version=__version__, instructions=INSTRUCTIONS)
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
        return await manager.resolve(session_id, _caller(ctx), _client(ctx))

    def _share(ctx: Context) -> str | None:
        """Whose share of the one-shot slots a call takes: none over stdio, where one client has them all."""
        key = caller_key(ctx.request_context.request)
        return None if key == LOCAL_CALLER else key

    @server.tool(structured_output=False, annotations=ToolAnnotations(open_world_hint=False))
    async def run_python(
        code: Annotated[str, Field(description="Python source; the value of the last expression is shown.")],
        ctx: Context,
        session_id: SessionId = None,
        timeout_s: Annotated[
            float | None,
            Field(gt=0, description=f"Wall-time limit in seconds (default {settings.timeout_s:g})."),
        ] = None,
        variables: VariablesArg = None,
    ) -> CallToolResult:
        """Run Python code in the session's persistent, sandboxed Jupyter kernel.

        Returns stdout, stderr, the last expression's value and tracebacks as text, and each
        chart or image as an image. State (variables, imports) persists between calls. On
        timeout the cell is interrupted (state kept) or, if it will not stop, the kernel is
        restarted (state lost); the reply says which, with the output produced so far.
        """

        async def progress(elapsed_s: float, output: OutputCollector) -> None:
            limit = timeout_s or settings.timeout_s
            await ctx.report_progress(elapsed_s, limit, f"running {elapsed_s:.0f}s: {output.tail_text(200)}")

        async def call() -> CallToolResult:
            values = check_variables(variables, "python")
            session = await _resolve(ctx, session_id)
            result = await session.run(code, timeout_s, progress, values)
            return _with_export_note(result.to_call_result(session.session_id), session)

        return await _guarded(call)

    @server.tool(structured_output=False)
    async def kernel_reset(ctx: Context, session_id: SessionId = None) -> CallToolResult:
        """Restart the session's kernel with fresh interpreter state; workspace files are kept."""

        async def call() -> CallToolResult:
            session = await _resolve(ctx, session_id)
            await session.reset()
            return _json_result({"reset": True, **_session_summary(session, manager)})

        return await _guarded(call)

    @server.tool(structured_output=False)
    async def create_session(
        ctx: Context,
        network: Annotated[
            str | None,
            Field(
                description="'none' (default): no network at all. 'internet': outbound access through a "
                "user-mode network stack (the host's own services stay unreachable); code can then send "
                "data anywhere."
            ),
        ] = None,
        memory_mb: Annotated[int | None, Field(description="Address-space limit in MiB (at least 512).")] = None,
        cpus: Annotated[float | None, Field(description="CPU limit (reported; enforced where cgroups allow).")] = None,
        timeout_s: Annotated[float | None, Field(description="Default run_python timeout in seconds.")] = None,
        name: Annotated[str | None, Field(description="A name for the session (and its workspace).")] = None,
        persistent: Annotated[
            bool,
            Field(
                description="Keep the workspace after the session closes and across server restarts; "
                "creating a session with the same name later reopens it (kernel state is not kept)."
            ),
        ] = False,
        mounts: Annotated[
            list[str] | None,
            Field(description="Extra host folders 'HOST:SANDBOX[:ro|rw]', only under the allowed mount roots."),
        ] = None,
    ) -> CallToolResult:
        """Start an independent session (own kernel, own workspace) and return its session_id."""

        async def call() -> CallToolResult:
            try:
                specs = [MountSpec.parse(text) for text in mounts or []]
            except MountError as exc:
                return error_result(str(exc))
            options = manager.options(
                network=network, memory_mb=memory_mb, cpus=cpus, timeout_s=timeout_s, mounts=specs, name=name,
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
        session_id: Annotated[str, Field(description="Session to close.")],
        ctx: Context,
    ) -> CallToolResult:
        """Stop a session's kernel and delete its workspace."""

        async def call() -> CallToolResult:
            await manager.close(session_id, _caller(ctx))
            return _json_result({"closed": session_id})

        return await _guarded(call)

    @server.tool(structured_output=False)
    async def session_status(ctx: Context, session_id: SessionId = None) -> CallToolResult:
        """Liveness, busy flag, uptime, memory used, limits and network of a session."""

        async def call() -> CallToolResult:
            session = await _resolve(ctx, session_id)
            return _json_result(await _off_loop(_session_summary, session, manager))

        return await _guarded(call)

    @server.tool(structured_output=False)
    async def list_sessions(ctx: Context) -> CallToolResult:
        """Open sessions of this server."""

        async def call() -> CallToolResult:
            sessions = manager.list(_caller(ctx))
            summaries = await _off_loop(lambda: [_session_summary(s, manager) for s in sessions])
            return _json_result({"sessions": summaries})

        return await _guarded(call)

    @server.tool(structured_output=False)
    async def list_files(
        ctx: Context,
        path: Annotated[
            str, Field(description="Folder inside the sandbox (relative paths start at /workspace).")
        ] = "/workspace",
        depth: Annotated[int, Field(ge=1, le=5, description="How many folder levels to list.")] = 1,
        session_id: SessionId = None,
    ) -> CallToolResult:
        """List files in the session's workspace or a mounted folder (paths as the sandbox sees them)."""

        async def call() -> CallToolResult:
            session = await _resolve(ctx, session_id)
            entries = await _off_loop(session.files.list, path, depth)
            return _json_result({"path": path, "entries": [asdict(entry) for entry in entries]})

        return await _guarded(call)

    @server.tool(structured_output=False)
    async def read_file(
        path: Annotated[str, Field(description="File inside the sandbox, e.g. /workspace/out.csv or data.csv.")],
        ctx: Context,
        session_id: SessionId = None,
        offset: Annotated[int, Field(ge=0, description="Byte to start at (text).")] = 0,
        length: Annotated[int | None, Field(ge=1, description="Bytes to return (text).")] = None,
        start_line: Annotated[int | None, Field(ge=1, description="First line (1-based) to return.")] = None,
        end_line: Annotated[int | None, Field(ge=1, description="Last line to return.")] = None,
    ) -> CallToolResult:
        """Read a file from the sandbox: text (with byte or line ranges), images as images, other
        binary inline when small; anything bigger comes back as a resource link."""

        async def call() -> CallToolResult:
            session = await _resolve(ctx, session_id)
            return await _off_loop(
                read_file_result, session.files, session.session_id, path, limit=settings.read_limit_bytes,
                image_limit=settings.image_limit_bytes, offset=offset, length=length,
                start_line=start_line, end_line=end_line,
            )  # fmt: skip

        return await _guarded(call)

    @server.tool(structured_output=False)
    async def write_file(
        path: Annotated[str, Field(description="File inside the sandbox (workspace or a rw mount).")],
        content: Annotated[str, Field(description="Text, or base64 when encoding is 'base64'.")],
        ctx: Context,
        encoding: Literal["text", "base64"] = "text",
        overwrite: bool = True,
        session_id: SessionId = None,
    ) -> CallToolResult:
        """Write a file into the sandbox's workspace or a writable mount (folders are created)."""

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
        host_path: Annotated[str, Field(description="Absolute host path inside one of the import folders.")],
        ctx: Context,
        sandbox_path: Annotated[str | None, Field(description="Destination; default /workspace/NAME.")] = None,
        overwrite: bool = False,
        session_id: SessionId = None,
    ) -> CallToolResult:
        """Copy a file from a host import folder (configured by the user) into the sandbox."""

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
        sandbox_path: Annotated[str, Field(description="File inside the sandbox.")],
        ctx: Context,
        host_path: Annotated[
            str | None, Field(description="Where in the export folder (relative, or absolute inside it).")
        ] = None,
        overwrite: bool = False,
        session_id: SessionId = None,
    ) -> CallToolResult:
        """Copy a file out of the sandbox into the export folder on the host (the only place it may go)."""

        async def call() -> CallToolResult:
            session = await _resolve(ctx, session_id)
            sandbox_uid = session.dirs.user.uid if session.dirs.user is not None else None
            target = export_target(settings.export_dir, session.options.client, host_path,
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
        args: dict[str, Any] | None,
        timeout_s: float | None,
    ) -> CallToolResult:
        async def call() -> CallToolResult:
            session = await _resolve(ctx, session_id)
            arguments = dict(args or {})
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
        input_path: Annotated[str, Field(description="PDF inside the sandbox, e.g. report.pdf.")],
        op: Annotated[
            str,
            Field(
                description="info | extract_text | merge | split | rotate | extract_pages | to_images | "
                "encrypt | decrypt"
            ),
        ],
        args: Annotated[
            dict[str, Any] | None,
            Field(
                description="Per op: pages ('1-3,5'), output, inputs (merge), ranges + output_prefix (split), "
                "degrees (rotate), dpi + output_prefix (to_images), password (encrypt/decrypt/read)."
            ),
        ] = None,
        session_id: SessionId = None,
        timeout_s: Annotated[float | None, Field(gt=0)] = None,
    ) -> CallToolResult:
        """Work with PDFs inside the sandbox (the host never parses them); outputs go to the workspace."""
        return await guest_tool(ctx, "pdf_ops", session_id, input_path, op, args, timeout_s)

    @server.tool(structured_output=False)
    async def image_ops(
        ctx: Context,
        input_path: Annotated[str, Field(description="Image inside the sandbox.")],
        op: Annotated[
            str, Field(description="info | resize | thumbnail | crop | rotate | flip | convert | grayscale | ocr")
        ],
        args: Annotated[
            dict[str, Any] | None,
            Field(
                description="Per op: width/height (resize), size (thumbnail), left/top/right/bottom (crop), "
                "degrees (rotate), direction (flip), format png|jpeg|webp|gif|bmp|tiff (convert), lang (ocr), output."
            ),
        ] = None,
        session_id: SessionId = None,
        timeout_s: Annotated[float | None, Field(gt=0)] = None,
    ) -> CallToolResult:
        """Transform or read images inside the sandbox (the host never decodes them); returns a preview."""
        return await guest_tool(ctx, "image_ops", session_id, input_path, op, args, timeout_s)

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
        url: Annotated[
            str,
            Field(
                description="Address to open; with network off only file:///workspace/... "
                "or a server started inside the sandbox loads."
            ),
        ],
        wait_for: Annotated[str | None, Field(description="CSS selector to wait for after loading.")] = None,
        timeout_s: Annotated[float | None, Field(gt=0, le=300)] = None,
        session_id: SessionId = None,
    ) -> CallToolResult:
        """Open a page in the session's browser (Chromium inside the sandbox): final url, status, title,
        visible text (bounded) and link count. The same page is reachable from run_python code."""
        args = {"url": url, "wait_for": wait_for, "timeout_s": timeout_s or BROWSER_TIMEOUT_S}
        return await browser(ctx, session_id, "navigate", args, timeout_s)

    @server.tool(structured_output=False)
    async def browser_extract(
        ctx: Context,
        selector: Annotated[str, Field(description="CSS selector on the current page.")],
        format: Annotated[
            Literal["text", "html", "json", "table", "links"], Field(description="table: rows as JSON")
        ] = "text",
        attribute: Annotated[str | None, Field(description="Return this attribute of each match instead.")] = None,
        session_id: SessionId = None,
    ) -> CallToolResult:
        """Extract from the current page: text, html, parsed JSON, a table as rows, or links."""
        return await browser(
            ctx, session_id, "extract", {"selector": selector, "format": format, "attribute": attribute}, None
        )

    @server.tool(structured_output=False)
    async def browser_screenshot(
        ctx: Context,
        full_page: bool = False,
        selector: Annotated[str | None, Field(description="Only this element.")] = None,
        output: Annotated[str, Field(description="Where to save the PNG in the sandbox.")] = "screenshot.png",
        session_id: SessionId = None,
    ) -> CallToolResult:
        """Screenshot of the current page (or one element) as an image; also saved in the workspace."""
        args = {"full_page": full_page, "selector": selector, "output": output}
        return await browser(ctx, session_id, "screenshot", args, None)

    @server.tool(structured_output=False)
    async def browser_interact(
        ctx: Context,
        action: Literal["click", "fill", "press", "select", "scroll", "wait_for"],
        selector: Annotated[str, Field(description="CSS selector of the element.")],
        value: Annotated[str | None, Field(description="Text to fill, key to press, option to select.")] = None,
        timeout_s: Annotated[float | None, Field(gt=0, le=300)] = None,
        session_id: SessionId = None,
    ) -> CallToolResult:
        """Click, fill, press a key, select an option, scroll to, or wait for an element on the current page."""
        args = {"action": action, "selector": selector, "value": value, "timeout_s": timeout_s or 10}
        return await browser(ctx, session_id, "interact", args, timeout_s)

    @server.tool(structured_output=False, annotations=ToolAnnotations(open_world_hint=False))
    async def execute_code(
        language: LanguageArg,
        code: Annotated[str, Field(description="The whole program.")],
        ctx: Context,
        stdin: Annotated[str | None, Field(max_length=MAX_STDIN_CHARS, description="Text fed to its stdin.")] = None,
        variables: VariablesArg = None,
        timeout_s: Annotated[
            float | None, Field(gt=0, description=f"Kill it after this many seconds (default {settings.timeout_s:g}).")
        ] = None,
        memory_mb: Annotated[int | None, Field(description="Memory limit in MiB (at least 512).")] = None,
        network: Annotated[
            Literal["none", "internet"] | None, Field(description="'none' (default) or 'internet' (outbound only).")
        ] = None,
    ) -> CallToolResult:
        """Run a program once in a fresh, throwaway sandbox (no kernel, nothing kept): Python, JavaScript
        (Node.js) or bash, with the same isolation and limits as sessions. Returns success, exit_code,
        stdout, stderr, execution_time_ms, memory_peak_mb and timed_out."""

        async def call() -> CallToolResult:
            values = check_variables(variables, language)
            options = manager.options(network=network, memory_mb=memory_mb, timeout_s=timeout_s, client=_client(ctx))
            result = await manager.oneshot.run(
                language, code, options, stdin=(stdin or "").encode(), variables=values, caller=_share(ctx)
            )
            return _json_result(asdict(result), is_error=not result.success)

        return await _guarded(call)

    @server.tool(structured_output=False, annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False))
    async def validate_code(language: LanguageArg, code: str, ctx: Context) -> CallToolResult:
        """Check code for syntax errors without running it (checked inside a sandbox): line and column of each."""

        async def call() -> CallToolResult:
            errors = await manager.oneshot.check(
                language, code, manager.options(client=_client(ctx)), caller=_share(ctx)
            )
            return _json_result({"language": language, "valid": not errors, "errors": errors})

        return await _guarded(call)

    @server.tool(structured_output=False, annotations=ToolAnnotations(open_world_hint=True))
    async def install_packages(
        ctx: Context,
        packages: Annotated[
            list[str], Field(description="Requirement specifiers, e.g. ['requests', 'httpx==0.28.1'].")
        ],
        session_id: SessionId = None,
        timeout_s: Annotated[float | None, Field(gt=0, le=1800, description="Bound on pip (default 300 s).")] = None,
    ) -> CallToolResult:
        """pip install into this session only (its own package folder; other sessions and the base environment
        are unchanged); importable at once and after kernel_reset. Needs a session with network 'internet'."""

        async def call() -> CallToolResult:
            wanted = check_requirements(packages)
            session = await _resolve(ctx, session_id)
            return _json_result(await session.install_packages(wanted, timeout_s or PIP_TIMEOUT_S))

        return await _guarded(call)

    @server.tool(structured_output=False, annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False))
    async def list_workspaces(ctx: Context) -> CallToolResult:
        """Your persistent workspaces (create_session(name=..., persistent=true)): name, size, whether in use."""

        async def call() -> CallToolResult:
            found = list_named(settings.workspaces_dir, _client(ctx))
            return _json_result({"workspaces": [asdict(entry) for entry in found]})

        return await _guarded(call)

    @server.tool(structured_output=False, annotations=ToolAnnotations(destructive_hint=True, open_world_hint=False))
    async def delete_workspace(
        ctx: Context,
        name: Annotated[str, Field(pattern=f"^{SESSION_NAME.pattern}$", description="A name from list_workspaces.")],
    ) -> CallToolResult:
        """Delete one of your persistent workspaces and all its files (not while a session uses it)."""

        async def call() -> CallToolResult:
            try:
                delete_named(settings.workspaces_dir, _client(ctx), name)
            except WorkspaceError as exc:
                return error_result(str(exc))
            return _json_result({"deleted": name})

        return await _guarded(call)

    _close_schemas(server, ("list_workspaces", "delete_workspace"))

    @server.tool(structured_output=False, annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False))
    async def get_capabilities() -> CallToolResult:
        """What this server offers: languages and versions, sandbox backend and isolation, limits, network
        policy, notable packages in the sandbox, and the tools."""

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

    return server
