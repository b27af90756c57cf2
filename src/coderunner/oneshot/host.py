"""OneShotHost: where the tools' one-shot runs go (execute_code, its check_only, manage_jobs, get_capabilities).

The tools reach one-shot runs only through this interface, given them beside the SessionHost (tools/context.py):
LocalOneShots (local.py) runs them in this process on a SessionManager's leases; a cluster's front door
(cluster/host.py: ClusterHost) sends each to a node. What crosses is data (options, results, jobs) and calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from coderunner.oneshot.runs import Language, OneShotResult
    from coderunner.sessions.egress_wiring import SessionEgress
    from coderunner.sessions.job_runner import JobTable
    from coderunner.sessions.sandbox_options import SandboxOptions


class OneShotHost(Protocol):
    """Where one-shot runs happen: a run, a syntax check, the languages' versions, and the runs kept as jobs."""

    @property
    def oneshot_jobs(self) -> JobTable:
        """execute_code runs that outlived their call (a session's own jobs are the session's)."""
        ...

    async def run_oneshot(
        self, language: Language, code: str, options: SandboxOptions, *, stdin: bytes = b"",
        variables: dict[str, Any] | None = None, caller: str | None = None,
        on_egress: Callable[[SessionEgress], None] | None = None,
    ) -> OneShotResult: ...  # fmt: skip
    async def check_code(
        self, language: Language, code: str, options: SandboxOptions, caller: str | None = None
    ) -> list[dict[str, Any]]: ...
    async def language_versions(self, options: SandboxOptions) -> dict[str, Any]: ...
    def ready_counts(self) -> dict[str, int] | None:
        """What the sandboxes started ahead did (ready.py: ReadyStats), or None where none are kept."""
        ...
