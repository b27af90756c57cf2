"""What a sandbox may be given: its options and the mount policy, as pure functions of the settings.

`SandboxOptions` configures a session and a one-shot run alike. Nothing here holds state or
starts anything; the SessionManager calls these with its settings and backend, and one-shot
runs receive the options it made. Refusals raise SessionError with what to ask for instead
(MountError for the server's own configured mounts, which `coderunner serve` reports at start).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from coderunner.config import MIN_MEMORY_MB, Settings
from coderunner.edge.client_tokens import tokens_dir
from coderunner.edge.owners import LOCAL_CLIENT
from coderunner.errors import SessionError
from coderunner.hostfs.exports import ExportError, prepare_export_dir
from coderunner.hostfs.mounts import resolve_mount
from coderunner.policy.egress import EgressPolicyError
from coderunner.policy.mounts import MountError, check_distinct, check_sandbox_path
from coderunner.sandbox import HostIdentity, Limits, Mount, SandboxBackend
from coderunner.vocabulary.mounts import MountSpec
from coderunner.vocabulary.network import NetworkCeilingError, NetworkMode, check_within
from coderunner.vocabulary.sandbox_request import DEFAULT_REQUEST, SandboxRequest

SESSION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,39}")


@dataclass(frozen=True)
class SandboxOptions:
    """One sandbox's network, limits, timeout and mounts: a session's, or a one-shot run's."""

    network: str
    limits: Limits
    timeout_s: float
    mounts: tuple[Mount, ...] = ()
    #: A named session's workspace can be persistent: it outlives the session and the server.
    name: str | None = None
    persistent: bool = False
    #: The client that owns its exports and its persistent name (owners.py).
    client: str = LOCAL_CLIENT
    #: Network 'allowlist': the entries this sandbox asked for (a subset of allowed_domains);
    #: empty means the whole ceiling.
    allow: tuple[str, ...] = ()
    #: A persistent session that saves its kernel state when it closes and loads it when reopened.
    keep_state: bool = False


def sandbox_options(
    settings: Settings,
    backend: SandboxBackend,
    base_mounts: list[Mount],
    request: SandboxRequest = DEFAULT_REQUEST,
) -> SandboxOptions:
    """The settings' defaults with what the caller asked for, each checked; raises SessionError."""
    name, persistent, keep_state, memory_mb, cpus = (
        request.name, request.persistent, request.keep_state, request.memory_mb, request.cpus
    )  # fmt: skip
    if name is not None and not SESSION_NAME.fullmatch(name):
        raise SessionError(f"session name {name!r}: use 1-40 letters, digits, '.', '_' or '-'")
    if persistent and name is None:
        raise SessionError("a persistent session needs a name (its workspace is found by it next time)")
    if keep_state and not persistent:
        raise SessionError(
            "keep_state needs persistent=true and a name: the state is saved under that name when the session "
            "closes (for any other session, use manage_snapshots)"
        )
    network = request.network or settings.network
    asked = tuple(entry for entry in request.allow if entry)
    check_allow(settings, network, asked)  # first: without allowed_domains it says how the user sets some
    try:
        check_within(network, settings.network_ceiling)
    except NetworkCeilingError as exc:
        raise SessionError(str(exc)) from None
    problem = backend.network_problem(network)
    if problem:
        raise SessionError(problem)
    if memory_mb is not None and memory_mb < MIN_MEMORY_MB:
        raise SessionError(f"memory_mb must be at least {MIN_MEMORY_MB} (a kernel with numpy maps ~420 MiB)")
    if cpus is not None and cpus <= 0:
        raise SessionError("cpus must be positive")
    check_timeout(settings, request.timeout_s)
    return SandboxOptions(
        network=network,
        limits=Limits(
            memory_mb=memory_mb or settings.memory_mb,
            cpus=cpus or settings.cpus,
            pids=settings.pids,
            tmp_mb=settings.tmp_mb,
            disk_mb=settings.disk_mb,
        ),
        timeout_s=request.timeout_s or settings.timeout_s,
        mounts=(*base_mounts, *session_mounts(settings, backend.identity, base_mounts, list(request.mounts))),
        name=name,
        persistent=persistent,
        client=request.client,
        allow=asked,
        keep_state=keep_state,
    )


def check_timeout(settings: Settings, timeout_s: float | None) -> None:
    """A timeout past the user's max_timeout_s is refused, by create_session and run_python alike (never
    cut down silently: the caller would wait for a run that ends sooner than it asked)."""
    if timeout_s is not None and not 0 < timeout_s <= settings.max_timeout_s:
        raise SessionError(f"timeout_s must be between 0 and {settings.max_timeout_s:g} seconds (max_timeout_s)")


def check_allow(settings: Settings, network: str, asked: tuple[str, ...]) -> None:
    """Network 'allowlist' needs a ceiling, and what a sandbox asks for must lie within it."""
    if asked and network != NetworkMode.ALLOWLIST:
        raise SessionError(f"allow applies to network 'allowlist' only (this one has network {network!r})")
    if network != NetworkMode.ALLOWLIST:
        return
    egress = settings.egress
    if not egress.names_hosts:
        raise SessionError(
            "network 'allowlist' needs the user to allow some hosts first: set allowed_domains in the "
            'configuration (e.g. allowed_domains = ["python-packages"]), CODERUNNER_ALLOWED_DOMAINS, or '
            "`coderunner serve --allow-domain NAME`; until then use network 'none'"
        )
    try:
        egress.ceiling.narrowed(asked)
    except EgressPolicyError as exc:
        raise SessionError(str(exc)) from None


def protected_paths(settings: Settings) -> list[Path]:
    """Paths no mount may overlap: other sessions' workspaces and sockets, the sandbox env, the HTTP tokens."""
    return [settings.runtime_dir, settings.workspaces_dir, settings.sandbox_env, settings.token_file,
            tokens_dir(settings.token_file)]  # fmt: skip


def configured_mounts(settings: Settings, identity: HostIdentity | None) -> list[Mount]:
    """The server-wide configured mounts (the export outbox is per sandbox). Raises MountError."""
    mounts = [resolve_mount(spec, protected=protected_paths(settings), identity=identity)
              for spec in settings.mounts]  # fmt: skip
    check_distinct([*mounts, *export_mount(settings)])
    if settings.export_dir is not None:
        try:
            prepare_export_dir(settings.export_dir)  # at start: a bad folder is told at once
        except ExportError as exc:
            raise MountError(exc.strerror) from None
    return mounts


def export_mount(settings: Settings) -> list[Mount]:
    """The export mount's sandbox path, so that no other mount takes it."""
    if settings.export_dir is None:
        return []
    return [Mount(Path("/"), check_sandbox_path(settings.export_mount), writable=True)]


def session_mounts(
    settings: Settings, identity: HostIdentity | None, base_mounts: list[Mount], specs: list[MountSpec]
) -> list[Mount]:
    """Mounts asked for by create_session: only under a folder the configuration allows."""
    roots = [root.expanduser().resolve() for root in settings.allowed_mount_roots]
    mounts = []
    for spec in specs:
        try:
            mount = resolve_mount(spec, protected=protected_paths(settings), identity=identity)
        except MountError as exc:
            raise SessionError(str(exc)) from None
        if not any(mount.host == root or root in mount.host.parents for root in roots):
            allowed = ", ".join(str(root) for root in roots) or "none are configured (allowed_mount_roots)"
            raise SessionError(f"{mount.host} may not be mounted: sessions may mount only under {allowed}")
        mounts.append(mount)
    try:
        check_distinct([*base_mounts, *export_mount(settings), *mounts])
    except MountError as exc:
        raise SessionError(str(exc)) from None
    return mounts
