"""A record of every egress decision: a bounded per-session log and an append-only JSONL file.

The per-session log answers `session_status` (recent entries, totals) and lets a `run_python` reply
name the hosts denied during that call (mark / denied_since). The file keeps everything, across
sessions, rotated by size; writing it never blocks the event loop and never grows a queue unbounded.
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


class AuditFile:
    """Append-only JSONL at path (in a host-only dir), rotated to path.1 .. path.keep past max_bytes.

    Lines are queued (bounded) and written by one worker thread; when the queue is full a line is
    dropped and counted, and a `{"dropped": N}` line is written once there is room. The file is opened
    with O_NOFOLLOW|O_APPEND|O_CREAT and mode 0600: a link planted at the path is refused.
    """

    def __init__(self, path: Path, max_bytes: int = 8 * MiB, keep: int = 3, queue_lines: int = 10_000) -> None:
        if max_bytes < 1 or keep < 1 or queue_lines < 1:
            raise ValueError("max_bytes, keep and queue_lines must be positive")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.keep = keep
        self._name = self.path.name
        self._dir_fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            self._fd = self._open()
        except BaseException:
            os.close(self._dir_fd)
            raise
        self._size = os.fstat(self._fd).st_size
        self._queue: queue.Queue[tuple[str, Decision]] = queue.Queue(maxsize=queue_lines)
        self._lock = threading.Lock()
        self._dropped = 0
        self._unreported = 0
        self._stop = threading.Event()
        self._worker = threading.Thread(target=self._run, name=f"egress-audit:{self._name}", daemon=True)
        self._worker.start()

    def write(self, session_id: str, decision: Decision) -> None:
        """Queue one line; never blocks (drops and counts when the queue is full)."""
        if self._stop.is_set():
            self._count_dropped(1)
            return
        try:
            self._queue.put_nowait((session_id, decision))
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
                session_id, decision = self._queue.get(timeout=_WORKER_POLL_S)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            try:
                with self._lock:
                    unreported, self._unreported = self._unreported, 0
                if unreported:
                    self._append({"at": round(time.time(), 3), "dropped": unreported})
                self._append(_line(session_id, decision))
            except OSError as exc:
                self._count_dropped(1)
                log.warning("egress audit log %s: a line could not be written: %s", self.path, exc)
            finally:
                self._queue.task_done()

    def _append(self, obj: dict[str, object]) -> None:
        data = (json.dumps(obj, ensure_ascii=True, separators=(",", ":")) + "\n").encode()
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


class DecisionLog:
    """One session's decisions: a bounded ring of recent entries, running totals, marks for denials."""

    def __init__(self, session_id: str, *, capacity: int = 200, sink: AuditFile | None = None) -> None:
        self.session_id = session_id
        self.sink = sink
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
        if self.sink is not None:
            self.sink.write(self.session_id, decision)

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
