"""The host's exchanges with the kernel template (sandbox/bwrap_template.py: KernelTemplate._ask), against a
stand-in template on the other end of its socketpair: a reply is never left for the next request, a caller
cancelled while the template works gets its cancel once the reply is in (the pidfd it carried closed), and a
template that does not answer is ended. The real template's side: tests/test_kernel_template_e2e.py."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest

from coderunner.sandbox import bwrap_template
from coderunner.sandbox.bwrap_template import (
    KIND_FORK,
    MAGIC,
    REPLY,
    KernelTemplate,
    TemplateReply,
    TemplateUnavailable,
    encode_request,
)

pytestmark = pytest.mark.anyio


class StandIn:
    """The template's end: answers each request in turn, a fork with its request's kind as pid and a pidfd of
    this process, once `release` is set (if given)."""

    def __init__(self, sock: socket.socket, release: threading.Event | None = None) -> None:
        self.sock = sock
        self.release = release
        self.received = threading.Event()
        self.answered = threading.Event()  # set once a reply is sent and this end's copy of its pidfd closed
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self.sock, bwrap_template.REQUEST.size, 8)
            except OSError:  # its socket closed under it: the test is over
                return
            for fd in fds:
                os.close(fd)
            if not data:
                return
            self.received.set()
            if self.release is not None:
                self.release.wait(10)
            kind = bwrap_template.REQUEST.unpack(data)[1]
            pidfd = [os.pidfd_open(os.getpid())] if kind == KIND_FORK else []
            try:
                socket.send_fds(self.sock, [REPLY.pack(MAGIC, 0, kind, 0, 0, 1)], pidfd)
            except OSError:  # closed under it while it waited for `release`
                return
            finally:
                for fd in pidfd:
                    os.close(fd)
            self.answered.set()


@asynccontextmanager
async def template(
    release: threading.Event | None = None, answers: bool = True
) -> AsyncIterator[tuple[KernelTemplate, StandIn | None]]:
    """A KernelTemplate whose process is a sleeper in a session of its own (not yet ready: close kills it at
    once) and whose socket's other end is a StandIn (or nobody, when `answers` is false)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    process = await anyio.open_process(["sleep", "60"], start_new_session=True, stdin=subprocess.DEVNULL)
    kept = KernelTemplate(process, ours, TemplateReply(0, 0, 0, 0, 1))
    stand_in = StandIn(theirs, release) if answers else None
    try:
        yield kept, stand_in
    finally:
        await kept.close()
        theirs.close()


def open_pidfds() -> set[str]:
    """This process's open pidfds (only these: a thread another test left may open other files meanwhile)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]":
                found.add(fd)
        except OSError:
            pass
    return found


async def test_a_caller_cancelled_while_the_template_works_leaves_the_next_exchange_in_step() -> None:
    release = threading.Event()
    async with template(release) as (kept, stand_in):
        assert stand_in is not None
        before = open_pidfds()
        async with anyio.create_task_group() as group:
            group.start_soon(kept._ask, encode_request(KIND_FORK), [])
            with anyio.fail_after(5):
                while not stand_in.received.is_set():  # the request is with the template
                    await anyio.sleep(0.01)
            group.cancel_scope.cancel()
            release.set()  # it answers after its caller was cancelled
        assert stand_in.answered.wait(5)  # the stand-in's own copy of that pidfd is closed too (it raced this check)
        assert open_pidfds() <= before  # the fork's pidfd that reply carried was closed, not leaked
        with anyio.fail_after(10):
            counters = await kept._ask(encode_request(bwrap_template.KIND_COUNTERS), [])
        assert (counters.pid, counters.pidfd) == (bwrap_template.KIND_COUNTERS, None), counters
        fork = await kept._ask(encode_request(KIND_FORK), [])
        assert fork.pid == KIND_FORK and fork.pidfd is not None
        os.close(fork.pidfd)


async def test_a_template_that_does_not_answer_is_ended_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bwrap_template, "FORK_TIMEOUT_S", 0.2)
    async with template(answers=False) as (kept, _):
        with (
            pytest.raises(TemplateUnavailable, match=r"did not answer within 0\.2s; it was ended"),
            anyio.fail_after(10),
        ):
            await kept._ask(encode_request(KIND_FORK), [])
        with anyio.fail_after(5):
            assert await kept.process.wait() == -9
        with pytest.raises(TemplateUnavailable, match="closed"), anyio.fail_after(10):
            await kept._ask(encode_request(KIND_FORK), [])
