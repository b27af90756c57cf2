"""Asking the user about a host, across the cluster: the node's side.

On one machine a call lends its CallAsker (egress/asker.py) to the session's proxy. In cluster mode
the proxy runs on the session's node and the user's client is at a front door, so the node's proxy
gets a RelayAsker instead, for as long as a call whose caller can be asked is going: each question
waits here, unanswered, in the session's value in its agent's long poll (SessionSide.news,
sessions/changes.py), which the front door follows while such a call goes; it puts each new one to
its user and answers (SessionSide.answer_egress). No answer in time is no answer: the proxy denies,
as it does when a client cannot be asked.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable

import anyio

from coderunner.cluster.wire import Question
from coderunner.egress.asker import ASK_WAIT_S

#: Bound on a question's trip: the front door's long poll, the user's answer, the reply back.
RELAY_WAIT_S = ASK_WAIT_S + 10.0
#: Questions held at once (the proxy asks one at a time; this bounds what a stuck front door leaves).
MAX_WAITING = 8


class RelayAsker:
    """An Asker (egress/policy_proxy.py) whose answers come from a front door. `on_change`: told when the
    questions waiting change (one asked, answered, timed out), to publish them."""

    def __init__(self, on_change: Callable[[], None] = lambda: None) -> None:
        self._waiting: dict[str, tuple[Question, asyncio.Future[bool | None]]] = {}
        self._on_change = on_change

    async def __call__(self, host: str, port: int) -> bool | None:
        if len(self._waiting) >= MAX_WAITING:
            return None
        question = Question(secrets.token_hex(8), host, port)
        answer: asyncio.Future[bool | None] = asyncio.get_running_loop().create_future()
        self._waiting[question.question_id] = (question, answer)
        self._on_change()
        try:
            with anyio.move_on_after(RELAY_WAIT_S):
                return await answer
            return None
        finally:
            if self._waiting.pop(question.question_id, None) is not None:
                self._on_change()

    def waiting(self) -> tuple[Question, ...]:
        """The questions not answered yet, oldest first."""
        return tuple(question for question, _ in self._waiting.values())

    def give_up(self) -> None:
        """The run that could ask ended: what still waits gets no answer (the proxy denies it)."""
        for _, waiting in self._waiting.values():
            if not waiting.done():
                waiting.set_result(None)

    def answer(self, question_id: str, allowed: bool | None) -> None:
        _, waiting = self._waiting.get(question_id, (None, None))
        if waiting is not None and not waiting.done():
            waiting.set_result(allowed)
