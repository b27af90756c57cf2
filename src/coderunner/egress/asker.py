"""Who asks the user about a host during one tool call: MCP elicitation through that call's client.

While a call runs code in an allowlist sandbox, the sandbox's proxy may meet a host inside the user's
ceiling (allowed_domains) but outside the session's own list. If the call's client declared form
elicitation and can take a request during the call, a CallAsker puts that host to the user (allow for
this session, or deny); otherwise, or without an answer in time, the proxy denies it. The proxy
(egress/policy_proxy.py) bounds how many questions a session may ask and asks one at a time; the
tools lend a call's asker to the proxy for the length of the call (tools/egress.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Literal

import anyio
from pydantic import BaseModel, Field

if TYPE_CHECKING:  # a cluster node imports this module (its relayed questions) and never loads the MCP SDK
    from mcp.server.mcpserver import Context

log = logging.getLogger(__name__)

#: Bound on the user's answer (the proxy holds the connection meanwhile, under its own longer bound).
ASK_WAIT_S = 50.0


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
    many a session may ask (egress/policy_proxy.py MAX_ASKS) and asks one at a time."""

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
