"""bench/suite.py without timing anything: its table and the docs rewrite from made-up summaries, a
lane's failures (an error, no --summary, a timeout) as rows, and every lane it names is a script."""

from __future__ import annotations

import importlib
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import REPO

BENCH = REPO / "bench"


@pytest.fixture
def suite(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))  # the bench scripts import each other as top-level modules
    return importlib.import_module("suite")


def made_up(suite: ModuleType) -> list:  # type: ignore[type-arg]
    from summary import Figure, Summary

    oneshot = Summary("oneshot", [
        Figure("execute_code bash, median", 7.5, "ms", baseline=3.25, baseline_name="plain bash", target="<= +5 ms",
               met=True),
        Figure("execute_code python, median", 30.0, "ms", baseline=12.0, baseline_name="python3 -c",
               target="<= 1.5x", met=False),
    ], machine={"load": "1.5 1.2 1.0"})  # fmt: skip
    startup = Summary("startup", [Figure("first | result", 1234.0, "ms", notes="pool on")], machine={"load": "2.0"})
    return [
        suite.LaneResult("oneshot", oneshot, seconds=61),
        suite.LaneResult("startup", startup, seconds=20),
        suite.LaneResult("egress", None, "failed: needs root"),
        suite.LaneResult("gvisor", None, "no summary: the script takes no --summary yet", seconds=1),
    ]


def test_the_table_shows_each_figure_beside_its_baseline_and_each_failure_with_its_reason(suite: ModuleType) -> None:
    lines = suite.table(made_up(suite)).splitlines()
    assert lines[0] == "| lane | figure | value | baseline (same run) | ratio, difference | target | met |"
    assert lines[2] == ("| oneshot | execute_code bash, median | 7.50 ms | plain bash: 3.25 ms | 2.31x, +4.25 ms "
                        "| <= +5 ms | yes |")  # fmt: skip
    assert lines[3] == ("| oneshot | execute_code python, median | 30.0 ms | python3 -c: 12.0 ms | 2.50x, +18.0 ms "
                        "| <= 1.5x | no |")  # fmt: skip
    # No baseline, no target: dashes; a | in a name cannot break the row.
    assert lines[4] == "| startup | first \\| result (pool on) | 1,234 ms | – | – | – | – |"
    assert lines[5] == "| egress | failed: needs root | – | – | – | – | – |"
    assert lines[6] == "| gvisor | no summary: the script takes no --summary yet | – | – | – | – | – |"
    assert len(lines) == 7
    loads = suite.lane_loads(made_up(suite))
    assert "oneshot 61 s (load 1.5 1.2 1.0)" in loads and "egress 0 s (load –)" in loads


def test_the_docs_block_is_replaced_and_the_prose_around_it_stays(suite: ModuleType) -> None:
    text = f"# Performance\n\n{suite.DOCS_BEGIN}\nold table\n{suite.DOCS_END}\n\n## One call\n\nOlder prose.\n"
    block = suite.docs_block("| new | table |", "python bench/suite.py --quick", "Machine: 2 cores.")
    rewritten = suite.rewrite_docs(text, block)
    assert rewritten.startswith(f"# Performance\n\n{suite.DOCS_BEGIN}\n")
    assert rewritten.endswith(f"{suite.DOCS_END}\n\n## One call\n\nOlder prose.\n")
    assert "old table" not in rewritten
    for part in ("| new | table |", "`python bench/suite.py --quick`", "Machine: 2 cores."):
        assert rewritten.count(part) == 1, rewritten
    assert suite.rewrite_docs(rewritten, block) == rewritten  # a second run replaces its own block
    with pytest.raises(ValueError, match=r"no <!-- bench/suite\.py begin -->"):
        suite.rewrite_docs("# Performance\n\nno markers\n", block)


def test_the_performance_page_has_the_block_at_its_top(suite: ModuleType) -> None:
    text = (REPO / "docs" / "performance.md").read_text()
    begin, end = text.index(suite.DOCS_BEGIN), text.index(suite.DOCS_END)
    assert begin < end < text.index("\n## One call")
    assert "\n## " not in text[:begin]  # nothing but the title and the introduction above it


def test_every_lane_is_a_script_here_and_only_known_lanes_are_taken(suite: ModuleType) -> None:
    assert list(suite.LANES)[:3] == ["oneshot", "reset", "startup"]
    for name, lane in suite.LANES.items():
        assert (BENCH / lane.script).is_file(), name
        assert lane.quick_timeout_s <= lane.full_timeout_s, name
    assert suite.chosen_lanes("reset, oneshot") == ["reset", "oneshot"]
    assert suite.chosen_lanes(None) == list(suite.LANES)
    with pytest.raises(SystemExit, match="unknown lane"):
        suite.chosen_lanes("oneshot,nonsense")


def lane_script(tmp_path: Path, name: str, body: str) -> Path:
    script = tmp_path / f"{name}.py"
    script.write_text(textwrap.dedent(body).format(bench=str(BENCH)))
    return script


WRITES = """
    import argparse, sys
    sys.path.insert(0, {bench!r})
    from summary import Figure, add_summary_argument, write_summary
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int)
    add_summary_argument(parser)
    args = parser.parse_args()
    write_summary(args.summary, "fake", [Figure("rounds", args.rounds, "", baseline=2.0, baseline_name="two")])
"""
NO_SUMMARY_ARGUMENT = """
    import argparse
    argparse.ArgumentParser().parse_args()
"""
FAILS = """
    import sys
    print("measuring")
    sys.exit("the lane broke: no backend")
"""
HANGS = """
    import time
    time.sleep(600)
"""
WRITES_NOTHING = """
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument("--summary")
    parser.add_argument("--rounds")
    parser.parse_args()
"""


@pytest.mark.parametrize(
    ("body", "failure"),
    [
        (WRITES, ""),
        (NO_SUMMARY_ARGUMENT, "no summary: the script takes no --summary yet"),
        (FAILS, "failed: exit 1: measuring / the lane broke: no backend"),
        (HANGS, "failed: timed out after 1 s"),
        (WRITES_NOTHING, "no summary: the script wrote none"),
    ],
)
def test_a_lane_gives_its_summary_or_the_reason_it_has_none(
    suite: ModuleType, tmp_path: Path, body: str, failure: str
) -> None:
    script = lane_script(tmp_path, "lane", body)
    lane = suite.Lane(str(script), "a made-up lane", ("--rounds", "30"), ("--rounds", "3"), 60, 1)
    logs = tmp_path / "logs"
    logs.mkdir()
    result = suite.run_lane("fake", lane, True, logs)
    assert result.failure == failure, (logs / "fake.log").read_text()
    if not failure:
        assert [(figure.name, figure.value, figure.ratio) for figure in result.summary.figures] == [("rounds", 3, 1.5)]
    assert (logs / "fake.log").exists()


def test_a_lane_that_needs_root_is_not_run_without_it(
    suite: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = lane_script(tmp_path, "lane", WRITES)
    lane = suite.Lane(str(script), "a made-up lane", (), (), 60, 60, needs_root=True)
    monkeypatch.setattr(suite.os, "geteuid", lambda: 1000)
    result = suite.run_lane("fake", lane, False, tmp_path)
    assert result.failure == "failed: needs root" and not (tmp_path / "fake.log").exists()


def test_a_lane_that_prints_without_end_is_ended(
    suite: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = lane_script(tmp_path, "lane", "while True:\n    print('x' * 1000, flush=True)\n")
    monkeypatch.setattr(suite, "MAX_LOG_BYTES", 100_000)
    monkeypatch.setattr(suite, "POLL_S", 0.05)
    lane = suite.Lane(str(script), "a made-up lane", (), (), 60, 60)
    result = suite.run_lane("fake", lane, False, tmp_path)
    assert result.failure == "failed: printed more than 100,000 bytes", result
