"""What the guest says of a save or a load, checked and cut before the host keeps or shows it.

The guest's accounts come from inside the sandbox: each is checked against a schema (SaveReport,
LoadReport) and cut to a fixed size, so a padded report can neither bloat the store's records nor
hide a snapshot from its owner (a record past MAX_META_BYTES would be unreadable).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from coderunner.snapshots.store import SnapshotError

#: Characters kept of one name, type or reason in a guest report (and of a snapshot's label).
REPORT_TEXT = 200
#: Entries of one list of a guest report that are checked (the rest are only counted).
REPORT_ITEMS = 5_000
#: Bytes (as JSON) one list of a guest report may take; what does not fit is counted in `left_out`.
REPORT_LIST_BYTES = 40 * 1024


def _clip(value: object) -> object:
    return value[:REPORT_TEXT] if isinstance(value, str) else value


def _head(value: object) -> object:
    return value[:REPORT_ITEMS] if isinstance(value, list) else value


Clipped = Annotated[str, BeforeValidator(_clip)]
Count = Annotated[int, Field(ge=0)]


class _Report(BaseModel):
    """A guest account: strict types, unknown keys dropped, every string clipped."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class SavedVariable(_Report):
    name: Clipped
    type: Clipped = ""
    bytes: Count = 0


class SavedModule(_Report):
    name: Clipped
    module: Clipped = ""


class LeftOut(_Report):
    name: Clipped
    type: Clipped = ""
    reason: Clipped = ""


class FailedLoad(_Report):
    name: Clipped
    reason: Clipped = ""


class SaveReport(_Report):
    """The guest's account of a save (coderunner_guest/snapshot.py `save`), as the host keeps it."""

    saved: Annotated[list[SavedVariable], BeforeValidator(_head)] = []
    modules: Annotated[list[SavedModule], BeforeValidator(_head)] = []
    skipped: Annotated[list[LeftOut], BeforeValidator(_head)] = []
    bytes: Count = 0
    not_carried: Annotated[list[Clipped], BeforeValidator(_head)] = []


class LoadReport(_Report):
    """The guest's account of a load, as the host shows it."""

    restored: Annotated[list[Clipped], BeforeValidator(_head)] = []
    modules: Annotated[list[Clipped], BeforeValidator(_head)] = []
    failed: Annotated[list[FailedLoad], BeforeValidator(_head)] = []
    not_carried: Annotated[list[Clipped], BeforeValidator(_head)] = []
    skipped: Annotated[list[LeftOut], BeforeValidator(_head)] = []


def bounded_report(raw: object, model: type[_Report]) -> dict[str, Any]:
    """`raw` (a guest's answer) checked against `model`, each list cut to REPORT_LIST_BYTES;
    `left_out` counts, per list, the entries cut. Raises SnapshotError when it has another shape."""
    if not isinstance(raw, dict):
        raise _bad_report()
    try:
        report = model.model_validate(raw).model_dump()
    except (ValidationError, RecursionError):
        raise _bad_report() from None
    left_out: dict[str, int] = {}
    for key, items in report.items():
        if isinstance(items, list):
            report[key] = kept = _fit(items, REPORT_LIST_BYTES)
            given = raw.get(key)
            cut = (len(given) if isinstance(given, list) else 0) - len(kept)
            if cut > 0:
                left_out[key] = cut
    if left_out:
        report["left_out"] = left_out
    return report


def bounded_load_report(raw: object) -> dict[str, Any]:
    """The load's account (bounded_report); one of another shape is said, not raised: the state is loaded."""
    try:
        return bounded_report(raw, LoadReport)
    except SnapshotError:
        return {"failed": [{"name": "(all)", "reason": "the kernel's account of the load was unreadable"}]}


def report_count(report: dict[str, Any], key: str) -> int:
    """How many entries the guest's list `key` had, those cut from the record included."""
    items, left_out = report.get(key), report.get("left_out")
    cut = left_out.get(key, 0) if isinstance(left_out, dict) else 0
    return (len(items) if isinstance(items, list) else 0) + (cut if isinstance(cut, int) else 0)


def _fit(items: list[Any], budget: int) -> list[Any]:
    """The first items whose JSON (as meta.json writes it) fits in `budget` bytes."""
    kept = []
    for item in items:
        budget -= len(json.dumps(item)) + 2
        if budget < 0:
            break
        kept.append(item)
    return kept


def _bad_report() -> SnapshotError:
    return SnapshotError(
        "the kernel's account of the save is not what CodeRunner's guest writes (it was changed inside the "
        "sandbox); nothing was kept. Run the snapshot again; if it repeats, reset the kernel (kernel_reset)"
    )
