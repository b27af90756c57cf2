"""SessionEgress on its own: the asker is set per call and reaches the proxy, and unset it asks nobody."""

from __future__ import annotations

from coderunner.policy.egress import EgressPolicy
from coderunner.sessions.egress_wiring import SessionEgress


def test_the_asker_is_set_and_cleared_per_call() -> None:
    ceiling = EgressPolicy.parse(["python-packages", "example.com"])
    egress = SessionEgress(ceiling.narrowed(["example.com"]), ceiling, session_id="s")

    async def yes(host: str, port: int) -> bool:
        return True

    assert egress.proxy.asker is None
    egress.set_asker(yes)
    assert egress.proxy.asker is yes
    egress.set_asker(None)
    assert egress.proxy.asker is None
