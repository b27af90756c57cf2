"""Where a session's create spends its time and CPU, step by step, template beside cold (issue 41, step 3).

    .venv/bin/python bench/template_fork.py --breakdown [--runs 20] [--cpu-weight 100] [--baseline-guest DIR]
        [--baseline-python-init] [--burst 100] [--summary PATH]

Two SessionManagers in this process on the bwrap backend, one with kernel_template on and one off (both
pool_size 0 and no reset standby: every create is a real start, nothing started ahead beside it); with
--baseline-guest, a third lane ("template before") whose template and sandboxes run another tree's guest
(e.g. /tmp/main/src/coderunner/guest from `git archive main`): before and after in one run; with
--baseline-python-init, that lane's sandboxes have the Python pid 1 (compiled_init false; with our guest unless
--baseline-guest says another). Their creates
alternate in shuffled rounds, each to the first `1+1` result, then the session is closed. Each step is timed by
wrapping the method that does it (nothing in src changes for this):

    dirs+workspace   SandboxLeases.lease: the session's dirs, its host uid, its workspace (near 0 when it takes
                     the dirs made ahead)
      workspace      Workspace.create (a capped one: an image, mkfs.ext4 and a loop mount), on the create's path
                     or, for the dirs made ahead, beside it (the refill the take started)
    mounts           SandboxLease.mount: the mount plan and outbox (a thread)
    cgroup           BwrapBackend._cgroup_for: mkdir and limits in cgroupfs (a thread)
    argv             BwrapCommand.argv: building bwrap's argv
    exec bwrap       BwrapBackend.start less the above and _hold: memfds, pipes, fork+exec of the prelude
    bwrap setup      BwrapBackend._hold: until bwrap built the namespaces and reported its child (the init
                     waits at the gate then)
    fork             template only: KernelTemplate.begin_fork (the template's fork into the sandbox's pid
                     namespace, made as soon as bwrap made its pid 1; the fork joins the cgroups and waits)
    placeholder      template only: the rest of the wait for the placeholder's "ready" (bwrap's mounts, pivot,
                     the init's Python, the shell), which the fork above overlapped
    enter            template only: KernelTemplate.finish_fork ("go": setns, confine, the report; the fork's
                     check that the template's imports are current in its sandbox comes after it, in kernel boot)
    kernel boot      KernelProcess.claim_sockets: until the kernel bound its sockets (the cold one imports all)
    handshake        KernelClient.connect: connect and the IOPub welcome
    server rest      the create's time outside every step above (its own steps: options, egress, bookkeeping)
    first result     session.run('1+1')

CPU per start, to the first result: the server process (all its threads, getrusage SELF), the helpers it ran and
reaped meanwhile (mkfs, mount: getrusage CHILDREN), the sandbox's processes
(bwrap and every process below it, a forked kernel too, each with what it reaped: /proc, its threads' schedstat
in ns), and the template's own
(its counters; its forks are the sandbox's; "cpu forked": the forked kernel's share of the sandbox's).
Root only (the template joins user namespaces).
"""

from __future__ import annotations

import functools
import os
import random
import resource
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

#: With --summary: new sessions per lane whose first cell is a chart.
CHART_ROUNDS = 6
#: Steps in the order a create meets them (the report's columns).
STEPS = (
    "dirs+workspace", "  workspace", "mounts", "cgroup", "argv", "exec bwrap", "bwrap setup", "fork", "placeholder",
    "enter",
    "kernel boot", "handshake", "server rest", "create", "first result",
)  # fmt: skip
LANES = ("cold", "template")
BEFORE = "template before"


class Clock:
    """The steps of the create under way (one at a time): each wrapped call adds its seconds to its step."""

    def __init__(self) -> None:
        self.steps: dict[str, float] = defaultdict(float)

    def wrap_async(self, owner: type, name: str, step: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        async def timed(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return await original(*args, **kwargs)
            finally:
                self.steps[step] += time.perf_counter() - began

        setattr(owner, name, timed)

    def _timed(self, original: Callable[..., Any], step: str) -> Callable[..., Any]:
        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.steps[step] += time.perf_counter() - began

        return timed

    def wrap_sync(self, owner: type, name: str, step: str) -> None:
        setattr(owner, name, self._timed(getattr(owner, name), step))

    def wrap_class(self, owner: type, name: str, step: str) -> None:
        # getattr gives the classmethod bound to `owner`: kept bound as a staticmethod.
        setattr(owner, name, staticmethod(self._timed(getattr(owner, name), step)))

    def install(self) -> None:
        from coderunner.hostfs.workspaces import Workspace
        from coderunner.kernel.client import KernelClient
        from coderunner.kernel.process import KernelProcess
        from coderunner.sandbox.bwrap import BwrapBackend
        from coderunner.sandbox.bwrap_argv import BwrapCommand
        from coderunner.sandbox.bwrap_template import KernelTemplate
        from coderunner.sessions.leases import SandboxLease, SandboxLeases

        self.wrap_async(SandboxLeases, "lease", "dirs+workspace")
        self.wrap_class(Workspace, "create", "_workspace")
        self.wrap_async(SandboxLease, "mount", "mounts")
        self.wrap_sync(BwrapBackend, "_cgroup_for", "cgroup")
        self.wrap_sync(BwrapCommand, "argv", "argv")
        self.wrap_async(BwrapBackend, "start", "_start")
        self.wrap_async(BwrapBackend, "_hold", "bwrap setup")
        self.wrap_async(KernelTemplate, "spawn_entered", "_entered")
        self.wrap_async(KernelTemplate, "begin_fork", "fork")
        self.wrap_async(KernelTemplate, "finish_fork", "enter")
        self.wrap_async(KernelProcess, "claim_sockets", "kernel boot")
        self.wrap_async(KernelClient, "connect", "handshake")

    def take(self, create_s: float, first_s: float) -> dict[str, float]:
        """This create's steps in ms (the derived ones computed), and the clock cleared for the next."""
        steps, self.steps = self.steps, defaultdict(float)
        start = steps.pop("_start", 0.0)
        entered = steps.pop("_entered", 0.0)
        steps["exec bwrap"] = start - steps["bwrap setup"] - steps["cgroup"] - steps["argv"]
        if entered:
            steps["placeholder"] = entered - start - steps["fork"] - steps["enter"]
        steps["  workspace"] = steps.pop("_workspace", 0.0)
        known = sum(value for key, value in steps.items() if key != "  workspace")
        steps["server rest"] = create_s - known
        steps["create"], steps["first result"] = create_s, first_s
        return {key: value * 1000 for key, value in steps.items()}


def own_cpu() -> float:
    """CPU-s of this process (the server: every thread of it)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    return me.ru_utime + me.ru_stime


def helpers_cpu() -> float:
    """CPU-s of this process's reaped children: before a close, the helpers a create ran (mkfs, mount)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return children.ru_utime + children.ru_stime


def tree_cpu(pid: int) -> float:
    """CPU-s of `pid` and every process below it, with what each reaped of its own children.

    A process's own CPU is the sum of its threads' schedstat (nanoseconds), or its /proc stat figure where that
    is more (it counts threads that ended too, but in clock ticks, 10 ms each: too coarse for a start of tens
    of ms); what it reaped is in ticks only."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            with open(f"/proc/{current}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            own_ticks, reaped_ticks = int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14])
            threads_ns = 0
            for tid in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{tid}/schedstat") as handle:
                    threads_ns += int(handle.read().split()[0])
                with open(f"/proc/{current}/task/{tid}/children") as handle:
                    todo += [int(child) for child in handle.read().split()]
            total += max(threads_ns / 1e9, own_ticks / tick) + reaped_ticks / tick
        except (OSError, ValueError, IndexError):
            continue
    return total


async def template_cpu(manager: Any) -> float:
    """The template's own CPU-s so far (not its forks': those are the sandbox's)."""
    starter = manager.template
    template = getattr(starter, "template", None) if starter is not None else None
    if template is None:
        return 0.0
    said = await template.counters()
    return said.cpu_us / 1e6


async def one(manager: Any, clock: Clock) -> dict[str, float]:
    """One create to its first result, then its close: the steps in ms and the CPU-ms by whom."""
    template0 = await template_cpu(manager)  # first: asking the template is the bench's work, not the server's
    server0, helpers0 = own_cpu(), helpers_cpu()
    began = time.perf_counter()
    session = await manager.create()
    created = time.perf_counter()
    result = await session.run("1+1", 60, None)
    first = time.perf_counter()
    server1, helpers1 = own_cpu(), helpers_cpu()
    if "2" not in "".join(result.outcome.output.head) and "2" not in str(result):
        raise RuntimeError(f"1+1 gave {result!r}")
    steps = clock.take(created - began, first - created)
    kernel = session.kernel
    assert kernel is not None and kernel.process is not None
    sandbox = tree_cpu(kernel.process.pid)  # bwrap and all below it: its init, and a cold kernel
    forked = 0.0
    if kernel.sandbox.from_template and kernel.process.program_pid:
        forked = tree_cpu(kernel.process.program_pid)  # a forked kernel is the template's child
    template1 = await template_cpu(manager)
    await manager.close(session.session_id)
    steps["cpu server"] = (server1 - server0) * 1000
    steps["cpu helpers"] = (helpers1 - helpers0) * 1000
    steps["cpu sandbox"] = (sandbox + forked) * 1000
    steps["cpu forked"] = forked * 1000
    steps["cpu template"] = (template1 - template0) * 1000
    steps["cpu total"] = steps["cpu server"] + steps["cpu helpers"] + steps["cpu sandbox"] + steps["cpu template"]
    steps["how"] = 1.0 if kernel.sandbox.from_template else 0.0
    return steps


def pct(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(len(ordered) * share), len(ordered) - 1)] if ordered else float("nan")


def report(samples: dict[str, list[dict[str, float]]], lanes: list[str], load_before: tuple[float, ...]) -> None:
    print(f"\nloadavg before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}; ms p50 (p90) per step, "
          f"{len(samples['cold'])} creates per lane, interleaved\n")  # fmt: skip
    print(f"{'step':16}" + "".join(f"{lane:>22}" for lane in lanes))
    for step in (*STEPS, "cpu server", "cpu helpers", "cpu sandbox", "cpu forked", "cpu template", "cpu total"):
        cells = []
        for lane in lanes:
            values = [row.get(step, 0.0) for row in samples[lane]]
            cells.append(f"{pct(values, 0.5):10.1f} ({pct(values, 0.9):7.1f})   ")
        unit = " CPU-ms" if step.startswith("cpu") else ""
        print(f"{step + unit:16}" + "".join(f"{cell:>22}" for cell in cells))
    for lane in lanes[1:]:
        forked = [row["how"] for row in samples[lane]]
        print(f"\n{lane} lane: {int(sum(forked))}/{len(forked)} kernels forked from the template", end="")
    mean = {lane: statistics.mean(row["create"] + row["first result"] for row in samples[lane]) for lane in lanes}
    print()
    print("mean create+first result ms: " + ", ".join(f"{lane} {value:.1f}" for lane, value in mean.items()))


def mem_available_mib() -> float:
    """The host's MemAvailable once the page cache was written back and dropped: what the sessions hold themselves
    (their processes, page tables, tmpfs), not what their workspace images' metadata left cached meanwhile (the
    undropped figure moved by several MiB a session between runs)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as handle:
        handle.write("3")
    with open("/proc/meminfo") as handle:
        return next(int(line.split()[1]) / 1024 for line in handle if line.startswith("MemAvailable:"))


async def burst(manager: Any, count: int, settle_s: float = 3.0) -> dict[str, float]:
    """`count` creates at once, each to its first `1+1`: seconds until all answered; then, all held idle for
    `settle_s`, the host's MemAvailable drop per session; then all closed."""
    before = mem_available_mib()
    sessions: list[Any] = []
    failures: list[str] = []

    async def one_session() -> None:
        try:
            session = await manager.create()
            sessions.append(session)
            result = await session.run("1+1", 120, None)
            if "2" not in "".join(result.outcome.output.head):
                failures.append(f"1+1 gave {result!r}")
        except Exception as exc:  # counted and reported: a burst figure needs all answered
            failures.append(repr(exc))

    began = time.perf_counter()
    with anyio.fail_after(600):
        async with anyio.create_task_group() as group:
            for _ in range(count):
                group.start_soon(one_session)
    answered_s = time.perf_counter() - began
    await anyio.sleep(settle_s)
    held = len(sessions)
    per_session = (before - mem_available_mib()) / max(held, 1)
    with anyio.fail_after(300):
        async with anyio.create_task_group() as group:
            for session in sessions:
                group.start_soon(manager.close, session.session_id)
    if failures:
        print(f"   {len(failures)} of {count} failed, first: {failures[0]}")
    return {"answered_s": answered_s, "mib_per_session": per_session, "answered": count - len(failures)}


#: A new session's first chart, as bench/first_cells.py draws it: pyplot imported, a line drawn, shown (a PNG).
CHART = "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [4, 1, 2])\nplt.title('chart')\nplt.show()"


async def first_chart(manager: Any) -> tuple[float, float]:
    """A new session's first cell is a chart: its ms, then the same cell again in it (warm) in ms."""
    session = await manager.create()
    try:
        times = []
        for _ in range(2):
            began = time.perf_counter()
            result = await session.run(CHART, 120, None)
            times.append((time.perf_counter() - began) * 1000)
            if not result.outcome.output.images:
                raise RuntimeError(f"the chart cell gave no image: {result!r}")
        return times[0], times[1]
    finally:
        await manager.close(session.session_id)


def write_figures(path: Path | None, samples: dict[str, list[dict[str, float]]], bursts: dict[str, dict[str, float]],
                  count: int, charts: dict[str, list[tuple[float, float]]]) -> None:  # fmt: skip
    """The issue's targets (41) for bench/suite.py: the template lane beside the cold one of the same run."""
    from summary import Figure, write_summary

    def p50(lane: str, key: str) -> float:
        return pct([row[key] for row in samples[lane]], 0.5)

    first = {lane: pct([row["create"] + row["first result"] for row in samples[lane]], 0.5) for lane in LANES}
    figures = [
        Figure("session create to first 1+1, p50 (kernel template)", first["template"], "ms", first["cold"],
               "template off", "<= 60 ms", first["template"] <= 60),
        Figure("CPU per started session (kernel template)", p50("template", "cpu total"), "CPU-ms",
               p50("cold", "cpu total"), "template off", "<= 50 CPU-ms", p50("template", "cpu total") <= 50),
    ]  # fmt: skip
    first_charts = {lane: pct([first for first, _ in charts[lane]], 0.5) for lane in charts}
    warm_charts = {lane: pct([warm for _, warm in charts[lane]], 0.5) for lane in charts}
    if charts:
        ratio = first_charts["template"] / warm_charts["template"]
        figures.append(Figure("a new session's first chart cell, p50 (kernel template)", first_charts["template"], "ms",
                              warm_charts["template"], "the same cell warm", "<= 1.5x", ratio <= 1.5,
                              notes=f"template off: {first_charts['cold']:.0f} ms"))  # fmt: skip
    if bursts:
        template, cold = bursts["template"], bursts["cold"]
        all_answered = template["answered"] == count
        figures += [
            Figure(f"{count} sessions at once, all answered (kernel template)", template["answered_s"], "s",
                   cold["answered_s"], "template off", "<= 5 s" if count == 100 else "",
                   (all_answered and template["answered_s"] <= 5) if count == 100 else None,
                   notes=f"{int(template['answered'])} of {count} answered"),
            Figure(f"idle memory per session, {count} held (kernel template)", template["mib_per_session"], "MiB",
                   cold["mib_per_session"], "template off", "<= 20 MiB" if count >= 100 else "",
                   template["mib_per_session"] <= 20 if count >= 100 else None, notes="host MemAvailable drop"),
        ]  # fmt: skip
    write_summary(path, "template_fork.py --breakdown", figures)


async def breakdown(
    runs: int,
    cpu_weight: int,
    baseline_guest: Path | None = None,
    burst_count: int = 0,
    summary: Path | None = None,
    baseline_python_init: bool = False,
) -> None:
    from coderunner.config import load_settings
    from coderunner.sandbox import bwrap, make_backend
    from coderunner.sandbox.bwrap import BwrapBackend
    from coderunner.sessions.manager import SessionManager

    if os.getuid() != 0:
        raise SystemExit("the kernel template needs root")
    root = Path(tempfile.mkdtemp(prefix="crbd-", dir="/tmp"))
    os.chmod(root, 0o755)
    clock = Clock()
    clock.install()
    managers: dict[str, Any] = {}
    samples: dict[str, list[dict[str, float]]] = defaultdict(list)
    load_before = os.getloadavg()
    async with anyio.create_task_group():
        import contextlib

        async with contextlib.AsyncExitStack() as stack:
            before = baseline_guest is not None or baseline_python_init
            lanes = [*LANES, *([BEFORE] if before else [])]
            for lane in lanes:
                os.environ.update(
                    CODERUNNER_CONFIG=os.devnull,
                    CODERUNNER_RUNTIME_DIR=str(root / lane / "run"),
                    CODERUNNER_WORKSPACES_DIR=str(root / lane / "workspaces"),
                )
                settings = load_settings().model_copy(
                    update={"pool_size": 0, "reset_standby": False, "kernel_template": lane != "cold",
                            "max_sessions": max(16, burst_count + 4),
                            "compiled_init": not (lane == BEFORE and baseline_python_init)}
                )  # fmt: skip
                ours = bwrap.GUEST_SOURCE
                bwrap.GUEST_SOURCE = baseline_guest if lane == BEFORE and baseline_guest is not None else ours
                try:
                    backend = make_backend(settings)  # installs its guest (from GUEST_SOURCE) under its runtime dir
                finally:
                    bwrap.GUEST_SOURCE = ours
                assert isinstance(backend, BwrapBackend)
                if backend.cgroups is not None:  # neutral weight: measure a start, not the machine's load
                    backend.cgroups.cpu_weight = cpu_weight
                managers[lane] = await stack.enter_async_context(SessionManager(settings, backend))
            with anyio.fail_after(300):
                while any(managers[lane].template.template is None for lane in lanes[1:]):
                    await anyio.sleep(0.2)
            for lane in lanes:  # one each first, not counted: the machine's caches warm alike
                await one(managers[lane], clock)
            for _ in range(runs):
                order = list(lanes)
                random.shuffle(order)
                for lane in order:
                    samples[lane].append(await one(managers[lane], clock))
            charts: dict[str, list[tuple[float, float]]] = defaultdict(list)
            for _ in range(CHART_ROUNDS if summary is not None else 0):
                for lane in random.sample(LANES, len(LANES)):
                    charts[lane].append(await first_chart(managers[lane]))
            bursts: dict[str, dict[str, float]] = {}
            for lane in random.sample(lanes, len(lanes)) if burst_count else ():  # the before lane too: same run
                await anyio.sleep(5)  # the last lane's closes settled
                bursts[lane] = await burst(managers[lane], burst_count)
    shutil.rmtree(root, ignore_errors=True)
    report(samples, lanes, load_before)
    for lane, figures in bursts.items():
        print(f"{lane}: {burst_count} sessions at once, {int(figures['answered'])} answered in "
              f"{figures['answered_s']:.1f} s; held idle, MemAvailable drop {figures['mib_per_session']:.1f} MiB "
              "per session")  # fmt: skip
    for lane, pairs in charts.items():
        print(f"{lane}: a new session's first chart p50 {pct([a for a, _ in pairs], 0.5):.0f} ms, the same cell warm "
              f"{pct([b for _, b in pairs], 0.5):.0f} ms ({len(pairs)} sessions)")  # fmt: skip
    write_figures(summary, samples, bursts, burst_count, charts)
