"""What `coderunner doctor` gets from each backend's probes (<backend>_doctor.py, named in registry.py):
one Check per finding, and what a backend not in use would need here."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from coderunner.sandbox.engine import QUERY_TIMEOUT_S, EngineError, engine_env, run_sync

if TYPE_CHECKING:
    from coderunner.config import Settings

#: Bound on each probe doctor runs.
PROBE_TIMEOUT_S = 30
#: (what is missing for a backend here, the fix), or (None, None) when it looks ready.
Readiness = tuple[str | None, str | None]


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str | None = None
    #: A warning: works, but with less containment than the machine could give.
    degraded: bool = False


def image_readiness(settings: Settings, name: str, cli: str, query: list[str]) -> Readiness:
    """Whether the engine `cli` answers `query` (an image inspect) with backend `name`'s image built."""
    try:
        done = run_sync(query, QUERY_TIMEOUT_S, check=False, env=engine_env(dict(os.environ)))
    except EngineError as exc:
        return f"{cli} does not answer ({exc})", None
    if done.returncode != 0:
        said = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        # Apple `container` 0.x says `notFound: "images: NAME"` (ImageInspect.swift), 1.x "image not found".
        if any(word in said[0].lower() for word in ("no such", "not known", "not found", "notfound")):
            return f"image {settings.image} not built", f"coderunner setup --backend {name}"
        return f"{cli} does not answer: {said[0][:200]}", None
    return None, None


def engine_checks(settings: Settings, name: str, readiness: Readiness) -> list[Check]:
    """An image backend in use: its engine and image, as its readiness found them."""
    missing, fix = readiness
    if missing is not None:
        return [Check(f"{name} backend", False, missing, fix)]
    return [Check(f"{name} backend", True, f"engine found, image {settings.image} built")]
