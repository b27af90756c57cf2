"""boundary: server memory. A kernel publishes huge multi-frame IOPub messages, signed with its
own session key, while no call reads and during calls: the server must hold only a bounded
number of bytes, keep serving, and leave the bystander alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from ..conftest import run, text_of
from .conftest import Arena
from .test_abuse import _server_pid, assert_still_serving

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

FRAME_MB = 30
FRAMES = 4
MESSAGES = 20
#: The server may grow by this much under the flood (a message is 120 MiB; 20 of them 2.4 GiB).
GROWTH_BOUND_MB = 160

#: Runs in the kernel: a thread that publishes MESSAGES messages of FRAMES frames of FRAME_MB MiB
#: each on the kernel's own IOPub socket, validly signed. One buffer backs every frame
#: (copy=False), so the kernel itself stays small.
FLOOD = f"""
import threading, time
_k = get_ipython().kernel
_big = b'F' * ({FRAME_MB} << 20)
def _publish(parent=None, count=1):
    for _ in range(count):
        msg = _k.session.msg('display_data', content={{'data': {{'text/plain': 'flood'}}, 'metadata': {{}}}},
                             parent=parent or {{}})
        frames = _k.session.serialize(msg)
        _k.iopub_socket.send_multipart([b'display_data'] + frames + [_big] * {FRAMES}, copy=False)
flood_done = threading.Event()
def _flood():
    time.sleep(0.5)  # after the cell has returned: nobody is reading
    _publish(count={MESSAGES})
    flood_done.set()
threading.Thread(target=_flood, daemon=True).start()
"""


def _reset_peak(pid: int) -> None:
    """Start VmHWM afresh (clear_refs 5), so earlier cases of the module do not count."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def _status_mb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field}")


async def test_an_iopub_flood_between_and_during_calls_keeps_the_server_bounded(arena: Arena) -> None:
    pid = _server_pid(arena)
    created = json.loads(text_of(await arena.client.call_tool("create_session", {})))
    session = created["session_id"]
    await run(arena.client, "1", session_id=session)  # the kernel is up before the baseline
    _reset_peak(pid)
    before_mb = _status_mb(pid, "VmRSS")

    started = await run(arena.client, FLOOD, session_id=session)
    assert not started.is_error, text_of(started)
    # Between calls: the flood arrives while no call reads this session.
    await anyio.sleep(3)
    between_mb = _status_mb(pid, "VmRSS")
    # A call while the flood may still be arriving: it ends, and says what it should.
    waited = await run(arena.client, "print('flood sent:', flood_done.wait(120))", session_id=session, timeout_s=150)
    peak_mb = _status_mb(pid, "VmHWM")
    print(
        f"\n[abuse] IOPub flood of {MESSAGES} x {FRAMES} x {FRAME_MB} MiB: server RSS {before_mb:.0f} MiB before, "
        f"{between_mb:.0f} MiB between calls, peak {peak_mb:.0f} MiB"
    )
    assert "flood sent: True" in text_of(waited), text_of(waited)
    assert peak_mb - before_mb < GROWTH_BOUND_MB, "the server must not hold what a kernel publishes"

    # A message for the running cell itself, over the bound: skipped, and the reply says so.
    own = await run(
        arena.client, "_publish(parent=_k.get_parent())\nprint('after the big one')", session_id=session, timeout_s=60
    )
    peak_mb = _status_mb(pid, "VmHWM")
    print(f"[abuse] one {FRAMES} x {FRAME_MB} MiB message for the running cell: server peak RSS {peak_mb:.0f} MiB")
    assert "after the big one" in text_of(own), text_of(own)
    assert "some output was lost" in text_of(own), text_of(own)
    assert peak_mb - before_mb < GROWTH_BOUND_MB, "the server must not hold what a kernel publishes"

    # The session itself still works, and so does everyone else.
    again = await run(arena.client, "print(6 * 7)", session_id=session)
    assert "42" in text_of(again), text_of(again)
    await arena.client.call_tool("manage_sessions", {"action": "close", "session_id": session})
    await assert_still_serving(arena)


async def test_unsolicited_replies_on_shell_and_control_do_not_pile_up(arena: Arena) -> None:
    """The kernel's ROUTER sockets can also send to the host at any time; replies nobody awaits
    (and forged ones) are read and dropped."""
    pid = _server_pid(arena)
    created = json.loads(text_of(await arena.client.call_tool("create_session", {})))
    session = created["session_id"]
    await run(arena.client, "1", session_id=session)
    _reset_peak(pid)
    before_mb = _status_mb(pid, "VmRSS")
    code = f"""
import threading, time
_k = get_ipython().kernel
_big = b'R' * ({FRAME_MB} << 20)
_host = _k.get_parent()['header']['session'].encode()  # the host's routing id on shell and control
_done = threading.Event()
def _send(stream):
    msg = _k.session.msg('execute_reply', content={{'status': 'ok'}})
    stream.socket.send_multipart(_k.session.serialize(msg, ident=[_host]) + [_big] * {FRAMES}, copy=False)
def _spam():
    time.sleep(0.5)  # after the cell has returned: nobody is reading
    for stream in (_k.shell_stream, _k.control_stream):
        for _ in range(8):
            stream.io_loop.add_callback(_send, stream)  # on the thread that owns the socket
    time.sleep(2)
    _done.set()
threading.Thread(target=_spam, daemon=True).start()
"""
    first = await run(arena.client, code, session_id=session)
    assert not first.is_error, text_of(first)
    await anyio.sleep(3)
    after = await run(arena.client, "print('spam sent:', _done.wait(60))", session_id=session, timeout_s=90)
    assert "spam sent:" in text_of(after), text_of(after)
    peak_mb = _status_mb(pid, "VmHWM")
    print(f"\n[abuse] shell/control spam: server RSS {before_mb:.0f} MiB before, peak {peak_mb:.0f} MiB")
    assert peak_mb - before_mb < GROWTH_BOUND_MB
    again = await run(arena.client, "print(6 * 7)", session_id=session)
    assert "42" in text_of(again), text_of(again)
    await arena.client.call_tool("manage_sessions", {"action": "close", "session_id": session})
    await assert_still_serving(arena)


async def test_a_kernel_that_closes_its_iopub_socket_is_replaced(arena: Arena) -> None:
    """No reconnect loop to a socket path the sandbox controls: a closed channel ends the kernel."""
    created = json.loads(text_of(await arena.client.call_tool("create_session", {})))
    session = created["session_id"]
    await run(arena.client, "kept = 1", session_id=session)
    code = (
        "k = get_ipython().kernel\n"
        "k.iopub_thread.io_loop.add_callback(lambda: k.iopub_thread.socket.close(linger=0))\n"
        "import time; time.sleep(1)"
    )
    closed = await run(arena.client, code, session_id=session, timeout_s=20)
    assert closed.is_error and "fresh kernel is ready" in text_of(closed), text_of(closed)
    fresh = await run(arena.client, "print('kept' in dir())", session_id=session)
    assert "False" in text_of(fresh), text_of(fresh)
    await arena.client.call_tool("manage_sessions", {"action": "close", "session_id": session})
    await assert_still_serving(arena)
