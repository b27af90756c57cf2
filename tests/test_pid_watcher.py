"""A SIGKILLed server's watcher ends what it was handed (sandbox/bwrap_watch.py, sandbox/pid_watcher.py).

Real processes, no bwrap: a stand-in server (a Python process using the real PidWatcher) hands its watcher
pidfds and cgroup dirs as BwrapBackend does, and is SIGKILLed. Its watcher must then kill the "outer"
process and its children (a pid 1 not reported yet), every "init" it was told of, everything in a cgroup
(a daemon that left its parent included), and hand-offs made before a restart of the watcher itself.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coderunner.sandbox.cgroups import CgroupLimits, CgroupManager, CgroupsUnavailable

REPO = Path(__file__).resolve().parents[1]
#: Bound on the watcher ending everything once its server is gone.
GONE_WITHIN_S = 10.0

SERVER = """
import os, subprocess, sys, time
from coderunner.sandbox.bwrap_watch import process_watch
from coderunner.sandbox.cgroups import SessionCgroup, enter_command
from pathlib import Path
token, version, cgroup_dirs = sys.argv[1], int(sys.argv[2]), [Path(p) for p in sys.argv[3:]]
watcher = process_watch().watcher
def spawn(argv):
    return subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
# An outer process whose child was never reported (a sandbox still starting).
outer = spawn(["/bin/sh", "-c", "sleep 900 & wait", token + "-outer"])
watcher.add(os.pidfd_open(outer.pid), [], [])
# A reported init, then the watcher killed and restarted: both must be told to the new one.
init_parent = spawn(["/bin/sh", "-c", "sleep 900; true", token + "-holder"])
entry = watcher.add(os.pidfd_open(init_parent.pid), [], [])
# (Childless: a real pid 1 takes its namespace with it, which tests/abuse/test_abuse_pid1.py shows.)
init = spawn([sys.executable, "-c", "import time; time.sleep(900)", token + "-init"])
watcher.add_init(entry, os.pidfd_open(init.pid))
os.kill(watcher.pid, 9)
while watcher._process.poll() is None:
    time.sleep(0.01)
# In a cgroup: a daemon that left its parent is reached only through the group.
if cgroup_dirs:
    group = SessionCgroup(version, {str(index): path for index, path in enumerate(cgroup_dirs)})
    inner = spawn(enter_command(group, ["/bin/sh", "-c", "(setsid sleep 900 &); sleep 900; true", token + "-grouped"]))
    watcher.add(os.pidfd_open(inner.pid), [], cgroup_dirs)
else:
    watcher.add(os.pidfd_open(spawn(["/bin/sh", "-c", "sleep 900; true", token + "-plain"]).pid), [], [])
print("ready", flush=True)
time.sleep(900)
"""


def with_token(token: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if token.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def descendants_and_self(pids: list[int]) -> set[int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = set(pids), list(pids)
    while frontier:
        parent = frontier.pop()
        for pid, its_parent in parents.items():
            if its_parent == parent and pid not in found:
                found.add(pid)
                frontier.append(pid)
    return found


def alive(pids: set[int]) -> list[int]:
    living = []
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
                living.append(pid)
        except OSError:
            continue
    return living


def cgroup_dirs(name: str) -> tuple[CgroupManager | None, list[Path]]:
    try:
        manager = CgroupManager.detect()
    except (CgroupsUnavailable, OSError):
        return None, []
    group = manager.create(name, CgroupLimits(memory_bytes=None, pids_max=None, cpus=None))
    return manager, sorted(set(group.dirs.values()))


@pytest.mark.parametrize("cgroups", [True, False], ids=["cgroups", "no-cgroups"])
def test_a_sigkilled_servers_watcher_ends_all_it_was_handed(cgroups: bool) -> None:
    token = f"watched-{secrets.token_hex(6)}"
    name = f"t-watch-{os.getpid()}-{secrets.token_hex(3)}"
    manager, dirs = cgroup_dirs(name) if cgroups else (None, [])
    if cgroups and not dirs:
        pytest.skip("no cgroups this process may create here")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "src")}
    version = str(manager.version) if manager is not None else "0"
    server = subprocess.Popen([sys.executable, "-c", SERVER, token, version, *map(str, dirs)], env=env,
                              stdout=subprocess.PIPE, start_new_session=True)  # fmt: skip
    try:
        assert server.stdout is not None and server.stdout.readline() == b"ready\n"
        deadline = time.monotonic() + GONE_WITHIN_S
        while len(with_token(token)) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        handed = descendants_and_self(with_token(token))
        if cgroups:  # the daemon that left its parent: in the group, no descendant of anything handed over
            handed |= {int(pid) for path in dirs for pid in (path / "cgroup.procs").read_text().split()}
        assert len(handed) >= 8, handed
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=10)
        deadline = time.monotonic() + GONE_WITHIN_S
        while alive(handed) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(handed), [(pid, Path(f"/proc/{pid}/cmdline").read_bytes()[:60]) for pid in alive(handed)]
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=10)
        for pid in alive(descendants_and_self(with_token(token))):
            os.kill(pid, signal.SIGKILL)
        if manager is not None:
            manager.remove_named(name)
