"""The host's ends of a kernel's channels: shell, control and IOPub connected with the host's own
bounded ZMTP reader (zmtp.py) and drained at once, so whatever the kernel sends is read and kept
only when expected (channels.py: Mailbox)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
from jupyter_client.session import Session

from coderunner.kernel.channels import IOPUB_LIMITS, IOPUB_QUEUE_BYTES, REPLY_LIMITS, Mailbox, connect
from coderunner.kernel.connection_info import channel_url
from coderunner.kernel.zmtp import Limits, ZmtpConnection, ZmtpError

log = logging.getLogger(__name__)

#: Pause between attempts to reach a kernel's channel while it starts (TCP channels accept
#: before the kernel listens).
CONNECT_RETRY_S = 0.05


@dataclass
class Deadline:
    at: float

    def remaining(self) -> float:
        return self.at - time.monotonic()


async def open_mailboxes(
    info: dict[str, Any], deadline: Deadline, check_alive: Callable[[], None]
) -> tuple[Mailbox, Mailbox, Mailbox]:
    """Shell, control and IOPub of the kernel `info` describes, each connected before `deadline`;
    `check_alive` raises once the sandbox is gone (no use waiting for it then)."""
    key = info["key"].encode() if isinstance(info["key"], str) else info["key"]
    session = Session(key=key, signature_scheme=info.get("signature_scheme", "hmac-sha256"), username="coderunner")
    mailboxes: list[Mailbox] = []
    try:
        for name, socket_type, limits in (
            ("shell", "DEALER", REPLY_LIMITS),
            ("control", "DEALER", REPLY_LIMITS),
            ("iopub", "SUB", IOPUB_LIMITS),
        ):
            url = channel_url(info, info[f"{name}_port"])
            connection = await _connect(url, socket_type, limits, session.bsession, deadline, check_alive)
            queue = IOPUB_QUEUE_BYTES if name == "iopub" else limits.max_message_bytes
            mailboxes.append(Mailbox(name, connection, session, queue_bytes=queue))
    except BaseException:  # the ones connected so far are closed: nobody else holds them
        for mailbox in mailboxes:
            mailbox.connection.close()
        raise
    shell, control, iopub = mailboxes
    return shell, control, iopub


async def _connect(
    url: str, socket_type: str, limits: Limits, identity: bytes, deadline: Deadline, check_alive: Callable[[], None]
) -> ZmtpConnection:
    while True:
        check_alive()
        if deadline.remaining() <= 0:
            raise TimeoutError
        with anyio.move_on_after(deadline.remaining()):
            try:
                return await connect(url, socket_type, limits, identity)
            except (OSError, ZmtpError) as exc:
                log.debug("kernel channel %s not ready: %s", url, exc)
        await anyio.sleep(CONNECT_RETRY_S)


async def pump_all(scope: anyio.CancelScope, mailboxes: list[Mailbox]) -> None:
    """Drain every mailbox until `scope` is cancelled (the kernel detached or shut down)."""
    with scope:
        async with anyio.create_task_group() as group:
            for mailbox in mailboxes:
                group.start_soon(mailbox.pump)
