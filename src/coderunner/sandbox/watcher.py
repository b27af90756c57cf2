"""A process on the host that removes a server's containers once that server is gone.

(For the gvisor backend, kind "runsc": the containers under the server process's own runsc
--root, then their rootfs mounts and that server process's dir, `clear_dir`. For Apple
`container`, kind "apple": the VMs whose names start with the server's prefix; each `container
run` client, in a session of its own that the server's end does not reach, exits with its VM.)

A container outlives its engine client (conmon keeps it running), so a server that dies by
SIGKILL, OOM or a crash would leave its kernels running. Nothing inside the container can be
trusted to end it (the sandbox may kill anything in there), so the watcher lives outside: one
small process per server process, in its own session (a signal to the server's process group
does not reach it). It reads a pipe whose only writer is the server; end of file means the server
is gone, however it went. It then removes every container labelled with that server process's
instance label, with bounded engine calls, and exits.

(bwrap has a watcher of its own, pid_watcher.py, which holds pidfds instead of a label: bwrap_watch.py.)

It runs nothing from the sandbox and touches no path: its whole input is its argv (the engine
command and the label, from the server) and the end of a pipe. It waits with the bare interpreter
(WAIT_THEN_RUN: about 4 MiB) and loads this file, which imports the standard library only, once the
server is gone.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

log = logging.getLogger(__name__)

#: An engine client the server started just before it died may still be creating its container
#: when the first sweep lists them: the watcher sweeps again every SWEEP_INTERVAL_S while any of
#: the server's engine clients lives (each carries the label in its argv), within SWEEP_DEADLINE_S.
SWEEP_INTERVAL_S = 1.0
SWEEP_DEADLINE_S = 60.0
#: Where /proc cannot tell (no procfs: Docker Desktop on macOS), fixed pauses before each sweep.
BLIND_SWEEP_DELAYS_S = (0.0, 2.0, 5.0)
#: Every VM name of ours starts so (container.NAME_PREFIX; this script imports the standard library only).
APPLE_NAME_PREFIX = "coderunner-"
#: Bounds on the engine calls (as engine.QUERY_TIMEOUT_S and REMOVE_TIMEOUT_S; engine.py imports anyio).
LIST_TIMEOUT_S = 20.0
REMOVE_TIMEOUT_S = 30.0
#: What the watcher process runs: it ignores a terminal's signals (the server's business) and waits for
#: the end of its pipe with nothing imported (about 4 MiB, where this file's imports make 8), then runs
#: this file (argv: this file, the plan), whose main finds the pipe ended.
WAIT_THEN_RUN = (
    "import os, signal, sys\n"
    "for number in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):\n"
    "    signal.signal(number, signal.SIG_IGN)\n"
    "while os.read(0, 4096):\n"
    "    pass\n"
    "import runpy\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


@dataclass(frozen=True)
class WatchPlan:
    """What the watcher removes, and how: the engine's argv prefix and a `key=value` label."""

    engine: list[str]  # e.g. ["podman", "--runtime", "runc"], or ["runsc", "--root=R", ...]
    kind: str  # "podman", "docker", "runsc" or "apple"
    #: podman/docker: the server process's instance label; runsc: its own --root (R), which every
    #: runsc client and sandbox process of that server carries in its argv; apple: the server
    #: process's mark (`-<instance>-`), in the name of each of its VMs and so in every `container run
    #: --name` of it (servers sharing a runtime dir share the name prefix, never the mark).
    label: str
    #: runsc: the server process's own host-only dir (bundles, overlay roots): unmounted and removed
    #: once its containers are gone.
    clear_dir: str = ""

    def list_argv(self) -> list[str]:
        if self.kind == "runsc":
            return [*self.engine, "list", "-quiet"]
        if self.kind == "apple":
            return [*self.engine, "list", "--all", "--format", "json"]
        return [*self.engine, "ps", "--all", "--quiet", "--filter", f"label={self.label}"]

    def remove_argv(self, ids: list[str]) -> list[str]:
        if self.kind in ("runsc", "apple"):
            return [*self.engine, "delete", "--force", *ids]
        force = ["--force"] if self.kind == "docker" else ["--force", "--time", "0"]
        return [*self.engine, "rm", *force, *ids]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WatchPlan:
        data = json.loads(text)
        return cls(
            engine=[str(part) for part in data["engine"]],
            kind=str(data["kind"]),
            label=str(data["label"]),
            clear_dir=str(data.get("clear_dir", "")),
        )


def _run(argv: list[str], timeout_s: float) -> str | None:
    """An engine call's stdout, or None if it failed or outlived `timeout_s` (then it is killed)."""
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout_s, check=False, stdin=subprocess.DEVNULL
        )
    except (subprocess.TimeoutExpired, OSError):
        return None
    return done.stdout if done.returncode == 0 else None


def apple_names(listed: str, mark: str) -> list[str]:
    """The VMs of ours whose name holds `mark`, in `container list --format json` (`configuration.id` in
    every release)."""
    try:
        records = json.loads(listed or "[]")
    except ValueError:
        return []
    names = []
    for record in records if isinstance(records, list) else [records]:
        configuration = record.get("configuration") if isinstance(record, dict) else None
        name = configuration.get("id") if isinstance(configuration, dict) else None
        if isinstance(name, str) and name.startswith(APPLE_NAME_PREFIX) and mark in name:
            names.append(name)
    return names


def sweep(plan: WatchPlan) -> int:
    """Remove every container carrying the plan's label; how many were found."""
    listed = _run(plan.list_argv(), LIST_TIMEOUT_S)
    if plan.kind == "apple":
        ids = apple_names(listed or "", plan.label)
    else:
        ids = [line.strip() for line in (listed or "").splitlines() if line.strip()]
    if ids:
        _run(plan.remove_argv(ids), REMOVE_TIMEOUT_S + 2 * len(ids))
    return len(ids)


def engine_clients_alive(label: str) -> bool:
    """Is any process but this one running with `label` in its argv (a `run --label ...` client)?"""
    needle, me = label.encode(), os.getpid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as handle:
                if needle in handle.read():
                    return True
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return False


def sweep_until_settled(plan: WatchPlan) -> None:
    """Sweep until a sweep finds nothing and no engine client of the server is left (bounded)."""
    if not os.path.isdir("/proc/self"):
        for delay in BLIND_SWEEP_DELAYS_S:
            time.sleep(delay)
            sweep(plan)
        return
    deadline = time.monotonic() + SWEEP_DEADLINE_S
    while True:
        found = sweep(plan)
        if (found == 0 and not engine_clients_alive(plan.label)) or time.monotonic() > deadline:
            return
        time.sleep(SWEEP_INTERVAL_S)


def _mounts_below(top: str) -> list[str]:
    """Mount points under `top`, deepest first (/proc/self/mountinfo's 5th field, octal-escaped)."""
    found = []
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                fields = line.split()
                if len(fields) > 4:
                    point = fields[4].encode().decode("unicode_escape")
                    if point.startswith(top + "/"):
                        found.append(point)
    except OSError:
        return []
    return sorted(found, key=len, reverse=True)


def clear_dir(top: str) -> None:
    """Unmount every mount below `top` (a dead server's overlay roots), then remove `top`, only once
    nothing is mounted below it any more (never delete through a mount)."""
    if not top or not os.path.isdir(top):
        return
    for point in _mounts_below(top):
        if _run(["umount", point], REMOVE_TIMEOUT_S) is None:
            _run(["umount", "--lazy", point], REMOVE_TIMEOUT_S)
    if not _mounts_below(top):
        shutil.rmtree(top, ignore_errors=True)


def wait_for_end_of_file(fd: int) -> None:
    """Block until every writer of the pipe `fd` has closed it (the server exited)."""
    while os.read(fd, 4096):
        pass


class Watcher:
    """The server's handle on its watcher: starts it, restarts it if it died, holds the pipe."""

    def __init__(self, plan: WatchPlan, env: dict[str, str]) -> None:
        self.plan = plan
        self.env = env
        self._process: subprocess.Popen[bytes] | None = None
        self._write_fd: int | None = None

    def ensure_running(self) -> None:
        """Start the watcher if it is not running (first container, or it died)."""
        if self._process is not None:
            if self._process.poll() is None:
                return
            log.warning("the container watcher exited (code %s); starting another", self._process.returncode)
        if self._write_fd is not None:
            os.close(self._write_fd)
            self._write_fd = None
        read_fd, write_fd = os.pipe()  # both close-on-exec: no other child holds the write end
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-I", "-c", WAIT_THEN_RUN, __file__, self.plan.to_json()],
                stdin=read_fd,
                stdout=subprocess.DEVNULL,
                # Not the server's stderr: a client that waits for its end would wait for the sweeps.
                stderr=subprocess.DEVNULL,
                env=self.env,
                cwd="/",
                start_new_session=True,
                close_fds=True,
            )
        except BaseException:
            os.close(write_fd)
            raise
        finally:
            os.close(read_fd)
        self._write_fd = write_fd

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None


def main(argv: list[str]) -> int:
    """argv: [this script, the plan as JSON] (what Watcher passes)."""
    if len(argv) != 2:
        print("the container watcher is started by coderunner serve, not by hand", file=sys.stderr)
        return 2
    plan = WatchPlan.from_json(argv[1])
    for number in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(number, signal.SIG_IGN)  # a terminal's signals are the server's business
    wait_for_end_of_file(0)  # WAIT_THEN_RUN waited already: at its end at once
    sweep_until_settled(plan)
    if plan.kind == "runsc":
        clear_dir(plan.clear_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
