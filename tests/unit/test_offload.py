"""offload.alongside: blocking host work beside an awaited call (a snapshot's workspace copy while the
guest pickles; a restore's state staged while the kernel starts). The work always ends before the
caller goes on (it may hold fds the caller closes next), and errors come out unwrapped."""

from __future__ import annotations

import threading
import time

import anyio
import pytest

from coderunner.offload import alongside

pytestmark = pytest.mark.anyio


async def test_both_results_and_the_two_overlap() -> None:
    started = threading.Event()

    def work() -> str:
        started.set()
        time.sleep(0.2)
        return "copied"

    async def main() -> str:
        # The work is under way while this runs: it is not queued behind it.
        await anyio.to_thread.run_sync(started.wait, 10)
        return "pickled" if started.is_set() else "alone"

    assert await alongside(work, main) == ("pickled", "copied")


async def test_mains_error_comes_out_unwrapped_once_the_work_has_ended() -> None:
    ended: list[bool] = []

    def work() -> None:
        time.sleep(0.2)
        ended.append(True)

    async def main() -> None:
        raise LookupError("the guest refused")

    with pytest.raises(LookupError, match="the guest refused"):
        await alongside(work, main)
    assert ended == [True], "the work ran to its end before the error came out"


async def test_the_works_error_comes_out_after_main() -> None:
    done: list[str] = []

    def work() -> None:
        raise OSError(28, "No space left on device")

    async def main() -> None:
        await anyio.sleep(0.05)
        done.append("main")

    with pytest.raises(OSError, match="No space left"):
        await alongside(work, main)
    assert done == ["main"]
