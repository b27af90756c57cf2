"""LocalOneShots: the OneShotHost (host.py) of one process, its runs on a SessionManager's sandboxes.

A run takes its sandbox on the manager's leases, with its egress hub, in its task group; the sandboxes
started ahead (ready.py) live in the manager's room: the manager counts them beside its sessions, takes
room back from them first and drains them on shutdown (sessions/idle_room.py), and they start only
where its room_ahead says they fit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from coderunner.oneshot.runs import ExportTo, Language, OneShotResult, OneShotRunner
from coderunner.sessions.job_runner import JobTable

if TYPE_CHECKING:
    from coderunner.sessions.egress_wiring import SessionEgress
    from coderunner.sessions.manager import SessionManager
    from coderunner.sessions.sandbox_options import SandboxOptions


@dataclass
class LocalOneShots:
    """One-shot runs in this process: a runner, and the table of runs that outlived their call."""

    runner: OneShotRunner
    #: execute_code runs that outlived their call.
    jobs: JobTable

    @classmethod
    def for_manager(cls, manager: SessionManager) -> LocalOneShots:
        """The runs of an entered `manager`'s server: its settings, leases, egress and task group; its
        room shared with the sandboxes started ahead. They end with the manager."""
        runner = OneShotRunner.for_settings(
            manager.settings, manager.backend, manager.task_group, manager.leases, manager.egress,
            ready_room=manager.room_ahead,
        )  # fmt: skip
        manager.share_room(runner.ahead)
        return cls(runner, JobTable(manager.task_group))

    @property
    def oneshot_jobs(self) -> JobTable:
        return self.jobs

    async def run_oneshot(
        self, language: Language, code: str, options: SandboxOptions, *, stdin: bytes = b"",
        variables: dict[str, Any] | None = None, caller: str | None = None,
        on_egress: Callable[[SessionEgress], None] | None = None, export_to: ExportTo | None = None,
    ) -> OneShotResult:  # fmt: skip
        return await self.runner.run(
            language, code, options, stdin=stdin, variables=variables, caller=caller, on_egress=on_egress,
            export_to=export_to,
        )  # fmt: skip

    async def check_code(
        self, language: Language, code: str, options: SandboxOptions, caller: str | None = None
    ) -> list[dict[str, Any]]:
        return await self.runner.check(language, code, options, caller=caller)

    async def language_versions(self, options: SandboxOptions) -> dict[str, Any]:
        return await self.runner.versions(options)

    def ready_counts(self) -> dict[str, int] | None:
        return self.runner.ready_counts()
