"""The node side of one-shot runs: a node agent's LocalOneShots, as one machine runs them, plus what a
cluster run brings back to its front door.

A one-shot run is a call of a node agent (agent.py), like a session's: the agent's manager gives it its
leases, egress hub and task group, and its sandboxes started ahead (oneshot_ready) serve the next run of
the same options warm, where a Ray task per run built a manager, and cold-started a sandbox, each time.
Two things cross back with the result: an allowlist run's proxy decisions (the reply's `network` line)
and what it exported. Its outbox goes to a host-only folder of the node made for that run alone
(oneshot_exports.node_export_folder), whose files the answer carries, so two runs of one client on one
node never mix their files; the folder is removed when the run ends.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import anyio

from coderunner.cluster.oneshot_exports import OneShotExports, collect, node_export_folder
from coderunner.cluster.remote_egress import delta_of
from coderunner.hostfs.exports import client_folder
from coderunner.oneshot.runs import ExportTo

if TYPE_CHECKING:
    from coderunner.cluster.wire import EgressDelta
    from coderunner.config import Settings
    from coderunner.oneshot.local import LocalOneShots
    from coderunner.oneshot.runs import OneShotResult
    from coderunner.sessions.egress_wiring import SessionEgress
    from coderunner.sessions.sandbox_options import SandboxOptions


async def run_here(
    oneshots: LocalOneShots, settings: Settings, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[OneShotResult, EgressDelta | None, OneShotExports | None]:
    """One run_oneshot(*args, **kwargs) on this node: its result, its proxy's decisions (read after the
    run) and the files it exported (None when the front door keeps no export folder)."""
    options: SandboxOptions = args[2]
    proxies: list[SessionEgress] = []
    held = contextlib.ExitStack()
    # No export folder at the front door: nothing on the node's disk to prepare, nor a worker-thread hop for it.
    exporting = settings.export_dir is not None
    try:
        export = await anyio.to_thread.run_sync(held.enter_context, node_export_folder(settings)) if exporting else {}
        export_to = None
        if export:
            folder = client_folder(export["export_dir"], options.client)
            export_to = ExportTo(folder, export["export_limit_mb"] * 2**20)
        result = await oneshots.run_oneshot(*args, on_egress=proxies.append, export_to=export_to, **kwargs)
        delta = delta_of(proxies[0], 0) if proxies else None
        files = None
        if export and result.exported:
            files = await anyio.to_thread.run_sync(collect, export["export_dir"], options.client)
        return result, delta, files
    finally:
        if exporting:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(held.close)
