"""An allowlist session's proxy on another node, as the front door's tools see it.

The proxy runs on the session's node and enforces the policy there. What the tools read of it (the
decisions behind a reply's "network: denied ..." line and session_status's egress section) is
mirrored here from the EgressDelta that agent answers carry: each answer brings the decisions after
this mirror's mark. The asker a call lends is kept here: while run_python, a guest tool or
install_packages goes, the node relays its proxy's questions to it (relay_asker.py).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from coderunner.cluster.wire import EgressDelta
from coderunner.egress.audit import Decision, DecisionLog
from coderunner.egress.policy_proxy import Asker
from coderunner.policy.egress import EgressPolicy

if TYPE_CHECKING:
    from coderunner.sessions.egress_wiring import SessionEgress


def delta_of(egress: SessionEgress, since: int) -> EgressDelta:
    """On the node: a proxy's decisions after the mark `since`, with its totals, open connections and policy."""
    decisions, mark = egress.log.since(since)
    return EgressDelta(decisions, mark, egress.log.totals(), egress.proxy.open_connections(), egress.proxy.policy)


class MirroredLog(DecisionLog):
    """A DecisionLog fed from a node's: its totals are the node's (the ring may have missed some)."""

    def __init__(self, session_id: str) -> None:
        super().__init__(session_id)
        self._node_totals: dict[str, int] | None = None

    def adopt_totals(self, totals: dict[str, int]) -> None:
        self._node_totals = dict(totals)

    def totals(self) -> dict[str, int]:
        return dict(self._node_totals) if self._node_totals is not None else super().totals()


class ProxyView:
    """What the tools read of a proxy: its policy and its open connections, as of the last answer."""

    def __init__(self, policy: EgressPolicy) -> None:
        self.policy = policy
        self.open_now: list[Decision] = []

    def open_connections(self) -> list[Decision]:
        return list(self.open_now)


class RemoteEgress:
    """The node's proxy for one session: `log` and `proxy` as SessionEgress has them."""

    def __init__(self, session_id: str, policy: EgressPolicy) -> None:
        self.session_id = session_id
        self.log = MirroredLog(session_id)
        self.proxy = ProxyView(policy)
        #: The node log's position this mirror has seen up to (what the next call asks after).
        self.mark = 0
        self._lock = threading.Lock()  # answers arrive on the loop and in worker threads (status)
        self.asker: Asker | None = None

    def apply(self, delta: EgressDelta | None) -> None:
        """Take in what an answer brought; an older or overlapping answer adds nothing twice."""
        if delta is None:
            return
        with self._lock:
            if delta.mark < self.mark:
                return
            first = delta.mark - len(delta.decisions) + 1  # the node's sequence number of decisions[0]
            for offset, decision in enumerate(delta.decisions):
                if first + offset > self.mark:
                    self.log.record(decision)
            self.mark = delta.mark
            self.log.adopt_totals(delta.totals)
            self.proxy.policy = delta.policy
            self.proxy.open_now = list(delta.open_now)

    def set_asker(self, asker: Asker | None) -> None:
        """The asker the node's questions go to while a run that can ask goes (module docstring)."""
        self.asker = asker
