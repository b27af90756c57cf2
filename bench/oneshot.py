"""execute_code round trip per language beside the same program as a plain host subprocess.

    .venv/bin/python bench/oneshot.py [--runs 20] [--phases [--cold]] [--before SRC] [--gap-ms MS]
                                      [--cpu-weight N] [--summary PATH]

Both sides run a trivial program (print one line): CodeRunner through the official MCP client over
stdio (a fresh throwaway sandbox per call: dirs, bwrap, seccomp, cgroups, the interpreter,
teardown); the baseline as an unsandboxed subprocess of the same interpreter, timed in the same
run. Lanes are interleaved in shuffled rounds, so that the load of a shared machine hits all of
them alike; the ratio (and the difference) is the price of the sandbox for a one-shot run.
The servers' lanes: "ours" is this tree as a user gets it (oneshot_ready: the next run's sandbox
started ahead), "cold" the same with oneshot_ready off (each run starts its own sandbox);
--before SRC adds "before": a server running the package found in SRC (e.g. an older commit's
src/, from `git archive COMMIT src | tar -x -C DIR`), so before and after share a run.
A sandbox started ahead needs time between calls to start the next one: --gap-ms (default
200 ms) pauses before every call of every lane alike, an agent's time between tool calls.
The sandboxes run at cpu weight 100 here (--cpu-weight), as the plain programs do: the server's
default (session_cpu_weight 20) gives them only idle CPU, so on a busy machine they would
measure the load, which is its purpose, not a run's cost. The foot of the table says what each
server reports of its sandboxes started ahead (get_capabilities): how many runs took one.

--phases runs the same one-shots in this process (no MCP, no server) and prints where each
run's time goes, phase by phase, beside the plain subprocess and the sandbox's layers started
by hand (bwrap alone; bwrap in the run's cgroups), all interleaved in the same rounds; --cold
there starts each run's sandbox on its path (oneshot_ready off), --cpu-weight sets the sandboxes'
weight (default: the setting):

    dirs     the host dirs and the workspace (a size-capped tmpfs; was a loop-mounted image)
    mounts   configured mounts and the export outbox
    inputs   the source (and variables) written where the sandbox reads them
    spawn    cgroups made, the seccomp filter handed over, the process started
    program  cgroup entry, setpriv, bwrap, prlimit, the launcher if any, the program, its exit
    reap     the sandbox killed and reaped, its cgroups removed
    export   the outbox copied to the client's export folder
    close    the mounts released, the dirs and workspace removed (after the reply: only handed over here)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
from latency import _passable, server_params
from mcp import Client, StdioServerParameters
from summary import Figure, add_summary_argument, write_summary

from coderunner.config import load_settings

PROGRAMS = {
    "python": "print('hi')",
    "javascript": "console.log('hi')",
    "bash": "echo hi",
}
#: Pause before each call: an agent's time between tool calls, in which the next sandbox starts.
GAP_MS = 200.0
PHASES = ("dirs", "mounts", "inputs", "spawn", "program", "reap", "export", "close")


def baseline_argv(language: str, python: Path) -> list[str]:
    if language == "python":
        return [str(python), "-c", PROGRAMS[language]]
    if language == "javascript":
        return ["/usr/bin/node", "-e", PROGRAMS[language]]
    return ["/bin/bash", "-c", PROGRAMS[language]]


async def plain(argv: list[str]) -> None:
    await anyio.run_process(argv, check=True)


async def interleaved(
    rounds: int, lanes: dict[str, Callable[[], Awaitable[None]]], gap_ms: float = 0.0
) -> dict[str, list[float]]:
    """Each lane once per round, in a fresh random order each round; ms per call. `gap_ms` between
    calls stands for an agent's time between tool calls (a sandbox started ahead has that time)."""
    samples: dict[str, list[float]] = defaultdict(list)
    for _ in range(rounds):
        order = list(lanes)
        random.shuffle(order)
        for name in order:
            await anyio.sleep(gap_ms / 1000)
            began = time.perf_counter()
            await lanes[name]()
            samples[name].append((time.perf_counter() - began) * 1000)
    return samples


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(int(len(ordered) * 0.9) - 1, 0)]


def caller(client: Client, language: str) -> Callable[[], Awaitable[None]]:
    async def call() -> None:
        result = await client.call_tool("execute_code", {"language": language, "code": PROGRAMS[language]})
        if result.is_error:
            raise RuntimeError(result.content)

    return call


#: This tree's package: a bench server runs it, not whatever the venv has installed.
OWN_SRC = Path(__file__).resolve().parent.parent / "src"


def lane_servers(root: Path, before: Path | None, cpu_weight: int) -> dict[str, StdioServerParameters]:
    """The servers compared: this tree as a user gets it ("ours": a sandbox started ahead), this tree
    with oneshot_ready off ("cold"), and optionally another tree ("before")."""
    trees = {"ours": (OWN_SRC, {}), "cold": (OWN_SRC, {"CODERUNNER_ONESHOT_READY": "0"})}
    if before is not None:
        trees["before"] = (before.resolve(), {})
    servers = {}
    for side, (src, extra) in trees.items():
        params = server_params(root / side, lane=f"oneshot {side}", src=src, cpu_weight=cpu_weight)
        params.env = {**(params.env or {}), **extra}
        servers[side] = params
    return servers


async def oneshot_figures(client: Client) -> str:
    """What the server says of its sandboxes started ahead (get_capabilities), for the table's foot."""
    result = await client.call_tool("get_capabilities", {})
    text = "".join(getattr(block, "text", "") for block in result.content)  # the JSON, once, as text
    try:
        found = json.loads(text).get("sandbox", {}).get("oneshot_ready")
    except (ValueError, AttributeError):
        found = None
    return json.dumps(found) if found is not None else "not reported"


#: Issue 29's targets for execute_code ("ours") against the plain program: a ratio for python, a difference for bash.
TARGET_RATIO = {"python": 1.5}
TARGET_OVER_MS = {"bash": 5.0}
BASELINE_NAMES = {"python": "python3 -c", "javascript": "node -e", "bash": "plain bash"}


def summary_figures(samples: dict[str, list[float]], languages: list[str]) -> list[Figure]:
    """Each language's execute_code median (as a user gets it) beside its plain program's, with the issue's target."""
    found = []
    for language in languages:
        ours, raw = median(samples[f"{language}/ours"]), median(samples[f"{language}/plain"])
        target, met = "", None
        if language in TARGET_RATIO:
            target, met = f"<= {TARGET_RATIO[language]:g}x", ours <= TARGET_RATIO[language] * raw
        elif language in TARGET_OVER_MS:
            target, met = f"<= +{TARGET_OVER_MS[language]:g} ms", ours - raw <= TARGET_OVER_MS[language]
        found.append(Figure(f"execute_code {language}, median", round(ours, 2), "ms", baseline=round(raw, 2),
                            baseline_name=BASELINE_NAMES[language], target=target, met=met))  # fmt: skip
    return found


async def round_trips(
    runs: int, languages: list[str], before: Path | None, gap_ms: float, cpu_weight: int, summary: Path | None = None
) -> None:
    settings = load_settings()
    root = _passable(Path(tempfile.mkdtemp(prefix="crb-", dir="/tmp")))
    servers = lane_servers(root, before, cpu_weight)
    figures: dict[str, str] = {}
    try:
        async with contextlib.AsyncExitStack() as stack:
            lanes: dict[str, Callable[[], Awaitable[None]]] = {}
            for language in languages:
                argv = baseline_argv(language, settings.sandbox_env / "bin" / "python")
                lanes[f"{language}/plain"] = lambda argv=argv: plain(argv)
            clients = {}
            for side, params in servers.items():
                (root / side).mkdir(mode=0o711)
                clients[side] = client = await stack.enter_async_context(Client(params, read_timeout_seconds=120))
                for language in languages:
                    lanes[f"{language}/{side}"] = caller(client, language)
            await interleaved(2, lanes, gap_ms)  # warm the page cache for every lane alike
            samples = await interleaved(runs, lanes, gap_ms)
            for side, client in clients.items():
                figures[side] = await oneshot_figures(client)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gap = f", {gap_ms:g} ms before each call" if gap_ms else ", calls back to back"
    print(f"execute_code over MCP (stdio), {runs} interleaved rounds{gap}, sandboxes' cpu weight {cpu_weight}")
    print("median ms [min] of each lane beside the same program as a plain subprocess, timed in the same rounds")
    print(f"{'language':12} {'side':7} {'plain':>14} {'execute_code':>14} {'p90':>7} {'ratio':>6} {'over plain':>11}")
    for language in languages:
        raw = samples[f"{language}/plain"]
        for side in servers:
            ours = samples[f"{language}/{side}"]
            print(
                f"{language:12} {side:7} {median(raw):6.1f} [{min(raw):5.1f}] {median(ours):6.1f} [{min(ours):5.1f}] "
                f"{p90(ours):7.1f} {median(ours) / median(raw):5.1f}x {median(ours) - median(raw):11.1f}"
            )
    for side, text in figures.items():
        print(f"{side}: sandboxes started ahead {text}")
    write_summary(summary, "oneshot", summary_figures(samples, languages))


async def phases(runs: int, languages: list[str], ready: bool, gap_ms: float, cpu_weight: int | None) -> None:
    """The runner's own phases, in process, beside the plain program and the sandbox's bare layers."""
    from coderunner.hostfs.private_dirs import ensure_private_dir
    from coderunner.oneshot.runs import OneShotRunner
    from coderunner.sandbox import UidPool, make_backend, per_sandbox_uids
    from coderunner.sandbox.bwrap import BwrapBackend
    from coderunner.sandbox.cgroups import CgroupLimits, SessionCgroup, enter_command
    from coderunner.sessions.leases import SandboxLeases, sandbox_spec
    from coderunner.sessions.sandbox_options import sandbox_options

    root = _passable(Path(tempfile.mkdtemp(prefix="crb-", dir="/tmp")))
    os.environ.update(
        CODERUNNER_CONFIG=os.devnull,
        CODERUNNER_RUNTIME_DIR=str(root / "run"),
        CODERUNNER_TOOLS="all",
        CODERUNNER_WORKSPACES_DIR=str(root / "workspaces"),
    )
    settings = load_settings()
    backend = make_backend(settings)
    ensure_private_dir(settings.runtime_dir, backend.dir_mode)
    ensure_private_dir(settings.workspaces_dir, backend.dir_mode)
    leases = SandboxLeases(settings, backend, UidPool() if per_sandbox_uids(settings.sandbox_user) else None)
    cgroups = getattr(backend, "cgroups", None)
    if cpu_weight is not None and cgroups is not None:
        # A parent group of this bench's own: every server on the machine shares "coderunner" and sets its weight.
        cgroups.prefix, cgroups.cpu_weight = f"coderunner-bench-{os.getpid()}", cpu_weight
    timings: dict[str, list[float]] = defaultdict(list)
    current: list[str] = [""]

    def sink(name: str, ms: float) -> None:
        timings[f"{current[0]}/{name}"].append(ms)

    options = sandbox_options(settings, backend, [])
    try:
        async with anyio.create_task_group() as tg:
            runner = OneShotRunner(backend, tg, leases, output_limit_chars=10_000, phases=sink, ready=ready)
            lanes: dict[str, Callable[[], Awaitable[None]]] = {}
            for language in languages:

                async def run(language: str = language) -> None:
                    current[0] = language
                    result = await runner.run(language, PROGRAMS[language], options)  # type: ignore[arg-type]
                    if not result.success:
                        raise RuntimeError(result.stderr)

                argv = baseline_argv(language, settings.sandbox_env / "bin" / "python")
                lanes[f"{language}/plain"] = lambda argv=argv: plain(argv)
                lanes[f"{language}/ours"] = run
            # The bare layers: /bin/true in bwrap (as the run's user, with its seccomp filter), then in cgroups too.
            layer_dirs = await leases.open_dirs(options, throwaway=True)
            spec = sandbox_spec(options, layer_dirs, (), settings.network_ceiling)
            seccomp = os.memfd_create("bench-seccomp", 0)
            os.write(seccomp, backend.seccomp_filter if isinstance(backend, BwrapBackend) else b"")
            if isinstance(backend, BwrapBackend):

                def bwrap_argv() -> list[str]:
                    os.lseek(seccomp, 0, os.SEEK_SET)
                    full = backend.command.argv(spec, ["/bin/true"], seccomp_fd=seccomp)
                    return [*spec.user.setpriv_prefix(), *full] if spec.user is not None else full

                async def bare(cgroups: bool, cpu: bool = True) -> None:
                    argv = bwrap_argv()
                    group = None
                    if cgroups and backend.cgroups is not None:
                        group = backend.cgroups.create("bench-layers", CgroupLimits(2**30, 256, None))
                        entered = group
                        if not cpu:
                            entered = SessionCgroup(group.version, {k: v for k, v in group.dirs.items() if k != "cpu"})
                        argv = enter_command(entered, argv)
                    try:
                        await anyio.run_process(argv, check=True, pass_fds=(seccomp,))
                    finally:
                        if group is not None:
                            group.remove()

                lanes["layer/true"] = lambda: plain(["/bin/true"])
                lanes["layer/bwrap true"] = lambda: bare(False)
                lanes["layer/cgroups+bwrap true"] = lambda: bare(True)
                if backend.cgroups is not None and backend.cgroups.version == 1:
                    lanes["layer/cgroups but cpu+bwrap true"] = lambda: bare(True, cpu=False)
            await interleaved(2, lanes, gap_ms)
            timings.clear()
            samples = await interleaved(runs, lanes, gap_ms)
            os.close(seccomp)
            await leases.close_dirs(layer_dirs)
            tg.cancel_scope.cancel()
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if cpu_weight is not None and cgroups is not None:
            for parent in cgroups.parents.values():
                with contextlib.suppress(OSError):
                    (parent / cgroups.prefix).rmdir()
    started = "a sandbox started ahead for each run" if ready else "each run starts its sandbox"
    if cpu_weight is not None:
        started += f", sandboxes' cpu weight {cpu_weight}"
    print(f"one-shot phases in process (no MCP), {runs} interleaved rounds, {started}; medians in ms")
    head = " ".join(f"{name:>7}" for name in PHASES)
    print(f"{'language':12} {head} {'total':>7} {'plain':>7} {'ratio':>6} {'min total':>10} {'min plain':>10}")
    for language in languages:
        parts = " ".join(f"{median(timings[f'{language}/{name}']):7.2f}" for name in PHASES)
        ours, raw = samples[f"{language}/ours"], samples[f"{language}/plain"]
        total, plain_ms = median(ours), median(raw)
        ratio = total / plain_ms
        print(f"{language:12} {parts} {total:7.2f} {plain_ms:7.2f} {ratio:5.1f}x {min(ours):10.2f} {min(raw):10.2f}")
    print("the sandbox's layers around /bin/true (ms, median [min]); the sessions' cpu cgroup has a low weight")
    print("(session_cpu_weight): on a busy machine a sandbox gets only idle CPU, so the cpu lane pays for the load")
    for name in ("layer/true", "layer/bwrap true", "layer/cgroups+bwrap true", "layer/cgroups but cpu+bwrap true"):
        if name in samples:
            print(f"{name:36} {median(samples[name]):7.2f} [{min(samples[name]):6.2f}]")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="interleaved rounds (at least 10)")
    parser.add_argument("--phases", action="store_true", help="the breakdown per phase, in process")
    parser.add_argument("--languages", default=",".join(PROGRAMS), help="comma-separated, default all")
    parser.add_argument("--before", type=Path, help="a src/ dir holding the coderunner package to compare with")
    parser.add_argument("--cold", action="store_true", help="--phases: each run starts its own sandbox")
    parser.add_argument("--gap-ms", type=float, default=GAP_MS, help="pause before each call (an agent's think time)")
    parser.add_argument("--cpu-weight", type=int, help="the sandboxes' cpu weight (round trips: default 100)")
    add_summary_argument(parser)
    arguments = parser.parse_args()
    chosen = [name for name in arguments.languages.split(",") if name in PROGRAMS]
    runs = max(arguments.runs, 10)
    if arguments.phases:
        if arguments.before:
            parser.error("--before compares round trips; --phases measures this tree only")
        if arguments.summary:
            parser.error("--summary writes the round trips' figures; --phases has none of the issue's")
        anyio.run(phases, runs, chosen, not arguments.cold, arguments.gap_ms, arguments.cpu_weight)
    else:
        weight = 100 if arguments.cpu_weight is None else arguments.cpu_weight
        anyio.run(round_trips, runs, chosen, arguments.before, arguments.gap_ms, weight, arguments.summary)
