"""Issue 41, route A measured: a kernel-like child forked from a warm template and entered into its bwrap sandbox,
beside today's cold start in the same sandbox, on real sandboxes of the project's own bwrap backend.

    .venv/bin/python bench/template_fork.py [--runs 20] [--lanes cold,template,template-nofreeze]
    .venv/bin/python bench/template_fork.py --breakdown [--runs 20]   (a whole create, step by step: start_breakdown.py)

Lanes, interleaved in shuffled rounds (a shared machine's load hits all alike):
    cold               today's path: bwrap starts the sandbox's Python, which imports what a kernel with a first
                       chart needs (warm_imports.py's steps, ipykernel) and answers one request
    template           route A: bwrap starts the same sandbox around a placeholder (sleep); a fork of a warm
                       template (gc.freeze()) enters it (sandbox/bwrap_template.py, guest/sandbox_enter.py)
                       and answers the same
    template-nofreeze  the same from a template that did not freeze its GC (livekit's finding: does it matter?)

Every child runs the same probe: one full gc.collect() (a kernel's collections come soon), then it reports what
it is (ids, capabilities, no_new_privs, seccomp, namespaces, /proc, its workspace's token, fds, threads,
random draws) over a unix socket in its own workspace, and waits. The host then reads its memory
(/proc/PID/smaps_rollup: Pss, Private_Dirty) and lets it exit. Figures: wall time from the sandbox's start to
the first answer, CPU-s per start (the host's reaped children: bwrap and all in the sandbox; for the template
lanes also the template's own CPU and its reaped forks), memory per child. --idle N then holds N children of
each lane at once (memory per sandbox when many share the template); --route-b measures only route B's raw
cost. The sandboxes run at cpu weight 100 (--cpu-weight), as the bench's own process does: the server's
default gives them only idle CPU, so on a busy machine they would measure the load. Root only (the template
joins user namespaces), bwrap backend only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import secrets
import shutil
import socket
import statistics
import struct
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from summary import add_summary_argument

#: What every child runs once it is a process of its sandbox (both lanes: the cold one after its imports).
PROBE = r"""
import gc, json, os, random, resource, secrets, socket, sys
gc.collect()
import numpy
fields = {}
for line in open("/proc/self/status"):
    key, _, value = line.partition(":")
    fields[key] = value.strip()
procs = {}
for name in os.listdir("/proc"):
    if name.isdigit():
        try:
            procs[name] = open(f"/proc/{name}/comm").read().strip()
        except OSError:
            pass
own = resource.getrusage(resource.RUSAGE_SELF)
facts = {
    "uid": os.getresuid(), "gid": os.getresgid(), "groups": os.getgroups(),
    **{key: fields[key] for key in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp")},
    "ns": {name: os.readlink(f"/proc/self/ns/{name}") for name in ("pid", "user", "mnt", "net", "ipc", "uts")},
    "pid": os.getpid(), "ppid": os.getppid(), "pid1": procs.get("1"), "procs": procs,
    "sid": os.getsid(0) == os.getpid(),
    "token": open("/workspace/token").read(), "cwd": os.getcwd(), "root": sorted(os.listdir("/"))[:40],
    "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")), "threads": len(os.listdir("/proc/self/task")),
    "random": random.random(), "numpy": float(numpy.random.random()), "secrets": secrets.token_hex(8),
    "cpu_s": own.ru_utime + own.ru_stime, "env": sorted(os.environ), "as": resource.getrlimit(resource.RLIMIT_AS),
    "hostname": os.uname().nodename, "modules": len(sys.modules), "comm": open("/proc/self/comm").read().strip(),
}
sock = socket.socket(socket.AF_UNIX)
sock.connect("/workspace/answer.sock")
sock.sendall(json.dumps(facts).encode())
sock.shutdown(socket.SHUT_WR)
sock.recv(1)
os._exit(0)
"""
#: The cold lane's child first does what the template did once.
COLD = """
from coderunner_guest.caches import seed
seed()
from coderunner_guest.warm_imports import run
run()
import ipykernel.ipkernel, ipykernel.kernelapp
"""
LANES = ("cold", "template", "template-nofreeze")
#: Route B's raw cost (--route-b): a fork that unshares the seven namespaces itself, maps one id, forks into its
#: pid namespace and makes as many read-only binds as bwrap's argv for a kernel has, a /proc, a /tmp and a /dev,
#: then pivots into them. Nothing of a real sandbox (no seccomp, no masks, no init, the id map is its own):
#: only what the kernel charges for the namespaces and mounts a zygote would make, beside bwrap's whole start.
ROUTE_B = r"""
import ctypes, json, os, resource, sys, time
libc = ctypes.CDLL(None, use_errno=True)
def check(result, what):
    if result != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"{what}: {os.strerror(number)}")
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
NAMESPACES = 0x10000000 | 0x00020000 | 0x40000000 | 0x08000000 | 0x04000000 | 0x02000000 | 0x20000000
binds, sources, rounds = int(sys.argv[1]), sys.argv[3:], int(sys.argv[2])
for _ in range(rounds):
    read, write = os.pipe()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    if os.fork() == 0:
        check(libc.unshare(NAMESPACES), "unshare")
        for name, text in (("setgroups", "deny"), ("uid_map", "1000 0 1"), ("gid_map", "1000 0 1")):
            with open(f"/proc/self/{name}", "w") as handle:
                handle.write(text)
        inner = os.fork()
        if inner:
            os._exit(os.waitstatus_to_exitcode(os.waitpid(inner, 0)[1]))
        check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "private")
        check(libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 0, None), "root tmpfs")
        for index in range(binds):
            target = f"/tmp/b{index}"
            os.mkdir(target)
            source = sources[index % len(sources)].encode()
            check(libc.mount(source, target.encode(), None, MS_BIND | MS_REC, None), "bind")
            check(libc.mount(None, target.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY, None), "remount ro")
        for name, kind in (("proc", b"proc"), ("tmp", b"tmpfs"), ("dev", b"tmpfs"), ("oldroot", None)):
            os.mkdir(f"/tmp/{name}")
            if kind is not None:
                check(libc.mount(kind, f"/tmp/{name}".encode(), kind, 0, None), name)
        check(libc.syscall(155, b"/tmp", b"/tmp/oldroot"), "pivot_root")
        os.chdir("/")
        check(libc.umount2(b"/oldroot", 2), "umount old root")
        os.write(write, str(time.perf_counter()).encode())
        os._exit(0)
    os.close(write)
    done = float(os.read(read, 64) or "nan")
    os.close(read)
    os.wait()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    print(json.dumps({"ms": (done - began) * 1000, "cpu_s": cpu}), flush=True)
"""
MIB = 2**20


def smaps(pid: int) -> dict[str, int]:
    """Bytes of each smaps_rollup field."""
    found = {}
    with open(f"/proc/{pid}/smaps_rollup") as handle:
        for line in handle:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                found[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return found


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


async def wait_exit(pid: int, timeout_s: float = 30.0) -> None:
    """Until process `pid` (not ours) has exited."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        with anyio.fail_after(timeout_s):
            await anyio.wait_readable(fd)
    finally:
        os.close(fd)


def same_as_pid1(pid: int, sandbox: Any) -> dict[str, bool]:
    """Whether process `pid` is in each namespace and cgroup of its sandbox's pid 1 (read on the host)."""
    with open(f"/proc/self/fdinfo/{sandbox.hold.init}") as handle:
        init = next(int(line.split()[1]) for line in handle if line.startswith("Pid:"))
    same = {
        name: os.readlink(f"/proc/{pid}/ns/{name}") == os.readlink(f"/proc/{init}/ns/{name}")
        for name in ("user", "mnt", "net", "ipc", "uts", "cgroup", "pid")
    }
    with open(f"/proc/{pid}/cgroup") as mine, open(f"/proc/{init}/cgroup") as theirs:
        same["cgroups"] = mine.read() == theirs.read()
    return same


@dataclass
class Started:
    """A child answering in its sandbox (Bench.start), until Bench.end."""

    lane: str
    dirs: Any
    token: str
    sandbox: Any = None
    listener: socket.socket | None = None
    conn: socket.socket | None = None
    pid: int = 0
    facts: dict[str, Any] = field(default_factory=dict)
    ready_ms: float | None = None
    entered_ms: float | None = None
    answered_ms: float = 0.0


def mem_available() -> int:
    with open("/proc/meminfo") as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith("MemAvailable:"))


def sandbox_pss(started: Started) -> int:
    """Pss of every process in the child's sandbox (its pid namespace's) and of its bwrap outside."""
    namespace = os.readlink(f"/proc/{started.pid}/ns/pid")
    total = smaps(started.sandbox.pid)["Pss"]
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") == namespace:
                    total += smaps(int(entry))["Pss"]
            except OSError:
                pass
    return total


class Bench:
    def __init__(self, runs: int, lanes: list[str], cpu_weight: int) -> None:
        self.runs, self.lanes, self.cpu_weight = runs, lanes, cpu_weight
        self.samples: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.templates: dict[str, Any] = {}

    async def setup(self, tg: Any) -> None:
        from coderunner.config import load_settings
        from coderunner.hostfs.private_dirs import ensure_private_dir
        from coderunner.sandbox import UidPool, make_backend, per_sandbox_uids
        from coderunner.sandbox.bwrap import BwrapBackend
        from coderunner.sandbox.bwrap_template import KernelTemplate
        from coderunner.sessions.leases import SandboxLeases
        from coderunner.sessions.sandbox_options import sandbox_options

        self.root = Path(tempfile.mkdtemp(prefix="crt-", dir="/tmp"))
        os.chmod(self.root, 0o755)
        os.environ.update(
            CODERUNNER_CONFIG=os.devnull,
            CODERUNNER_RUNTIME_DIR=str(self.root / "run"),
            CODERUNNER_WORKSPACES_DIR=str(self.root / "workspaces"),
        )
        self.settings = settings = load_settings()
        backend = make_backend(settings)
        if not isinstance(backend, BwrapBackend):
            raise SystemExit("this bench measures the bwrap backend")
        self.backend = backend
        if backend.cgroups is not None:  # the server's default weight gives sandboxes only idle CPU: it would
            backend.cgroups.cpu_weight = self.cpu_weight  # measure the machine's load, not a start's cost
        ensure_private_dir(settings.runtime_dir, backend.dir_mode)
        ensure_private_dir(settings.workspaces_dir, backend.dir_mode)
        self.leases = SandboxLeases(settings, backend, UidPool() if per_sandbox_uids(settings.sandbox_user) else None)
        self.options = sandbox_options(settings, backend, [])
        self.tg = tg
        for lane in self.lanes:
            if lane.startswith("template"):
                began = time.perf_counter()
                self.templates[lane] = await KernelTemplate.start(
                    backend.command, backend.seccomp_filter, freeze=lane == "template", child_code=PROBE
                )
                took = time.perf_counter() - began
                print(f"{lane}: template pid {self.templates[lane].pid} warm in {took:.1f} s, "
                      f"{self.templates[lane].ready.threads} thread(s) at its first fork")  # fmt: skip

    async def close(self) -> None:
        for template in self.templates.values():
            await template.close()
        shutil.rmtree(self.root, ignore_errors=True)

    async def start(self, lane: str) -> Started:
        """A child of `lane` in a sandbox of its own, once it answered (it then waits for `end`)."""
        from coderunner.sandbox.bwrap_template import PLACEHOLDER
        from coderunner.sandbox.common import product_python
        from coderunner.sessions.leases import sandbox_spec

        dirs = await self.leases.open_dirs(self.options, throwaway=True)
        started = Started(lane, dirs, token=secrets.token_hex(16))
        try:
            spec = sandbox_spec(self.options, dirs, (), self.settings.network_ceiling)
            (dirs.workspace.path / "token").write_text(started.token)
            os.chmod(dirs.workspace.path / "token", 0o644)
            listener = socket.socket(socket.AF_UNIX)
            started.listener = listener
            listener.bind(str(dirs.workspace.path / "answer.sock"))
            os.chmod(dirs.workspace.path / "answer.sock", 0o666)
            listener.listen(1)
            listener.setblocking(False)
            template = self.templates.get(lane)
            began = time.perf_counter()
            if template is None:
                argv = product_python(self.backend.python, "-c", COLD + PROBE)
                started.sandbox = await self.backend.spawn(spec, argv, self.tg)
            else:  # template.spawn_entered, in its phases: the sandbox finished, then the fork entered
                started.sandbox = await self.backend.spawn(spec, PLACEHOLDER, self.tg, pipes=True)
                with anyio.fail_after(30):
                    said = await started.sandbox.streams[1].receive()
                if not said.startswith(b"ready"):
                    raise RuntimeError(f"the placeholder said {said!r}")
                started.ready_ms = (time.perf_counter() - began) * 1000
                answer = await template.finish_fork(await template.begin_fork(started.sandbox, spec, 2))
                if answer.pidfd is not None:
                    os.close(answer.pidfd)
                started.entered_ms = (time.perf_counter() - began) * 1000 - started.ready_ms
            with anyio.fail_after(300):
                await anyio.wait_readable(listener)
            conn, _ = listener.accept()
            started.conn = conn
            conn.setblocking(True)
            started.pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
            data = b""
            while chunk := await anyio.to_thread.run_sync(conn.recv, 65536):
                data += chunk
            started.answered_ms = (time.perf_counter() - began) * 1000
            started.facts = json.loads(data)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.end(started)
            raise
        return started

    async def end(self, started: Started) -> None:
        """Let the child exit, then end its sandbox and remove its dirs."""
        try:
            if started.conn is not None:
                started.conn.send(b"x")
                started.conn.close()
                await wait_exit(started.pid)
                if started.lane not in self.templates and started.sandbox is not None:
                    with anyio.fail_after(30):
                        await started.sandbox.wait()
        finally:
            if started.sandbox is not None:
                await started.sandbox.kill()
            if started.listener is not None:
                started.listener.close()
            await self.leases.close_dirs(started.dirs)

    async def one(self, lane: str) -> dict[str, Any]:
        """One start in `lane`, to its answer and its end; its figures and what the child said."""
        template = self.templates.get(lane)
        before_host = children_cpu()
        before_template = await template.counters() if template else None
        started = await self.start(lane)
        try:
            memory = smaps(started.pid)
            same = same_as_pid1(started.pid, started.sandbox)
        finally:
            await self.end(started)
        cpu = children_cpu() - before_host
        if template is not None and before_template is not None:
            after = await template.counters()
            cpu += (
                after.cpu_us + after.children_cpu_us - before_template.cpu_us - before_template.children_cpu_us
            ) / 1e6
        facts = started.facts
        return {"ms": started.answered_ms, "ready_ms": started.ready_ms, "entered_ms": started.entered_ms,
                "cpu_s": cpu, "memory": memory, "facts": facts, "token_ok": facts["token"] == started.token,
                "host_pid": started.pid, "same": same}  # fmt: skip

    async def idle(self, lane: str, count: int) -> None:
        """`count` children of `lane` alive at once: memory per child (MemAvailable, Pss of each sandbox's
        processes, the kernel's Private_Dirty), beside the template's own."""
        held: list[Started] = []
        template = self.templates.get(lane)
        await anyio.sleep(1)
        available = mem_available()
        template_pss = smaps(template.pid)["Pss"] if template else 0
        try:
            for _ in range(count):
                held.append(await self.start(lane))
            await anyio.sleep(2)
            used = available - mem_available()
            sandboxes = [sandbox_pss(started) for started in held]
            dirty = [smaps(started.pid)["Private_Dirty"] for started in held]
            kernels = [smaps(started.pid)["Pss"] for started in held]
            template_now = smaps(template.pid)["Pss"] if template else 0
        finally:
            for started in held:
                with anyio.CancelScope(shield=True):
                    await self.end(started)
        print(
            f"{lane:18} {count:3} alive: MemAvailable {-used / count / MIB:+6.1f} MiB each; a sandbox's processes "
            f"Pss {statistics.mean(sandboxes) / MIB:6.1f} MiB (its kernel {statistics.mean(kernels) / MIB:5.1f}, "
            f"Private_Dirty {statistics.mean(dirty) / MIB:5.1f}); the template's Pss {template_pss / MIB:.1f} -> "
            f"{template_now / MIB:.1f} MiB; loadavg {os.getloadavg()[0]:.2f}"
        )

    async def run(self) -> None:
        for lane in self.lanes:  # one of each first: caches of the machine warm for every lane alike
            await self.one(lane)
        for _ in range(self.runs):
            order = list(self.lanes)
            random.shuffle(order)
            for lane in order:
                self.samples[lane].append(await self.one(lane))


def pct(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(len(ordered) * share), len(ordered) - 1)]


def checks(bench: Bench, lane: str, sample: dict[str, Any]) -> dict[str, bool]:
    """Each property the issue asks of a child, true or false for this one."""
    facts = sample["facts"]
    zero = "0000000000000000"
    template = bench.templates.get(lane)
    template_pidns = os.readlink(f"/proc/{template.pid}/ns/pid") if template else None
    return {
        "uid/gid 1000": facts["uid"] == [1000] * 3 and facts["gid"] == [1000] * 3,
        "no groups": facts["groups"] in ([], [1000]),
        "caps 0 (eff,prm,inh,amb,bnd)": all(
            facts[key] == zero for key in ("CapEff", "CapPrm", "CapInh", "CapAmb", "CapBnd")
        ),
        "NoNewPrivs=1": facts["NoNewPrivs"] == "1",
        "Seccomp=2": facts["Seccomp"] == "2",
        "pid 1 is sandbox-init": facts["pid1"] == "sandbox-init",
        "own pid ns (not the template's)": facts["ns"]["pid"] != (template_pidns or os.readlink("/proc/self/ns/pid")),
        "own workspace (token)": sample["token_ok"],
        "template not in /proc": "kernel-template" not in facts["procs"].values()
        and (template is None or str(template.pid) not in facts["procs"]),
        "fds 0-2 only (+ the listing's)": len([fd for fd in facts["fds"] if fd > 2]) <= 1,
        "new session": facts["sid"],
        "cwd /workspace": facts["cwd"] == "/workspace",
        "hostname sandbox": facts["hostname"] == "sandbox",
        **{f"pid 1's {name}": same for name, same in sample["same"].items()},
    }


def report(bench: Bench, load_before: tuple[float, ...]) -> None:
    print(f"\nloadavg before {' '.join(f'{x:.2f}' for x in load_before)}, after "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; {bench.runs} starts per lane, interleaved\n")  # fmt: skip
    header = (
        f"{'lane':18} {'p50 ms':>8} {'p90 ms':>8} {'ready p50':>9} {'fork p50':>9} {'CPU-s p50':>9} {'CPU-s mean':>10} "
    )
    header += f"{'Pss MiB':>8} {'PrivDirty':>9} {'Rss MiB':>8} {'child CPU-s':>11}"
    print(header)
    nan = float("nan")
    for lane in bench.lanes:
        rows = bench.samples[lane]
        ms = [row["ms"] for row in rows]
        entered = [row["entered_ms"] for row in rows if row["entered_ms"] is not None]
        ready = [row["ready_ms"] for row in rows if row["ready_ms"] is not None]
        cpu = [row["cpu_s"] for row in rows]
        pss = [row["memory"]["Pss"] / MIB for row in rows]
        dirty = [row["memory"]["Private_Dirty"] / MIB for row in rows]
        rss = [row["memory"]["Rss"] / MIB for row in rows]
        own = [row["facts"]["cpu_s"] for row in rows]
        print(
            f"{lane:18} {pct(ms, 0.5):8.1f} {pct(ms, 0.9):8.1f} {pct(ready, 0.5) if ready else nan:9.1f} "
            f"{pct(entered, 0.5) if entered else nan:9.1f} "
            f"{pct(cpu, 0.5):9.3f} {statistics.mean(cpu):10.3f} {pct(pss, 0.5):8.1f} {pct(dirty, 0.5):9.1f} "
            f"{pct(rss, 0.5):8.1f} {pct(own, 0.5):11.3f}"
        )
    for lane, template in bench.templates.items():
        memory = smaps(template.pid)
        tasks = len(os.listdir(f"/proc/{template.pid}/task"))
        print(f"{lane}: the template itself Rss {memory['Rss'] / MIB:.1f} MiB, Pss {memory['Pss'] / MIB:.1f} MiB, "
              f"{tasks} task(s)")  # fmt: skip
    print("\nchecks (children passing / children):")
    names: list[str] = []
    passed: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for lane in bench.lanes:
        for sample in bench.samples[lane]:
            for name, ok in checks(bench, lane, sample).items():
                if name not in names:
                    names.append(name)
                passed[lane][name] += ok
    print(f"{'':34}" + "".join(f"{lane:>19}" for lane in bench.lanes))
    for name in names:
        print(f"{name:34}" + "".join(f"{passed[lane][name]:>15}/{len(bench.samples[lane]):<3}" for lane in bench.lanes))
    for lane in bench.lanes:
        rows = [row["facts"] for row in bench.samples[lane]]
        distinct = {key: len({json.dumps(row[key]) for row in rows}) for key in ("random", "numpy", "secrets")}
        first = rows[0]
        print(f"{lane}: distinct draws over {len(rows)} children {distinct}; pid {first['pid']} ppid {first['ppid']}; "
              f"threads {first['threads']}; fds {first['fds']}; comm {first['comm']}; RLIMIT_AS {first['as']}; "
              f"modules {first['modules']}; /proc pids {sorted(first['procs'].items())}")  # fmt: skip
    envs = {lane: bench.samples[lane][0]["facts"]["env"] for lane in bench.lanes}
    names_seen = [set(env) for env in envs.values()]
    print("environment names not in every lane:", sorted(set.union(*names_seen) - set.intersection(*names_seen)))


async def route_b(runs: int) -> None:
    """Route B's raw cost, as many mounts as a kernel's bwrap argv has (ROUTE_B), beside a bare bwrap start."""
    from coderunner.config import load_settings
    from coderunner.sandbox import make_backend
    from coderunner.sandbox.base import SandboxSpec
    from coderunner.sandbox.bwrap import BwrapBackend

    settings = load_settings(Path(os.devnull))
    backend = make_backend(settings)
    assert isinstance(backend, BwrapBackend)
    here = Path("/tmp")
    argv = backend.command.argv(
        SandboxSpec(name="b", workspace=here, runtime_dir=here, host_dir=here), ["true"], gate_fd=3
    )
    binds = sum(argv.count(flag) for flag in ("--ro-bind", "--bind", "--ro-bind-data"))  # /proc, /tmp, /dev: below
    sources = ["/usr", str(settings.sandbox_env), "/etc/ssl/certs", "/etc/fonts"]
    load = os.getloadavg()
    result = await anyio.run_process(["/usr/bin/python3", "-I", "-c", ROUTE_B, str(binds), str(runs), *sources])
    rows = [json.loads(line) for line in result.stdout.decode().splitlines()]
    ms, cpu = [row["ms"] for row in rows], [row["cpu_s"] for row in rows]
    figures = f"p50 {pct(ms, 0.5):.1f} ms, p90 {pct(ms, 0.9):.1f} ms, CPU-s p50 {pct(cpu, 0.5):.4f} over {len(rows)}"
    print(f"route B raw ({binds} read-only binds + proc, tmp, dev, pivot_root), loadavg {load[0]:.2f}: {figures}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--lanes", default=",".join(LANES))
    parser.add_argument("--route-b", action="store_true", help="only route B's raw cost (see ROUTE_B)")
    parser.add_argument("--cpu-weight", type=int, default=100, help="the sandboxes' cpu weight (100: neutral)")
    parser.add_argument("--idle", type=int, default=0, help="then this many children of each lane alive at once")
    parser.add_argument("--breakdown", action="store_true", help="only a create's steps (bench/start_breakdown.py)")
    parser.add_argument("--baseline-guest", type=Path, help="--breakdown: also a template lane of this guest dir")
    parser.add_argument("--burst", type=int, default=0, help="--breakdown: then this many creates at once, each lane")
    parser.add_argument(
        "--baseline-python-init", action="store_true", help="--breakdown: a before lane with the Python pid 1"
    )
    add_summary_argument(parser)
    args = parser.parse_args()
    if args.breakdown:
        from start_breakdown import breakdown

        await breakdown(
            args.runs, args.cpu_weight, args.baseline_guest, args.burst, args.summary, args.baseline_python_init
        )
        return
    if args.route_b:
        await route_b(args.runs)
        return
    lanes = [lane for lane in args.lanes.split(",") if lane]
    if unknown := set(lanes) - set(LANES):
        raise SystemExit(f"unknown lanes: {sorted(unknown)}")
    bench = Bench(args.runs, lanes, args.cpu_weight)
    load_before = os.getloadavg()
    async with anyio.create_task_group() as tg:
        try:
            await bench.setup(tg)
            if args.runs:
                await bench.run()
                report(bench, load_before)
            for lane in lanes if args.idle else ():
                await bench.idle(lane, args.idle)
        finally:
            with anyio.CancelScope(shield=True):
                await bench.close()
        tg.cancel_scope.cancel()


if __name__ == "__main__":
    anyio.run(main)
