"""Sandbox backends behind one face: the base class, its errors, and `make_backend`.

Everything outside this package imports from here. Each backend is a SandboxBackend subclass
(base.py: spawn, the network-mode check and start-failure translation written once; a backend
declares its network modes, kernel channels and checkpointer) and one entry in vocabulary/backends.py, which
names its modules as text: a backend's code is imported only when it is chosen, so a bwrap server
never loads the container code. A new backend is its own modules plus one registry entry:

    bwrap           bwrap.py        Linux default, no daemon (bwrap_argv.py builds its argv; pid1.py
                                    holds pidfds of each sandbox's outer bwrap and pid 1, which is
                                    guest/sandbox_init.py; bwrap_watch.py hands them to pid_watcher.py,
                                    which ends a killed server's sandboxes; bwrap_template.py and
                                    template_kernels.py fork kernels from a warm template: kernel_template)
    podman, docker  oci.py          one container per kernel, from the CodeRunner image
                                    (oci_argv.py builds the engine's argv)
    gvisor          gvisor.py       runsc directly on podman's image: a kernel of its own per sandbox;
                                    its checkpointer (gvisor_checkpoint.py) saves and restores one whole;
                                    runsc.py builds runsc's argv and OCI config, gvisor_instances.py
                                    keeps each server's dirs and clears dead servers'
    apple           apple.py        one lightweight VM per kernel (macOS `container`); apple_version.py
                                    says what each `container` release can do

Each backend's doctor probes are in <module>_doctor.py (the registry names them; probes.py holds
what they share). Shared paths, environment and limits live in common.py; the container backends
share container.py (names, labels, the attached engine client), engine.py (bounded engine calls)
and watcher.py (a server's leftovers removed when it dies). Building the sandbox's Python
environment (env.py) sits beside building the image (image_build.py).
"""

from __future__ import annotations

from coderunner.sandbox.base import (
    Checkpointer,
    KernelChannels,
    KernelStarter,
    LimitReport,
    Limits,
    SandboxBackend,
    SandboxProcess,
    SandboxSpec,
    SandboxUnavailable,
)
from coderunner.sandbox.common import PRIVATE_CONNECTION, SESSION_PACKAGES
from coderunner.sandbox.identity import UidPool, per_sandbox_uids, sandbox_identity
from coderunner.sandbox.registry import kernel_starter, make_backend
from coderunner.vocabulary.backends import BACKENDS

# The floor's words the face speaks in (a SandboxSpec's mounts, the host user it runs as, its workspace).
from coderunner.vocabulary.host_identity import HostIdentity, IdentityError
from coderunner.vocabulary.mounts import Mount
from coderunner.vocabulary.sandbox_layout import WORKSPACE

__all__ = [
    "BACKENDS",
    "PRIVATE_CONNECTION",
    "SESSION_PACKAGES",
    "WORKSPACE",
    "Checkpointer",
    "HostIdentity",
    "IdentityError",
    "KernelChannels",
    "KernelStarter",
    "LimitReport",
    "Limits",
    "Mount",
    "SandboxBackend",
    "SandboxProcess",
    "SandboxSpec",
    "SandboxUnavailable",
    "UidPool",
    "kernel_starter",
    "make_backend",
    "per_sandbox_uids",
    "sandbox_identity",
]
