"""Calls about what one node keeps (its snapshot store, its workspaces), run there as Ray tasks.

A store lookup or a workspace deletion needs no sandbox and no session: a task pinned to the node, with
no CPU asked, runs it by a SessionManager of the node's own settings (no pool) and returns the answer.
One-shot runs are not tasks: they are calls of a node agent (agent.py, oneshot_side.py), whose warm
sandboxes serve them.
"""

from __future__ import annotations

import contextlib
from typing import Any

import anyio
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from coderunner.cluster.agent import node_settings
from coderunner.cluster.remote_session import CALL_S, cause_of
from coderunner.config import Settings
from coderunner.errors import SessionError
from coderunner.sandbox import make_backend
from coderunner.sessions.manager import SessionManager


def node_call(settings: dict[str, Any], method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """On the node: one SessionHost call about what the node keeps (snapshot_listing, delete_workspace, ...)
    by a manager of its own, which starts no sandbox."""
    chosen = node_settings(settings, pool_size=0, oneshot_ready=False)

    async def call() -> Any:
        async with SessionManager(chosen, make_backend(chosen)) as manager:
            return await getattr(manager, method)(*args, **kwargs)

    return anyio.run(call)


NodeCall = ray.remote(node_call)


class NodeCalls:
    """Runs calls about what one node keeps as tasks pinned to that node."""

    def __init__(self, settings: Settings, settings_sent: dict[str, Any]) -> None:
        self.settings = settings
        self.settings_sent = settings_sent

    async def run_on(self, node_id: str, method: str, *args: Any) -> Any:
        """A call about what one node keeps (its snapshot store, its workspaces): no sandbox, no CPU asked."""
        strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
        ref = NodeCall.options(max_retries=0, num_cpus=0, scheduling_strategy=strategy).remote(
            self.settings_sent, method, args, {}
        )
        return await self._result(ref, self.settings.snapshot_timeout_s + CALL_S)

    async def _result(self, ref: Any, bound: float) -> Any:
        """The task's answer within `bound`; what it raised as the tools would see it here."""
        try:
            with anyio.fail_after(bound):
                return await ref
        except ray.exceptions.RayTaskError as exc:
            raise cause_of(exc) from None
        except ray.exceptions.RayError as exc:  # its worker or node went away
            raise SessionError(f"the call was lost with its node ({type(exc).__name__}); try again") from None
        except TimeoutError:
            await _cancel(ref)
            raise SessionError(f"the call did not end within {bound:g}s on its node; it was stopped") from None
        except BaseException:
            await _cancel(ref)
            raise


async def _cancel(ref: Any) -> None:
    """Stop a task whatever happens to its caller (force: its worker, and so its sandbox, is killed)."""
    with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
        await anyio.to_thread.run_sync(lambda: ray.cancel(ref, force=True))
