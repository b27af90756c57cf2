"""What one bench script hands bench/suite.py: each figure beside its baseline and the target it answers.

A lane script keeps printing its own report for a reader; with `--summary PATH` it also writes the
figures the performance table shows, as JSON, so the suite never parses printed text:

    parser = argparse.ArgumentParser(...)
    add_summary_argument(parser)
    ...
    write_summary(args.summary, "oneshot", [Figure("execute_code python, median", 31.2, "ms",
                                                   baseline=28.0, baseline_name="python3 -c",
                                                   target="<= 1.5x", met=31.2 <= 1.5 * 28.0)])

`met` is the script's own reading of its target (None where there is no target): the suite prints it,
it never decides it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Figure:
    """One measured figure and, where there is one, the baseline measured in the same run."""

    name: str
    value: float
    unit: str
    baseline: float | None = None
    baseline_name: str = ""
    target: str = ""
    met: bool | None = None
    notes: str = ""

    @property
    def ratio(self) -> float | None:
        if self.baseline is None or self.baseline == 0:
            return None
        return self.value / self.baseline


@dataclass(frozen=True)
class Summary:
    """One script's figures, with the machine and load they were measured under."""

    script: str
    figures: list[Figure]
    machine: dict[str, str] = field(default_factory=dict)


def add_summary_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--summary", type=Path, help="also write the figures as JSON here (for bench/suite.py)")


def machine_now() -> dict[str, str]:
    """The machine and its load as the figures were taken: a figure without them is half a figure."""
    load = os.getloadavg()
    return {
        "cpus": str(os.cpu_count()),
        "load": f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f}",
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def write_summary(path: Path | None, script: str, figures: list[Figure]) -> None:
    """Write the figures as JSON to `path` (nothing when the script was run without --summary)."""
    if path is None:
        return
    summary = Summary(script=script, figures=figures, machine=machine_now())
    path.write_text(json.dumps(asdict(summary), indent=1) + "\n")


def read_summary(path: Path) -> Summary:
    raw = json.loads(path.read_text())
    return Summary(
        script=raw["script"],
        figures=[Figure(**figure) for figure in raw["figures"]],
        machine=dict(raw.get("machine", {})),
    )
