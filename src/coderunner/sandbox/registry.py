"""Building the chosen sandbox backend, and probing one for doctor, from its entry (vocabulary/backends.py).

The entry names a backend's modules as text; they are imported here only when that backend is
chosen (or probed), so a bwrap server never loads the container code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from coderunner.sandbox.base import KernelStarter, SandboxBackend, SandboxUnavailable
from coderunner.vocabulary.backends import BACKENDS, BackendEntry

if TYPE_CHECKING:
    from coderunner.config import Settings
    from coderunner.sandbox.probes import Check, Readiness


def build(entry: BackendEntry, settings: Settings) -> SandboxBackend:
    backend: SandboxBackend = importlib.import_module(entry.module).build(settings)
    return backend


def readiness(entry: BackendEntry, settings: Settings) -> Readiness:
    """(what is missing for this backend here, the fix), or (None, None) when it looks ready."""
    found: Readiness = importlib.import_module(entry.probes).readiness(settings, entry.name)
    return found


def checks(entry: BackendEntry, settings: Settings) -> list[Check]:
    """Doctor's checks of this backend when it is the one in use."""
    found: list[Check] = importlib.import_module(entry.probes).checks(settings, entry.name)
    return found


def kernel_starter(
    backend: SandboxBackend, preload_imports: bool = True, *, asked: bool = True
) -> KernelStarter | None:
    """The warm kernel template of `backend` (not yet open), from its entry's module, with numpy, pandas and
    matplotlib imported if `preload_imports`; None where it has none or cannot run here. Where the user
    `asked` for it (kernel_template true), the backend then says why to every kernel's start; where it was
    only 'auto', kernels start cold with nothing to say."""
    entry = BACKENDS.get(backend.name)
    if entry is None or entry.kernel_template is None:
        module, why_not = None, f"the {backend.name} backend has no kernel template"
    else:
        module = importlib.import_module(entry.kernel_template)
        why_not = module.unavailable_here()
    if module is None or why_not is not None:
        backend.no_kernel_starter = why_not if asked else None
        return None
    starter: KernelStarter = module.kernel_starter(backend, preload_imports)
    return starter


def make_backend(settings: Settings) -> SandboxBackend:
    """Raises SandboxUnavailable (with the fix in its message) when the backend cannot work here."""
    found = BACKENDS.get(settings.backend)
    if found is None:
        raise SandboxUnavailable(f"unknown backend {settings.backend!r}: use one of {', '.join(BACKENDS)}")
    return build(found, settings)
