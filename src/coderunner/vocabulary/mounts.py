"""A host folder inside a sandbox: as the user or a caller asks for it (MountSpec), and as granted (Mount).

Both cross every layer: the settings hold MountSpecs, create_session takes them, hostfs checks one
and makes a Mount of it (hostfs/mounts.py), and the backends bind Mounts. Their text form and the
paths no mount may take are policy/mounts.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, field_validator


@dataclass(frozen=True)
class Mount:
    """A host folder as it appears inside the sandbox."""

    host: Path
    sandbox: str
    writable: bool


class MountSpec(BaseModel):
    """One mount as configured: `{host = "~/data", sandbox = "/data", mode = "ro"}` or "~/data:/data:ro"
    (that text form: policy/mounts.py parse_mount)."""

    host: Path
    sandbox: str
    mode: Literal["ro", "rw"] = "ro"

    @field_validator("sandbox")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(f"sandbox path {value!r} must be absolute, e.g. /data")
        return value
