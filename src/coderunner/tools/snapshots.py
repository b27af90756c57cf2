"""manage_snapshots: save, restore, fork, list and delete snapshots of a session, one tool with an action.

The actions share their few arguments (session_id, snapshot, name), and a tools/list entry costs every
turn: one tool with an enum is cheaper than five and as easy for a model to fill in.

The work is in sessions/session_snapshots.py (saving and seeding) and snapshots/store.py (the host's store);
these parse, call and say plainly what came back and what did not.
"""

# No `from __future__ import annotations`: the SDK reads tool signatures at runtime.

import time
from typing import Any, Literal

from mcp.server.mcpserver import Context
from mcp.types import CallToolResult

from coderunner.sessions.seam import SessionHandle
from coderunner.sessions.session_snapshots import MEMORY_CARRIES, Seed, Taken, memory_key
from coderunner.sessions.snapshot_reports import REPORT_TEXT, report_count
from coderunner.snapshots.layout import SNAPSHOT_ID
from coderunner.snapshots.store import CopyReport, DamagedSnapshot, Listing, SnapshotMeta, SnapshotNotFound
from coderunner.tools.arguments import SessionId, Text
from coderunner.tools.context import ToolContext, json_result, tool
from coderunner.vocabulary.sandbox_request import SandboxRequest

#: Entries of a list a reply shows at most (the rest are counted).
SHOWN = 50
#: Snapshots an error names when a name matched none.
SHOWN_NAMES = 10


async def save(tools: ToolContext, ctx: Context, session_id: str, name: str) -> CallToolResult:
    """manage_snapshots save: the session's files and variables, kept under the caller's client."""
    session = await tools.session(ctx, session_id)
    taken = await tools.host.take_snapshot(session, name)
    return json_result(_taken(taken))


async def restore(tools: ToolContext, ctx: Context, snapshot: str) -> CallToolResult:
    """manage_snapshots restore: a new session from a snapshot (an id, or a name for its newest)."""
    client = tools.client(ctx)
    try:
        meta = await tools.host.snapshot(client, snapshot)
    except SnapshotNotFound as missing:  # not an id of theirs: a name, then (its newest snapshot)
        meta = named(await tools.host.snapshot_listing(client), snapshot, missing)
    session = await _open(tools, ctx, meta, Seed(client, meta.snapshot_id))
    return json_result(_restored(session, meta))


async def fork(tools: ToolContext, ctx: Context, session_id: str) -> CallToolResult:
    """manage_snapshots fork: a new session with a copy of this one (through a snapshot deleted after)."""
    session = await tools.session(ctx, session_id)
    taken = await tools.host.take_snapshot(session, f"fork of {session.session_id[:8]}")
    try:
        forked = await _open(tools, ctx, taken.meta, Seed(taken.meta.client, taken.meta.snapshot_id))
    finally:
        await tools.host.delete_snapshot(taken.meta.client, taken.meta.snapshot_id)
    forked.note_restored_from(f"fork of session {session.session_id[:8]}")  # its snapshot is gone
    reply = _restored(forked, taken.meta)
    reply["forked_from"] = session.session_id
    del reply["snapshot"]
    return json_result(reply)


async def listing(tools: ToolContext, ctx: Context) -> CallToolResult:
    """manage_snapshots list: the caller's snapshots, newest first, damaged ones marked."""
    found = await tools.host.snapshot_listing(tools.client(ctx))
    entries = [(meta.created, _listed(meta)) for meta in found.snapshots]
    entries += [(entry.modified, _damaged(entry)) for entry in found.damaged]
    entries.sort(key=lambda pair: pair[0], reverse=True)
    return json_result({"snapshots": [listed for _, listed in entries]})


async def delete(tools: ToolContext, ctx: Context, snapshot: str) -> CallToolResult:
    """manage_snapshots delete: one of the caller's snapshots."""
    await tools.host.delete_snapshot(tools.client(ctx), snapshot)
    return json_result({"deleted": snapshot})


@tool(group="snapshots")
async def manage_snapshots(
    tools: ToolContext,
    action: Literal["save", "restore", "fork", "list", "delete"],
    ctx: Context,
    session_id: SessionId = "",
    snapshot: Text = "",
    name: Text = "",
) -> CallToolResult:
    """Snapshots of a session's files and variables: save, restore (a new session), fork (copy a session),
    list, delete."""
    if action in ("save", "fork"):
        return await (save(tools, ctx, session_id, name) if action == "save" else fork(tools, ctx, session_id))
    if action == "list":
        return await listing(tools, ctx)
    if not snapshot:
        raise SnapshotNotFound(f"manage_snapshots action {action!r} needs a snapshot (action 'list' shows yours)")
    return await (restore(tools, ctx, snapshot) if action == "restore" else delete(tools, ctx, snapshot))


def named(found: Listing, name: str, missing: SnapshotNotFound) -> SnapshotMeta:
    """The newest of the client's snapshots called `name`; none: `missing`, saying which there are."""
    for meta in found.snapshots:  # newest first
        if meta.name == name:
            return meta
    if SNAPSHOT_ID.fullmatch(name) or not found.snapshots:
        raise missing  # an id (maybe a damaged one: its own message says so), or nothing to offer
    shown = [f"{meta.name!r} ({meta.snapshot_id})" if meta.name else meta.snapshot_id for meta in found.snapshots]
    more = f" and {len(shown) - SHOWN_NAMES} more" if len(shown) > SHOWN_NAMES else ""
    raise SnapshotNotFound(
        f"no snapshot with the id or name {name[:80]!r} for this client; yours, newest first: "
        f"{', '.join(shown[:SHOWN_NAMES])}{more}"
    )


async def _open(tools: ToolContext, ctx: Context, meta: SnapshotMeta, seed: Seed) -> SessionHandle:
    """A new session with the snapshot's options, checked against today's settings."""
    saved = meta.options
    options = tools.host.options(SandboxRequest(
        network=saved.get("network"), memory_mb=saved.get("memory_mb"), cpus=saved.get("cpus"),
        timeout_s=saved.get("timeout_s"), client=tools.client(ctx), allow=tuple(saved.get("allow") or ()),
    ))  # fmt: skip
    return await tools.host.create(options, owner=tools.caller(ctx), seed=seed)


def _taken(taken: Taken) -> dict[str, Any]:
    meta, report = taken.meta, taken.meta.state_report
    reply: dict[str, Any] = {"snapshot": meta.snapshot_id, "name": meta.name, "size_mb": _mb(meta.size_bytes)}
    if memory_key(meta) is not None:
        reply["memory"] = MEMORY_CARRIES
    else:
        reply["variables"] = _names(report.get("saved", []), report_count(report, "saved"))
        reply["modules"] = _names(report.get("modules", []), report_count(report, "modules"))
    skipped = report.get("skipped", [])
    if skipped:
        reply["not_saved"] = _reasons(skipped)
    if report.get("left_out"):
        reply["report_cut"] = "the kernel's account was too long to keep whole: lists are shortened and counted"
    if taken.workspace is not None:
        reply["workspace"] = _copy(taken.workspace)
    reply["never_carried"] = _names(report.get("not_carried", []))
    reply["seconds"] = round(taken.seconds, 2)
    return reply


def _restored(session: SessionHandle, meta: SnapshotMeta) -> dict[str, Any]:
    reply: dict[str, Any] = {"session_id": session.session_id, "snapshot": meta.snapshot_id}
    reply.update(loaded_report(session.seeded))
    seed: Seed | None = session.seeded
    if seed is not None and seed.workspace is not None:
        reply["workspace"] = _copy(seed.workspace)
    if session.startup is not None:
        reply["startup_files"] = session.startup
    reply["network"], reply["memory_mb"] = session.options.network, session.options.limits.memory_mb
    return reply


def loaded_report(seed: Seed | None) -> dict[str, Any]:
    """What a seeded session's load brought back, and what it did not: left out at save, or failed to load."""
    loaded = seed.loaded if seed is not None else {}
    report: dict[str, Any] = {
        "restored": _names(loaded.get("restored", []), report_count(loaded, "restored")),
        "modules": _names(loaded.get("modules", []), report_count(loaded, "modules")),
    }
    skipped = seed.meta.state_report.get("skipped", []) if seed is not None and seed.meta is not None else []
    missing = _reasons([*skipped, *loaded.get("failed", [])])
    if missing:
        report["not_restored"] = missing
    report["never_carried"] = _names(loaded.get("not_carried", []))
    return report


def _reasons(items: list[dict[str, Any]]) -> list[str]:
    """'name: reason' for each variable left out, at most SHOWN of them."""
    return [_text(f"{item.get('name')}: {item.get('reason')}") for item in items[:SHOWN] if isinstance(item, dict)]


def _names(items: list[Any], total: int | None = None) -> list[str]:
    """At most SHOWN names, then how many more there were (`total`: the count before the record was cut)."""
    shown = [_text(item.get("name", "?") if isinstance(item, dict) else item) for item in items[:SHOWN]]
    more = max(len(items) if total is None else total, len(items)) - len(shown)
    return shown if more <= 0 else [*shown, f"... and {more} more"]


def _text(value: object) -> str:
    return str(value)[:REPORT_TEXT]


def _copy(report: CopyReport) -> dict[str, Any]:
    copied: dict[str, Any] = {"files": report.files, "mb": _mb(report.bytes)}
    if report.skipped:
        copied["left_out"] = report.skipped[:SHOWN]
    return copied


def _listed(meta: SnapshotMeta) -> dict[str, Any]:
    return {
        "snapshot": meta.snapshot_id,
        "name": meta.name,
        "kind": meta.kind,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(meta.created)),
        "from_session": meta.source_session,
        "size_mb": _mb(meta.size_bytes),
        "variables": "all (memory)" if memory_key(meta) is not None else report_count(meta.state_report, "saved"),
    }


def _damaged(entry: DamagedSnapshot) -> dict[str, Any]:
    return {
        "snapshot": entry.snapshot_id,
        "kind": entry.kind,
        "damaged": f"{entry.why}: it cannot be restored; action 'delete' removes it (so does the next server start)",
        "modified": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(entry.modified)),
        "size_mb": _mb(entry.size_bytes),
    }


def _mb(size: int) -> float:
    return round(size / 2**20, 2)
