"""The front door's mirror of a node's allowlist proxy (cluster/remote_egress.py), without a cluster."""

from __future__ import annotations

from coderunner.cluster.remote_egress import RemoteEgress
from coderunner.cluster.wire import EgressDelta
from coderunner.egress.audit import Decision, DecisionLog
from coderunner.egress.policy import EgressPolicy

POLICY = EgressPolicy.parse(["a.example.org"])


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
    mirror.set_asker(object())  # asking does not cross: accepted and ignored
    assert mirror.proxy.policy == POLICY and mirror.proxy.open_connections() == []
