"""The session contract: what the tools rely on of any SessionHost's sessions (sessions/seam.py), as cases
that take a host and assert. test_session_conformance.py runs each over the local SessionManager in the
test's process, and over a cluster front door's ClusterHost in a Ray driver inside the test cluster's
namespace (this module imported there too: `python -c RAY_DRIVER`), so both run the very same code.

Plain asserts and anyio only: no pytest here (the driver has none of its fixtures).
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from coderunner.errors import SessionError
from coderunner.sessions.job_runner import JobStatus
from coderunner.sessions.job_updates import JobUpdate
from coderunner.sessions.seam import SessionHandle, SessionHost
from coderunner.vocabulary.sandbox_request import SandboxRequest

#: What both hosts are configured with beyond the suite's defaults: a ceiling that holds a host to ask about.
ENV = {"CODERUNNER_ALLOWED_DOMAINS": '["a.example.org", "b.example.org"]'}
OWNER, CLIENT = "alice/1", "alice"
#: Bound on any one step of a case (a cold sandbox on a loaded machine, through a cluster).
STEP_S = 120.0
FETCH = """
import urllib.request, urllib.error
try:
    urllib.request.urlopen("http://{host}/", timeout=30)
except urllib.error.HTTPError as error:
    print("HTTP", error.code)
"""

Case = Callable[[SessionHost], Awaitable[None]]


async def opened(host: SessionHost, **request: Any) -> SessionHandle:
    with anyio.fail_after(STEP_S):
        return await host.create(host.options(SandboxRequest(client=CLIENT, **request)), owner=OWNER)


async def closed(host: SessionHost, session: SessionHandle) -> None:
    with anyio.fail_after(STEP_S):
        await host.close(session.session_id, OWNER)


async def ran(session: SessionHandle, code: str) -> str:
    """Run `code` to its end as run_python does (start, then wait in steps); its output's text."""
    with anyio.fail_after(STEP_S):
        update = await session.start_run(code, 60, None, 1.0)
        while update.running:
            update = await session.wait_job(update.job_id, 1.0)
    assert update.result is not None, update
    assert not session.holds_job(update.job_id), "a job answered whole is still held"
    return update.result.outcome.output.text()


async def started(session: SessionHandle, code: str) -> JobUpdate:
    """`code` started and still running: its first update."""
    update = await session.start_run(code, 60)
    assert update.running and update.job_id and session.holds_job(update.job_id), update
    return update


# --- the cases --------------------------------------------------------------------------------------


async def create(host: SessionHost) -> None:
    """A session opens with the options asked, is listed for its owner, and answers its status."""
    session = await opened(host)
    try:
        assert session.owner == OWNER and session.options.client == CLIENT
        assert session.session_id in [listed.session_id for listed in host.list(OWNER)]
        status = await session.status()
        assert status.session_id == session.session_id, status
    finally:
        await closed(host, session)


async def run_keeps_state(host: SessionHost) -> None:
    """What a cell defines, the next cell sees: one kernel, kept."""
    session = await opened(host)
    try:
        assert (await ran(session, "x = 41\nprint('set')")).strip() == "set"
        assert (await ran(session, "print(x + 1)")).strip() == "42"
        generation, preserved = session.kernel_state()
        assert preserved, generation
    finally:
        await closed(host, session)


async def reset(host: SessionHost) -> None:
    """A reset is a fresh kernel: what was defined is gone, the generation says so, and cells run."""
    session = await opened(host)
    try:
        await ran(session, "x = 1")
        before, _ = session.kernel_state()
        await session.reset()
        after, preserved = session.kernel_state()
        assert after > before and not preserved, (before, after)
        assert "NameError" in await ran(session, "try:\n    x\nexcept NameError as e:\n    print('NameError')")
        assert (await ran(session, "print(2 * 21)")).strip() == "42"
    finally:
        await closed(host, session)


async def job_progress_is_read_incrementally(host: SessionHost) -> None:
    """A running job's output is read as it comes: each read brings only what is new, the end brings the rest;
    a look that does not take leaves it for the next read, and the reader's updates say where the job is."""
    session = await opened(host)
    try:
        code = "import time\nfor i in range(6):\n    print(f'tick {i}', flush=True)\n    time.sleep(0.5)"
        job_id = (await started(session, code)).job_id
        with anyio.fail_after(STEP_S):
            look = await session.read_job(job_id, 0.0, take=False)
            while look.running and "tick 1" not in look.tail:
                look = await session.read_job(job_id, 0.2, take=False)
        assert look.running, "the job ended before its progress was read"
        assert look.executing_for_s is not None and look.text == "", look
        reads = [await session.read_job(job_id)]
        with anyio.fail_after(STEP_S):
            while (last := await session.read_job(job_id, 1.0)).running:
                reads.append(last)
        reads.append(last)
        texts = [read.text for read in reads]
        assert last.status == JobStatus.DONE.value and last.result is not None, last
        assert "tick 0" in texts[0] and "tick 5" not in texts[0], texts
        assert "tick 5" in "".join(texts[1:]) and "tick 0" not in "".join(texts[1:]), texts  # read once each
        assert "".join(texts).count("tick") == 6, texts
        assert session.holds_job(job_id), "a job a reader saw end is kept for it until it is forgotten"
        assert {"job_id": job_id, "status": "done"}.items() <= (await session.list_jobs())[0].items()
    finally:
        await closed(host, session)


async def cancel(host: SessionHost) -> None:
    """Cancelling a running cell ends its job as interrupted, and the session runs the next cell."""
    session = await opened(host)
    try:
        job_id = (await started(session, "import time\nprint('begun', flush=True)\ntime.sleep(60)")).job_id
        with anyio.fail_after(STEP_S):
            while "begun" not in (look := await session.read_job(job_id, 0.2, take=False)).tail:
                assert look.running, look
        began = time.monotonic()
        with anyio.fail_after(STEP_S):
            await session.cancel_job(job_id)
            update = await session.wait_job(job_id, 1.0)
        assert update.status == JobStatus.INTERRUPTED.value, update
        assert time.monotonic() - began < 50, "the cell ran on"
        assert (await ran(session, "print('after')")).strip() == "after"
    finally:
        await closed(host, session)


async def a_cancelled_wait_cancels_the_cell(host: SessionHost) -> None:
    """The run's own wait, cancelled (a client that gave up on run_python), interrupts its cell; a reader's
    cancelled wait leaves the job running."""
    session = await opened(host)
    try:
        job_id = (await started(session, "import time\nprint('begun', flush=True)\ntime.sleep(60)")).job_id
        with anyio.move_on_after(0.5):
            await session.read_job(job_id, 30.0, take=False)
        assert (await session.read_job(job_id, take=False)).running, "a reader's cancelled wait ended the job"
        with anyio.move_on_after(0.5):
            await session.wait_job(job_id, 30.0)
        with anyio.fail_after(STEP_S):
            while (update := await session.read_job(job_id, 1.0)).running:
                pass
        assert update.status == JobStatus.INTERRUPTED.value, update
        assert (await ran(session, "print('after')")).strip() == "after"
    finally:
        await closed(host, session)


async def a_run_beside_a_detached_job_is_told_busy(host: SessionHost) -> None:
    """A job read by another than its run's own wait (its run answered with its id) is detached: another run
    is refused at once, naming it, instead of waiting behind it."""
    session = await opened(host)
    try:
        job_id = (await started(session, "import time\ntime.sleep(60)")).job_id
        await session.read_job(job_id)
        began = time.monotonic()
        try:
            with anyio.fail_after(STEP_S):
                await session.start_run("1 + 1", 60)
        except SessionError as exc:
            assert f"busy with job {job_id}" in str(exc), exc
        else:
            raise AssertionError("a run beside a detached job was not refused")
        assert time.monotonic() - began < 10, "the run waited behind the job"
        await session.cancel_job(job_id)
    finally:
        await closed(host, session)


async def egress_decision(host: SessionHost) -> None:
    """Network 'allowlist': a host inside the ceiling but outside the session's list is put to the call's
    asker; declined, the proxy denies it, and the decision is in the session's egress log."""
    session = await opened(host, network="allowlist", allow=["a.example.org"])
    asked: list[str] = []

    async def asker(host_name: str, port: int) -> bool:
        asked.append(f"{host_name}:{port}")
        return False

    try:
        egress = session.egress
        assert egress is not None
        egress.set_asker(asker)
        try:
            out = await ran(session, FETCH.format(host="b.example.org"))
        finally:
            egress.set_asker(None)
        assert asked == ["b.example.org:80"], (asked, out)
        assert "HTTP 403" in out, out
        recent = [(d.host, d.allowed) for d in egress.log.recent(10)]
        assert ("b.example.org", False) in recent, recent
    finally:
        await closed(host, session)


async def files_in_and_out(host: SessionHost) -> None:
    """A file written into the workspace is the kernel's to read; what the kernel writes is read back."""
    session = await opened(host)
    try:
        files = session.files
        await anyio.to_thread.run_sync(lambda: files.write("/workspace/in.txt", b"hello from outside"))
        code = "data = open('in.txt').read()\nopen('out.txt', 'w').write(data.upper())\nprint(len(data))"
        assert (await ran(session, code)).strip() == "18"
        data, _, _ = await anyio.to_thread.run_sync(lambda: files.read("/workspace/out.txt"))
        assert data == b"HELLO FROM OUTSIDE", data
        names = [entry.path for entry in await anyio.to_thread.run_sync(lambda: files.list("/workspace", 1))]
        assert any(name.endswith("out.txt") for name in names), names
    finally:
        await closed(host, session)


async def close_leaves_nothing(host: SessionHost) -> None:
    """A closed session is gone: not listed, not found by its id, its running job ended with it."""
    session = await opened(host)
    await started(session, "import time\ntime.sleep(60)")
    await closed(host, session)
    assert session.session_id not in [listed.session_id for listed in host.list()]
    try:
        await host.resolve(session.session_id, OWNER, CLIENT)
    except SessionError as exc:
        assert "unknown or expired session_id" in str(exc), exc
    else:
        raise AssertionError("a closed session was found by its id")


CASES: dict[str, Case] = {
    case.__name__: case
    for case in (create, run_keeps_state, reset, job_progress_is_read_incrementally, cancel,
                 a_cancelled_wait_cancels_the_cell, a_run_beside_a_detached_job_is_told_busy, egress_decision,
                 files_in_and_out, close_leaves_nothing)
}  # fmt: skip


async def run_all(host: SessionHost, names: list[str]) -> dict[str, str | None]:
    """Each named case on `host` in turn: None when it passed, else its traceback."""
    found: dict[str, str | None] = {}
    for name in names:
        try:
            await CASES[name](host)
            found[name] = None
        except Exception:
            found[name] = traceback.format_exc()
    return found


#: A Ray driver in the cluster's namespace: `python -c RAY_DRIVER <ray address> <case>...` prints each case's outcome.
RAY_DRIVER = """
import json, sys, anyio
from coderunner.config import load_settings
from coderunner.cluster.host import ClusterHost
from tests.cluster.session_contract import run_all

async def main():
    async with ClusterHost(load_settings(ray_address=sys.argv[1])) as host:
        found = await run_all(host, sys.argv[2:])
    print(json.dumps(found))

anyio.run(main)
"""
