"""Per-session cgroups: memory, process count and CPU, where the server may create cgroups.

cgroup v1 (one hierarchy per controller, as on this project's CI machines) and v2 (one
unified hierarchy; needs root or a delegated subtree, e.g. from `systemd-run --user --scope`).
Sessions are created below the server's own cgroup, in a parent group of this server process
alone: `coderunner-server-<pid>-<start time>/<session>`. A process enters its cgroups before it
execs bwrap (see `enter_command`), so nothing it forks can start outside them.

CPU policy: every session has its own cpu cgroup (equal weights: sessions share fairly among
themselves, however many threads each runs), and the server's parent group holding all of them
has a lower weight than the server and the host's other processes (`cpu_weight`, 100 = neutral).
So code spinning in a sandbox, even after its call returned, takes only idle CPU from the
server, bystander sessions and the user's own programs. A hard cap is the `cpus` quota.

The parent group is per server, not shared: several servers (one per MCP client) may run on one
machine with different weights, and a shared group's weight would be whatever the last server to
start wrote. Each server's group is made with its first session and removed with its last; one
whose server died is removed by the next server that creates a session (never killing anything:
a dead server's sandboxes died with it).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("memory", "pids", "cpu")
#: v1 controllers used where the server may write them: the freezer, with which a dead server's watcher
#: (pid_watcher.py) stops a sandbox forking while it kills its tasks one by one (v1 has no cgroup.kill).
V1_OPTIONAL = ("freezer",)
CPU_PERIOD_US = 100_000
#: Weight of all sessions together against the processes beside them, on cgroup v2's scale (1-10000, 100 =
#: an ordinary process group). v1 cpu.shares is this x 1024 / 100.
DEFAULT_CPU_WEIGHT = 20
#: Bound on waiting for a killed cgroup to empty before removing it.
REMOVE_WAIT_S = 3.0
#: First and longest pause between tries to remove a cgroup whose last tasks are still exiting.
REMOVE_FIRST_PAUSE_S = 0.001
REMOVE_PAUSE_S = 0.02


class CgroupsUnavailable(RuntimeError):
    """This server cannot create cgroups here; the message says why."""


@dataclass(frozen=True)
class CgroupLimits:
    memory_bytes: int | None
    pids_max: int | None
    cpus: float | None


@dataclass
class SessionCgroup:
    """The cgroup dirs of one sandbox: one per controller (v1) or a single dir (v2)."""

    version: int
    dirs: dict[str, Path] = field(default_factory=dict)
    #: Called once the dirs are removed (its server's parent group goes with the last session).
    after_remove: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def procs_files(self) -> list[Path]:
        return sorted({path / "cgroup.procs" for path in self.dirs.values()})

    def join_files(self) -> list[Path]:
        """Where a single-threaded process joins the groups by writing "0" (itself): v1's `tasks`, v2's
        cgroup.procs. Why not v1's cgroup.procs: a write there takes the kernel's global threadgroup lock
        for writing, which waits for an RCU grace period (measured here: 5 to 12 ms for four controllers, on
        every sandbox start and again in every kernel forked from the template); a thread moving itself
        through `tasks` skips that lock. The writer must be single-threaded (a shell, a fresh fork): `tasks`
        moves the writing thread alone, and what it starts later follows it."""
        name = "tasks" if self.version == 1 else "cgroup.procs"
        return sorted({path / name for path in self.dirs.values()})

    def memory_bytes(self) -> int | None:
        name = "memory.usage_in_bytes" if self.version == 1 else "memory.current"
        return _read_int(self.dirs.get("memory"), name)

    def memory_peak_bytes(self) -> int | None:
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        return _read_int(self.dirs.get("memory"), name)

    def reset_peak(self) -> None:
        """Start the peak afresh (cgroup v1; v2 keeps its own per reader)."""
        memory = self.dirs.get("memory")
        if memory is not None and self.version == 1:
            _write_quietly(memory / "memory.max_usage_in_bytes", "0")

    def pids_current(self) -> int | None:
        return _read_int(self.dirs.get("pids"), "pids.current")

    def oom_kills(self) -> int:
        """How often the kernel's OOM killer struck inside this cgroup."""
        memory = self.dirs.get("memory")
        if memory is None:
            return 0
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        with contextlib.suppress(OSError, ValueError):
            for line in (memory / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0

    def write_limits(self, limits: CgroupLimits) -> None:
        """Write `limits` (those not None) into the dirs: when the group is made, and again into a running
        sandbox's group when a warm pool's sandbox is taken with lower ones (sandbox/live_limits.py).
        Raises OSError (a limit the kernel refused)."""
        if self.version == 1:
            memory, pids, cpu = self.dirs["memory"], self.dirs["pids"], self.dirs.get("cpu")
        else:
            memory = pids = cpu = self.dirs["unified"]
        if limits.memory_bytes is not None:
            if self.version == 1:
                (memory / "memory.limit_in_bytes").write_text(str(limits.memory_bytes))
                # Where swap accounting exists, swap counts too: no escaping the limit into swap.
                with contextlib.suppress(OSError):
                    (memory / "memory.memsw.limit_in_bytes").write_text(str(limits.memory_bytes))
            else:
                (memory / "memory.max").write_text(str(limits.memory_bytes))
                with contextlib.suppress(OSError):
                    (memory / "memory.swap.max").write_text("0")
        if limits.pids_max is not None:
            (pids / "pids.max").write_text(str(limits.pids_max))
        if limits.cpus is not None and cpu is not None:
            quota = int(limits.cpus * CPU_PERIOD_US)
            if self.version == 1:
                (cpu / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
                (cpu / "cpu.cfs_quota_us").write_text(str(quota))
            else:
                (cpu / "cpu.max").write_text(f"{quota} {CPU_PERIOD_US}")

    def kill_all(self) -> None:
        """SIGKILL every process left in the cgroup: v2 has cgroup.kill; v1 goes pid by pid, and remove()
        goes again until the cgroup is empty (a child forked between reading the list and its parent's
        kill is in the next list; a killed task forks no more).

        Not under the v1 freezer: a server SIGKILLed between FROZEN and THAWED leaves its tasks frozen,
        and a frozen task dies of nothing, a SIGKILL already sent included, nor does a frozen init read
        its gate's end of file; with the watcher gone too, nothing would thaw them."""
        if self.version == 2:
            with contextlib.suppress(OSError):
                (self.dirs["unified"] / "cgroup.kill").write_text("1")
                return
        for procs in self.procs_files():
            with contextlib.suppress(OSError, ValueError):
                for pid in procs.read_text().split():
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(int(pid), 9)

    def remove(self) -> None:
        """Kill what is left and remove the dirs, within REMOVE_WAIT_S.

        Blocking (it sleeps while the last tasks exit): async code calls it through off_loop.
        """
        try:
            self._remove_dirs()
        finally:
            if self.after_remove is not None:
                self.after_remove()

    def _remove_dirs(self) -> None:
        self.kill_all()
        deadline = time.monotonic() + REMOVE_WAIT_S
        for path in self.dirs.values():
            pause = REMOVE_FIRST_PAUSE_S
            while True:
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    self.kill_all()
                    # A sandbox reaped a moment ago often leaves its cgroup busy for a millisecond
                    # or two (its last tasks still exiting): look again soon, then less often.
                    time.sleep(pause)
                    pause = min(pause * 2, REMOVE_PAUSE_S)


def _write_quietly(path: Path, value: str) -> None:
    """A policy knob the kernel may not offer (e.g. cpu not delegated on v2): the limits still hold without it."""
    with contextlib.suppress(OSError):
        path.write_text(value)


def _read_int(directory: Path | None, name: str) -> int | None:
    if directory is None:
        return None
    try:
        return int((directory / name).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _process_start(pid: int) -> str | None:
    """A process's start time in clock ticks since boot (with its pid, unique while the host runs), or None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    return fields[19] if len(fields) > 19 else None


def _server_id() -> str:
    """This process's id for its parent cgroup: pid and start time, so a reused pid is another server."""
    return f"{os.getpid()}-{_process_start(os.getpid()) or 0}"


def _own_cgroups() -> dict[str, str]:
    """Controller -> path of this process's cgroup, from /proc/self/cgroup ('' is v2's unified one)."""
    result: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            result[controller] = path
    return result


@dataclass
class CgroupManager:
    """Creates SessionCgroups under a parent dir this server may write."""

    version: int
    parents: dict[str, Path]
    prefix: str = "coderunner"
    #: The CPU weight of this server's parent group of sessions (None: leave it as it is).
    cpu_weight: int | None = DEFAULT_CPU_WEIGHT
    #: Names this server process's own parent group (see _server_id).
    server_id: str = field(default_factory=_server_id)
    #: Held while the server's parent group is made or removed: a create never sees it vanish.
    _lock: threading.RLock = field(default_factory=threading.RLock, init=False, repr=False, compare=False)
    _swept: bool = field(default=False, init=False, repr=False, compare=False)

    @property
    def server_group(self) -> str:
        """The name of this server's parent group, beside the server's own processes."""
        return f"{self.prefix}-server-{self.server_id}"

    @classmethod
    def detect(cls) -> CgroupManager:
        """The cgroup setup usable here, or CgroupsUnavailable saying why not."""
        own = _own_cgroups()
        if all((CGROUP_ROOT / name / "cgroup.procs").exists() for name in V1_CONTROLLERS) and all(
            name in own for name in V1_CONTROLLERS
        ):
            parents = {name: CGROUP_ROOT / name / own[name].lstrip("/") for name in V1_CONTROLLERS}
            for name, parent in parents.items():
                if not os.access(parent, os.W_OK):
                    raise CgroupsUnavailable(f"cgroup v1 {name} hierarchy at {parent} is not writable (not root)")
            for name in V1_OPTIONAL:
                parent = CGROUP_ROOT / name / own.get(name, "/").lstrip("/")
                if name in own and (parent / "cgroup.procs").exists() and os.access(parent, os.W_OK):
                    parents[name] = parent
            return cls(version=1, parents=parents)
        if (CGROUP_ROOT / "cgroup.controllers").exists() and "" in own:
            parent = CGROUP_ROOT / own[""].lstrip("/")
            available = set((parent / "cgroup.controllers").read_text().split())
            missing = {"memory", "pids"} - available
            if missing:
                raise CgroupsUnavailable(f"cgroup v2 controllers {sorted(missing)} are not delegated to {parent}")
            if not os.access(parent, os.W_OK):
                raise CgroupsUnavailable(
                    f"cgroup v2 dir {parent} is not writable: run as root, or start the server in a delegated "
                    "scope: systemd-run --user --scope -p Delegate=yes coderunner serve"
                )
            return cls(version=2, parents={"unified": parent})
        raise CgroupsUnavailable("no usable cgroup hierarchy (need v1 memory+pids+cpu, or v2 with delegation)")

    def create(self, name: str, limits: CgroupLimits) -> SessionCgroup:
        """A session's cgroups in this server's parent group (made, with its weight, if need be).

        Blocking file work in cgroupfs: async code calls it through off_loop."""
        with self._lock:
            if not self._swept:
                self._swept = True
                self.sweep_dead()
            group = SessionCgroup(version=self.version, after_remove=self._leave)
            try:
                if self.version == 1:
                    self._create_v1(group, name, limits)
                else:
                    self._create_v2(group, name, limits)
            except OSError:
                group.remove()
                raise
            return group

    def _leave(self) -> None:
        """A session's cgroups are gone: remove this server's parent group if it was the last."""
        with self._lock:
            for parent in self.parents.values():
                with contextlib.suppress(OSError):  # busy: other sessions are in it; or already gone
                    (parent / self.server_group).rmdir()

    def _create_v1(self, group: SessionCgroup, name: str, limits: CgroupLimits) -> None:
        for controller, parent in self.parents.items():
            base = parent / self.server_group
            base.mkdir(exist_ok=True)
            if controller == "cpu" and self.cpu_weight is not None:
                _write_quietly(base / "cpu.shares", str(max(2, self.cpu_weight * 1024 // 100)))
            path = base / name
            path.mkdir(exist_ok=True)
            group.dirs[controller] = path
        group.write_limits(limits)

    def _create_v2(self, group: SessionCgroup, name: str, limits: CgroupLimits) -> None:
        parent = self.parents["unified"]
        base = parent / self.server_group
        base.mkdir(exist_ok=True)
        with contextlib.suppress(OSError):
            (base / "cgroup.subtree_control").write_text("+memory +pids +cpu")
        if self.cpu_weight is not None:
            _write_quietly(base / "cpu.weight", str(min(max(self.cpu_weight, 1), 10_000)))
        path = base / name
        path.mkdir(exist_ok=True)
        group.dirs = {"unified": path, "memory": path, "pids": path}
        group.write_limits(limits)

    def remove_named(self, name: str) -> None:
        """Remove a session's cgroups left by a server that is gone (the caller checked its lock),
        in whichever server's parent group they are (or the shared one of older versions)."""
        for base in [self.prefix, *self._server_groups()]:
            dirs = {controller: parent / base / name for controller, parent in self.parents.items()}
            existing = {controller: path for controller, path in dirs.items() if path.is_dir()}
            if existing:
                SessionCgroup(self.version, existing).remove()

    def _server_groups(self) -> list[str]:
        """Names of every server's parent group (live or dead) beside this server's processes."""
        pattern = re.compile(rf"{re.escape(self.prefix)}-server-\d+-\d+")
        names: set[str] = set()
        for parent in self.parents.values():
            with contextlib.suppress(OSError):
                names.update(entry.name for entry in os.scandir(parent) if pattern.fullmatch(entry.name))
        return sorted(names)

    def sweep_dead(self) -> None:
        """Remove the empty parent groups (and empty session groups in them) of servers that are gone.

        Only rmdir, never a kill: a group that still has tasks (a server this one cannot see in its
        /proc, say) stays. A dead server's sandboxes died with it (its watcher: bwrap_watch.py).
        """
        for name in self._server_groups():
            pid, _, start = name.rpartition("-server-")[2].partition("-")
            if name == self.server_group or _process_start(int(pid)) == start:
                continue
            for parent in self.parents.values():
                base = parent / name
                with contextlib.suppress(OSError):
                    for entry in os.scandir(base):
                        if entry.is_dir(follow_symlinks=False):
                            with contextlib.suppress(OSError):
                                os.rmdir(entry.path)
                with contextlib.suppress(OSError):
                    base.rmdir()


#: /bin/sh that moves itself into the cgroups named by its arguments: a count N, then N join files (it is
#: single-threaded, so "0", the writer, is the whole process); any failure exits 97. It leaves the rest of the
#: arguments as "$@". A fragment, so that a start's one shell (pid1.gated_command) joins them too.
JOIN_SCRIPT = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo 0 > "$1" || exit 97; shift; n=$((n-1)); done; '


def join_arguments(group: SessionCgroup | None) -> list[str]:
    """JOIN_SCRIPT's arguments for `group` (none: a count of 0)."""
    files = [str(path) for path in group.join_files()] if group is not None else []
    return [str(len(files)), *files]


def enter_command(group: SessionCgroup, argv: list[str]) -> list[str]:
    """Prefix `argv` with a /bin/sh that moves itself into the cgroups (JOIN_SCRIPT), then execs `argv`."""
    return ["/bin/sh", "-c", JOIN_SCRIPT + 'exec "$@"', "coderunner-cgroup-enter", *join_arguments(group), *argv]
