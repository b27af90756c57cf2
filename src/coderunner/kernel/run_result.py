"""ExecutionResult: what one run_python call produced, and what the session did about it."""

from __future__ import annotations

from dataclasses import dataclass

from coderunner.kernel.execution import RunOutcome, RunStatus


@dataclass
class ExecutionResult:
    """A RunOutcome plus what the session did about it (restart, state kept or lost)."""

    outcome: RunOutcome
    notice: str | None = None
    state_lost: bool = False

    @property
    def is_error(self) -> bool:
        return self.outcome.status is not RunStatus.OK
