"""A server SIGKILLed leaves no sandbox behind, and takes no other server's with it.

Each server's watcher holds pidfds of every sandbox's outer bwrap and pid 1 (sandbox/bwrap_watch.py), and
each sandbox's init ends when the server's end of its gate closes: the session, its canary, its
network helper (slirp4netns, which ends with the server's lifeline pipe), its standby and the pooled
sandbox all end. A bystander server shares the runtime and workspace folders, so a clean-up by path
would take its sandboxes too. (tests/abuse/test_abuse_pid1.py does the same after the sandbox took
over its own pid 1.)
"""

from __future__ import annotations

import secrets
import signal
from pathlib import Path

import pytest

from .conftest import ServerDirs, raw_stdio_server, run, server_env, stdio_client, text_of, wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

#: Bound on everything of the killed server ending (its watcher sweeps at once, then twice a second apart).
GONE_WITHIN_S = 60.0

CANARY = """
import subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(900)", {token!r}], start_new_session=True,
                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
'canary started'
"""


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a live process, or None once it is gone (or a zombie)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else (int(fields[1]), int(fields[19]))


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def descendants(root: int) -> dict[int, int]:
    """Every live process below `root`: pid -> start time (so that a reused pid is not taken for it)."""
    stats = {int(entry.name): _stat(int(entry.name)) for entry in Path("/proc").iterdir() if entry.name.isdigit()}
    found: dict[int, int] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, stat in stats.items():
            if stat is not None and stat[0] == parent and pid not in found:
                found[pid] = stat[1]
                frontier.append(pid)
    return found


def alive(processes: dict[int, int]) -> list[int]:
    return [pid for pid, started in processes.items() if (stat := _stat(pid)) is not None and stat[1] == started]


def with_token(token: str) -> list[int]:
    return [
        int(entry.name)
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit() and token in _cmdline(int(entry.name))
    ]


async def test_a_sigkilled_server_leaves_no_sandbox_and_a_bystander_still_serves(dirs: ServerDirs) -> None:
    doomed_canary, bystander_canary = f"canary-{secrets.token_hex(6)}", f"canary-{secrets.token_hex(6)}"
    # A pooled sandbox besides the session's; network 'internet', whose slirp4netns must end too.
    env = server_env(dirs, CODERUNNER_POOL_SIZE="1", CODERUNNER_NETWORK="internet", CODERUNNER_MAX_NETWORK="internet")
    calls: list[tuple[str, dict[str, object]]] = [("run_python", {"code": CANARY.format(token=doomed_canary)})]
    with raw_stdio_server(env, calls) as doomed:
        assert await wait_until(lambda: len(with_token(doomed_canary)) == 1, 30), "the canary did not start"
        async with stdio_client(server_env(dirs)) as bystander:
            started = await run(bystander, CANARY.format(token=bystander_canary))
            assert "canary started" in text_of(started), text_of(started)
            # The session's sandbox (and its standby) and the pooled one: each an outer bwrap, its pid 1 ours.
            bwraps = lambda: [pid for pid in descendants(doomed.pid) if is_bwrap(pid)]  # noqa: E731
            assert await wait_until(lambda: len(bwraps()) >= 3, 60), [_cmdline(pid)[:3] for pid in bwraps()]
            its_own = descendants(doomed.pid)
            assert any(_cmdline(pid)[0].endswith("slirp4netns") for pid in its_own), "no network helper to watch"
            assert not any("CODERUNNER_SANDBOX_OF" in " ".join(_cmdline(pid)) for pid in its_own), "a mark is back"
            bystanders = sandbox_of(bystander_canary)
            doomed.send_signal(signal.SIGKILL)
            doomed.wait(timeout=10)
            assert await wait_until(lambda: not alive(its_own), GONE_WITHIN_S), [
                (pid, _cmdline(pid)[:4]) for pid in alive(its_own)
            ]
            assert not with_token(doomed_canary)
            # The bystander's sandboxes were not touched, and it serves on.
            assert alive(bystanders) == list(bystanders) and len(with_token(bystander_canary)) == 1
            again = await run(bystander, "1 + 1")
            assert not again.is_error and text_of(again).splitlines()[0] == "2", text_of(again)
    # What the killed server left on disk (its workspaces, mounted, and the one it made ahead), if its dirs sweeper
    # has not removed it yet, goes at the next start on these folders (which makes one ahead of its own).
    left = {path.name for path in dirs.workspace_entries()}
    with raw_stdio_server(server_env(dirs), []):
        assert not left & {path.name for path in dirs.workspace_entries()}
        assert dirs.session_workspaces() == []


def sandbox_of(canary: str) -> dict[int, int]:
    """The processes of the sandbox the canary runs in: its outer bwrap (the canary's topmost bwrap
    ancestor) and everything below it."""
    (pid,) = with_token(canary)
    outer = pid
    while (stat := _stat(pid)) is not None and stat[0] > 1:
        pid = stat[0]
        if is_bwrap(pid):
            outer = pid
    started = _stat(outer)
    assert started is not None and is_bwrap(outer)
    return {outer: started[1], **descendants(outer)}


def is_bwrap(pid: int) -> bool:
    argv = _cmdline(pid)
    return bool(argv) and argv[0].endswith("bwrap")
