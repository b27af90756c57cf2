"""The performance issue's lanes in one run: each lane script's figures gathered into one markdown table.

    .venv/bin/python bench/suite.py [--quick] [--only oneshot,reset] [--write-docs] [--logs DIR]

Each lane is its own script (LANES), run as a subprocess of this one with `--summary PATH` and
bounded time; the figures come from that JSON (bench/summary.py), never from printed text. A lane
that fails, times out, needs root it lacks or writes no summary prints as such, with its reason; the
others run on. Printed: one table (figure, value, the baseline measured in the same run, ratio and
difference, target, met), each lane's load as it ended, and the machine (cores, kernel, load before
and after). `--quick` runs every lane with small round counts (a few minutes in all; the figures are
then rough). `--write-docs` puts the table, the command and the machine into docs/performance.md,
between DOCS_BEGIN and DOCS_END (the prose below them stays). Each lane's own report (stdout and
stderr) is kept in the logs dir, which is printed at the end.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from summary import Summary, read_summary

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
DOCS = REPO / "docs" / "performance.md"
DOCS_BEGIN = "<!-- bench/suite.py begin -->"
DOCS_END = "<!-- bench/suite.py end -->"
#: How much of a failed lane's output its reason quotes (the whole output stays in the logs dir).
REASON_CHARS = 300
#: After a timeout's SIGTERM, how long the lane's process group has before SIGKILL.
KILL_GRACE_S = 10.0
#: Most a lane may print (its log file); past it the lane is ended as a failure.
MAX_LOG_BYTES = 16 * 2**20
#: How often a running lane's log size is checked.
POLL_S = 1.0


@dataclass(frozen=True)
class Lane:
    """One lane script: its arguments for a full run and for --quick, and the time each may take."""

    script: str
    what: str
    full: tuple[str, ...]
    quick: tuple[str, ...]
    full_timeout_s: float
    quick_timeout_s: float
    needs_root: bool = False


#: In the issue's order (issue 29: one-shots, reset, start, warm and many clients, egress, gVisor, snapshots),
#: then issue 37's first cells, then issue 41's kernel template.
LANES: dict[str, Lane] = {
    "oneshot": Lane("oneshot.py", "execute_code python and bash beside python3 -c and plain bash",
                    ("--languages", "python,bash", "--runs", "30"), ("--languages", "python,bash", "--runs", "10"),
                    600, 180),
    "reset": Lane("reset.py", "kernel_reset to first result", ("--rounds", "20"), ("--rounds", "5", "--settle", "1"),
                  600, 150),
    "startup": Lane("startup.py", "coderunner --help, stdio initialize, first 1+1 after launch", ("--rounds", "10"),
                    ("--rounds", "3"), 600, 150),
    "latency": Lane("latency.py", "warm run_python('1+1') beside a raw kernel", (),
                    ("--rounds", "5", "--per-round", "5", "--colds", "3"), 900, 180),
    "scale": Lane("scale.py", "8 HTTP clients running 1+1 beside 8 raw kernels", ("--only", "concurrency"),
                  ("--only", "concurrency", "--rounds", "4", "--calls", "40"), 900, 180),
    "egress": Lane("egress.py", "allowlist proxy beside direct: throughput, connection setup", (),
                   ("--rounds", "2", "--requests", "10", "--downloads", "1"), 900, 180, needs_root=True),
    "gvisor": Lane("gvisor.py", "gVisor create to first result and warm 1+1 beside bwrap", (),
                   ("--rounds", "1", "--warm", "10", "--size-mb", "20"), 900, 240),
    "snapshots": Lane("snapshots.py", "500 MB snapshot and restore beside np.save + np.load + a copy",
                      ("--backends", "bwrap"), ("--backends", "bwrap", "--size-mb", "100", "--rounds", "1"), 900, 180),
    "first_cells": Lane("first_cells.py", "first chart and pandas cell in a new session beside a warm session's",
                        ("--rounds", "6"), ("--rounds", "2", "--settle", "2"), 900, 300),
    "template": Lane("template_fork.py", "sessions from the kernel template beside template off: create, CPU, "
                     "100 at once, idle memory", ("--breakdown", "--runs", "20", "--burst", "100"),
                     ("--breakdown", "--runs", "5", "--burst", "20"), 1200, 300, needs_root=True),
}  # fmt: skip


@dataclass(frozen=True)
class LaneResult:
    """What one lane gave: its summary, or why there is none."""

    name: str
    summary: Summary | None
    failure: str = ""
    seconds: float = 0.0


def lane_argv(lane: Lane, quick: bool, summary: Path) -> list[str]:
    return [sys.executable, str(BENCH / lane.script), *(lane.quick if quick else lane.full), "--summary", str(summary)]


def run_lane(name: str, lane: Lane, quick: bool, logs: Path) -> LaneResult:
    """Run one lane script to its end or its time bound; its summary, or the reason it has none."""
    if lane.needs_root and os.geteuid() != 0:
        return LaneResult(name, None, "failed: needs root")
    summary_path = logs / f"{name}.json"
    summary_path.unlink(missing_ok=True)
    timeout = lane.quick_timeout_s if quick else lane.full_timeout_s
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    began = time.monotonic()
    with open(logs / f"{name}.log", "wb") as log:
        # Its own process group: a timeout ends the lane's servers and sandboxes with it.
        process = subprocess.Popen(lane_argv(lane, quick, summary_path), cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        code, failure = _wait_bounded(process, began + timeout, log)
        if failure:
            _end_group(process)
            return LaneResult(name, None, failure.format(timeout=timeout), time.monotonic() - began)
    seconds = time.monotonic() - began
    tail = _tail(logs / f"{name}.log")
    if code == 2 and re.search(r"unrecognized arguments:.* --summary", tail):
        return LaneResult(name, None, "no summary: the script takes no --summary yet", seconds)
    if code != 0:
        return LaneResult(name, None, f"failed: exit {code}: {tail}", seconds)
    if not summary_path.exists():
        return LaneResult(name, None, "no summary: the script wrote none", seconds)
    try:
        summary = read_summary(summary_path)
    except (ValueError, KeyError, TypeError) as exc:
        return LaneResult(name, None, f"failed: unreadable summary: {exc}", seconds)
    return LaneResult(name, summary, "" if summary.figures else "no figures in its summary", seconds)


def _wait_bounded(process: subprocess.Popen[bytes], deadline: float, log: IO[bytes]) -> tuple[int | None, str]:
    """The lane's exit code, or why it had to be ended: past its deadline, or printing past MAX_LOG_BYTES."""
    while True:
        try:
            return process.wait(timeout=max(0.0, min(POLL_S, deadline - time.monotonic()))), ""
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                return None, "failed: timed out after {timeout:.0f} s"
            if os.fstat(log.fileno()).st_size > MAX_LOG_BYTES:
                return None, f"failed: printed more than {MAX_LOG_BYTES:,} bytes"


def _end_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the lane's process group (its cleanups run), SIGKILL after KILL_GRACE_S."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=KILL_GRACE_S)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _tail(path: Path) -> str:
    """The last lines of a lane's output, on one line, for a failure's reason."""
    with open(path, "rb") as handle:
        handle.seek(max(0, path.stat().st_size - REASON_CHARS))
        text = handle.read().decode("utf-8", "replace")
    return " / ".join(line.strip() for line in text.replace("\r", "\n").splitlines() if line.strip())[-REASON_CHARS:]


def number(value: float) -> str:
    """Three significant figures or so: 0.873, 31.2, 144, 1,230."""
    if math.isnan(value):
        return "nan"
    size = abs(value)
    if size >= 100:
        return f"{value:,.0f}"
    if size >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}" if size >= 1 else f"{value:.3g}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(results: list[LaneResult]) -> str:
    """One markdown table: every lane's figures, or the lane's reason for having none."""
    lines = [
        "| lane | figure | value | baseline (same run) | ratio, difference | target | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for result in results:
        if result.summary is None or not result.summary.figures:
            lines.append(f"| {result.name} | {_cell(result.failure)} | – | – | – | – | – |")
            continue
        for figure in result.summary.figures:
            value = f"{number(figure.value)} {figure.unit}".strip()
            baseline = ratio = "–"
            if figure.baseline is not None:
                baseline = f"{figure.baseline_name}: {number(figure.baseline)} {figure.unit}".strip()
                difference = figure.value - figure.baseline
                ratio = f"{'+' if difference >= 0 else '-'}{number(abs(difference))} {figure.unit}".strip()
                if figure.ratio is not None:
                    ratio = f"{figure.ratio:.2f}x, {ratio}"
            met = {True: "yes", False: "no", None: "–"}[figure.met]
            name = figure.name + (f" ({figure.notes})" if figure.notes else "")
            cells = (result.name, name, value, baseline, ratio, figure.target or "–", met)
            lines.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    return "\n".join(lines)


def lane_loads(results: list[LaneResult]) -> str:
    """Each lane's time and the load as its figures were written (a figure without its load is half one)."""
    parts = []
    for result in results:
        load = result.summary.machine.get("load", "?") if result.summary is not None else "–"
        parts.append(f"{result.name} {result.seconds:.0f} s (load {load})")
    return "Lanes (time taken; 1/5/15-min load as each wrote its figures): " + ", ".join(parts) + "."


def load_now() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.1f} {five:.1f} {fifteen:.1f}"


def machine_line(before: str, after: str, when: str) -> str:
    return (f"Machine: {os.cpu_count()} cores, Linux {platform.release()}, Python {platform.python_version()}; "
            f"load (1/5/15 min) {before} before, {after} after; {when}.")  # fmt: skip


def docs_block(report: str, command: str, machine: str) -> str:
    return (f"{DOCS_BEGIN}\n## Every lane in one run\n\n"
            f"Written by `{command}` (run it again rather than edit this by hand): each figure beside its baseline "
            f"from the same run and the target it is held to. On a shared machine read the ratios and the load."
            f"\n\n{report}\n\n{machine}\n{DOCS_END}")  # fmt: skip


def rewrite_docs(text: str, block: str) -> str:
    """`text` with what lies between the markers (the markers included) replaced by `block`."""
    start, end = text.find(DOCS_BEGIN), text.find(DOCS_END)
    if start < 0 or end < start:
        raise ValueError(f"docs/performance.md has no {DOCS_BEGIN} ... {DOCS_END} block to replace")
    return text[:start] + block + text[end + len(DOCS_END) :]


def chosen_lanes(only: str | None) -> list[str]:
    if not only:
        return list(LANES)
    names = [name.strip() for name in only.split(",") if name.strip()]
    unknown = [name for name in names if name not in LANES]
    if unknown:
        raise SystemExit(f"unknown lane(s) {', '.join(unknown)}; the lanes are {', '.join(LANES)}")
    return names


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small round counts: a few minutes in all, rough figures")
    parser.add_argument("--only", help=f"comma-separated lanes (default all: {','.join(LANES)})")
    parser.add_argument("--write-docs", action="store_true", help="put the table into docs/performance.md")
    parser.add_argument("--logs", type=Path, help="where each lane's output and summary go (default: a new temp dir)")
    args = parser.parse_args(argv)
    names = chosen_lanes(args.only)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="bench-suite-"))
    logs.mkdir(parents=True, exist_ok=True)
    before, results = load_now(), []
    for name in names:
        print(f"{name}: {LANES[name].what} ...", file=sys.stderr, flush=True)
        results.append(result := run_lane(name, LANES[name], args.quick, logs))
        print(f"{name}: {result.failure or 'done'} ({result.seconds:.0f} s)", file=sys.stderr, flush=True)
    command = " ".join(
        ["python bench/suite.py", *(["--quick"] if args.quick else []), *(["--only", args.only] if args.only else [])]
    )
    machine = machine_line(before, load_now(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    report = table(results) + "\n\n" + lane_loads(results)
    print(f"{report}\n\n{machine}\n\nEach lane's own report: {logs}")
    if args.write_docs:
        DOCS.write_text(rewrite_docs(DOCS.read_text(), docs_block(report, command, machine)))
        print(f"wrote {DOCS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
