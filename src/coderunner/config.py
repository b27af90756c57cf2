"""One Settings object: defaults < TOML file < environment (CODERUNNER_*) < command-line flags.

One idea: every setting with its default, bounds and description in one pydantic-settings class, so the help,
the docs and validation read one table.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, SecretStr, StringConstraints, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from coderunner import __version__
from coderunner.app_dirs import (  # noqa: F401 - re-exported: where settings live by default
    APP_NAME,
    default_config_dir,
    default_config_file,
    default_data_dir,
    default_export_dir,
    default_runtime_dir,
)
from coderunner.errors import CodeRunnerError
from coderunner.policy.egress import EgressPolicy, EgressPolicyError
from coderunner.policy.egress_settings import EgressSettings
from coderunner.policy.mounts import parse_mount
from coderunner.policy.tool_groups import ALL, DEFAULT_GROUPS, TOOL_GROUPS, ToolsetError, check_selection
from coderunner.vocabulary.backends import BACKEND_NAMES, platform_default
from coderunner.vocabulary.mounts import MountSpec
from coderunner.vocabulary.network import CEILING_SETTING, NetworkMode, default_ceiling, rank

#: Below this an ipykernel with numpy cannot even start under RLIMIT_AS (measured: ~420 MiB mapped).
MIN_MEMORY_MB = 512
Transport = Literal["stdio", "streamable-http", "sse"]
#: The names `backend` may be set to: one per entry of the backend registry (vocabulary/backends.py),
#: in its order (a Literal made from it, so the settings' schema and errors list them as before).
Backend = Literal[BACKEND_NAMES]  # type: ignore[valid-type]  # a Literal built from the registry
#: A node label's name or value: plain text, as Ray would otherwise read '!' or 'in(...)' as operators.
RayLabel = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9._/-]+$")]


def default_backend() -> Backend:
    """Linux: bwrap (no daemon, embedded). macOS: Apple `container` VMs when the CLI is installed.
    Each backend's entry says when it is the default (vocabulary/backends.py platform_default)."""
    return platform_default()


class ConfigError(CodeRunnerError):
    """The configuration cannot be used; the message says which setting and why."""


class Settings(BaseSettings):
    """Everything the server can be told. Field docs double as the reference for config.toml."""

    model_config = SettingsConfigDict(env_prefix="CODERUNNER_", extra="forbid", validate_default=True)
    #: Built by the `egress` property on first use (the server's start) and kept.
    _egress: EgressSettings | None = PrivateAttr(default=None)

    # Where things live.
    sandbox_env: Path = Field(
        default_factory=lambda: default_data_dir() / "sandbox-env",
        description="The sandbox's own Python environment (made by `coderunner setup`).",
    )
    sandbox_python: Path = Field(
        default=Path("/usr/bin/python3"),
        description="System interpreter the sandbox environment is built from; must live under /usr.",
    )
    workspaces_dir: Path = Field(
        default_factory=lambda: default_data_dir() / "workspaces",
        description="Parent of the per-session workspaces (each is removed when its session closes).",
    )
    runtime_dir: Path = Field(
        default_factory=default_runtime_dir,
        description="Parent of the per-session runtime dirs (kernel sockets and connection files).",
    )

    # Sandbox.
    backend: Backend = Field(
        default_factory=lambda: default_backend(),
        description="How sessions are isolated: bwrap (Linux default), podman, docker, gvisor (runsc on podman's "
        "image, root only: a kernel of its own per sandbox), or apple (Apple `container` VMs; the macOS default when "
        "`container` is installed).",
    )
    image: str = Field(
        default=f"coderunner-sandbox:{__version__}",
        description="The sandbox image of the container backends (built by `coderunner setup --backend ...`).",
    )
    base_image: str | None = Field(
        default=None,
        description="Base image the sandbox image is built FROM (default: the Containerfile's Debian bookworm "
        "Python image); e.g. an offline one made with containers/make-base-image.sh.",
    )
    oci_runtime: str | None = Field(
        default=None, description="OCI runtime podman/docker use (e.g. runc where crun cannot work)."
    )
    kernel_channels: Literal["auto", "ipc", "tcp"] = Field(
        default="auto",
        description="How the host reaches a container's kernel: ipc sockets (Linux engines; vsock-relayed "
        "with Apple `container`), or TCP published on 127.0.0.1 (needs the container's network).",
    )
    sandbox_user: str | None = Field(
        default=None,
        description="When the server runs as root: one fixed unprivileged host user all sandboxes run as. "
        "Default: each sandbox gets a host uid of its own from a reserved range (1,900,000,000 and up), so "
        "per-user kernel limits (inotify, message queues, processes) are per sandbox.",
    )
    network: NetworkMode = Field(
        default=NetworkMode.NONE,
        description="Default network of sessions and one-shot runs: none, allowlist (only allowed_domains, "
        "through the host's policy proxy) or internet (outbound anywhere).",
    )
    max_network: NetworkMode | None = Field(
        default=None,
        description="The most network any session or one-shot run may have; agents may ask for less, never "
        "more. Default: what you turned on: internet only when `network` is internet, allowlist when "
        "allowed_domains is set, else none.",
    )
    allowed_domains: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="The most network mode 'allowlist' may reach: host names, '*.example.com' wildcards, IP "
        "literals or presets (python-packages, github). Sessions may ask for a subset, never more.",
    )
    allowed_ports: Annotated[list[Annotated[int, Field(ge=1, le=65535)]], NoDecode] = Field(
        default_factory=lambda: [80, 443], description="Ports network mode 'allowlist' may connect to."
    )
    egress_audit_log: Path = Field(
        default_factory=lambda: default_data_dir() / "egress.jsonl",
        description="Append-only JSONL of every allowlist network decision (rotated by size; host-only).",
    )
    memory_mb: int = Field(
        2048, ge=MIN_MEMORY_MB, description="Address-space (RLIMIT_AS) limit of a session's kernel, MiB."
    )
    cpus: float | None = Field(default=None, gt=0, description="CPU quota per session (cgroups).")
    session_cpu_weight: int = Field(
        default=20,
        ge=1,
        le=10_000,
        description="CPU weight of all sessions together against the server and the host's other processes "
        "(cgroups; 100 = an ordinary process): spinning sandboxes get only otherwise idle CPU.",
    )
    pids: int = Field(default=256, ge=32, description="Processes and threads per session (ipykernel uses ~15).")
    tmp_mb: int = Field(default=512, ge=16, description="Size of the sandbox's /tmp (a tmpfs).")
    cgroups: bool = Field(default=True, description="Use per-session cgroups where the server may create them.")
    disk_mb: int = Field(default=2048, ge=16, description="Size cap of a session's workspace.")
    workspace_quota: bool = Field(default=True, description="Cap workspaces with a loop-mounted image (root).")
    start_namespace: bool = Field(
        default=True,
        description="Root, bwrap: start sandboxes in a mount namespace without the held sessions' mounts, so a start "
        "costs the same however many sessions are held (sandbox/start_namespace.py).",
    )
    compiled_init: bool = Field(
        default=True,
        description="bwrap: each sandbox's pid 1 is the compiled init `coderunner setup` built (about 5 CPU-ms less "
        "a start than the Python one, the same protocol and containment); false, or where none was built: Python.",
    )
    max_sessions: int = Field(
        default=16,
        ge=1,
        description="Open sessions at most (the warm pool's sandboxes only use room left under it). An idle "
        "session costs about 35 MiB (PSS, bench/scale.py), as much as a bare ipykernel.",
    )
    max_sessions_per_client: int = Field(
        default=4,
        ge=1,
        description="Sessions one HTTP client may hold open (see callers.py for how clients are told apart); "
        "a stdio server's one client may use all of max_sessions.",
    )
    max_oneshot_runs: int = Field(default=4, ge=1, description="execute_code sandboxes at once (check_only too).")
    max_oneshot_runs_per_client: int = Field(
        default=2, ge=1, description="One-shot sandboxes one HTTP client may run at once; more wait for its own slot."
    )
    oneshot_ready: bool = Field(
        default=True,
        description="Keep an execute_code sandbox started ahead for the options of the last runs (each used "
        "once, dropped after 60 s unused): a run skips the sandbox's start. They use only room left under "
        "max_sessions and pool_memory_mb, and a session takes their room back.",
    )
    idle_timeout_s: float = Field(default=3600.0, gt=0, description="Close sessions unused this long.")
    ray_address: str | None = Field(
        default=None,
        description="Cluster mode: the Ray cluster sessions live on (HOST:PORT of its head, or 'auto' for the "
        "cluster this process runs in). Each session lives in its worker node's agent (a detached actor); see "
        "the README's 'Beyond one machine'. Needs the `ray` extra.",
    )
    ray_node_labels: dict[RayLabel, RayLabel] = Field(
        default_factory=dict,
        description="Cluster mode: the node labels (`ray start --labels`) a node must have to hold this front "
        'door\'s sessions and one-shot runs, e.g. {"pool" = "agents"}; plain values only (no operators).',
    )
    agent_handover_s: float = Field(
        default=60.0,
        ge=0.0,
        le=3600.0,
        description="Cluster mode: how long the sessions of a node agent that died wait for the next agent on "
        "their node to take them over, kernels and files kept (network 'none' sessions on bwrap); 0: they end "
        "with it.",
    )
    pool_size: int = Field(
        default=2,
        ge=0,
        description="Sandboxes kept started ahead for new sessions (0: none; pool_take_apply: which). They use only "
        "room left under max_sessions, and a cold session takes a pooled one's room back.",
    )
    pool_memory_mb: int = Field(
        default=512,
        ge=0,
        description="Most memory the idle sandboxes started ahead (the warm pool's and execute_code's) may use "
        "together, in MiB.",
    )
    pool_take_apply: bool = Field(True, description="A create asking for less memory_mb or cpus, an allowlist "
        "of its own or another timeout_s takes a warm pool's sandbox too, given them as it is taken (limits: where "
        "the backend lowers them live, bwrap with cgroups); off: only creates with the default options do, and a "
        "default network 'allowlist' has no pool.")  # fmt: skip
    kernel_template: bool | Literal["auto"] = Field("auto", description="Kernels are forks of one warm template "
        "(numpy, pandas and matplotlib imported once, with preload_imports) instead of each starting from nothing: "
        "'auto' where it can be (bwrap, the server run as root), true to ask for it (where it cannot be, each "
        "kernel's status says why), false never. A kernel it cannot give (the template starting or refusing a "
        "fork, a workspace module shadowing one it imported) starts cold, and manage_sessions status says which "
        "way and why (kernel_start).")  # fmt: skip
    reset_standby: bool = Field(True, description="Each session keeps a fresh kernel started ahead (about 35 MiB, "
        "idle, about 90 with preload_imports; in manage_sessions status) that kernel_reset and restarts swap to "
        "instead of starting one (bwrap).")  # fmt: skip
    reset_standby_memory_mb: int = Field(512, ge=0, description="Most memory the sessions' standby kernels "
        "(reset_standby) may hold together, in MiB; a session whose standby would not fit has kernel_reset start a "
        "kernel cold.")  # fmt: skip
    preload_imports: bool = Field(True, description="Kernels started ahead (the warm pool's, the reset standbys) "
        "import numpy, pandas and matplotlib before their user arrives, so a new session's first chart or frame "
        "is quick; each then holds about 55 MiB more idle (about 90 MiB; docs/performance.md).")  # fmt: skip

    # Snapshots (manage_snapshots: save, restore, fork; keep_state).
    snapshots_dir: Path | None = Field(
        default=None,
        description="Where snapshots are kept, host-only (default: 'snapshots' beside workspaces_dir).",
    )
    snapshots_shared: bool = Field(
        default=False,
        description="Cluster mode: snapshots_dir is one store every node sees (shared storage), so a snapshot "
        "restores on any node; otherwise on the node that took it.",
    )
    snapshot_limit_mb: int = Field(
        default=4096, ge=1, description="Largest snapshot (workspace files plus kernel state), in MiB."
    )
    snapshot_keep: int = Field(default=20, ge=1, description="Snapshots kept per client; older ones are deleted.")
    snapshot_retention_s: float = Field(
        default=7 * 86400.0, gt=0, description="Snapshots older than this are deleted (default 7 days)."
    )
    keep_state_save_idle_s: float = Field(
        30.0,
        ge=0,
        description="A keep_state session that ran something saves "
        "its state after this long idle, so a crash or reboot loses only the work since (0: only at close).",
    )
    snapshot_timeout_s: float = Field(default=300.0, gt=0, description="Bound on saving or loading one kernel's state.")

    # Files.
    mounts: list[MountSpec] = Field(
        default_factory=list,
        description="Host folders every session sees: [{host, sandbox, mode}] or 'HOST:SANDBOX[:ro|rw]'.",
    )
    mounts_shared: bool = Field(
        default=False,
        description="Cluster mode: the folders of mounts and allowed_mount_roots are on storage every node "
        "sees at the same paths; without it a cluster front door with mounts refuses to start.",
    )
    export_dir: Path | None = Field(
        default_factory=lambda: default_export_dir(),
        description="Where exports land, one subfolder per client; sandboxes never see it. Empty to disable.",
    )
    export_mount: str = Field(
        default="/mnt/outputs",
        description="Where a sandbox saves files for export; they are copied to export_dir/<client>/ after each call.",
    )
    export_limit_mb: int = Field(default=1024, ge=0, description="Most bytes one session or run may export.")
    import_dirs: list[Path] = Field(default_factory=list, description="Host folders transfer_file may upload from.")
    allowed_mount_roots: list[Path] = Field(
        default_factory=list, description="Host folders under which create_session may mount more folders."
    )
    transfer_limit_bytes: int = Field(default=512 * 2**20, ge=0, description="Largest upload or download.")
    read_limit_bytes: int = Field(default=256 * 1024, ge=1024, description="Most bytes read_file returns inline.")
    resource_limit_bytes: int = Field(default=16 * 2**20, ge=1024, description="Largest sandbox:// resource read.")

    # Execution.
    timeout_s: float = Field(
        900.0,
        gt=0,
        description="Default wall-time limit of one run_python or "
        "execute_code run. A run longer than detach_after_s goes on as a job: this may exceed what clients wait.",
    )
    detach_after_s: float = Field(
        default=40.0,
        ge=0,
        description="A run still going after this long answers with its output so far and a job id (manage_jobs "
        "reads the rest). Kept under the 60 s many clients wait for a reply (the TypeScript SDK's default).",
    )
    max_timeout_s: float = Field(default=3600.0, gt=0, description="Largest timeout_s a caller may ask for.")
    interrupt_grace_s: float = Field(
        default=3.0,
        gt=0,
        description="Wait after an interrupt before a restart, counted in time the sandbox could run: on a loaded "
        "machine its waits for a CPU lengthen it (by at most 30 s).",
    )
    startup_timeout_s: float = Field(default=60.0, gt=0, description="Limit on a kernel's start to first reply.")
    output_limit_chars: int = Field(default=20_000, ge=1_000, description="Text kept inline per call.")
    spill_limit_bytes: int = Field(
        default=64 * 1024 * 1024, ge=0, description="Most output saved to the workspace file per call."
    )
    image_limit_bytes: int = Field(
        default=600_000, ge=0, description="Most image bytes returned inline per call; the rest go to files."
    )
    file_links: Literal["resource_link", "text"] = Field(
        default="resource_link",
        description="How replies point at files too big to send inline (spilled output, extra images, big "
        "read_file results): resource_link blocks (sandbox:// URIs the client reads on demand), or 'text': "
        "only their paths in the reply text, for clients that cannot follow links (langchain turns them "
        "into file URLs some model APIs refuse).",
    )
    progress_interval_s: float = Field(default=1.0, gt=0, description="Least time between progress notes.")

    # Serving.
    tools: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: list(DEFAULT_GROUPS),
        description=f"Tools to offer: {ALL}, or groups ({', '.join(TOOL_GROUPS)}) and single tool names, as a "
        f"list or 'python,files' (default {','.join(DEFAULT_GROUPS)}; get_capabilities always): fewer cost less.",
    )
    transport: Transport = "stdio"
    host: str = "127.0.0.1"
    port: int = Field(default=8765, ge=0, le=65535)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    token: SecretStr | None = Field(
        default=None,
        description="Bearer token HTTP clients must send; by default the one in token_file (made on first use).",
    )
    token_file: Path = Field(
        default_factory=lambda: default_config_dir() / "token",
        description="Where the HTTP bearer token is kept (0600).",
    )
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="Extra Host header values HTTP requests may carry (e.g. 'myhost:8765'); loopback always.",
    )
    allowed_origins: list[str] = Field(
        default_factory=list, description="Extra Origin values (browser-based clients); loopback always."
    )
    http_max_connections: int = Field(
        default=256,
        ge=1,
        description="Open HTTP connections at most; over it the oldest one still waiting for a request is closed "
        "(or the new one, when all are busy).",
    )
    http_head_timeout_s: float = Field(
        default=10.0, gt=0, description="Time an HTTP connection has to send a complete request head."
    )
    http_idle_timeout_s: float = Field(
        default=15.0, gt=0, description="An idle kept-alive HTTP connection is closed after this long."
    )

    @field_validator("export_dir", mode="before")
    @classmethod
    def _no_export(cls, value: Any) -> Any:
        """An empty export_dir means: no export folder at all."""
        return None if value in ("", None) else value

    @field_validator("allowed_domains", "allowed_ports", mode="before")
    @classmethod
    def _list_text(cls, value: Any) -> Any:
        """Accept a JSON list or 'a,b' (environment form) as well as a list."""
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [item.strip() for item in text.split(",") if item.strip()]
        return value

    @field_validator("allowed_domains")
    @classmethod
    def _known_domains(cls, value: list[str]) -> list[str]:
        """Bad names are told at load, under the field's name (the ceiling is built by `egress`, with the ports)."""
        if not value:
            return value
        try:
            EgressPolicy.parse(value)
        except EgressPolicyError as exc:
            raise ValueError(str(exc)) from None
        return value

    @field_validator("transport", mode="before")
    @classmethod
    def _transport_alias(cls, value: Any) -> Any:
        """`http` (what users type first) is streamable-http, by flag, environment or file; kept by its real name."""
        return "streamable-http" if value == "http" else value

    @field_validator("tools", mode="before")
    @classmethod
    def _tools_text(cls, value: Any) -> Any:
        """Accept 'python,files' (flag and environment form) as well as a list."""
        return value.split(",") if isinstance(value, str) else value

    @field_validator("tools")
    @classmethod
    def _known_tools(cls, value: list[str]) -> list[str]:
        try:
            return check_selection(value)
        except ToolsetError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("mounts", mode="before")
    @classmethod
    def _mount_strings(cls, value: Any) -> Any:
        """Accept the flag form "HOST:SANDBOX[:ro|rw]" wherever a mount is expected."""
        if isinstance(value, list):
            return [parse_mount(item) if isinstance(item, str) else item for item in value]
        return value

    @model_validator(mode="after")
    def _allowlist_needs_a_ceiling(self) -> Settings:
        if self.network == NetworkMode.ALLOWLIST and not self.allowed_domains:
            raise ValueError(
                "network 'allowlist' as the default needs allowed_domains (e.g. [\"python-packages\"]; "
                "CODERUNNER_ALLOWED_DOMAINS or --allow-domain)"
            )
        return self

    @model_validator(mode="after")
    def _default_within_ceiling(self) -> Settings:
        if self.max_network is not None and rank(self.network) > rank(self.max_network):
            raise ValueError(
                f"network {self.network!r} is above max_network {self.max_network!r}: lower network or raise "
                f"max_network ({CEILING_SETTING})"
            )
        return self

    @property
    def egress(self) -> EgressSettings:
        """The network settings with the host ceiling parsed: once, then the same one (policy/egress_settings.py)."""
        if self._egress is None or not self._egress.reads(self):
            self._egress = EgressSettings.of(self)
        return self._egress

    @property
    def network_ceiling(self) -> NetworkMode:
        """The most network an agent may ask for (vocabulary/network.py; no host parsing, unlike `egress`)."""
        return default_ceiling(self.network, self.allowed_domains, self.max_network)

    @property
    def snapshot_root(self) -> Path:
        """The snapshot store's folder: snapshots_dir, or 'snapshots' beside workspaces_dir."""
        return self.snapshots_dir or self.workspaces_dir.parent / "snapshots"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls))


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Read the TOML file (flag, else $CODERUNNER_CONFIG, else the per-user default) under env and flags.

    Only the default may be absent: a named file that is not there is a typo that would drop its settings."""
    named = config_file or os.environ.get("CODERUNNER_CONFIG")
    path = Path(named or default_config_file())
    if named and not path.is_file() and path != Path(os.devnull):  # os.devnull: on purpose, no file
        source = "--config" if config_file else "CODERUNNER_CONFIG"
        raise ConfigError(f"no configuration file at {path} (named by {source}): correct the path or create the file")
    file_bound = type(
        "FileSettings",
        (Settings,),
        {"model_config": SettingsConfigDict(**{**Settings.model_config, "toml_file": path})},
    )
    flags = {key: value for key, value in overrides.items() if value is not None}
    try:
        return file_bound(**flags)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in err['loc']) or 'settings'}: {err['msg'].removeprefix('Value error, ')}"
            for err in exc.errors()
        )
        raise ConfigError(f"invalid configuration ({path}, CODERUNNER_* or flags): {problems}") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the configuration file {path}: {exc}") from None
