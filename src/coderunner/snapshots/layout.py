"""Snapshots on the host: where the store keeps each client's saved sessions, and what it says
when it cannot.

    SNAPSHOTS/                  host-only (0700, the server's user); never bound into a sandbox
        <client>/               one client's snapshots: a client lists, restores and deletes only these
            <snapshot_id>/      one whole snapshot (renamed into place once complete)
                meta.json       SnapshotMeta, written by the host last
                state/          the kernel state the guest saved (manifest.json, v-NNNN.pkl): bytes
                                that are only ever read inside a sandbox, never unpickled here (a
                                restore stages them as links, the files made 0444: store.stage_state)
                workspace/      the workspace's files: regular files, folders and symlinks (kept as
                                links, never followed); fifos, sockets and devices are left out
                memory/         a gVisor memory checkpoint instead of state/ (written by runsc, read
                                only by runsc restoring it), and memory.json beside it: what the
                                restored kernel is reached with (its key: never shown to anyone)
            .draft-<random>/    a snapshot being made; a dead server's drafts go at the next start

These are the layout's names and bounds, and the store's errors (store.py serves the store,
draft.py fills a new snapshot, records.py reads one back).
"""

from __future__ import annotations

import os
import re
import secrets

from coderunner.errors import CodeRunnerError

#: A snapshot id: "s-" and 12 url-safe characters, or "keep-<workspace name>" (a persistent session's).
SNAPSHOT_ID = re.compile(r"(s-[A-Za-z0-9_-]{12}|keep-[A-Za-z0-9][A-Za-z0-9_.-]{0,63})")
META_NAME = "meta.json"
STATE_DIR = "state"
WORKSPACE_DIR = "workspace"
MEMORY_DIR = "memory"
MEMORY_CONNECTION = "memory.json"
#: The names a guest's state folder may hold (manifest.json, v-0001.pkl, ...): anything else is tampering.
STATE_FILE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
DRAFT_PREFIX = ".draft-"
KINDS = ("snapshot", "persistent")
#: meta.json is the host's own, small: a bigger one is broken (and never written: commit refuses it).
MAX_META_BYTES = 1 << 20
#: Entries a damaged snapshot's size walk visits (its size is then "at least").
DAMAGED_SIZE_ENTRIES = 100_000
MIB = 1 << 20
#: Bits the store's own copy always grants its owner, so a non-root server can read back a file
#: the sandbox had made 0000 (root reads it anyway, and then keeps the mode exactly).
STORE_FILE_BITS = 0 if os.geteuid() == 0 else 0o600
STORE_DIR_BITS = 0 if os.geteuid() == 0 else 0o700


class SnapshotError(CodeRunnerError):
    """A snapshot request that cannot be served; the message says why and what to do."""


class SnapshotTooLarge(SnapshotError):
    """The snapshot would pass its size cap (snapshot_limit_mb); nothing was kept."""


class SnapshotNotFound(SnapshotError):
    """No snapshot of that id for this client (another client's id gets the same answer)."""


def too_large(so_far: int, limit: int) -> SnapshotTooLarge:
    cap = f"{limit // MIB}" if limit % MIB == 0 else f"{limit / MIB:.1f}"
    return SnapshotTooLarge(
        f"the snapshot is past its size cap: {so_far / MIB:.1f} MiB so far, the cap is {cap} MiB; "
        "delete files or variables you do not need, or ask the user to raise snapshot_limit_mb"
    )


def tampered(why: str) -> SnapshotError:
    return SnapshotError(
        f"the saved state was tampered with inside the sandbox ({why}); nothing was kept. "
        "Run the snapshot again; if it repeats, reset the kernel (kernel_reset)"
    )


def write_failed(exc: OSError) -> SnapshotError:
    why = exc.strerror or type(exc).__name__
    return SnapshotError(
        f"the snapshot could not be copied ({why}); if a disk is full, delete files you do not need "
        "or ask the user to free space on the server"
    )


def too_large_to_restore(so_far: int, limit: int) -> SnapshotError:
    return SnapshotError(
        f"the snapshot's files do not fit this session's disk cap: {so_far / MIB:.1f} MiB so far, "
        f"the cap is {limit / MIB:.0f} MiB; ask the user to raise the disk cap, or restore a smaller snapshot"
    )


def draft_name() -> str:
    return DRAFT_PREFIX + secrets.token_hex(8)


def no_state() -> SnapshotError:
    return SnapshotError("the kernel saved no state to take (it may have been reset meanwhile); run the snapshot again")


def not_found(snapshot_id: object) -> SnapshotNotFound:
    shown = snapshot_id[:80] if isinstance(snapshot_id, str) else snapshot_id
    return SnapshotNotFound(
        f"no snapshot {shown!r} for this client; manage_snapshots (action 'list') shows the ones you can use"
    )
