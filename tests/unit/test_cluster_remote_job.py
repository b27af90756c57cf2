"""A job mirrored at the front door (cluster/remote_job.py), kept in step by its agent's long poll
(cluster/agent_watch.py, sessions/changes.py) and scripted reads, instead of an actor."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from coderunner.cluster.remote_job import RemoteJob, mirror_output
from coderunner.cluster.remote_session import RemoteSession
from coderunner.cluster.wire import JobDelta, NodeInfo, Question, SessionInfo, SessionNews
from coderunner.config import load_settings
from coderunner.errors import SessionError
from coderunner.kernel.output_capture import ImageOutput
from coderunner.sandbox.base import Limits
from coderunner.sessions.changes import Changes
from coderunner.sessions.job_runner import JobStatus
from coderunner.sessions.sandbox_options import SandboxOptions

pytestmark = pytest.mark.anyio

SESSION = "s1"


def mirrored() -> RemoteJob:
    return RemoteJob(job_id="job-1", kind="python", label="x", owner="o", output=mirror_output(1000))


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
        return answer.wire() if isinstance(answer, JobDelta) else answer  # a delta crosses in its wire form


def remote_session(agent: FakeAgent, group: Any) -> RemoteSession:
    settings = load_settings(Path(os.devnull), export_dir="")
    options = SandboxOptions(network="none", limits=Limits(), timeout_s=60, client="alice")
    info = SessionInfo(SESSION, "alice/1", options, NodeInfo("n" * 56, "10.0.0.7"), generation=0)
    return RemoteSession(agent, info, settings, group)


def following(session: RemoteSession, job: RemoteJob) -> None:
    """A job the session learnt of from its start_run's first answer, still running there."""
    session._jobs[job.job_id] = job
    session._follow_as_needed()


async def test_what_the_node_sends_is_read_once_then_the_end_wakes_the_waiters() -> None:
    job = mirrored()
    deltas = iter([
        JobDelta("job-1", text="tick 0\n", executing_for_s=0.2, mark=1),
        JobDelta("job-1", text="tick 1\n", images=[ImageOutput("image/png", "AAAA")], spill_path="/workspace/o.txt",
                 mark=2),
        JobDelta("job-1", ended=True, status="done", notice="fine", generation=3, mark=3),
    ])  # fmt: skip
    agent = FakeAgent(lambda method: lambda *args: next(deltas))
    agent.changes.publish(SESSION, SessionNews())
    async with anyio.create_task_group() as group:
        session = remote_session(agent, group)
        following(session, job)
        for mark in (1, 2, 3):
            await anyio.wait_all_tasks_blocked()
            agent.changes.publish(SESSION, SessionNews({"job-1": mark}))
        with anyio.fail_after(10):
            await job.done.wait()
    assert job.done.is_set() and job.status is JobStatus.DONE and job.notice == "fine" and job.generation == 3
    assert job.executing_since is not None
    assert job.output is not None and "tick 1" in job.output.tail_text(100)
    first = job.output.take()
    assert first.text == "tick 0\ntick 1\n" and len(first.images) == 1 and first.spill_path == "/workspace/o.txt"
    assert job.output.take().text == ""  # read once
    assert agent.calls.count("read_job") == 3  # one read per change, none while nothing changed
    assert not session._watch.following(SESSION)  # the job ended: the session follows nothing any more


async def test_an_idle_session_costs_no_poll_and_news_of_no_job_it_waits_for_costs_no_read() -> None:
    agent = FakeAgent(lambda method: lambda *args: JobDelta("job-1"))
    agent.changes.publish(SESSION, SessionNews())
    async with anyio.create_task_group() as group:
        session = remote_session(agent, group)
        session._follow_as_needed()
        agent.changes.publish(SESSION, SessionNews({"other": 5}))
        await anyio.wait_all_tasks_blocked()
        assert agent.calls == [] and session._watch.polls == 0
        agent.changes.publish(SESSION, SessionNews({"job-1": 4, "other": 5}))
        job = mirrored()
        job.read_mark = 4  # its first answer was read at its fourth change
        following(session, job)
        await anyio.wait_all_tasks_blocked()
        agent.changes.publish(SESSION, SessionNews({"job-1": 4, "other": 6}))  # nothing past that read
        await anyio.wait_all_tasks_blocked()
        assert "read_job" not in agent.calls and session._watch.following(SESSION)
        group.cancel_scope.cancel()


async def test_a_node_that_stops_answering_ends_the_job_as_lost_saying_so() -> None:
    job = mirrored()

    def read(method: str) -> Any:
        raise ConnectionError("node gone")

    agent = FakeAgent(read)
    agent.changes.publish(SESSION, SessionNews())
    async with anyio.create_task_group() as group:
        session = remote_session(agent, group)
        following(session, job)
        await anyio.wait_all_tasks_blocked()
        agent.changes.publish(SESSION, SessionNews({"job-1": 1}))
        with anyio.fail_after(10):
            await job.done.wait()
    assert job.status is JobStatus.LOST and job.notice == session.lost_text(ConnectionError())
    assert "ConnectionError" in job.notice and "lost with node" in job.notice


async def test_a_refusal_from_the_node_is_the_job_s_failure() -> None:
    job = mirrored()

    def read(method: str) -> Any:
        raise SessionError("session s was closed")

    agent = FakeAgent(read)
    agent.changes.publish(SESSION, SessionNews())
    async with anyio.create_task_group() as group:
        session = remote_session(agent, group)
        following(session, job)
        await anyio.wait_all_tasks_blocked()
        agent.changes.publish(SESSION, SessionNews({"job-1": 1}))
        with anyio.fail_after(10):
            await job.done.wait()
    assert job.status is JobStatus.LOST and isinstance(job.failure, SessionError)


async def test_a_session_its_agent_dropped_ends_its_running_jobs_as_unknown() -> None:
    job = mirrored()
    agent = FakeAgent()
    agent.changes.publish(SESSION, SessionNews({"job-1": 0}))  # the node follows the job from its start
    async with anyio.create_task_group() as group:
        session = remote_session(agent, group)
        following(session, job)
        await anyio.wait_all_tasks_blocked()
        agent.changes.drop(SESSION)  # closed by another front door, or its node's idle reaper
        with anyio.fail_after(10):
            await job.done.wait()
    assert job.status is JobStatus.LOST and isinstance(job.failure, SessionError)
    assert job.notice == f"unknown or expired session_id {SESSION!r}"


async def test_a_question_is_put_to_the_user_once_and_answered() -> None:
    answers: list[tuple[str, bool | None]] = []
    asked: list[str] = []
    agent = FakeAgent(lambda method: lambda *args: answers.append(args))
    agent.changes.publish(SESSION, SessionNews({"job-1": 0}))
    job = mirrored()
    async with anyio.create_task_group() as group:
        session = remote_session(agent, group)

        class Egress:
            async def asker(self, host: str, port: int) -> bool:
                asked.append(host)
                return True

        session._egress = Egress()  # type: ignore[assignment]  # the part _answer reads
        following(session, job)
        await anyio.wait_all_tasks_blocked()
        question = Question("q1", "b.example.org", 443)
        agent.changes.publish(SESSION, SessionNews({"job-1": 0}, (question,)))
        with anyio.fail_after(10):  # the answer's call sleeps in the fake agent: not "all tasks blocked" alone
            while not answers:
                await anyio.sleep(0.01)
        agent.changes.publish(SESSION, SessionNews({"job-1": 0}, (question,)))  # still waiting there: not again
        await anyio.wait_all_tasks_blocked()
        await anyio.sleep(0.1)
        await anyio.wait_all_tasks_blocked()
        group.cancel_scope.cancel()
    assert asked == ["b.example.org"] and answers == [("q1", True)]


async def test_a_guest_call_that_can_ask_follows_the_news_only_while_it_goes() -> None:
    """A guest call is one agent call: the questions its proxy asks meanwhile come by the long poll."""
    answers: list[tuple[str, bool | None]] = []
    answered = anyio.Event()

    async def navigate(*args: Any) -> Any:
        agent.changes.publish(SESSION, SessionNews({}, (Question("q1", "b.example.org", 80),)))
        await answered.wait()
        return {"done": True}, None, None

    def reads(method: str) -> Any:
        if method == "answer_egress":
            return lambda *args: (answers.append(args), answered.set())
        assert method == "guest_op", method
        return navigate

    agent = FakeAgent(reads)
    agent.changes.publish(SESSION, SessionNews())

    class Egress:
        mark = 0

        def apply(self, delta: Any) -> None:
            pass

        async def asker(self, host: str, port: int) -> bool:
            return host == "b.example.org"

    async with anyio.create_task_group() as group:
        session = remote_session(agent, group)
        session._egress = Egress()  # type: ignore[assignment]  # the part a guest call reads
        with anyio.fail_after(10):
            done = await session.guest_op("browser", "navigate", {}, 30)
        assert done == {"done": True} and answers == [("q1", True)]
        assert not session._watch.following(SESSION)  # the call is over: nothing followed
        assert "read_questions" not in agent.calls
        group.cancel_scope.cancel()


async def test_cancelling_the_mirror_asks_the_node() -> None:
    job, asked = mirrored(), []
    job.request_cancel = lambda: asked.append(True)
    job.cancel()
    assert asked == [True] and job.cancel_requested and not job.done.is_set()  # the node's answer ends it


def test_a_finished_job_s_result_crosses_without_the_node_s_hook() -> None:
    """The node's output carries its publishing hook (bound to the session's side); its portable copy does not."""
    import pickle
    import threading

    from coderunner.cluster.wire import portable_output
    from coderunner.sessions.job_runner import JobOutput

    output = JobOutput(limit_chars=100, spill_limit_bytes=0, image_limit_bytes=0)
    lock = threading.Lock()  # stands for what the hook is bound to: nothing that pickles
    output.on_change = lambda ended: lock.acquire(blocking=False) and None
    output.add_text("done\n")
    moved = pickle.loads(pickle.dumps(portable_output(output)))
    assert moved.text() == "done\n" and moved.on_change is None and output.on_change is not None
