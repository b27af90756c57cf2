"""NodeTable: a front door's copy of Ray's node table, which creates and one-shot runs read without a wait.

Every create and one-shot run needs the cluster's nodes (what each could hold, which are alive) to
refuse at once what nothing can hold and to choose where it goes. Asking Ray's GCS each time cost a
worker-thread hop and a GCS call (1.5-2 ms) on every create and every one-shot run, for a table that
changes when a node joins or leaves. A copy younger than FRESH_S is used as it is, and one older than
REFRESH_S is asked again in the background after it is used, so a front door in use keeps it seconds
old without a call in any create's way.

A copy some seconds old loses little that Ray's own table would have given: Ray marks a node dead only
once its health checks have failed for about as long (5 checks 3 s apart by default), so placement
already meets agents that stopped answering, and copes (the others are asked; a create that still
fails says so). After such a failure the copy is dropped (`stale`): the next create asks Ray.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import anyio
import ray
from anyio.abc import TaskGroup

log = logging.getLogger(__name__)

#: A copy this old at most is used as it is.
FRESH_S = 10.0
#: A copy older than this is asked again in the background once it has been used.
REFRESH_S = 1.0


class NodeTable:
    """Ray's nodes (`ray.nodes()` entries), as of at most FRESH_S ago."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._nodes: list[dict[str, Any]] | None = None
        self._taken_at = 0.0
        self._refreshing = False

    async def current(self, task_group: TaskGroup) -> list[dict[str, Any]]:
        """The nodes: the copy if fresh enough (asked again in `task_group` when it is aging), else asked now."""
        age = self._clock() - self._taken_at
        if self._nodes is None or age > FRESH_S:
            return await self.refresh()
        if age > REFRESH_S and not self._refreshing:
            self._refreshing = True
            task_group.start_soon(self._refresh_quietly)
        return self._nodes

    async def refresh(self) -> list[dict[str, Any]]:
        """The nodes as Ray's GCS says now (kept as the copy)."""
        asked_at = self._clock()
        nodes: list[dict[str, Any]] = await anyio.to_thread.run_sync(ray.nodes)
        if asked_at >= self._taken_at:  # a slower answer asked earlier never replaces a newer one
            self._nodes, self._taken_at = nodes, asked_at
        return nodes

    def stale(self) -> None:
        """Something the copy said did not hold (an agent lost, no room where it looked): ask Ray next time."""
        self._nodes = None

    async def _refresh_quietly(self) -> None:
        try:
            await self.refresh()
        except Exception as exc:  # the GCS is unreachable for a moment: the next create asks itself
            log.info("refreshing the node table: %r", exc)
            self.stale()
        finally:
            self._refreshing = False
