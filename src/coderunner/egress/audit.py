"""A record of every egress decision: a bounded per-session log and an append-only JSONL file.

The per-session log answers `manage_sessions status` (recent entries, totals) and lets a `run_python` reply
name the hosts denied during that call (mark / denied_since). The file keeps every session's
decisions, rotated by size; writing it never blocks the event loop and never grows a queue unbounded.

One sandbox must not be able to wipe everyone's history by flooding denials (issue 25, finding 4),
so each session writes through a SessionAudit: a small burst of denial lines per window, then one
"N more denials of HOST" line per host and window (nothing lost as a count), and a byte share of
the file it can never exceed (see SessionAudit for why a share of one file, not a file per session).

One idea: the record of egress decisions, one record with two views: the bounded per-session log and the
rotated JSONL file.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import queue
import stat
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MiB = 1024 * 1024


@dataclass(frozen=True)
class Decision:
    """One decision: allowed connections are recorded when they close (with bytes), denials at once."""

    at: float
    host: str
    port: int
    allowed: bool
    reason: str
    sent: int = 0
    received: int = 0


#: Longest host kept in a record: the proxy records what a hostile client sent, so it is bounded.
MAX_HOST_CHARS = 255
_MAX_DENIED_KEPT = 1_000
_MAX_DENIED_NAMED = 20
_WORKER_POLL_S = 0.2

# Per-session rate limit of the audit file (module constants, not settings: the defaults fit any
# server; a session's own log and manage_sessions status keep every decision whatever these say).
#: Denial lines a session writes one by one per window, and of those at most HOST_BURST per host:port.
SESSION_BURST = 20
HOST_BURST = 3
#: The window: later denials in it are counted per host:port and written as one line when it ends.
WINDOW_S = 60.0
#: host:port counted apart in one window; denials of further hosts share one count ("*").
MAX_FOLDED_HOSTS = 32
#: A session may fill at most 1/SESSION_SHARE of the audit file's bytes ((keep + 1) * max_bytes).
SESSION_SHARE = 32


class AuditFile:
    """Append-only JSONL at path (in a host-only dir), rotated to path.1 .. path.keep past max_bytes.

    On disk at most (keep + 1) * max_bytes (a file passes max_bytes only by a single line longer
    than that); one session's lines take at most session_bytes of it (SessionAudit), plus one
    closing line of fixed size. Lines are queued (bounded) and written by one worker thread; when
    the queue is full a line is dropped and counted, and a `{"dropped": N}` line is written once
    there is room. The file is opened with O_NOFOLLOW|O_APPEND|O_CREAT and mode 0600: a link
    planted at the path is refused.
    """

    def __init__(
        self,
        path: Path,
        max_bytes: int = 8 * MiB,
        keep: int = 3,
        queue_lines: int = 10_000,
        session_bytes: int | None = None,
    ) -> None:
        if max_bytes < 1 or keep < 1 or queue_lines < 1:
            raise ValueError("max_bytes, keep and queue_lines must be positive")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.keep = keep
        #: What one session's lines may take of the file over its life (SessionAudit keeps to it).
        self.session_bytes = (keep + 1) * max_bytes // SESSION_SHARE if session_bytes is None else session_bytes
        self._name = self.path.name
        self._dir_fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            self._fd = self._open()
        except BaseException:
            os.close(self._dir_fd)
            raise
        self._size = os.fstat(self._fd).st_size
        self._queue: queue.Queue[bytes] = queue.Queue(maxsize=queue_lines)
        self._lock = threading.Lock()
        self._dropped = 0
        self._unreported = 0
        self._stop = threading.Event()
        self._worker = threading.Thread(target=self._run, name=f"egress-audit:{self._name}", daemon=True)
        self._worker.start()

    def write(self, session_id: str, decision: Decision) -> None:
        """Queue the line of one decision as it is (no rate limit: sessions go through SessionAudit)."""
        self.write_data(encode(_line(session_id, decision)))

    def write_data(self, data: bytes) -> None:
        """Queue one encoded line; never blocks (drops and counts when the queue is full)."""
        if self._stop.is_set():
            self._count_dropped(1)
            return
        try:
            self._queue.put_nowait(data)
        except queue.Full:
            self._count_dropped(1)

    @property
    def dropped(self) -> int:
        """Lines dropped so far because the queue was full (or the file could not be written)."""
        with self._lock:
            return self._dropped

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait (blocking, bounded) until every queued line is written; True if it got there."""
        with self._queue.all_tasks_done:
            return self._queue.all_tasks_done.wait_for(lambda: self._queue.unfinished_tasks == 0, timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (bounded wait), stop the worker and close the file."""
        if self._stop.is_set():
            return
        self.flush(timeout_s)
        self._stop.set()
        self._worker.join(timeout_s)
        if self._worker.is_alive():
            log.warning("egress audit writer for %s did not stop in %.0f s", self.path, timeout_s)
            return  # it still holds the fd; the daemon thread dies with the process
        os.close(self._fd)
        os.close(self._dir_fd)

    # The worker thread: the only code that touches the file after __init__.

    def _run(self) -> None:
        while True:
            try:
                data = self._queue.get(timeout=_WORKER_POLL_S)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            try:
                with self._lock:
                    unreported, self._unreported = self._unreported, 0
                if unreported:
                    self._append({"at": round(time.time(), 3), "dropped": unreported})
                self._append_data(data)
            except OSError as exc:
                self._count_dropped(1)
                log.warning("egress audit log %s: a line could not be written: %s", self.path, exc)
            finally:
                self._queue.task_done()

    def _append(self, obj: dict[str, object]) -> None:
        self._append_data(encode(obj))

    def _append_data(self, data: bytes) -> None:
        if self._size > 0 and self._size + len(data) > self.max_bytes:
            self._rotate()
        os.write(self._fd, data)
        self._size += len(data)

    def _rotate(self) -> None:
        os.close(self._fd)
        self._fd = -1
        dfd = self._dir_fd
        for k in range(self.keep, 1, -1):
            with contextlib.suppress(FileNotFoundError):
                os.replace(f"{self._name}.{k - 1}", f"{self._name}.{k}", src_dir_fd=dfd, dst_dir_fd=dfd)
        os.replace(self._name, f"{self._name}.1", src_dir_fd=dfd, dst_dir_fd=dfd)
        self._fd = self._open()
        self._size = 0

    def _open(self) -> int:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        try:
            fd = os.open(self._name, flags, 0o600, dir_fd=self._dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise OSError(exc.errno, f"refusing the egress audit log {self.path}: it is a symbolic link") from None
            raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            os.close(fd)
            raise OSError(errno.EPERM, f"refusing the egress audit log {self.path}: not a regular file of ours")
        os.fchmod(fd, 0o600)  # an older file keeps no wider mode than a new one gets
        os.set_blocking(fd, True)
        return fd

    def _count_dropped(self, n: int) -> None:
        with self._lock:
            self._dropped += n
            self._unreported += n


def encode(obj: dict[str, object]) -> bytes:
    """One JSONL line, ASCII only."""
    return (json.dumps(obj, ensure_ascii=True, separators=(",", ":")) + "\n").encode()


def _line(session_id: str, d: Decision) -> dict[str, object]:
    return {
        "at": round(d.at, 3),
        "session": session_id,
        "host": d.host,
        "port": d.port,
        "allowed": d.allowed,
        "reason": d.reason,
        "sent": d.sent,
        "received": d.received,
    }


@dataclass
class _Fold:
    """Denials of one host:port in the current window not written one by one."""

    host: str
    port: int
    count: int = 0


@dataclass
class _Overflow:
    """What did not fit in the session's share: written as one line when the session closes."""

    denied: int = 0
    allowed: int = 0
    sent: int = 0
    received: int = 0

    def __bool__(self) -> bool:
        return bool(self.denied or self.allowed)


class SessionAudit:
    """One session's way into the shared audit file: rate-limited denials, a byte share, exact counts.

    Per window of WINDOW_S, the first SESSION_BURST denials (at most HOST_BURST of one host:port)
    are written as they come; later ones are counted per host:port (MAX_FOLDED_HOSTS of them, the
    rest together as host "*") and written as one line each, with "folded": N, when the window has
    ended (on the session's next decision) or at close. Allowed connections are written one by one.
    Every line counts against session_bytes; one that does not fit is counted instead and the
    counts are written as one closing line. So for each session, the denial lines without "folded"
    plus the sum of "folded" equal its denials, and it never holds more than session_bytes (plus
    that one line) of the file.

    Why a share of one file rather than a file per session: the file keeps its path, format and
    on-disk bound ((keep + 1) * max_bytes) for everything that reads it, and files per session
    would pile up with every session ever opened unless old ones were pruned, which again lets
    sessions evict each other. With a share, a session can displace at most session_bytes of
    others' history (1/SESSION_SHARE of the file) however long it floods; only many sessions
    over time age the file, as they should.
    """

    def __init__(self, session_id: str, sink: AuditFile, clock: Callable[[], float] = time.time) -> None:
        self.session_id = session_id
        self.sink = sink
        self.clock = clock
        self._lock = threading.Lock()
        self._budget = sink.session_bytes
        self._spent = 0
        self._window_start: float | None = None
        self._written = 0
        self._per_host: dict[tuple[str, int], int] = {}
        self._folds: dict[str, _Fold] = {}
        self._over = _Overflow()

    @property
    def spent(self) -> int:
        """Bytes of this session's lines queued for the file so far."""
        with self._lock:
            return self._spent

    def record(self, decision: Decision) -> None:
        with self._lock:
            now = self.clock()
            if self._window_start is None or not 0 <= now - self._window_start < WINDOW_S:
                self._end_window(now)
                self._window_start = now
            if decision.allowed:
                self._emit(_line(self.session_id, decision), _Overflow(0, 1, decision.sent, decision.received))
                return
            key = (decision.host, decision.port)
            if self._written < SESSION_BURST and self._per_host.get(key, 0) < HOST_BURST:
                self._written += 1
                self._per_host[key] = self._per_host.get(key, 0) + 1
                self._emit(_line(self.session_id, decision), _Overflow(1, 0, decision.sent, decision.received))
                return
            name = _host_port(*key)
            if name not in self._folds and len(self._folds) >= MAX_FOLDED_HOSTS:
                name = "*"
            fold = self._folds.setdefault(name, _Fold(*key) if name != "*" else _Fold("*", 0))
            fold.count += 1

    def close(self) -> None:
        """Write the open window's counts and, if the share ran out, the closing line."""
        with self._lock:
            self._end_window(self.clock())
            self._window_start = None
            if self._over:
                over, self._over = self._over, _Overflow()
                self.sink.write_data(encode(self._overflow_line(over)))

    def _end_window(self, now: float) -> None:
        since = self._window_start if self._window_start is not None else now
        for name, fold in self._folds.items():
            what = "other hosts" if name == "*" else name
            line: dict[str, object] = {
                "at": round(now, 3),
                "session": self.session_id,
                "host": fold.host,
                "port": fold.port,
                "allowed": False,
                "reason": f"{fold.count} more denials of {what} in the last {round(now - since)} s",
                "sent": 0,
                "received": 0,
                "folded": fold.count,
                "since": round(since, 3),
            }
            self._emit(line, _Overflow(denied=fold.count))
        self._folds = {}
        self._per_host = {}
        self._written = 0

    def _emit(self, obj: dict[str, object], stands_for: _Overflow) -> None:
        """Write one line if it fits in the share, else count what it stands for."""
        data = encode(obj)
        if self._spent + len(data) <= self._budget:
            self._spent += len(data)
            self.sink.write_data(data)
            return
        self._over.denied += stands_for.denied
        self._over.allowed += stands_for.allowed
        self._over.sent += stands_for.sent
        self._over.received += stands_for.received

    def _overflow_line(self, over: _Overflow) -> dict[str, object]:
        return {
            "at": round(self.clock(), 3),
            "session": self.session_id,
            "host": "*",
            "port": 0,
            "allowed": False,
            "reason": f"past this session's share of the audit log ({self._budget} bytes): "
            f"{over.denied} denials and {over.allowed} allowed connections counted, not listed",
            "sent": over.sent,
            "received": over.received,
            "folded": over.denied,
            "folded_allowed": over.allowed,
        }


class DecisionLog:
    """One session's decisions: a bounded ring of recent entries, running totals, marks for denials."""

    def __init__(
        self,
        session_id: str,
        *,
        capacity: int = 200,
        sink: AuditFile | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.session_id = session_id
        self.sink = sink
        self.audit = SessionAudit(session_id, sink, clock) if sink is not None else None
        self._lock = threading.Lock()
        self._ring: deque[Decision] = deque(maxlen=capacity)
        self._denied: deque[tuple[int, str]] = deque(maxlen=_MAX_DENIED_KEPT)
        self._seq = 0
        self._totals = {"allowed": 0, "denied": 0, "sent": 0, "received": 0}

    def record(self, decision: Decision) -> None:
        """Add one decision (ring, totals, the audit file if any). Cheap; safe on the event loop."""
        if len(decision.host) > MAX_HOST_CHARS:
            decision = Decision(
                decision.at,
                decision.host[:MAX_HOST_CHARS] + "...",
                decision.port,
                decision.allowed,
                decision.reason,
                decision.sent,
                decision.received,
            )
        with self._lock:
            self._seq += 1
            self._ring.append(decision)
            self._totals["allowed" if decision.allowed else "denied"] += 1
            self._totals["sent"] += decision.sent
            self._totals["received"] += decision.received
            if not decision.allowed:
                self._denied.append((self._seq, _host_port(decision.host, decision.port)))
        if self.audit is not None:
            self.audit.record(decision)

    def close(self) -> None:
        """The session is over: write what its audit still holds as counts (see SessionAudit)."""
        if self.audit is not None:
            self.audit.close()

    def recent(self, n: int = 10) -> list[Decision]:
        """The last n decisions, oldest first."""
        with self._lock:
            return list(self._ring)[-n:] if n > 0 else []

    def totals(self) -> dict[str, int]:
        """Counts over the whole session: allowed, denied, sent, received (bytes)."""
        with self._lock:
            return dict(self._totals)

    def mark(self) -> int:
        """A position to ask denied_since about later (e.g. at the start of a run_python call)."""
        with self._lock:
            return self._seq

    def since(self, mark: int) -> tuple[list[Decision], int]:
        """The decisions after `mark` still in the ring (the last, if more came) and the new mark (a mirror's)."""
        with self._lock:
            new = max(0, self._seq - mark)
            return (list(self._ring)[-new:] if new else []), self._seq

    def denied_since(self, mark: int) -> list[str]:
        """Distinct "host:port" denied since mark, in first-seen order (at most 20)."""
        seen: dict[str, None] = {}
        with self._lock:
            for seq, name in self._denied:
                if seq > mark and name not in seen:
                    seen[name] = None
                    if len(seen) == _MAX_DENIED_NAMED:
                        break
        return list(seen)


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
