"""A session's record crosses from a dead agent to its successor as plain JSON, and is read back whole or not at all.

Fast checks of sessions/adoption.py's data (no process, no sandbox: tests/cluster runs the whole take-over): the
record of a session with limits, mounts, an outbox and a uid survives the round trip as it was; a record whose
fds do not match what came with it, or which this version cannot read, is refused (its sandbox then ends); an
allowlist session's decisions come back within the next server's ceiling, never beyond it.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from coderunner.egress.audit import DecisionLog
from coderunner.egress.policy_proxy import EgressProxy
from coderunner.policy.egress import EgressPolicy
from coderunner.sandbox import Limits, Mount
from coderunner.sandbox.handover import Handed
from coderunner.sessions.adoption import (
    DIRS_LOCK,
    EGRESS_LISTENER,
    GATE,
    KERNEL_OUTPUT,
    KERNEL_PIDFD,
    RECORDS,
    UID_CLAIM,
    KernelRecord,
    SessionRecord,
    read,
)
from coderunner.sessions.sandbox_options import SandboxOptions
from coderunner.vocabulary.host_identity import HostIdentity


def a_record(fds: tuple[str, ...] = (GATE, DIRS_LOCK, UID_CLAIM, KERNEL_PIDFD, KERNEL_OUTPUT)) -> SessionRecord:
    options = SandboxOptions(
        network="none", limits=Limits(memory_mb=512, cpus=0.5, pids=256, disk_mb=64, tmp_mb=64), timeout_s=30.0,
        mounts=(Mount(Path("/srv/data"), "/data", writable=False),), client="alice",
    )  # fmt: skip
    return SessionRecord(
        session_id="abc-node-key", owner="alice/1", options=options, generation=3, next_kernel=4,
        kernel=KernelRecord(2, "0a1b2c3d", {"key": "k" * 64, "transport": "ipc", "ip": "/r/k2", "shell_port": 1001},
                            "template", 4242),
        dirs_key="0a1b2c3d", user=HostIdentity("uid 1100042", 1100042, 1100042),
        workspace_path=Path("/w/0a1b2c3d"), workspace_size_mb=64, workspace_image=Path("/w/0a1b2c3d.img"),
        workspace_tmpfs=False, mounts=(Mount(Path("/r/0a1b2c3d/host/staged/outputs"), "/outputs", writable=True),),
        staged_dir=Path("/r/0a1b2c3d/host/staged"), export_mount="/outputs",
        host_view=(Mount(Path("/srv/data"), "/data", writable=False),), owners={"/data": (1100042, 1100042)},
        cgroup_version=2, cgroup_dirs={"unified": Path("/sys/fs/cgroup/x/0a1b2c3d")}, fds=fds,
        extra={"request": {"cpus": 0.5, "memory_mb": 512, "backend": "bwrap", "labels": [["pool", "a"]]}},
    )  # fmt: skip


def handed_with(record: str, count: int) -> Handed:
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(count + 2)]
    return Handed("entry", fds[0], [fds[1]], [], record, fds[2:])


def test_a_record_comes_back_as_it_was_written() -> None:
    record = a_record()
    text = RECORDS.dump_json(record).decode()
    assert RECORDS.validate_json(text) == record
    handed = handed_with(text, len(record.fds))
    try:
        assert read(handed) == record
    finally:
        handed.close()


def test_a_record_that_names_other_fds_than_came_or_cannot_be_read_is_refused() -> None:
    text = RECORDS.dump_json(a_record()).decode()
    for handed in (handed_with(text, 3), handed_with(text.replace('"generation":3', '"generation":"x"'), 5),
                   handed_with("not json", 5)):  # fmt: skip
        try:
            assert read(handed) is None
        finally:
            handed.close()
    without_gate = RECORDS.dump_json(a_record((DIRS_LOCK,))).decode()
    handed = handed_with(without_gate, 1)
    try:
        assert read(handed) is None  # a sandbox is never held without its gate and its dirs' lock
    finally:
        handed.close()


def test_an_allowlist_sessions_decisions_cross_and_stay_within_the_next_servers_ceiling() -> None:
    record = dataclasses.replace(
        a_record((GATE, DIRS_LOCK, EGRESS_LISTENER)),
        options=dataclasses.replace(
            a_record().options, network="allowlist", allow=("a.example.org", "*.docs.example.org")
        ),
        egress_allowed=("a.example.org", "*.docs.example.org", "c.example.org", "gone.example.org"),
        egress_declined=("b.example.org",),
    )
    assert RECORDS.validate_json(RECORDS.dump_json(record)) == record
    # The next server's ceiling no longer covers one host the user had allowed: that one is dropped.
    ceiling = EgressPolicy.parse(["*.example.org"]).narrowed(["a.example.org", "*.docs.example.org", "c.example.org",
                                                            "b.example.org"])  # fmt: skip
    session = EgressPolicy.parse(["a.example.org", "*.docs.example.org"])
    proxy = EgressProxy(session, ceiling, session_id="s", log=DecisionLog("s"))
    assert proxy.restore(record.egress_allowed, record.egress_declined) == ["gone.example.org"]
    assert proxy.policy.hosts == ("a.example.org", "*.docs.example.org", "c.example.org")
    assert proxy.declined == {"b.example.org"} and not proxy.policy.allows("b.example.org", 80)
