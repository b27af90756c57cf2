"""Asking the user about a host during a one-shot run in cluster mode: a mailbox both sides reach.

A one-shot run is a Ray task (node_calls.py), and a task takes no calls, so its proxy's questions
cannot wait on the node for the front door's read as a session's do (relay_asker.py). Instead each
front door keeps one small actor on its own node, a QuestionBox, dying with it. A run that can ask
(network 'allowlist', a client that takes elicitation) opens a RelayAsker there under two secret
tokens: the node's run posts its questions with the ask token (BoxAsker) and waits, bounded, for the
answer; the front door alone holds the read token, reads the questions with it, puts them to the
call's user and answers. The node never has the read token, so it cannot answer a question, and no
run reaches another run's questions. The decision stays with the node's proxy, within the user's
ceiling; a run whose caller is gone (a detached job) gets no answer: the proxy denies.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from typing import TYPE_CHECKING, Any

import anyio
import ray

from coderunner.cluster.relay_asker import RELAY_WAIT_S, RelayAsker
from coderunner.cluster.remote_job import POLL_S
from coderunner.cluster.wire import Question

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from coderunner.cluster.remote_egress import RemoteEgress

log = logging.getLogger(__name__)

#: Runs that may ask at once through one front door's box (each holds a RelayAsker there).
MAX_RUNS = 256
#: Bound on one call to the box beyond its own wait (the box is on the front door's node).
BOX_CALL_S = 10.0


class QuestionBox:
    """Ray actor: the questions of the one-shot runs that can ask, by token (module docstring)."""

    def __init__(self) -> None:
        self._by_ask: dict[str, RelayAsker] = {}
        self._by_read: dict[str, RelayAsker] = {}

    async def open(self, ask_token: str, read_token: str) -> bool:
        if len(self._by_read) >= MAX_RUNS:
            return False
        self._by_ask[ask_token] = self._by_read[read_token] = RelayAsker()
        return True

    async def ask(self, ask_token: str, host: str, port: int) -> bool | None:
        """The node's run: put `host` to the run's user and wait for the answer (None: none in time)."""
        relay = self._by_ask.get(ask_token)
        return await relay(host, port) if relay is not None else None

    async def read(self, read_token: str, wait_s: float) -> list[Question]:
        """The front door: the run's questions, as soon as there is one (up to `wait_s`)."""
        relay = self._by_read.get(read_token)
        if relay is None:
            return []
        with anyio.move_on_after(wait_s):
            await relay.asked.wait()
        return relay.take()

    async def answer(self, read_token: str, question_id: str, allowed: bool | None) -> None:
        relay = self._by_read.get(read_token)
        if relay is not None:
            relay.answer(question_id, allowed)

    async def close(self, ask_token: str, read_token: str) -> None:
        """The run ended: what still waits gets no answer."""
        self._by_ask.pop(ask_token, None)
        relay = self._by_read.pop(read_token, None)
        if relay is not None:
            relay.give_up()


QuestionBoxActor = ray.remote(QuestionBox)


class BoxAsker:
    """On the node: an Asker (egress/policy_proxy.py) whose answers come through the front door's box."""

    def __init__(self, box: Any, ask_token: str) -> None:
        self._box = box
        self._ask_token = ask_token

    async def __call__(self, host: str, port: int) -> bool | None:
        with anyio.move_on_after(RELAY_WAIT_S + BOX_CALL_S):
            try:
                answer: bool | None = await self._box.ask.remote(self._ask_token, host, port)
                return answer
            except ray.exceptions.RayError as exc:  # the front door (and its box) is gone: nobody answers
                log.info("question about %s:%s not relayed (%s): denied", host, port, type(exc).__name__)
        return None


def new_tokens() -> tuple[str, str]:
    """An ask token (the node gets it) and a read token (the front door keeps it)."""
    return secrets.token_urlsafe(18), secrets.token_urlsafe(18)


async def relay_questions(box: Any, read_token: str, mirror: RemoteEgress, group: TaskGroup) -> None:
    """The front door, while the run goes: read its questions and answer each (until `group` is cancelled)."""
    while True:
        try:
            with anyio.fail_after(POLL_S + BOX_CALL_S):
                questions: list[Question] = await box.read.remote(read_token, POLL_S)
        except TimeoutError:
            continue
        except ray.exceptions.RayError:  # the box is gone: the node's questions get no answer, its proxy denies
            return
        for question in questions:
            group.start_soon(_answer, box, read_token, mirror, question)


async def _answer(box: Any, read_token: str, mirror: RemoteEgress, question: Question) -> None:
    """Put one question to the user of the call lent now (none: a detached run, no answer, the node denies)."""
    asker = mirror.asker
    allowed = await asker(question.host, question.port) if asker is not None else None
    with anyio.move_on_after(BOX_CALL_S), contextlib.suppress(ray.exceptions.RayError):
        await box.answer.remote(read_token, question.question_id, allowed)
