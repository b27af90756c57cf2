"""Asking the user about a host, across the cluster: the node's side.

On one machine a call lends its CallAsker (egress/asker.py) to the session's proxy. In cluster mode
the proxy runs on the session's node and the user's client is at a front door, so the node's proxy
gets a RelayAsker instead, for as long as a call whose caller can be asked is going: each question
waits here, goes out in the next read the front door makes (a run's JobDelta.questions; a guest
tool's or install_packages' read_questions, its one agent call having no reads of its own), whose
long poll it wakes, and the front door puts it to its user and answers (SessionSide.answer_egress).
No answer in time is no answer: the proxy denies, as it does when a client cannot be asked.
"""

from __future__ import annotations

import asyncio
import secrets

import anyio

from coderunner.cluster.wire import Question
from coderunner.egress.asker import ASK_WAIT_S

#: Bound on a question's trip: the front door's read (about 1 s), the user's answer, the reply back.
RELAY_WAIT_S = ASK_WAIT_S + 10.0
#: Questions held at once (the proxy asks one at a time; this bounds what a stuck front door leaves).
MAX_WAITING = 8


class RelayAsker:
    """An Asker (egress/policy_proxy.py) whose answers come from a front door."""

    def __init__(self) -> None:
        self._waiting: dict[str, asyncio.Future[bool | None]] = {}
        self._unsent: list[Question] = []
        #: Set when a question waits to be sent: a read waiting on the node returns early for it.
        self.asked = anyio.Event()

    async def __call__(self, host: str, port: int) -> bool | None:
        if len(self._waiting) >= MAX_WAITING:
            return None
        question = Question(secrets.token_hex(8), host, port)
        answer: asyncio.Future[bool | None] = asyncio.get_running_loop().create_future()
        self._waiting[question.question_id] = answer
        self._unsent.append(question)
        self.asked.set()
        try:
            with anyio.move_on_after(RELAY_WAIT_S):
                return await answer
            return None
        finally:
            self._waiting.pop(question.question_id, None)
            if question in self._unsent:
                self._unsent.remove(question)
                self._quiet()

    def take(self) -> list[Question]:
        """The questions not sent yet (each goes out once)."""
        unsent, self._unsent = self._unsent, []
        self._quiet()
        return unsent

    def _quiet(self) -> None:
        """`asked` is set exactly while a question waits to be sent (else a read would spin on it)."""
        if not self._unsent and self.asked.is_set():
            self.asked = anyio.Event()

    def give_up(self) -> None:
        """The run that could ask ended: what still waits gets no answer (the proxy denies it)."""
        self._unsent.clear()
        self._quiet()
        for waiting in self._waiting.values():
            if not waiting.done():
                waiting.set_result(None)

    def answer(self, question_id: str, allowed: bool | None) -> None:
        waiting = self._waiting.get(question_id)
        if waiting is not None and not waiting.done():
            waiting.set_result(allowed)
