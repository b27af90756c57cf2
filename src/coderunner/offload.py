"""Blocking file and /proc work, off the event loop: one bounded pool of worker threads per server.

Every file read, write, copy, listing, spill write and /proc walk a call makes runs here, so one
client copying 512 MiB never stalls another's `run_python`. The pool is one CapacityLimiter of
FILE_WORKERS threads (a constant: the work is disk-bound, and more threads than this only queue in
the kernel). Bulk copies (upload, download, whole-file reads) take at most BULK_WORKERS of them,
so the light work every call does (the copy-out after a run, a spill write, a status walk) always
finds a free thread instead of queueing behind copies of hundreds of MiB.

The limiters are per event loop (anyio RunVar), as anyio's own default thread limiter is.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import anyio.to_thread
from anyio.lowlevel import RunVar

#: Worker threads for all blocking file and /proc work of one server.
FILE_WORKERS = 4
#: Of those, how many bulk copies may hold at once; the rest stay free for per-call work.
BULK_WORKERS = FILE_WORKERS - 1

T = TypeVar("T")
R = TypeVar("R")

_workers: RunVar[anyio.CapacityLimiter] = RunVar("coderunner_file_workers")
_bulk: RunVar[anyio.CapacityLimiter] = RunVar("coderunner_bulk_workers")


def loop_local(var: RunVar[T], make: Callable[[], T]) -> T:
    """`var`'s value in the running event loop, made by `make` at its first use there."""
    try:
        return var.get()
    except LookupError:
        value = make()
        var.set(value)
        return value


def _limiter(var: RunVar[anyio.CapacityLimiter], tokens: int) -> anyio.CapacityLimiter:
    return loop_local(var, lambda: anyio.CapacityLimiter(tokens))


def file_workers() -> anyio.CapacityLimiter:
    """The shared limiter of this event loop's file worker threads."""
    return _limiter(_workers, FILE_WORKERS)


async def off_loop(function: Callable[..., T], *args: Any, bulk: bool = False, **kwargs: Any) -> T:
    """`function(*args, **kwargs)` in a file worker thread; `bulk` for copies that may run for seconds.

    The thread runs to its end even if the caller is cancelled (an fd-based copy is never left
    half-way by a cancelled call; the work itself is bounded in bytes).
    """
    call = functools.partial(function, *args, **kwargs)
    if not bulk:
        return await anyio.to_thread.run_sync(call, limiter=file_workers())
    async with _limiter(_bulk, BULK_WORKERS):
        return await anyio.to_thread.run_sync(call, limiter=file_workers())


async def alongside(work: Callable[[], T], main: Callable[[], Awaitable[R]]) -> tuple[R, T]:
    """`main()` awaited while `work()` (blocking, bounded) runs in a bulk file worker: both results.

    For host work that needs nothing of what `main` does (a snapshot's workspace copy while the
    guest pickles; a restore's state staged while the kernel starts), so the two take the longer
    of their times, not the sum. `work` always runs to its end before this returns or raises
    (nothing is left touching fds the caller closes next); `main`'s error is raised first, else `work`'s.
    """
    done: list[T] = []
    failed: list[Exception] = []

    async def run_work() -> None:
        try:
            done.append(await off_loop(work, bulk=True))
        except Exception as exc:  # raised below, once `main` is through: never wrapped in a group
            failed.append(exc)

    main_failed: Exception | None = None
    async with anyio.create_task_group() as group:
        group.start_soon(run_work)
        try:
            answer = await main()
        except Exception as exc:
            main_failed = exc
    if main_failed is not None:
        raise main_failed
    if failed:
        raise failed[0]
    return answer, done[0]
