"""Network 'allowlist' during one tool call: lend the call's asker, then say what was denied.

While a call runs code in an allowlist sandbox, that sandbox's proxy may meet a host inside the
user's ceiling (allowed_domains) but outside the session's own list; the call's CallAsker
(egress/asker.py) puts it to the user when the client can be asked. Either way the reply names every
host denied during the call and the way to allow it (egress/texts.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

from mcp.server.mcpserver import Context
from mcp.types import CallToolResult, TextContent

from coderunner.egress.asker import CallAsker
from coderunner.egress.texts import denial_note, denied_with_reasons, offline_note
from coderunner.errors import CodeRunnerError
from coderunner.policy.egress import EgressPolicy
from coderunner.vocabulary.network import NetworkMode, more_network

if TYPE_CHECKING:
    from coderunner.sessions.egress_wiring import SessionEgress

#: Decisions searched for the reasons of this call's denials.
REASON_WINDOW = 200


class EgressCall:
    """One tool call's share of a sandbox's egress: the asker it lends, the denials it reports."""

    def __init__(self, ceiling: EgressPolicy, asker: CallAsker | None) -> None:
        self.ceiling = ceiling
        self.asker = asker
        self.egress: SessionEgress | None = None
        self._mark = 0

    def attach(self, egress: SessionEgress) -> None:
        """Watch this sandbox's decisions from now on (a one-shot run's proxy, made during the call)."""
        self.egress = egress
        self._mark = egress.log.mark()
        if self.asker is not None and self.asker.enabled:
            egress.set_asker(self.asker)

    def note(self) -> str | None:
        """'network: denied ...' for the hosts denied since the call began, or None."""
        if self.egress is None:
            return None
        targets = self.egress.log.denied_since(self._mark)
        if not targets:
            return None
        denied = denied_with_reasons(targets, self.egress.log.recent(REASON_WINDOW))
        declined = self.asker.declined if self.asker is not None else ()
        return denial_note(denied, self.egress.proxy.policy, self.ceiling, declined=declined)

    def noted(self, reply: CallToolResult) -> CallToolResult:
        """The reply with the denial line appended as its own text block (if anything was denied)."""
        note = self.note()
        if note:
            reply.content.append(TextContent(type="text", text=f"[{note}]"))
        return reply


def offline_noted(reply: CallToolResult, network: str, ceiling: str) -> CallToolResult:
    """A run's reply in a session with network 'none' that failed for want of network, with a line saying
    so (the allowlist mode's denial line does the same for hosts its proxy refused)."""
    if network != NetworkMode.NONE or not reply.is_error:
        return reply
    output = "\n".join(block.text for block in reply.content if isinstance(block, TextContent))
    note = offline_note(output, more_network(ceiling))
    if note:
        reply.content.append(TextContent(type="text", text=f"[{note}]"))
    return reply


class EgressCalls:
    """The calls in flight on each allowlist sandbox; the latest one's client is the one asked."""

    def __init__(self, ceiling: EgressPolicy) -> None:
        self.ceiling = ceiling
        self._askers: dict[int, list[CallAsker]] = {}

    @contextlib.asynccontextmanager
    async def during(self, ctx: Context, egress: SessionEgress | None, session_id: str) -> AsyncIterator[EgressCall]:
        """Lend this call's asker to a session's proxy while the body runs; take it back after."""
        if egress is None:
            yield EgressCall(self.ceiling, None)
            return
        asker = CallAsker(ctx, f"session {session_id[:8]}")
        call = EgressCall(self.ceiling, asker)
        if not asker.enabled:  # nobody to ask: the proxy denies with its hint, and records no "no"
            call.attach(egress)
            with _noting(call):
                yield call
            return
        stack = self._askers.setdefault(id(egress), [])
        stack.append(asker)
        call.attach(egress)
        try:
            with _noting(call):
                yield call
        finally:
            stack.remove(asker)
            egress.set_asker(stack[-1] if stack else None)
            if not stack:
                del self._askers[id(egress)]

    @contextlib.contextmanager
    def oneshot(self, ctx: Context) -> Iterator[EgressCall]:
        """For a one-shot run: its proxy is its own, made during the call and attached then."""
        call = EgressCall(self.ceiling, CallAsker(ctx, "a one-shot run (execute_code)"))
        with _noting(call):
            yield call


@contextlib.contextmanager
def _noting(call: EgressCall) -> Iterator[None]:
    """A call that failed (a guest tool, for want of a host) still says which hosts were denied."""
    try:
        yield
    except CodeRunnerError as exc:
        note = call.note()
        if note:
            exc.args = (f"{exc}\n[{note}]",)
        raise
