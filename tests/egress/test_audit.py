"""DecisionLog (ring, totals, marks) and AuditFile (JSONL, rotation, bounds, refusing planted links)."""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

import pytest

from coderunner.egress import audit as audit_module
from coderunner.egress.audit import HOST_BURST, SESSION_BURST, WINDOW_S, AuditFile, Decision, DecisionLog


def decision(host: str = "example.com", port: int = 443, allowed: bool = True, **kw: int) -> Decision:
    return Decision(at=1700000000.0, host=host, port=port, allowed=allowed, reason="r", **kw)


def test_ring_keeps_the_last_entries_and_totals_cover_all() -> None:
    log = DecisionLog("s1", capacity=5)
    for i in range(12):
        log.record(decision(f"h{i}.example.com", allowed=i % 3 != 0, sent=10, received=100))
    recent = log.recent(3)
    assert [d.host for d in recent] == ["h9.example.com", "h10.example.com", "h11.example.com"]
    assert len(log.recent(100)) == 5
    assert log.recent(0) == []
    assert log.totals() == {"allowed": 8, "denied": 4, "sent": 120, "received": 1200}


def test_denied_since_names_distinct_denials_after_the_mark() -> None:
    log = DecisionLog("s1")
    log.record(decision("before.example.com", allowed=False))
    mark = log.mark()
    log.record(decision("a.example.com", allowed=False))
    log.record(decision("ok.example.com", allowed=True))
    log.record(decision("a.example.com", allowed=False))
    log.record(decision("2001:db8::1", port=80, allowed=False))
    assert log.denied_since(mark) == ["a.example.com:443", "[2001:db8::1]:80"]
    assert log.denied_since(log.mark()) == []
    for i in range(100):
        log.record(decision(f"d{i}.example.com", allowed=False))
    assert len(log.denied_since(mark)) == 20  # bounded, for a reply


def test_hostile_long_hosts_are_bounded_in_records() -> None:
    log = DecisionLog("s1")
    log.record(decision("x" * 10_000, allowed=False))
    assert len(log.recent(1)[0].host) < 300


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_audit_file_writes_jsonl_with_the_session_and_mode_0600(tmp_path: Path) -> None:
    audit = AuditFile(tmp_path / "egress.jsonl")
    log = DecisionLog("sess-1", sink=audit)
    log.record(decision("example.com", sent=5, received=7))
    log.record(decision("evil.example.org", allowed=False))
    assert audit.flush()
    audit.close()
    got = lines(tmp_path / "egress.jsonl")
    assert [(g["session"], g["host"], g["allowed"], g["sent"], g["received"]) for g in got] == [
        ("sess-1", "example.com", True, 5, 7),
        ("sess-1", "evil.example.org", False, 0, 0),
    ]
    assert stat.S_IMODE((tmp_path / "egress.jsonl").stat().st_mode) == 0o600


def test_audit_file_rotates_by_size_and_keeps_a_bounded_number(tmp_path: Path) -> None:
    path = tmp_path / "egress.jsonl"
    audit = AuditFile(path, max_bytes=600, keep=2)
    for i in range(200):
        audit.write("s", decision(f"h{i}.example.com"))
    assert audit.flush()
    audit.close()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["egress.jsonl", "egress.jsonl.1", "egress.jsonl.2"]
    for name in names:
        assert (tmp_path / name).stat().st_size <= 600
    # The newest lines are in the live file, the ones before in .1, then .2; nothing older is kept.
    newest = [g["host"] for g in lines(path)]
    assert newest[-1] == "h199.example.com"
    older = [g["host"] for g in lines(tmp_path / "egress.jsonl.1")]
    assert older[-1] == f"h{int(newest[0][1:].split('.')[0]) - 1}.example.com"


def test_audit_file_drops_and_counts_when_the_queue_is_full(tmp_path: Path) -> None:
    path = tmp_path / "egress.jsonl"
    audit = AuditFile(path, queue_lines=5)
    gate = threading.Event()
    real_append = audit._append_data

    def slow_append(data: bytes) -> None:
        gate.wait(10)
        real_append(data)

    audit._append_data = slow_append  # type: ignore[method-assign]
    for i in range(50):
        audit.write("s", decision(f"h{i}.example.com"))
    assert audit.dropped >= 40
    gate.set()
    assert audit.flush()
    audit.write("s", decision("after.example.com"))
    assert audit.flush()
    audit.close()
    got = lines(path)
    dropped_lines = [g for g in got if "dropped" in g]
    assert dropped_lines and sum(g["dropped"] for g in dropped_lines) == audit.dropped
    assert got[-1]["host"] == "after.example.com"
    assert len(got) <= 8  # at most: one line in flight, five queued, the dropped line, the last one


def test_audit_file_refuses_a_planted_symlink(tmp_path: Path) -> None:
    canary = tmp_path / "canary.txt"
    canary.write_text("untouched")
    (tmp_path / "egress.jsonl").symlink_to(canary)
    with pytest.raises(OSError, match="symbolic link"):
        AuditFile(tmp_path / "egress.jsonl")
    assert canary.read_text() == "untouched"


def test_audit_file_refuses_a_planted_fifo_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "egress.jsonl")
    with pytest.raises(OSError):
        AuditFile(tmp_path / "egress.jsonl")


def test_rotation_does_not_follow_a_link_planted_at_a_rotated_name(tmp_path: Path) -> None:
    canary = tmp_path / "canary.txt"
    canary.write_text("untouched")
    (tmp_path / "egress.jsonl.1").symlink_to(canary)
    audit = AuditFile(tmp_path / "egress.jsonl", max_bytes=300, keep=2)
    for i in range(20):
        audit.write("s", decision(f"h{i}.example.com"))
    assert audit.flush()
    audit.close()
    assert canary.read_text() == "untouched"


# --- one session's flood never costs another session its history (issue 25, finding 4) -----------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1700000000.0

    def __call__(self) -> float:
        return self.now


def denials_of(got: list[dict], session: str) -> int:
    """What the file says a session's denials were: one per plain line, N per folded line."""
    return sum(g.get("folded", 1) for g in got if g.get("session") == session and g["allowed"] is False)


def test_a_flood_from_one_session_leaves_anothers_earlier_records_and_counts_exactly(tmp_path: Path) -> None:
    """Without a share, 20k denial lines (about 3 MB) rotate a 4 x 64 KiB file many times over."""
    path = tmp_path / "egress.jsonl"
    audit = AuditFile(path, max_bytes=64 * 1024, keep=3)
    clock = FakeClock()
    bystander = DecisionLog("sess-b", sink=audit, clock=clock)
    for i in range(5):
        bystander.record(decision(f"b{i}.example.com", sent=i))
    bystander.record(decision("denied-b.example.com", allowed=False))
    flooder = DecisionLog("sess-a", sink=audit, clock=clock)
    flooded = 0
    for minute in range(60):
        for i in range(400):
            clock.now += 0.1
            flooder.record(decision(f"h{i % 50}.evil.example", port=443 + minute % 2, allowed=False))
            flooded += 1
    flooder.close()
    bystander.close()
    assert audit.flush()
    audit.close()
    got = [g for name in ["egress.jsonl.3", "egress.jsonl.2", "egress.jsonl.1", "egress.jsonl"]
           if (tmp_path / name).exists() for g in lines(tmp_path / name)]  # fmt: skip
    ours = [g["host"] for g in got if g.get("session") == "sess-b"]
    assert ours == [f"b{i}.example.com" for i in range(5)] + ["denied-b.example.com"]
    assert denials_of(got, "sess-a") == flooded
    share = sum(len(audit_module.encode(g)) for g in got if g.get("session") == "sess-a")
    assert share <= audit.session_bytes + 1024  # its share, plus the one closing line
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= 4 * 64 * 1024


def test_denials_past_the_burst_fold_into_one_line_per_host_and_window(tmp_path: Path) -> None:
    path = tmp_path / "egress.jsonl"
    audit = AuditFile(path)
    clock = FakeClock()
    log = DecisionLog("s", sink=audit, clock=clock)
    for _ in range(100):
        log.record(decision("a.evil.example", allowed=False))
    assert log.totals()["denied"] == 100  # the session's own log keeps every decision
    log.record(decision("ok.example.com", sent=3))  # allowed lines are not rate-limited
    clock.now += WINDOW_S  # the window ends: its counts are written with the next decision
    log.record(decision("b.evil.example", allowed=False))
    assert audit.flush()
    got = lines(path)
    assert [g["host"] for g in got] == ["a.evil.example"] * HOST_BURST + ["ok.example.com", "a.evil.example",
                                                                          "b.evil.example"]  # fmt: skip
    folded = got[HOST_BURST + 1]
    assert folded["folded"] == 100 - HOST_BURST and folded["allowed"] is False and folded["port"] == 443
    assert folded["reason"] == f"{100 - HOST_BURST} more denials of a.evil.example:443 in the last 60 s"
    assert folded["since"] == 1700000000.0 and folded["at"] == 1700000000.0 + WINDOW_S
    # Many hosts: the session burst, then one line per host, then one for all the rest ("*").
    for i in range(200):
        log.record(decision(f"h{i}.evil.example", allowed=False))
    log.close()
    assert audit.flush()
    audit.close()
    got = lines(path)[6:]
    assert len([g for g in got if "folded" not in g]) == SESSION_BURST - 1
    assert len([g for g in got if "folded" in g]) == audit_module.MAX_FOLDED_HOSTS + 1
    assert got[-1]["host"] == "*" and denials_of(got, "s") == 200


def test_a_session_past_its_share_writes_counts_at_close(tmp_path: Path) -> None:
    path = tmp_path / "egress.jsonl"
    audit = AuditFile(path, session_bytes=1000)
    log = DecisionLog("s", sink=audit, clock=FakeClock())
    for i in range(50):
        log.record(decision(f"ok{i}.example.com", sent=10, received=20))
    for i in range(10):
        log.record(decision(f"no{i}.example.com", allowed=False))
    log.close()
    assert audit.flush()
    audit.close()
    got = lines(path)
    assert sum(len(audit_module.encode(g)) for g in got[:-1]) <= 1000
    last = got[-1]
    written_allowed = [g for g in got[:-1] if g["allowed"]]
    assert last["host"] == "*" and last["folded_allowed"] == 50 - len(written_allowed)
    assert last["sent"] == 10 * last["folded_allowed"] and denials_of(got, "s") == 10
