"""The browser tools: the seed's browser_navigate and browser_extract, and browser_screenshot and
browser_interact for the rest. One Chromium context per session, inside its sandbox (guest/browser.py);
run_python reaches the same page, and kernel_reset gives a fresh one.

Untrusted pages are parsed in the sandbox, never here. A file:// URL names a sandbox file, so its path
is confined by the session like any path a guest tool is given (on whichever node holds it): a path
outside what the sandbox shares is refused in plain words instead of with Chromium's raw error.
"""

# No `from __future__ import annotations`: the SDK reads tool signatures at runtime.

import re
import urllib.parse
from typing import Annotated, Any, Literal

from mcp.server.mcpserver import Context
from mcp.types import CallToolResult, ToolAnnotations
from pydantic import Field

from coderunner.errors import GuestCallError
from coderunner.tools.arguments import BrowserSeconds, SessionId, Text
from coderunner.tools.context import ToolContext, tool
from coderunner.tools.documents import called_as
from coderunner.vocabulary.network import NetworkMode, more_network

#: Default wait for a page, and the extra allowance for starting the browser on first use.
BROWSER_TIMEOUT_S = 30.0
BROWSER_START_S = 30.0
#: The actions of browser_interact (guest/browser.py's `interact` op).
InteractAction = Literal["click", "fill", "press", "select", "scroll", "wait_for"]
ExtractFormat = Literal["text", "html", "json", "table", "links"]


def absolute_url(url: str) -> bool:
    """A URL the browser can open as it is: a scheme and '//' (http, https, file), or about: and data:."""
    return bool(re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*://", url)) or url.startswith(("about:", "data:"))


def checked_url(url: str) -> str:
    """`url` as the browser gets it, or a refusal that says what is accepted."""
    if not absolute_url(url):
        raise GuestCallError(
            f"browser_navigate needs an absolute URL (http://..., https://... or file:///workspace/...), "
            f"not {url[:200]!r}"
        )
    return url


def file_path(url: str) -> str | None:
    """The sandbox path a file:// URL names (None: another scheme), for the session to confine as it
    confines every path a guest tool is given; a file on another host is refused."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() != "file":
        return None
    if parts.netloc not in ("", "localhost"):
        raise GuestCallError(f"browser_navigate: a file:// URL names a file in the sandbox, not on {parts.netloc!r}")
    return urllib.parse.unquote(parts.path)


async def browser_op(
    tools: ToolContext, ctx: Context, session_id: str, op: str, args: dict[str, Any], timeout_s: float | None
) -> CallToolResult:
    """One op of the session's browser, under the network rules of a call; errors name the tool called."""
    session = await tools.session(ctx, session_id)
    limit = (timeout_s or BROWSER_TIMEOUT_S) + BROWSER_START_S
    tool = f"browser_{op}"
    async with tools.egress_call(ctx, session) as network:
        try:
            result = await session.guest_op("browser", op, args, limit, paths=("output", "file"))
        except GuestCallError as failed:
            exc = GuestCallError(called_as(str(failed), "browser", tool))
            # The guest says only that the network is off; the way out depends on the user's ceiling.
            if session.options.network == NetworkMode.NONE and "network is off" in str(exc):
                way_out = more_network(tools.settings.network_ceiling)
                raise GuestCallError(f"{exc}; to browse the web: {way_out}") from None
            raise exc from None
    return network.noted(await tools.guest_reply(session, result))


@tool(group="browser", annotations=ToolAnnotations(open_world_hint=True))
async def browser_navigate(
    tools: ToolContext,
    ctx: Context,
    url: str,
    wait_for: Annotated[Text, Field(description="CSS selector to wait for")] = "",
    timeout_s: BrowserSeconds = None,
    session_id: SessionId = "",
) -> CallToolResult:
    """Open a page in the session's Chromium (a JavaScript app too; offline: file:///workspace/... or a
    server in the sandbox): url, status, title, text."""
    args = {"url": checked_url(url), "wait_for": wait_for or None, "timeout_s": timeout_s or BROWSER_TIMEOUT_S}
    if (path := file_path(url)) is not None:
        args["file"] = path  # confined by the session like any path: outside what it shares is refused
    return await browser_op(tools, ctx, session_id, "navigate", args, timeout_s)


@tool(group="browser")
async def browser_extract(
    tools: ToolContext,
    ctx: Context,
    selector: str,
    format: ExtractFormat = "text",
    attribute: Annotated[Text, Field(description="extract it instead")] = "",
    session_id: SessionId = "",
) -> CallToolResult:
    """The current page's matches of a CSS selector as text, html, JSON, table rows or links."""
    args = {"selector": selector, "format": format, "attribute": attribute or None}
    return await browser_op(tools, ctx, session_id, "extract", args, None)


@tool(group="browser")
async def browser_screenshot(
    tools: ToolContext,
    ctx: Context,
    full_page: bool = False,
    selector: Annotated[Text, Field(description="only this element")] = "",
    output: Annotated[Text, Field(description="screenshot.png")] = "",
    session_id: SessionId = "",
) -> CallToolResult:
    """The current page or one element as an image, also saved to output."""
    args = {"full_page": full_page, "selector": selector or None, "output": output or "screenshot.png"}
    return await browser_op(tools, ctx, session_id, "screenshot", args, None)


@tool(group="browser")
async def browser_interact(
    tools: ToolContext,
    ctx: Context,
    action: InteractAction,
    selector: str,
    value: Annotated[Text, Field(description="fill, press, select")] = "",
    timeout_s: BrowserSeconds = None,
    session_id: SessionId = "",
) -> CallToolResult:
    """Act on an element of the current page (CSS selector)."""
    args = {"action": action, "selector": selector, "value": value or None, "timeout_s": timeout_s or 10}
    return await browser_op(tools, ctx, session_id, "interact", args, timeout_s)
