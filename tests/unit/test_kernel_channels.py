"""The host's bounded kernel channels against real libzmq peers (the kernel's side of the wire):
what is expected arrives verified, everything else is dropped, and nothing exceeds its budget."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import zmq
import zmq.asyncio
from jupyter_client.session import Session

from coderunner.kernel.channels import ChannelBroken, Lost, Mailbox, Message, connect
from coderunner.kernel.zmtp import Limits, ZmtpError

pytestmark = pytest.mark.anyio

KEY = b"k" * 32
SMALL = Limits(max_frame_bytes=1 << 20, max_message_bytes=1 << 20, max_frames=16)


@pytest.fixture
def zctx() -> Any:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


def url(tmp_path: Path, name: str) -> str:
    return f"ipc://{tmp_path}/{name}"


@asynccontextmanager
async def pumped(mailbox: Mailbox) -> AsyncIterator[Mailbox]:
    async with anyio.create_task_group() as group:
        group.start_soon(mailbox.pump)
        try:
            yield mailbox
        finally:
            mailbox.connection.close()
            group.cancel_scope.cancel()


async def subscribed_publisher(
    zctx: Any, tmp_path: Path, limits: Limits = SMALL, queue_bytes: int = 1 << 20
) -> tuple[Any, Mailbox]:
    """A kernel-side XPUB and the host's IOPub mailbox on it, once the subscription is in."""
    xpub = zctx.socket(zmq.XPUB)
    xpub.bind(url(tmp_path, "iopub"))
    connection = await connect(url(tmp_path, "iopub"), "SUB", limits)
    with anyio.fail_after(10):
        assert await xpub.recv() == b"\x01"  # we subscribed to every topic
    return xpub, Mailbox("iopub", connection, Session(key=KEY), queue_bytes=queue_bytes)


def frames_for(
    parent: str, msg_type: str = "stream", content: dict[str, Any] | None = None, key: bytes = KEY
) -> list[bytes]:
    session = Session(key=key)
    msg = session.msg(msg_type, content=content or {"name": "stdout", "text": "hi"}, parent={"msg_id": parent})
    return [msg_type.encode(), *session.serialize(msg)]


async def next_item(mailbox: Mailbox) -> Message | Lost:
    with anyio.fail_after(10):
        while True:
            item = await mailbox.get(timeout=1)
            if item is not None:
                return item


async def test_only_expected_messages_arrive_and_forged_ones_are_lost(zctx: Any, tmp_path: Path) -> None:
    xpub, mailbox = await subscribed_publisher(zctx, tmp_path)
    async with pumped(mailbox):
        mailbox.expect("mine")
        await xpub.send_multipart(frames_for("theirs"))
        await xpub.send_multipart(frames_for("mine", content={"name": "stdout", "text": "hello"}))
        await xpub.send_multipart(frames_for("mine", key=b"x" * 32))  # signed with another key
        first = await next_item(mailbox)
        assert isinstance(first, Message) and first.content["text"] == "hello" and first.msg_type == "stream"
        forged = await next_item(mailbox)
        assert isinstance(forged, Lost) and forged.parent_id == "mine" and "signature" in forged.reason
        assert mailbox.dropped == 1


async def test_between_calls_everything_is_dropped(zctx: Any, tmp_path: Path) -> None:
    xpub, mailbox = await subscribed_publisher(zctx, tmp_path)
    async with pumped(mailbox):
        for _ in range(10):
            await xpub.send_multipart([*frames_for("later"), b"x" * (512 << 10)])
        with anyio.fail_after(10):  # read while nothing was expected: skipped unread
            while mailbox.dropped < 10:
                await anyio.sleep(0.01)
        assert mailbox._queued_bytes == 0 and await mailbox.get(timeout=0) is None
        mailbox.expect("later")
        await xpub.send_multipart(frames_for("later", content={"name": "stdout", "text": "kept"}))
        item = await next_item(mailbox)
        assert isinstance(item, Message) and item.content["text"] == "kept"


async def test_a_message_over_the_budget_is_skipped_and_the_channel_goes_on(zctx: Any, tmp_path: Path) -> None:
    xpub, mailbox = await subscribed_publisher(zctx, tmp_path)
    async with pumped(mailbox):
        mailbox.expect("mine")
        # Every frame is under the per-frame limit; together they are four times the message limit.
        await xpub.send_multipart(frames_for("mine") + [b"x" * (1 << 20)] * 4)
        await xpub.send_multipart(frames_for("mine") + [b""] * 40)  # too many frames
        await xpub.send_multipart(frames_for("mine", content={"name": "stdout", "text": "after"}))
        over = await next_item(mailbox)
        assert isinstance(over, Lost) and over.parent_id == "mine" and "over 1 MiB" in over.reason
        after = await next_item(mailbox)
        if isinstance(after, Lost):  # the second loss, unless it was folded into the first one
            assert after == over
            after = await next_item(mailbox)
        assert isinstance(after, Message) and after.content["text"] == "after"


async def test_json_that_would_swell_in_python_is_not_decoded(zctx: Any, tmp_path: Path) -> None:
    """300 KB of `[[],[],...]` would take about 7 MB as Python objects: refused before decoding."""
    xpub, mailbox = await subscribed_publisher(zctx, tmp_path, limits=Limits(1 << 20, 1 << 20, 16))
    async with pumped(mailbox):
        mailbox.expect("mine")
        await xpub.send_multipart(frames_for("mine", "display_data", content={"data": [[]] * 100_000}))
        text = "a, b: [c] {d}" * 20_000  # the same characters inside a string are harmless
        await xpub.send_multipart(frames_for("mine", content={"name": "stdout", "text": text}))
        swollen = await next_item(mailbox)
        assert isinstance(swollen, Lost) and "too many values" in swollen.reason
        fine = await next_item(mailbox)
        assert isinstance(fine, Message) and fine.content["text"] == text


async def test_the_queue_of_kept_messages_is_bounded_in_bytes_and_loses_nothing(zctx: Any, tmp_path: Path) -> None:
    xpub, mailbox = await subscribed_publisher(zctx, tmp_path, queue_bytes=1 << 20)
    async with pumped(mailbox):
        mailbox.expect("mine")
        for index in range(20):
            text = f"{index:02d}" + "x" * (200 << 10)
            await xpub.send_multipart(frames_for("mine", content={"name": "stdout", "text": text}))
        with anyio.fail_after(10):  # the pump fills the queue, then stops reading
            while mailbox._queued_bytes < (1 << 20) - (250 << 10):
                await anyio.sleep(0.01)
        await anyio.sleep(0.2)
        assert mailbox._queued_bytes <= 1 << 20
        seen = []
        for _ in range(20):
            item = await next_item(mailbox)
            assert isinstance(item, Message)
            assert mailbox._queued_bytes <= 1 << 20
            seen.append(int(item.content["text"][:2]))
        assert seen == list(range(20))


async def test_shell_request_and_reply_and_unsolicited_replies(zctx: Any, tmp_path: Path) -> None:
    router = zctx.socket(zmq.ROUTER)
    router.bind(url(tmp_path, "shell"))
    session = Session(key=KEY)
    connection = await connect(url(tmp_path, "shell"), "DEALER", SMALL, identity=session.bsession)
    mailbox = Mailbox("shell", connection, session, queue_bytes=1 << 20)
    async with pumped(mailbox):
        request = mailbox.make("execute_request", {"code": "1+1"})
        msg_id = request["header"]["msg_id"]
        mailbox.expect(msg_id)
        await mailbox.send(request, timeout=10)
        with anyio.fail_after(10):
            received = await router.recv_multipart()
        assert received[0] == session.bsession  # the host's routing id is its session id
        idents, rest = session.feed_identities(received)
        assert session.deserialize(rest)["content"] == {"code": "1+1"}  # signed as the kernel expects
        kernel = Session(key=KEY)
        unsolicited = kernel.msg("execute_reply", content={"status": "ok"})
        await router.send_multipart([*kernel.serialize(unsolicited, ident=idents), b"x" * (1 << 19)])
        reply = kernel.msg("execute_reply", content={"status": "ok", "execution_count": 7}, parent=request)
        await router.send_multipart(kernel.serialize(reply, ident=idents))
        answer = await next_item(mailbox)
        assert isinstance(answer, Message) and answer.content["execution_count"] == 7
        assert mailbox.dropped == 1
        mailbox.forget(msg_id)


async def test_a_peer_that_goes_away_breaks_the_channel(zctx: Any, tmp_path: Path) -> None:
    xpub, mailbox = await subscribed_publisher(zctx, tmp_path)
    async with pumped(mailbox):
        mailbox.expect("mine")
        xpub.close(linger=0)
        with anyio.fail_after(10), pytest.raises(ChannelBroken):
            while True:
                await mailbox.get(timeout=1)


async def test_a_peer_of_the_wrong_kind_is_refused(zctx: Any, tmp_path: Path) -> None:
    push = zctx.socket(zmq.PUSH)
    push.bind(url(tmp_path, "push"))
    with anyio.fail_after(10), pytest.raises(ZmtpError):
        await connect(url(tmp_path, "push"), "DEALER", SMALL)


def test_frames_for_is_valid_jupyter() -> None:
    """The helper above builds what ipykernel sends: topic, delimiter, signature, four JSON frames."""
    frames = frames_for("p")
    assert frames[1] == b"<IDS|MSG>" and len(frames) == 7
    assert json.loads(frames[4])["msg_id"] == "p"


async def test_a_link_or_a_non_socket_in_place_of_a_kernel_socket_is_never_connected(tmp_path: Path) -> None:
    """The runtime folder is writable from the sandbox: a swapped-in link must not lead the host
    to another socket (here a canary listener the test made), and a FIFO must not hang it."""
    canary = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    canary.bind(str(tmp_path / "canary"))
    canary.listen(4)
    canary.setblocking(False)
    (tmp_path / "k0-1").symlink_to(tmp_path / "canary")
    os.mkfifo(tmp_path / "k0-2")
    (tmp_path / "k0-3").write_text("not a socket")
    for name in ("k0-1", "k0-2", "k0-3"):
        with anyio.fail_after(10), pytest.raises(OSError):
            await connect(url(tmp_path, name), "DEALER", SMALL)
    with pytest.raises(BlockingIOError):
        canary.accept()  # nobody ever connected to it
    canary.close()
