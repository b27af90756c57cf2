"""The pipes a bwrap start is plumbed with: the gate (pid1.py), --info-fd and, for network 'internet', --block-fd.

bwrap's --info-fd is a read-write end of its pipe (reader_of_its_own): bwrap (0.8) writes its report
there after it cloned the sandbox's pid 1 and before it lets that child go on (the child waits on an
eventfd only bwrap writes). On a write end alone, a report that finds no reader (this process and its
watcher both gone) would kill bwrap with SIGPIPE, and its child, already pid 1 of the new namespace,
would wait for ever, before any gate or pidfd can reach it. With a reader of its own the report always
goes through, the child goes on into the sandbox's init, and the init ends with its gate's end of file.
bwrap's child closes that fd first thing: nothing of it reaches the sandbox.

Each end is closed once (then None): an fd number closed twice may by then name another file of this
process.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from typing import Any

import anyio

from coderunner.sandbox.pid1 import Gate


async def read_json_document(fd: int) -> dict[str, Any] | None:
    """bwrap writes one JSON object to --info-fd and closes it: read until it parses. None: it closed the
    pipe without one (it failed first)."""
    data = b""
    while True:
        await anyio.wait_readable(fd)
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
        with contextlib.suppress(ValueError):
            document = json.loads(data)
            return document if isinstance(document, dict) else None
    return None


@dataclass
class StartFds:
    """The gate (sandbox/pid1.py), --info-fd (bwrap tells its child's pid; `info_write` is read-write: see
    the module docstring) and, for network 'internet', --block-fd (we say: the network is up)."""

    gate: Gate
    info_read: int | None
    info_write: int | None
    block_read: int | None = None
    block_write: int | None = None

    @property
    def network(self) -> bool:
        return self.block_write is not None

    @classmethod
    def open(cls, network: bool) -> StartFds:
        read, write = os.pipe()
        try:
            both = reader_of_its_own(read)
        except BaseException:
            os.close(read)
            raise
        finally:
            os.close(write)
        fds = cls(Gate.open(), read, both)
        if network:
            fds.block_read, fds.block_write = os.pipe()
        return fds

    def child_fds(self) -> tuple[int, ...]:
        return tuple(fd for fd in (self.gate.read, self.info_write, self.block_read) if fd is not None)

    def close_child_ends(self) -> None:
        self.gate.close_child_end()
        self.info_write = _close_once(self.info_write)
        self.block_read = _close_once(self.block_read)

    def close(self, gate_too: bool = False) -> None:
        """Our ends; the gate's writer is the hold's (SandboxHold), unless the start failed before one."""
        if gate_too:
            self.gate.close()
        self.info_read = _close_once(self.info_read)
        self.block_write = _close_once(self.block_write)


def reader_of_its_own(read: int) -> int:
    """A read-write fd on the pipe whose read end is `read` (this process's own fd, reopened through its
    /proc entry): a writer that is a reader too never meets a pipe without readers."""
    return os.open(f"/proc/self/fd/{read}", os.O_RDWR | os.O_CLOEXEC)


def _close_once(fd: int | None) -> int | None:
    """Close `fd` if open; what the field holds afterwards (None: closed, never closed again)."""
    if fd is not None and fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)
    return None
