"""What allowlist sessions tell the agent and the user: denial lines, status, the question put to the user.

Pure parts with the real policy and decision log; the asker with a stand-in for the MCP context (the
real elicitation round trip is tests/test_e2e_egress_ux.py).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import anyio
import pytest
from mcp.server.elicitation import AcceptedElicitation, DeclinedElicitation
from mcp.types import ClientCapabilities, ElicitationCapability, FormElicitationCapability

from coderunner.egress.asker import CallAsker, HostPermission
from coderunner.egress.audit import Decision, DecisionLog
from coderunner.egress.texts import denial_note, denied_with_reasons, egress_status
from coderunner.policy.egress import EgressPolicy

CEILING = EgressPolicy.parse(["ix.example", "fx.example", "*.example.org", "198.51.100.7"])
SESSION = EGRESS = CEILING.narrowed(["ix.example", "198.51.100.7"])


def denied(log: DecisionLog, host: str, port: int = 443, reason: str = "not in this session's allowlist") -> None:
    log.record(Decision(at=1_800_000_000.0, host=host, port=port, allowed=False, reason=reason))


def note_for(log: DecisionLog, mark: int, declined: tuple[str, ...] = ()) -> str | None:
    pairs = denied_with_reasons(log.denied_since(mark), log.recent(200))
    return denial_note(pairs, SESSION, CEILING, declined=declined)


def test_no_denial_no_line() -> None:
    log = DecisionLog("s")
    mark = log.mark()
    log.record(Decision(at=1.0, host="ix.example", port=443, allowed=True, reason="allowed", sent=10, received=20))
    assert note_for(log, mark) is None


def test_denials_are_grouped_by_their_way_out() -> None:
    log = DecisionLog("s")
    denied(log, "before.example.org")  # before the call's mark: not this call's
    mark = log.mark()
    denied(log, "data.example.org")  # inside the ceiling, not the session's list
    denied(log, "data.example.org")  # twice: named once
    denied(log, "evil.test")  # beyond the ceiling
    denied(log, "ix.example", 8080, reason="port 8080 is not allowed")  # a port beyond the ceiling
    denied(log, "198.51.100.7", 443, reason="resolves to a private/loopback address")  # allowed, refused by address
    assert note_for(log, mark) == (
        "network: denied data.example.org:443 (not in this session's allowlist; allowed: ix.example, 198.51.100.7 "
        "on ports 80, 443); to reach it: create_session(network='allowlist', allow=['data.example.org']); "
        "denied evil.test:443 (not in the user's allowed_domains; only the user can add it: `allowed_domains` "
        "(config, CODERUNNER_ALLOWED_DOMAINS or --allow-domain)); "
        "denied ix.example:8080 (port not allowed; the user's allowed_ports: 80, 443); "
        "denied 198.51.100.7:443 (resolves to a private/loopback address)"
    )


def test_a_declined_host_says_the_user_declined() -> None:
    log = DecisionLog("s")
    mark = log.mark()
    denied(log, "data.example.org")
    assert note_for(log, mark, declined=("data.example.org",)) == (
        "network: denied data.example.org:443 (the user declined)"
    )


def test_many_hosts_are_counted_not_listed() -> None:
    log = DecisionLog("s")
    mark = log.mark()
    for n in range(9):
        denied(log, f"h{n}.example.org")
    note = note_for(log, mark)
    assert note is not None and "h4.example.org:443 and 4 more" in note and "h5.example.org" not in note


def test_status_shows_hosts_recent_decisions_and_totals() -> None:
    log = DecisionLog("s")
    log.record(Decision(at=1_800_000_000.0, host="ix.example", port=443, allowed=True, reason="ok", sent=5, received=7))
    denied(log, "evil.test")
    status = egress_status(SESSION, log.recent(10), log.totals())
    assert status["allowed_hosts"] == ["ix.example", "198.51.100.7"] and status["ports"] == [80, 443]
    assert status["recent"][0] == {
        "at": "2027-01-15T08:00:00Z", "host": "ix.example", "port": 443, "allowed": True, "sent": 5, "received": 7,
    }  # fmt: skip
    assert status["recent"][1]["allowed"] is False and status["recent"][1]["reason"]
    assert status["totals"] == {"allowed": 1, "denied": 1, "sent": 5, "received": 7}


# --- the asker ------------------------------------------------------------------------------------


class FakeContext:
    """The two things CallAsker uses of an MCP Context: the client's capabilities, and elicit."""

    def __init__(self, answers: dict[str, str], elicitation: bool = True, back_channel: bool = True) -> None:
        capabilities = ClientCapabilities(
            elicitation=ElicitationCapability(form=FormElicitationCapability()) if elicitation else None
        )
        session = SimpleNamespace(client_capabilities=capabilities, can_send_request=back_channel)
        self.request_context = SimpleNamespace(session=session)
        self.answers = answers
        self.asked: list[str] = []
        self.release = anyio.Event()

    async def elicit(self, message: str, schema: type[HostPermission]) -> Any:
        host = next(name for name in self.answers if name in message)
        self.asked.append(host)
        await self.release.wait()
        answer = self.answers[host]
        if answer == "decline":
            return DeclinedElicitation()
        return AcceptedElicitation(data=schema(decision=answer))


@pytest.mark.anyio
async def test_one_question_per_host_however_many_connections_ask() -> None:
    ctx = FakeContext({"a.example.org": "allow", "b.example.org": "deny"})
    asker = CallAsker(ctx, "session-id-1234")  # type: ignore[arg-type]
    results: dict[str, list[bool]] = {"a.example.org": [], "b.example.org": []}

    async def connect(host: str) -> None:
        results[host].append(await asker(host, 443))

    async with anyio.create_task_group() as tg:
        for host in ("a.example.org", "b.example.org") * 3:
            tg.start_soon(connect, host)
        await anyio.wait_all_tasks_blocked()
        ctx.release.set()
    assert sorted(ctx.asked) == ["a.example.org", "b.example.org"]
    assert results == {"a.example.org": [True] * 3, "b.example.org": [False] * 3}
    assert asker.declined == ["b.example.org"]
    assert await asker("a.example.org", 443) and ctx.asked.count("a.example.org") == 1


@pytest.mark.anyio
async def test_no_answer_is_not_a_no() -> None:
    """A client that fails the request answers nothing: None, so the proxy does not record the user's no."""

    class Failing(FakeContext):
        async def elicit(self, message: str, schema: type[HostPermission]) -> Any:
            raise RuntimeError("Elicitation not supported")

    asker = CallAsker(Failing({}), "session-id-1234")  # type: ignore[arg-type]
    assert await asker("a.example.org", 443) is None and asker.declined == []


@pytest.mark.anyio
@pytest.mark.parametrize(("elicitation", "back_channel"), [(False, True), (True, False)])
async def test_without_elicitation_nobody_is_asked(elicitation: bool, back_channel: bool) -> None:
    ctx = FakeContext({"a.example.org": "allow"}, elicitation=elicitation, back_channel=back_channel)
    ctx.release.set()
    asker = CallAsker(ctx, "session-id-1234")  # type: ignore[arg-type]
    assert not asker.enabled
    assert await asker("a.example.org", 443) is None and ctx.asked == []
