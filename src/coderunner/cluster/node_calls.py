"""Host calls run on the nodes as Ray tasks: one-shot runs anywhere, store lookups on a given node.

One-shot runs (execute_code, check_only too) in cluster mode are each one a Ray task on some node.

A one-shot keeps nothing, so it is a task, not a call of a node agent (agent.py; moving it there is
still to do): a task placed by Ray with a session's CPUs, memory and one `coderunner-<backend>` unit
runs it through the node's own SessionManager and OneShotRunner, exactly as one machine would, and
returns the OneShotResult. Ray reuses its worker processes for tasks, so no process starts per run. An
allowlist run returns its proxy's decisions too (the reply's `network` line). A cancelled or over-time
run cancels its task (force: the worker is killed, and its sandbox dies with it: its init's gate ends
and the worker's watcher kills it).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import anyio
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from coderunner.cluster.agent import node_settings
from coderunner.cluster.oneshot_exports import OneShotExports, collect, node_export_folder
from coderunner.cluster.placement import Request, check_fits
from coderunner.cluster.remote_egress import delta_of
from coderunner.cluster.remote_session import CALL_S, cause_of
from coderunner.config import Settings
from coderunner.errors import SessionError
from coderunner.oneshot.local import LocalOneShots
from coderunner.sandbox import make_backend
from coderunner.sessions.manager import SessionManager
from coderunner.sessions.sandbox_options import SandboxOptions

if TYPE_CHECKING:
    from coderunner.cluster.wire import EgressDelta
    from coderunner.oneshot.runs import OneShotResult
    from coderunner.sessions.egress_wiring import SessionEgress


#: The calls node_call makes of the node's one-shot runs (the rest are its SessionManager's).
ONESHOT_CALLS = frozenset({"check_code", "language_versions"})


def node_call(settings: dict[str, Any], method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """On the node: one host call by its own manager: a OneShotHost call (check_code, language_versions) by
    the manager's LocalOneShots, or a SessionHost call about what the node keeps (delete_workspace, ...)."""
    # A manager per call: a sandbox started ahead for the next run would only be started and dropped.
    chosen = node_settings(settings, pool_size=0, oneshot_ready=False)

    async def call() -> Any:
        async with SessionManager(chosen, make_backend(chosen)) as manager:
            host = LocalOneShots.for_manager(manager) if method in ONESHOT_CALLS else manager
            return await getattr(host, method)(*args, **kwargs)

    return anyio.run(call)


NodeCall = ray.remote(node_call)


def node_oneshot(
    settings: dict[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[OneShotResult, EgressDelta | None, OneShotExports | None]:
    """On the node: one run_oneshot, with its allowlist proxy's decisions (read after the run) and what
    it exported, for the front door's export folder (oneshot_exports.py)."""
    proxies: list[SessionEgress] = []
    node = node_settings(settings, pool_size=0, oneshot_ready=False)
    with node_export_folder(node) as export:
        chosen = node.model_copy(update=export)

        async def call() -> tuple[OneShotResult, EgressDelta | None]:
            async with SessionManager(chosen, make_backend(chosen)) as manager:
                oneshots = LocalOneShots.for_manager(manager)
                result = await oneshots.run_oneshot(*args, on_egress=proxies.append, **kwargs)
                return result, delta_of(proxies[0], 0) if proxies else None

        result, delta = anyio.run(call)
        files = collect(export["export_dir"], args[2].client) if export and result.exported else None
    return result, delta, files


NodeOneShot = ray.remote(node_oneshot)


class NodeCalls:
    """Runs host calls as tasks on the cluster's nodes, at most `limit` at once from this front door."""

    def __init__(self, settings: Settings, settings_sent: dict[str, Any], backend: str) -> None:
        self.settings = settings
        self.settings_sent = settings_sent
        self.backend = backend
        self.slots = anyio.CapacityLimiter(settings.max_oneshot_runs)

    async def run(self, method: str, options: SandboxOptions, *args: Any, **kwargs: Any) -> Any:
        """A call that starts a sandbox (check_code): placed by Ray like a session with `options`."""
        return await self._placed(options, NodeCall, self.settings_sent, method, args, kwargs)

    async def run_oneshot(
        self, options: SandboxOptions, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[OneShotResult, EgressDelta | None, OneShotExports | None]:
        """A one-shot run (node_oneshot), placed like a session with `options`."""
        done: tuple[OneShotResult, EgressDelta | None, OneShotExports | None] = await self._placed(
            options, NodeOneShot, self.settings_sent, args, kwargs
        )
        return done

    async def _placed(self, options: SandboxOptions, function: Any, *args: Any) -> Any:
        request = Request.of(options, self.backend, self.settings.ray_node_labels)
        check_fits(request, await anyio.to_thread.run_sync(ray.nodes))
        bound = options.timeout_s + self.settings.startup_timeout_s + CALL_S
        async with self.slots:
            ref = function.options(max_retries=0, **request.actor_options()).remote(*args)
            return await self._result(ref, bound)

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
