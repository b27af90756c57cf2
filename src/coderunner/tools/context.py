"""What every tool module shares: one ToolContext, and the decorator that registers a tool.

A tool raises CodeRunnerError (errors.py) for anything the caller can act on; the decorator turns it
into an isError result with the plain message. Anything else is a bug and stays the SDK's (its text
goes to the server's log, never to the model as a repr).
"""

# No `from __future__ import annotations`: the SDK reads tool signatures at runtime.

import contextlib
import inspect
import json
import time
import types
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.types import CallToolResult, TextContent, ToolAnnotations

from coderunner.config import Settings
from coderunner.edge.callers import LOCAL_CALLER, caller_key, on_connection_close
from coderunner.edge.owners import client_of
from coderunner.errors import CodeRunnerError
from coderunner.offload import off_loop
from coderunner.oneshot.host import OneShotHost
from coderunner.policy.tool_mentions import Mentions
from coderunner.sessions.seam import SessionHandle, SessionHost
from coderunner.tools.capabilities import Capabilities
from coderunner.tools.egress import EgressCall, EgressCalls
from coderunner.tools.replies import ReplyBounds, error_result, guest_tool_result
from coderunner.tools.session_replies import brief, detailed

T = TypeVar("T")
Declared = TypeVar("Declared", bound=Callable[..., Awaitable[Any]])
#: The attribute a module-level tool or resource function carries its declaration in.
DECLARATION = "coderunner_declaration"


@dataclass(frozen=True)
class ToolDeclaration:
    """A module-level tool: `async def name(tools: ToolContext, ...)`, its groups and MCP annotations.

    `per_settings`: the arguments whose type or default the user's settings decide (the network modes
    within the ceiling, a default limit), as name -> (annotation, default), given the settings.
    """

    groups: tuple[str, ...]
    annotations: ToolAnnotations | None = None
    per_settings: Callable[[Settings], dict[str, tuple[Any, Any]]] | None = None


@dataclass(frozen=True)
class ResourceDeclaration:
    """A module-level resource template: `async def name(tools: ToolContext, ...)` serves its reads."""

    uri: str
    name: str
    description: str


def tool(
    group: str | tuple[str, ...],
    annotations: ToolAnnotations | None = None,
    per_settings: Callable[[Settings], dict[str, tuple[Any, Any]]] | None = None,
) -> Callable[[Declared], Declared]:
    """Declare a module-level function a tool of `group` (its first argument is the ToolContext, which
    the model never sees). The function stays itself: importable, callable and testable by name."""
    groups = (group,) if isinstance(group, str) else group

    def declare(function: Declared) -> Declared:
        setattr(function, DECLARATION, ToolDeclaration(groups, annotations, per_settings))
        return function

    return declare


def resource(uri: str, name: str, description: str) -> Callable[[Declared], Declared]:
    """Declare a module-level function the reader of a resource template (first argument: the ToolContext)."""

    def declare(function: Declared) -> Declared:
        setattr(function, DECLARATION, ResourceDeclaration(uri, name, description))
        return function

    return declare


def declared_in(module: types.ModuleType) -> list[Callable[..., Awaitable[Any]]]:
    """The tools and resources `module` defines, in the order it defines them (tools/list's order)."""
    return [
        value
        for value in vars(module).values()
        if callable(value) and hasattr(value, DECLARATION) and getattr(value, "__module__", None) == module.__name__
    ]


def without_context(
    function: Callable[..., Any], settings: Settings, spec: ToolDeclaration | None
) -> inspect.Signature:
    """The signature the SDK reads: the function's, less its first argument (the ToolContext), with the
    arguments the settings decide made so."""
    parameters = list(inspect.signature(function).parameters.values())[1:]
    decided = spec.per_settings(settings) if spec is not None and spec.per_settings is not None else {}
    parameters = [
        parameter.replace(annotation=decided[parameter.name][0], default=decided[parameter.name][1])
        if parameter.name in decided
        else parameter
        for parameter in parameters
    ]
    return inspect.signature(function).replace(parameters=parameters)


def json_result(payload: dict[str, Any], is_error: bool = False) -> CallToolResult:
    """A JSON answer as one compact text block, once.

    No structured copy: no tool declares an outputSchema, so the spec asks for none, and a copy
    doubled every answer on the wire (the model reads the text; a program parses the same JSON).
    """
    return CallToolResult(content=[TextContent(type="text", text=compact_json(payload))], is_error=is_error)


def compact_json(payload: Any) -> str:
    """JSON without indentation or padding (what a reply carries costs every byte); ASCII, so a lone
    surrogate a sandbox wrote cannot break the wire."""
    return json.dumps(payload, separators=(",", ":"))


@dataclass
class ToolContext:
    """The server and what its tools need: where sessions and one-shot runs live, settings, caller lookup,
    a session by id.

    Tools reach sessions only through `host` and the handles it gives (sessions/seam.py), and one-shot
    runs only through `oneshots` (oneshot/host.py).
    """

    server: MCPServer
    host: SessionHost
    oneshots: OneShotHost
    capabilities: Capabilities
    reply_bounds: ReplyBounds
    #: Network 'allowlist': who is asked about a host during a call, and what the reply says was denied.
    egress_calls: EgressCalls
    #: The groups each registered tool declared (tool name -> groups; policy/tool_groups.py).
    groups: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: Which tools the `tools` setting offers (set by build_server once all are registered); replies
    #: name no other tool (policy/tool_mentions.py). None: not yet known, nothing rewritten.
    mentions: Mentions | None = None

    @classmethod
    def create(cls, server: MCPServer, host: SessionHost, oneshots: OneShotHost) -> "ToolContext":
        settings = host.settings
        return cls(
            server=server,
            host=host,
            oneshots=oneshots,
            capabilities=Capabilities(),  # caches the versions it reads from a sandbox
            reply_bounds=ReplyBounds(
                settings.output_limit_chars, settings.image_limit_bytes, settings.spill_limit_bytes
            ),
            egress_calls=EgressCalls(settings.egress.ceiling),
        )

    @property
    def settings(self) -> Settings:
        return self.host.settings

    def add(self, function: Callable[..., Awaitable[Any]]) -> None:
        """Register a module-level tool or resource (see `tool` and `resource`) on this server, bound to this
        context: the SDK sees its signature without the context, and a tool's CodeRunnerError is an isError
        reply."""
        declared = getattr(function, DECLARATION)
        if isinstance(declared, ResourceDeclaration):

            async def read(*args: Any, **kwargs: Any) -> Any:
                return await function(self, *args, **kwargs)

            self.server.resource(declared.uri, name=declared.name, description=declared.description)(
                _bound(read, function, without_context(function, self.settings, None))
            )
            return
        self.groups[function.__name__] = declared.groups

        async def call(*args: Any, **kwargs: Any) -> CallToolResult:
            try:
                reply = await function(self, *args, **kwargs)
            except CodeRunnerError as exc:
                reply = error_result(str(exc))
            return self.unnamed(reply)

        guarded = _bound(call, function, without_context(function, self.settings, declared))
        self.server.tool(structured_output=False, annotations=declared.annotations)(guarded)

    def offers(self, tool: str) -> bool:
        """Whether the `tools` setting offers `tool`: a reply the tool layer writes names it only then."""
        return self.mentions is None or self.mentions.offers(tool)

    def say(self, text: str) -> str:
        """`text` naming only offered tools (for answers that are not tool replies, e.g. a resource read)."""
        return text if self.mentions is None else self.mentions.text(text)

    def unnamed(self, reply: CallToolResult) -> CallToolResult:
        """The reply with each tool that is not offered named only by the group the user would add."""
        mentions = self.mentions
        if mentions is None:
            return reply
        for block in reply.content:
            if isinstance(block, TextContent):
                block.text = mentions.text(block.text)
        if reply.structured_content is not None:
            reply.structured_content = mentions.value(reply.structured_content)
        return reply

    @contextlib.asynccontextmanager
    async def heartbeat(self, ctx: Context, began: float, total: float | None, what: str) -> AsyncIterator[None]:
        """Progress every progress_interval_s while the body waits for what is not yet the cell (a session's
        first start, say, seconds on a loaded machine): a client whose request timeout resets on progress
        (the TypeScript SDK's resetTimeoutOnProgress) keeps waiting instead of giving up. Its value is the
        time since `began`, so it only grows across this note and the cell's own."""
        interval = self.settings.progress_interval_s

        async def beat() -> None:
            while True:
                await anyio.sleep(interval)
                elapsed = time.monotonic() - began
                try:
                    await ctx.report_progress(elapsed, total, f"{what} ({elapsed:.0f} s)")
                except Exception:  # a client gone mid-call: the call itself finds out and answers no one
                    return

        failure: Exception | None = None
        async with anyio.create_task_group() as group:
            group.start_soon(beat)
            try:
                yield
            except Exception as exc:  # raised past the group, not inside an ExceptionGroup: callers catch
                failure = exc  # CodeRunnerError by its own type (the tool decorator turns it into isError)
            finally:
                group.cancel_scope.cancel()
        if failure is not None:
            raise failure

    @staticmethod
    async def off_loop(function: Callable[..., T], *args: Any, bulk: bool = False, **kwargs: Any) -> T:
        """Blocking file or /proc work in the server's bounded worker threads (offload.py); `bulk` for copies."""
        return await off_loop(function, *args, bulk=bulk, **kwargs)

    def caller(self, ctx: Context) -> str:
        """Which client this call is from: each has its own default session (see callers.py)."""
        key = caller_key(ctx.request_context.request)
        on_connection_close(ctx.request_context.session, key, self.host.release_caller)
        return key

    @staticmethod
    def client(ctx: Context) -> str:
        """Which client owns this call's exports and persistent names (see owners.py)."""
        return client_of(ctx.request_context.request)

    @staticmethod
    def share(ctx: Context) -> str | None:
        """Whose share of the one-shot slots a call takes: none over stdio, where one client has them all."""
        key = caller_key(ctx.request_context.request)
        return None if key == LOCAL_CALLER else key

    async def session(self, ctx: Context, session_id: str | None, total: float | None = None) -> SessionHandle:
        """The session a call names ('' or None: the caller's default, started on its first use), or
        SessionError saying why not; progress goes out while a start takes its time (`total`: the call's)."""
        async with self.heartbeat(ctx, time.monotonic(), total, "starting the session"):
            return await self.host.resolve(session_id or None, self.caller(ctx), self.client(ctx))

    def egress_call(self, ctx: Context, session: SessionHandle) -> contextlib.AbstractAsyncContextManager[EgressCall]:
        """Around code that runs in the session's sandbox: ask this call's user about hosts, note denials."""
        return self.egress_calls.during(ctx, session.egress, session.session_id)

    async def summary(self, session: SessionHandle, *, detail: bool = False) -> dict[str, Any]:
        """A session as the session tools report it: brief, or (`detail`) manage_sessions status' view."""
        describe = detailed if detail else brief
        return describe(await session.status(), self.host.is_default(session))

    async def guest_reply(self, session: SessionHandle, result: dict[str, Any]) -> CallToolResult:
        """A guest tool's answer under the bounds of cell output; an oversized answer spills to the workspace."""
        if session.export_note:
            result["exported"] = session.export_note
        return await self.off_loop(guest_tool_result, result, self.reply_bounds, session.reply_writer())

    @staticmethod
    def with_export_note(reply: CallToolResult, session: SessionHandle) -> CallToolResult:
        """Say what the call's copy-out put in the client's export folder (or refused), if anything."""
        if session.export_note:
            reply.content.append(TextContent(type="text", text=f"[{session.export_note}]"))
        return reply


def _bound(
    wrapper: Callable[..., Any], function: Callable[..., Any], signature: inspect.Signature
) -> Callable[..., Any]:
    """`wrapper` named and documented as `function`, with `signature` (and annotations to match: the SDK
    finds the Context argument by its type hint)."""
    wrapper.__name__ = wrapper.__qualname__ = function.__name__
    wrapper.__doc__ = function.__doc__
    wrapper.__module__ = function.__module__
    wrapper.__signature__ = signature  # type: ignore[attr-defined]
    wrapper.__annotations__ = {
        name: parameter.annotation
        for name, parameter in signature.parameters.items()
        if parameter.annotation is not inspect.Parameter.empty
    } | {"return": signature.return_annotation}
    return wrapper
