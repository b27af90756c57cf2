"""A session on a node, as the front door's tools use it (cluster/remote_session.py): a transport of the
session's own calls, each answer made again as it was sent (a JobUpdate), nothing of a job kept here;
and the agent's long poll (cluster/agent_watch.py, sessions/changes.py) for the questions its proxy asks."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from coderunner.cluster.remote_session import RemoteSession
from coderunner.cluster.wire import NodeInfo, Question, SessionInfo, SessionNews
from coderunner.config import load_settings
from coderunner.errors import SessionError
from coderunner.kernel.execution import RunOutcome, RunStatus
from coderunner.kernel.output_capture import OutputCollector
from coderunner.kernel.run_result import ExecutionResult
from coderunner.sandbox.base import Limits
from coderunner.sessions.changes import Changes
from coderunner.sessions.job_updates import JobUpdate
from coderunner.sessions.sandbox_options import SandboxOptions

pytestmark = pytest.mark.anyio

SESSION = "s1"


class Remote:
    """`method.remote(*args)` of a Ray actor handle: a coroutine, as Ray's ObjectRef is awaited."""

    def __init__(self, method: Callable[..., Any]) -> None:
        self.method = method

    def remote(self, *args: Any) -> Any:
        return self.method(*args)


class FakeAgent:
    """A node agent: a real Changes for its long poll; each session call scripted by `reads`."""

    def __init__(self, reads: Callable[[str], Any] | None = None) -> None:
        self.changes = Changes()
        self.reads = reads
        self.calls: list[str] = []
        self.changes_since = Remote(self._changes_since)
        self.wake = Remote(self._wake)
        self.call = Remote(self._call)

    async def _changes_since(self, versions: dict[str, int | None], timeout_s: float, waiter: str) -> Any:
        self.calls.append("changes_since")
        return await self.changes.changes_since(versions, timeout_s, waiter)

    async def _wake(self, waiter: str) -> None:
        self.changes.wake(waiter)

    async def _call(self, session_id: str, method: str, args: Sequence[Any] = ()) -> Any:
        self.calls.append(method)
        assert self.reads is not None
        await anyio.sleep(0.001)
        answer = self.reads(method)(*args)
        answer = await answer if inspect.isawaitable(answer) else answer
        if isinstance(answer, JobUpdate):  # an update crosses in its wire form, beside the egress and the outbox
            return {"update": answer.wire(), "egress": None, "exports": None}
        return answer


def remote_session(agent: FakeAgent, group: Any) -> RemoteSession:
    settings = load_settings(Path(os.devnull), export_dir="")
    options = SandboxOptions(network="none", limits=Limits(), timeout_s=60, client="alice")
    info = SessionInfo(SESSION, "alice/1", options, NodeInfo("n" * 56, "10.0.0.7"), generation=0)
    return RemoteSession(agent, info, settings, group)


class FakeEgress:
    """The part of a session's mirrored proxy that a run, a guest call and a question's answer read."""

    mark = 0

    def __init__(self, allows: Callable[[str], bool]) -> None:
        self.allows = allows

    def apply(self, delta: Any) -> None:
        pass

    async def asker(self, host: str, port: int) -> bool:
        return self.allows(host)


def done(job_id: str = "job-1", text: str = "2\n") -> JobUpdate:
    output = OutputCollector(limit_chars=1000, spill_limit_bytes=0, image_limit_bytes=0)
    output.add_text(text)
    result = ExecutionResult(RunOutcome(status=RunStatus.OK, output=output, execution_count=1))
    return JobUpdate(job_id, status="done", generation=1, result=result)


async def test_a_quick_run_comes_whole_in_one_call_and_leaves_nothing_known() -> None:
    agent = FakeAgent(lambda method: lambda *args: done())
    async with anyio.create_task_group() as group:
        session = remote_session(agent, group)
        update = await session.start_run("1+1", None, None, 1.0)
    assert agent.calls == ["start_run"]
    assert update.result is not None and update.result.outcome.output.text() == "2\n"
    assert not session.holds_job("job-1") and session.kernel_state() == (1, True)


async def test_a_running_job_is_known_until_an_answer_says_it_ended() -> None:
    answers = iter([JobUpdate("job-1", executing_for_s=0.1), JobUpdate("job-1", executing_for_s=1.1), done()])
    agent = FakeAgent(lambda method: lambda *args: next(answers))
    async with anyio.create_task_group() as group:
        session = remote_session(agent, group)
        first = await session.start_run("slow()", None, None, 1.0)
        assert first.running and session.holds_job("job-1")
        assert (await session.wait_job("job-1", 1.0)).running and session.holds_job("job-1")
        assert not (await session.wait_job("job-1", 1.0)).running
    assert agent.calls == ["start_run", "wait_job", "wait_job"] and not session.holds_job("job-1")


async def test_a_job_a_reader_saw_end_stays_known_and_one_the_node_forgot_does_not() -> None:
    answers = iter([JobUpdate("job-1"), done(), JobUpdate("job-1", status="lost", gone=True)])
    agent = FakeAgent(lambda method: lambda *args: next(answers))
    async with anyio.create_task_group() as group:
        session = remote_session(agent, group)
        await session.start_run("slow()", None)
        assert not (await session.read_job("job-1")).running and session.holds_job("job-1")
        assert (await session.read_job("job-1")).gone and not session.holds_job("job-1")


async def test_a_refusal_from_the_node_is_the_caller_s() -> None:
    def refuse(method: str) -> Any:
        def answer(*args: Any) -> Any:
            raise SessionError("session s was closed")

        return answer

    async with anyio.create_task_group() as group:
        session = remote_session(FakeAgent(refuse), group)
        with pytest.raises(SessionError, match="was closed"):
            await session.wait_job("job-1", 1.0)


async def test_a_cancelled_wait_asks_the_node_to_cancel_the_cell() -> None:
    """The run's own wait cancelled (a client that gave up): the node is asked to cancel that wait by the token it
    carried (the node's wait, cancelled, cancels the cell); a start cancelled before its answer, the same."""
    seen: list[tuple[str, tuple[Any, ...]]] = []

    def reads(method: str) -> Any:
        async def answer(*args: Any) -> Any:
            seen.append((method, args))
            if method in ("wait_job", "start_run"):
                await anyio.sleep(30)
            return None

        return answer

    async with anyio.create_task_group() as group:
        session = remote_session(FakeAgent(reads), group)
        with anyio.move_on_after(0.2):
            await session.wait_job("job-1", 30.0)
        with anyio.move_on_after(0.2):
            await session.start_run("slow()", None, None, 30.0)
    names = [name for name, _ in seen]
    assert names == ["wait_job", "cancel_run", "start_run", "cancel_run"], names
    assert seen[1][1] == (seen[0][1][3],)  # the token the wait carried
    assert seen[3][1] == (seen[2][1][6],)  # the token the start carried


async def test_a_question_is_put_to_the_user_once_and_answered_while_an_asking_run_goes() -> None:
    answers: list[tuple[str, bool | None]] = []
    asked: list[str] = []
    agent = FakeAgent(lambda method: lambda *args: answers.append(args) if method == "answer_egress" else JobUpdate(
        "job-1"
    ))  # fmt: skip
    agent.changes.publish(SESSION, SessionNews())

    async with anyio.create_task_group() as group:
        session = remote_session(agent, group)
        session._egress = FakeEgress(lambda host: asked.append(host) or True)  # type: ignore[assignment]
        assert (await session.start_run("fetch()", None)).running
        assert session._watch.following(SESSION)  # its run can ask: followed until an answer says it ended
        question = Question("q1", "b.example.org", 443)
        agent.changes.publish(SESSION, SessionNews((question,)))
        with anyio.fail_after(10):  # the answer's call sleeps in the fake agent: not "all tasks blocked" alone
            while not answers:
                await anyio.sleep(0.01)
        agent.changes.publish(SESSION, SessionNews((question,)))  # still waiting there: not again
        await anyio.wait_all_tasks_blocked()
        await anyio.sleep(0.1)
        await anyio.wait_all_tasks_blocked()
        group.cancel_scope.cancel()
    assert asked == ["b.example.org"] and answers == [("q1", True)]


async def test_an_idle_session_costs_no_poll() -> None:
    agent = FakeAgent(lambda method: lambda *args: done())
    agent.changes.publish(SESSION, SessionNews())
    async with anyio.create_task_group() as group:
        session = remote_session(agent, group)
        await session.start_run("1+1", None, None, 1.0)  # nobody can be asked: no question to wait for
        agent.changes.publish(SESSION, SessionNews((Question("q1", "b.example.org", 80),)))
        await anyio.wait_all_tasks_blocked()
        assert agent.calls == ["start_run"] and session._watch.polls == 0
        assert not session._watch.following(SESSION)


async def test_a_guest_call_that_can_ask_follows_the_news_only_while_it_goes() -> None:
    """A guest call is one agent call: the questions its proxy asks meanwhile come by the long poll."""
    answers: list[tuple[str, bool | None]] = []
    answered = anyio.Event()

    async def navigate(*args: Any) -> Any:
        agent.changes.publish(SESSION, SessionNews((Question("q1", "b.example.org", 80),)))
        await answered.wait()
        return {"done": True}, None, None

    def reads(method: str) -> Any:
        if method == "answer_egress":
            return lambda *args: (answers.append(args), answered.set())
        assert method == "guest_op", method
        return navigate

    agent = FakeAgent(reads)
    agent.changes.publish(SESSION, SessionNews())

    async with anyio.create_task_group() as group:
        session = remote_session(agent, group)
        session._egress = FakeEgress(lambda host: host == "b.example.org")  # type: ignore[assignment]
        with anyio.fail_after(10):
            done = await session.guest_op("browser", "navigate", {}, 30)
        assert done == {"done": True} and answers == [("q1", True)]
        assert not session._watch.following(SESSION)  # the call is over: nothing followed
        assert "read_questions" not in agent.calls
        group.cancel_scope.cancel()
