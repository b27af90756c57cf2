"""The guest's save and load accounts cross from the sandbox into the host's meta.json and replies:
checked against a schema and cut to a fixed size first (sessions/session_snapshots.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from coderunner.sessions.snapshot_reports import (
    REPORT_LIST_BYTES,
    REPORT_TEXT,
    LoadReport,
    SaveReport,
    bounded_load_report,
    bounded_report,
    report_count,
)
from coderunner.snapshots.store import MAX_META_BYTES, SnapshotError

HONEST: dict[str, Any] = {
    "saved": [{"name": "df", "type": "DataFrame", "bytes": 120}],
    "modules": [{"name": "np", "module": "numpy"}],
    "skipped": [{"name": "fh", "type": "TextIOWrapper", "reason": "an open file handle"}],
    "bytes": 140,
    "not_carried": ["open files and sockets"],
    "cwd": "/workspace",
}


def padded() -> dict[str, Any]:
    """What code in the kernel can make the guest answer: long lists, long and escaped strings, extra keys."""
    return {
        **HONEST,
        "saved": [{"name": "v" * 300 + str(i), "type": "\u2603" * 10_000, "bytes": 1} for i in range(20_000)],
        "skipped": [{"name": "\x00" * 5_000, "type": "t", "reason": "r" * 100_000}] * 10_000,
        "not_carried": ["n" * (4 << 20)],
        "padding": "p" * (8 << 20),
    }


def test_an_honest_report_is_kept_whole() -> None:
    report = bounded_report(HONEST, SaveReport)
    assert report == {key: value for key, value in HONEST.items() if key != "cwd"}
    assert report_count(report, "saved") == 1


def test_a_padded_report_is_cut_to_a_fixed_size_and_counted() -> None:
    report = bounded_report(padded(), SaveReport)
    size = len(json.dumps(report))
    assert size <= 5 * REPORT_LIST_BYTES + 4096 < MAX_META_BYTES // 4, size
    assert "padding" not in report
    assert all(len(item["name"]) <= REPORT_TEXT and len(item["type"]) <= REPORT_TEXT for item in report["saved"])
    assert report["not_carried"] == ["n" * REPORT_TEXT]
    assert 0 < len(report["saved"]) < 20_000 and report["left_out"]["saved"] == 20_000 - len(report["saved"])
    assert report_count(report, "saved") == 20_000 and report_count(report, "skipped") == 10_000


@pytest.mark.parametrize(
    "raw",
    [
        None,
        "x" * 100,
        [HONEST],
        {**HONEST, "saved": "everything"},
        {**HONEST, "saved": [{"name": 5}]},
        {**HONEST, "saved": [{"type": "int"}]},
        {**HONEST, "bytes": -1},
        {**HONEST, "bytes": "9"},
        {**HONEST, "modules": [{"name": "np", "module": ["numpy"]}]},
        {**HONEST, "not_carried": [{"deep": [[[]]]}]},
    ],
)
def test_a_report_of_another_shape_refuses_the_snapshot(raw: object) -> None:
    with pytest.raises(SnapshotError, match="changed inside the sandbox"):
        bounded_report(raw, SaveReport)


def test_a_load_report_is_bounded_and_an_unreadable_one_is_said() -> None:
    loaded = {"restored": ["x" * 1000] * 50_000, "modules": [], "failed": [], "not_carried": [], "skipped": []}
    report = bounded_report(loaded, LoadReport)
    assert len(json.dumps(report)) <= 5 * REPORT_LIST_BYTES + 4096
    assert report_count(report, "restored") == 50_000
    assert bounded_load_report("garbage")["failed"][0]["reason"] == "the kernel's account of the load was unreadable"
