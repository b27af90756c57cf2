"""Per-server parent cgroups and cgroup removal off the event loop, on this machine's real cgroupfs.

Several servers share a machine (one per MCP client): each has its own parent group with its own
CPU weight, so one server's setting never changes another's. Needs root (or a delegated v2 tree).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import threading
import time
from pathlib import Path

import anyio
import pytest
from anyio.abc import TaskGroup

from coderunner.sandbox.base import SandboxProcess
from coderunner.sandbox.cgroups import (
    CgroupLimits,
    CgroupManager,
    CgroupsUnavailable,
    SessionCgroup,
    _process_start,
    enter_command,
)

NO_LIMITS = CgroupLimits(memory_bytes=None, pids_max=None, cpus=None)


@pytest.fixture
def manager() -> CgroupManager:
    try:
        return CgroupManager.detect()
    except (CgroupsUnavailable, OSError) as exc:
        pytest.skip(f"no cgroups this process may create here: {exc}")


def _weight_file(manager: CgroupManager, server_group: str) -> Path:
    if manager.version == 1:
        return manager.parents["cpu"] / server_group / "cpu.shares"
    return manager.parents["unified"] / server_group / "cpu.weight"


def _weight(manager: CgroupManager, value: int) -> str:
    return str(value * 1024 // 100) if manager.version == 1 else str(value)


def _other_server(manager: CgroupManager, weight: int) -> CgroupManager:
    """A second server's manager: another live process's id (pid 1's), another weight."""
    return dataclasses.replace(manager, server_id=f"1-{_process_start(1)}", cpu_weight=weight)


def test_each_server_weighs_its_own_parent_group(manager: CgroupManager) -> None:
    # Not this process's own group: in-process servers of e2e tests in this worker keep theirs there, and a
    # session group of theirs still being removed would keep it past this test's last session.
    parent = os.getppid()
    first = dataclasses.replace(manager, server_id=f"{parent}-{_process_start(parent)}", cpu_weight=37)
    second = _other_server(manager, 50)
    name = f"t-{os.getpid()}-weights"
    mine = first.create(name, NO_LIMITS)
    try:
        theirs = second.create(name, NO_LIMITS)
        try:
            for controller, path in mine.dirs.items():
                assert path.parent.name == first.server_group, (controller, path)
            assert _weight_file(first, first.server_group).read_text().strip() == _weight(first, 37)
            assert _weight_file(second, second.server_group).read_text().strip() == _weight(second, 50)
            # The first server makes another session: still its own weight, the second's untouched.
            again = first.create(name + "-b", NO_LIMITS)
            again.remove()
            assert _weight_file(second, second.server_group).read_text().strip() == _weight(second, 50)
        finally:
            theirs.remove()
        assert not any((parent / second.server_group).exists() for parent in second.parents.values())
        assert _weight_file(first, first.server_group).read_text().strip() == _weight(first, 37)
    finally:
        mine.remove()
    # The last session gone, so is the server's parent group.
    assert not any((parent / first.server_group).exists() for parent in first.parents.values())


def test_a_dead_servers_empty_groups_are_swept(manager: CgroupManager) -> None:
    dead = dataclasses.replace(manager, server_id="999999999-1")  # no such pid: a server that is gone
    left = dead.create("t-left", NO_LIMITS)
    left.after_remove = None  # as if its server died before removing anything
    for path in left.dirs.values():
        path.rmdir()  # its sandboxes died with it: empty session groups (and one removed) stay behind
    (manager.parents[next(iter(manager.parents))] / dead.server_group / "t-empty").mkdir()
    fresh = dataclasses.replace(manager, server_id=manager.server_id)
    created = fresh.create(f"t-{os.getpid()}-sweep", NO_LIMITS)
    try:
        assert not any((parent / dead.server_group).exists() for parent in manager.parents.values())
    finally:
        created.remove()


async def sleeper_in(group: SessionCgroup, tg: TaskGroup) -> SandboxProcess:
    """A sandbox whose process is a `sleep` in `group`, once the group holds it."""
    process = await anyio.open_process(
        enter_command(group, ["sleep", "60"]),
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    sandbox = SandboxProcess(process, tg, cgroup=group)
    with anyio.fail_after(10):
        while not any(procs.read_text().split() for procs in group.procs_files()):
            await anyio.sleep(0.01)
    return sandbox


@pytest.mark.anyio
async def test_a_killed_sandboxs_cgroup_is_removed_in_a_worker_thread(
    manager: CgroupManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The removal waits (up to REMOVE_WAIT_S) for the last tasks to exit: never on the event loop."""
    removed_in: list[int] = []
    remove = SessionCgroup.remove

    def recording_remove(self: SessionCgroup) -> None:
        removed_in.append(threading.get_ident())
        remove(self)

    monkeypatch.setattr(SessionCgroup, "remove", recording_remove)
    group = manager.create(f"t-{os.getpid()}-kill", NO_LIMITS)
    loop_thread = threading.get_ident()
    async with anyio.create_task_group() as tg:
        sandbox = await sleeper_in(group, tg)
        await sandbox.kill()
    assert removed_in and loop_thread not in removed_in, "the cgroup was removed on the event loop thread"
    assert not any(path.exists() for path in group.dirs.values())
    assert sandbox.cgroup is group  # still there for what reads it after the kill (memory, OOM)


@pytest.mark.anyio
async def test_a_second_kill_waits_for_the_first_so_the_next_sandbox_of_the_name_is_not_killed(
    manager: CgroupManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forked kernel's exit starts its sandbox's kill (template_kernels.relay_exit) and the session's restart
    kills it again, then makes the session's next cgroup, of the same name. Had the second kill returned while
    the first's removal still ran, that removal would kill the next sandbox (seen under load: the new kernel's
    placeholder died before it said ready). Here the first removal is slowed; the second kill waits for it."""
    remove = SessionCgroup.remove
    calls: list[str] = []

    def slow_first_remove(self: SessionCgroup) -> None:
        calls.append("remove")
        if len(calls) == 1:
            time.sleep(1.0)  # a loaded machine: the first removal's thread runs late
        remove(self)
        calls.append("removed")

    monkeypatch.setattr(SessionCgroup, "remove", slow_first_remove)
    name = f"t-{os.getpid()}-twice"
    group = manager.create(name, NO_LIMITS)
    async with anyio.create_task_group() as tg:
        sandbox = await sleeper_in(group, tg)
        tg.start_soon(sandbox.kill)  # the relay of the exit
        await anyio.sleep(0.1)
        await sandbox.kill()  # the restart's
        assert calls == ["remove", "removed"], calls  # ended, and once
        following = manager.create(name, NO_LIMITS)  # the session's next sandbox
        bystander = subprocess.Popen(enter_command(following, ["sleep", "60"]), stdin=subprocess.DEVNULL)
        try:
            await anyio.sleep(1.5)  # past the first removal's delay, had it still been running
            assert bystander.poll() is None, "the first kill's removal killed the next sandbox of the same name"
        finally:
            bystander.kill()
            bystander.wait(timeout=10)
            remove(following)


def test_the_servers_own_kill_never_leaves_a_v1_cgroup_frozen(
    manager: CgroupManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server may be SIGKILLed at any moment of a kill, and its watcher may be gone already: then
    nothing thaws what it froze, and a frozen task dies of nothing (a SIGKILL sent before included), nor
    does a frozen sandbox init read its gate's end of file. So no moment of the server's own kill has the
    cgroup frozen: looked at each time it sends SIGKILL."""
    if "freezer" not in manager.parents:
        pytest.skip("no cgroup v1 freezer here")
    group = manager.create(f"t-{os.getpid()}-nofreeze", NO_LIMITS)
    state = group.dirs["freezer"] / "freezer.state"
    sleeper = subprocess.Popen(enter_command(group, ["sleep", "60"]), stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while str(sleeper.pid) not in (group.dirs["freezer"] / "cgroup.procs").read_text().split():
            assert time.monotonic() < deadline, "the sleeper never entered its cgroup"
            time.sleep(0.01)
        seen: list[str] = []
        kill = os.kill

        def looking_kill(pid: int, number: int) -> None:
            seen.append(state.read_text().strip())
            kill(pid, number)

        monkeypatch.setattr(os, "kill", looking_kill)
        group.kill_all()
        monkeypatch.undo()
        assert seen and "FROZEN" not in seen, seen
        assert sleeper.wait(timeout=10) == -9
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait(timeout=10)
        group.remove()


def test_a_process_joins_every_controller_by_the_join_files_and_its_children_follow(manager: CgroupManager) -> None:
    """enter_command writes "0" to join_files (v1: `tasks`, the thread itself, which skips the kernel's global
    lock and its RCU wait): the shell, what it execs and that program's children are all in every controller's
    group, as /proc/PID/cgroup says, not only by the group's own lists."""
    group = manager.create(f"t-{os.getpid()}-join", NO_LIMITS)
    try:
        names = {path.name for path in group.join_files()}
        assert names == ({"tasks"} if manager.version == 1 else {"cgroup.procs"})
        script = "sleep 60 & echo $!; exec sleep 60"
        parent = subprocess.Popen(
            enter_command(group, ["/bin/sh", "-c", script]), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE
        )
        try:
            assert parent.stdout is not None
            child = int(parent.stdout.readline())
            for pid in (parent.pid, child):
                lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
                for controller, path in group.dirs.items():
                    tail = f"/{path.parent.name}/{path.name}"  # the server's group, then the session's
                    assert any(line.endswith(tail) for line in lines), (pid, controller, lines)
                    assert str(pid) in (path / "cgroup.procs").read_text().split()
        finally:
            parent.kill()
            parent.wait()
    finally:
        group.remove()
