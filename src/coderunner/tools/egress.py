"""Network 'allowlist' during one tool call: ask the user about a host, then say what was denied.

While a call runs code in an allowlist sandbox, that sandbox's proxy may meet a host inside the
user's ceiling (allowed_domains) but outside the session's own list. If the client declared MCP
elicitation and can take a request during this call, the user is asked (allow for this session, or
deny); otherwise, or without an answer in time, the host is denied. Either way the reply names every
host denied during the call and the way to allow it (egress_text.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Literal

import anyio
from mcp.server.mcpserver import Context
from mcp.types import CallToolResult, TextContent
from pydantic import BaseModel, Field

from coderunner.egress.policy import EgressPolicy
from coderunner.egress.texts import denial_note, denied_with_reasons
from coderunner.errors import CodeRunnerError

if TYPE_CHECKING:
    from coderunner.egress.gateway import SessionEgress

log = logging.getLogger(__name__)

#: Bound on the user's answer (the proxy holds the connection meanwhile, under its own longer bound).
ASK_WAIT_S = 50.0
#: Decisions searched for the reasons of this call's denials.
REASON_WINDOW = 200


class HostPermission(BaseModel):
    """The one closed question put to the user."""

    decision: Literal["allow", "deny"] = Field(
        title="Network access", description="allow: this host for the rest of this session; deny: not now"
    )


def can_elicit(ctx: Context) -> bool:
    """Whether this call's client declared form elicitation and can take a request during the call."""
    session = ctx.request_context.session
    capabilities = session.client_capabilities
    elicitation = capabilities.elicitation if capabilities is not None else None
    if elicitation is None:
        return False
    # An empty elicitation capability means form mode (the spec's backwards-compatible reading).
    form = elicitation.form is not None or elicitation.url is None
    return form and session.can_send_request


class CallAsker:
    """Puts hosts to the user through one call's client, one question per host. The proxy bounds how
    many a session may ask (egress/proxy.py MAX_ASKS) and asks one at a time."""

    def __init__(self, ctx: Context, who: str) -> None:
        self._ctx = ctx
        self._who = who
        self.enabled = can_elicit(ctx)
        #: host -> the user's answer, for this call.
        self.answers: dict[str, bool] = {}
        self._pending: dict[str, anyio.Event] = {}

    @property
    def declined(self) -> list[str]:
        return [host for host, allowed in self.answers.items() if not allowed]

    async def __call__(self, host: str, port: int) -> bool | None:
        """True: the user allowed it; False: the user said no; None: nobody was asked (or answered)."""
        if not self.enabled:
            return None
        if host in self.answers:
            return self.answers[host]
        if host in self._pending:  # another connection to it is already being asked about
            await self._pending[host].wait()
            return self.answers.get(host)
        self._pending[host] = done = anyio.Event()
        try:
            allowed = await self._ask(host, port)
            if allowed is not None:
                self.answers[host] = allowed
            return allowed
        finally:
            del self._pending[host]
            done.set()

    async def _ask(self, host: str, port: int) -> bool | None:
        message = (
            f"Code in CodeRunner {self._who} wants to connect to {host}:{port}. "
            "It is within your allowed_domains but not in this session's allowlist. "
            "Allow it for the rest of this session?"
        )
        try:
            with anyio.move_on_after(ASK_WAIT_S):
                answer = await self._ctx.elicit(message, HostPermission)
                return answer.action == "accept" and answer.data.decision == "allow"
        except Exception as exc:  # the client refused the request, or answered out of schema: no answer
            log.info("elicitation about %s:%s failed (%s): denied", host, port, exc)
        return None


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
