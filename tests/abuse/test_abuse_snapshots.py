"""Snapshots cross the boundary twice (sandbox files into the host's store, and back into a new
sandbox): sandboxed code aims both crossings at canaries this test made.

It plants links to a host canary file and folder in its workspace, races the guest's state folder
into links while the host takes it, plants a start-up hook, and pickles an object whose unpickling
writes to the canary's path. No canary may change, no canary byte may land in the store or in a
restored sandbox, the planted hook must not run, the server must still serve and the bystander
session keeps its state.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from coderunner.snapshots.store import MAX_META_BYTES, SNAPSHOT_ID

from ..conftest import ServerDirs, _passable, run, text_of
from .conftest import Arena, HostTargets, open_arena
from .test_abuse import assert_still_serving

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

SECRET = b"host-canary-7f3a9c-never-in-a-snapshot"
MIB = 1 << 20


@pytest.fixture(scope="module")
def canary() -> Iterator[Path]:
    root = _passable(Path(tempfile.mkdtemp(prefix="crs-", dir="/tmp")))
    (root / "file").write_bytes(SECRET)
    (root / "dir").mkdir()
    (root / "dir" / "inside").write_bytes(SECRET)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def seen(root: Path) -> dict[str, object]:
    """Everything a host write, chown, chmod, create or delete through a link would change."""
    found: dict[str, object] = {}
    for path in sorted([root, *root.rglob("*")]):
        info = path.lstat()
        found[str(path)] = (stat.S_IFMT(info.st_mode), stat.S_IMODE(info.st_mode), info.st_uid, info.st_size,
                            info.st_mtime_ns, path.read_bytes() if path.is_file() else None)  # fmt: skip
    return found


@pytest.fixture(scope="module")
def snapshot_dirs() -> Iterator[ServerDirs]:
    root = _passable(Path(tempfile.mkdtemp(prefix="crp-", dir="/tmp")))
    yield ServerDirs(root=root, runtime=root / "r", workspaces=root / "w")
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
async def arena(snapshot_dirs: ServerDirs, host_listeners: HostTargets) -> AsyncIterator[Arena]:
    async with open_arena(snapshot_dirs, host_listeners) as made:
        yield made


async def call(arena: Arena, tool: str, **arguments: Any) -> tuple[bool, dict[str, Any] | str]:
    result = await arena.client.call_tool(tool, arguments)
    text = text_of(result)
    return (not result.is_error, json.loads(text) if not result.is_error else text)


def store_holds_no_secret(dirs: ServerDirs) -> None:
    store = dirs.root / "snapshots"
    for path in store.rglob("*"):
        info = path.lstat()
        assert not stat.S_ISLNK(info.st_mode) or not os.readlink(path).startswith(str(dirs.root)), path
        if stat.S_ISREG(info.st_mode):
            assert SECRET not in path.read_bytes(), f"a canary's bytes landed in the store: {path}"


async def new_session(arena: Arena) -> str:
    ok, created = await call(arena, "create_session")
    assert ok and isinstance(created, dict), created
    return created["session_id"]


async def test_links_and_a_racing_state_folder_never_carry_a_canary(arena: Arena, canary: Path) -> None:
    before = seen(canary)
    session = await new_session(arena)
    links = f"""
import os
os.symlink({str(canary / "file")!r}, "link_file")
os.symlink({str(canary / "dir")!r}, "link_dir")
value = 41
"""
    assert not (await run(arena.client, links, session_id=session)).is_error
    # Links in the workspace travel as links: the snapshot holds no canary byte, and the restored
    # sandbox cannot read through them (the host paths are not there inside).
    ok, taken = await call(arena, "manage_snapshots", action="save", session_id=session)
    assert ok and isinstance(taken, dict), taken
    ok, restored = await call(arena, "manage_snapshots", action="restore", snapshot=taken["snapshot"])
    assert ok and isinstance(restored, dict), restored
    probe = (
        "import os\nprint(value, os.path.islink('link_file'), os.path.islink('link_dir'))\n"
        "for name in ('link_file', 'link_dir/inside'):\n"
        "    try:\n        print(open(name, 'rb').read())\n"
        "    except OSError as exc:\n        print(type(exc).__name__)"
    )
    looked = text_of(await run(arena.client, probe, session_id=restored["session_id"]))
    assert "41 True True" in looked and SECRET.decode() not in looked, looked
    await call(arena, "manage_sessions", action="close", session_id=restored["session_id"])
    store_holds_no_secret(arena.dirs)

    # Now a thread swaps the guest's state folder and its files for links while the host takes them.
    race = f"""
import os, threading, time
os.makedirs(".coderunner", exist_ok=True)
stop = False
def race():
    while not stop:
        for target, name in (({str(canary / "dir")!r}, ".coderunner/snapshot"),
                             ({str(canary / "file")!r}, ".coderunner/snapshot/manifest.json"),
                             ({str(canary / "file")!r}, ".coderunner/snapshot/v-0001.pkl")):
            try:
                if os.path.isdir(name) and not os.path.islink(name):
                    os.rename(name, name + ".old")
                elif os.path.lexists(name):
                    os.unlink(name)
                os.symlink(target, name)
            except OSError:
                pass
        time.sleep(0.0005)
racer = threading.Thread(target=race, daemon=True)
racer.start()
"""
    assert not (await run(arena.client, race, session_id=session)).is_error
    outcomes = [await call(arena, "manage_snapshots", action="save", session_id=session) for _ in range(6)]
    await run(arena.client, "stop = True\nracer.join(5)", session_id=session)
    assert seen(canary) == before, "a canary changed"
    store_holds_no_secret(arena.dirs)
    for ok, reply in outcomes:
        if not ok:  # a clear refusal ("tampered with", "could not be written"), never a crash
            assert isinstance(reply, str) and "Traceback" not in reply and reply.strip(), reply
            continue
        assert isinstance(reply, dict)
        ok, raced = await call(arena, "manage_snapshots", action="restore", snapshot=reply["snapshot"])
        assert ok and isinstance(raced, dict), raced
        looked = text_of(await run(arena.client, probe, session_id=raced["session_id"]))
        assert SECRET.decode() not in looked, looked
        await call(arena, "manage_sessions", action="close", session_id=raced["session_id"])
    assert seen(canary) == before
    await call(arena, "manage_sessions", action="close", session_id=session)
    await assert_still_serving(arena)


async def test_a_planted_start_up_hook_does_not_run_in_the_restored_session(arena: Arena) -> None:
    session = await new_session(arena)
    plant = (
        "import os\nos.makedirs('.coderunner/site-packages', exist_ok=True)\n"
        "open('.coderunner/site-packages/sitecustomize.py', 'w').write(\"open('/workspace/hook_ran', 'w')\")\n"
        "kept = 'state'"
    )
    assert not (await run(arena.client, plant, session_id=session)).is_error
    ok, taken = await call(arena, "manage_snapshots", action="save", session_id=session)
    assert ok and isinstance(taken, dict), taken
    ok, restored = await call(arena, "manage_snapshots", action="restore", snapshot=taken["snapshot"])
    assert ok and isinstance(restored, dict), restored
    assert "sitecustomize.py" in json.dumps(restored.get("startup_files")), restored
    looked = text_of(
        await run(arena.client, "import os\nprint(kept, os.path.exists('hook_ran'))", session_id=restored["session_id"])
    )
    assert "state False" in looked, looked
    for sid in (session, restored["session_id"]):
        await call(arena, "manage_sessions", action="close", session_id=sid)
    await assert_still_serving(arena)


async def test_an_unpickling_side_effect_stays_inside_the_new_sandbox(arena: Arena, canary: Path) -> None:
    before = seen(canary)
    session = await new_session(arena)
    cell = f"""
class Trap:
    def __reduce__(self):
        # At load this opens the canary's path for writing: inside the sandbox that path does not exist.
        return (open, ({str(canary / "file")!r}, "w"))
trap = Trap()
plain = 5
"""
    assert not (await run(arena.client, cell, session_id=session)).is_error
    ok, taken = await call(arena, "manage_snapshots", action="save", session_id=session)
    assert ok and isinstance(taken, dict), taken
    ok, restored = await call(arena, "manage_snapshots", action="restore", snapshot=taken["snapshot"])
    assert ok and isinstance(restored, dict), restored
    assert "plain" in restored["restored"]
    assert "trap" not in restored["restored"] and any(line.startswith("trap: ") for line in restored["not_restored"]), (
        restored
    )
    assert seen(canary) == before, "unpickling reached the host"
    for sid in (session, restored["session_id"]):
        await call(arena, "manage_sessions", action="close", session_id=sid)
    await assert_still_serving(arena)


# A restore stages the state as links to the store's own files where it can (no copy): code that
# runs while the state loads aims at them, to change a snapshot for every later restore.
TAMPER = """
def _tamper():
    import os, sys
    frame = sys._getframe()
    while frame is not None and not (frame.f_code.co_name == "load" and "dir" in frame.f_locals):
        frame = frame.f_back
    folder = frame.f_locals["dir"]
    tried = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        attempts = (("chmod", lambda: os.chmod(path, 0o666)), ("write", lambda: open(path, "r+b").write(b"X")),
                    ("truncate", lambda: os.truncate(path, 0)), ("unlink", lambda: os.unlink(path)),
                    ("rename", lambda: os.rename(path, path + ".x")))
        for label, attempt in attempts:
            try:
                attempt()
                tried[name + " " + label] = "done"
            except OSError as exc:
                tried[name + " " + label] = type(exc).__name__
    try:
        open(os.path.join(folder, "v-9999.pkl"), "wb").close()
        tried["create"] = "done"
    except OSError as exc:
        tried["create"] = type(exc).__name__
    return tried
class Tamper:
    def __reduce__(self):
        return (_tamper, ())
tamper = Tamper()
plain = 5
"""


def state_files(dirs: ServerDirs, snapshot_id: str) -> dict[str, bytes]:
    (found,) = list((dirs.root / "snapshots").glob(f"*/{snapshot_id}/state"))
    return {path.name: path.read_bytes() for path in sorted(found.iterdir())}


async def test_code_run_by_a_load_cannot_change_the_stored_state(arena: Arena) -> None:
    session = await new_session(arena)
    assert not (await run(arena.client, TAMPER, session_id=session)).is_error
    ok, taken = await call(arena, "manage_snapshots", action="save", session_id=session)
    assert ok and isinstance(taken, dict), taken
    before = state_files(arena.dirs, taken["snapshot"])
    assert len(before) >= 3, before  # the manifest and a pickle for each of tamper and plain
    for _ in range(2):  # the second restore loads what the first one's code could reach
        ok, restored = await call(arena, "manage_snapshots", action="restore", snapshot=taken["snapshot"])
        assert ok and isinstance(restored, dict), restored
        assert {"tamper", "plain"} <= set(restored["restored"]), restored
        looked = text_of(
            await run(arena.client, "print(sorted(tamper.items()), plain)", session_id=restored["session_id"])
        )
        await call(arena, "manage_sessions", action="close", session_id=restored["session_id"])
        assert "'done'" not in looked and "'create'" in looked and "v-0001.pkl chmod" in looked, looked
        assert state_files(arena.dirs, taken["snapshot"]) == before, "a load changed the stored state"
    await call(arena, "manage_sessions", action="close", session_id=session)
    await assert_still_serving(arena)


# The guest's save report crosses from the sandbox into the host's meta.json. Code in the kernel
# pads it (the guest module's own constant, and a wrapped write_state): the host must bound it,
# keep every snapshot listed, counted against snapshot_keep and deletable, and its disk bounded.
PAD_REPORT = """
import coderunner_guest.snapshot as guest_snapshot
guest_snapshot.NOT_CARRIED.append("n" * (1 << 20))
_real_write_state = guest_snapshot.write_state
def _padded(*args, **kwargs):
    report = _real_write_state(*args, **kwargs)
    report["saved"] = report["saved"] + [
        {"name": "v" * 300 + str(i), "type": "\\u2603" * 300, "bytes": 1} for i in range(4000)
    ]
    report["padding"] = "p" * (2 << 20)
    return report
guest_snapshot.write_state = _padded
value = 7
"""
KEEP = 2
TAKEN = 5


@pytest.fixture(scope="module")
async def keep_arena(host_listeners: HostTargets) -> AsyncIterator[Arena]:
    root = _passable(Path(tempfile.mkdtemp(prefix="crk-", dir="/tmp")))
    dirs = ServerDirs(root=root, runtime=root / "r", workspaces=root / "w")
    try:
        async with open_arena(dirs, host_listeners, CODERUNNER_SNAPSHOT_KEEP=str(KEEP)) as made:
            yield made
    finally:
        shutil.rmtree(root, ignore_errors=True)


def stored_snapshots(dirs: ServerDirs) -> dict[str, int]:
    """Every snapshot folder on disk (drafts aside), by id, with the bytes of its files."""
    found: dict[str, int] = {}
    for client in (dirs.root / "snapshots").iterdir():
        for entry in client.iterdir():
            if SNAPSHOT_ID.fullmatch(entry.name):
                found[entry.name] = sum(p.lstat().st_size for p in entry.rglob("*") if p.is_file())
    return found


async def test_a_padded_save_report_cannot_hide_a_snapshot_from_its_owner(keep_arena: Arena) -> None:
    arena = keep_arena
    session = await new_session(arena)
    assert not (await run(arena.client, PAD_REPORT, session_id=session)).is_error
    taken: list[str] = []
    for _ in range(TAKEN):
        result = await arena.client.call_tool("manage_snapshots", {"action": "save", "session_id": session})
        text = text_of(result)
        assert not result.is_error, text
        assert len(text) < 64 * 1024, f"the reply carried the padding: {len(text)} characters"
        taken.append(json.loads(text)["snapshot"])

    # Every stored snapshot is listed (a damaged one marked), and retention held them to KEEP.
    ok, listed = await call(arena, "manage_snapshots", action="list")
    assert ok and isinstance(listed, dict), listed
    ids = [item["snapshot"] for item in listed["snapshots"]]
    on_disk = stored_snapshots(arena.dirs)
    assert sorted(ids) == sorted(on_disk), f"stored but not listed: {set(on_disk) - set(ids)}"
    assert sorted(ids) == sorted(taken[-KEEP:]), (ids, taken)
    for item in listed["snapshots"]:
        assert "damaged" in item or isinstance(item["variables"], int), item
    for meta in (arena.dirs.root / "snapshots").glob("*/*/meta.json"):
        assert meta.stat().st_size <= MAX_META_BYTES // 4, f"{meta} holds {meta.stat().st_size} bytes"
    assert sum(on_disk.values()) <= KEEP * 8 * MIB, on_disk

    # A kept snapshot still restores, and its owner deletes every one of them.
    ok, restored = await call(arena, "manage_snapshots", action="restore", snapshot=ids[0])
    assert ok and isinstance(restored, dict), restored
    assert "7" in text_of(await run(arena.client, "print(value)", session_id=restored["session_id"]))
    await call(arena, "manage_sessions", action="close", session_id=restored["session_id"])
    for snapshot in ids:
        ok, deleted = await call(arena, "manage_snapshots", action="delete", snapshot=snapshot)
        assert ok, deleted
    ok, listed = await call(arena, "manage_snapshots", action="list")
    assert ok and isinstance(listed, dict) and listed["snapshots"] == [], listed
    assert stored_snapshots(arena.dirs) == {}
    await call(arena, "manage_sessions", action="close", session_id=session)
    await assert_still_serving(arena)
