"""The front door's mirror of a node's allowlist proxy (cluster/remote_egress.py), without a cluster."""

from __future__ import annotations

import pytest

from coderunner.cluster.remote_egress import RemoteEgress
from coderunner.cluster.wire import EgressDelta
from coderunner.egress.audit import Decision, DecisionLog
from coderunner.policy.egress import EgressPolicy

POLICY = EgressPolicy.parse(["a.example.org"])

pytestmark = pytest.mark.anyio


def denied(host: str) -> Decision:
    return Decision(0.0, host, 80, False, "not in this session's allowlist")


def answer(node: DecisionLog, since: int) -> EgressDelta:
    """What an actor answers a caller whose mark is `since` (actor.py's egress_delta)."""
    decisions, mark = node.since(since)
    return EgressDelta(decisions, mark, node.totals(), [], POLICY)


def test_each_decision_is_mirrored_once_whatever_order_answers_arrive_in() -> None:
    node, mirror = DecisionLog("s"), RemoteEgress("s", POLICY)
    node.record(denied("one.example"))
    first = answer(node, mirror.mark)
    node.record(denied("two.example"))
    second = answer(node, mirror.mark)  # asked with the same mark: overlaps `first`
    call_mark = mirror.log.mark()
    mirror.apply(second)
    mirror.apply(first)  # older: adds nothing
    mirror.apply(second)  # again: adds nothing
    assert [d.host for d in mirror.log.recent(10)] == ["one.example", "two.example"]
    assert mirror.log.denied_since(call_mark) == ["one.example:80", "two.example:80"]
    assert mirror.log.totals()["denied"] == 2


def test_a_ring_that_moved_on_still_gives_the_nodes_totals() -> None:
    node, mirror = DecisionLog("s", capacity=3), RemoteEgress("s", POLICY)
    for index in range(10):
        node.record(denied(f"h{index}.example"))
    mirror.apply(answer(node, mirror.mark))
    assert [d.host for d in mirror.log.recent(10)] == ["h7.example", "h8.example", "h9.example"]
    assert mirror.log.totals()["denied"] == 10 and mirror.mark == 10
    assert mirror.proxy.policy == POLICY and mirror.proxy.open_connections() == []


async def test_a_relayed_question_is_published_until_answered_and_waits_for_its_answer() -> None:
    import anyio

    from coderunner.cluster.relay_asker import RelayAsker

    published: list[tuple[str, ...]] = []
    relay = RelayAsker(lambda: published.append(tuple(q.host for q in relay.waiting())))
    answers: list[bool | None] = []

    async def proxy_asks() -> None:
        answers.append(await relay("b.example.org", 443))

    async with anyio.create_task_group() as group:
        group.start_soon(proxy_asks)
        await anyio.wait_all_tasks_blocked()
        (question,) = relay.waiting()
        assert (question.host, question.port) == ("b.example.org", 443)
        assert published == [("b.example.org",)]  # published once, as it was asked
        relay.answer(question.question_id, True)
    assert answers == [True]
    assert relay.waiting() == () and published[-1] == ()  # answered: no longer published
    # The run that could ask ended: a question still waiting gets no answer (the proxy denies).
    async with anyio.create_task_group() as group:
        group.start_soon(proxy_asks)
        await anyio.wait_all_tasks_blocked()
        assert len(relay.waiting()) == 1
        relay.give_up()
    assert answers == [True, None] and relay.waiting() == () and published[-1] == ()
