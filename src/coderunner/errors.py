"""One root for every error whose message is meant for the caller: CodeRunnerError.

The message of a CodeRunnerError is for the person or model who asked, and says the fix. The tools turn
it into an isError result (tools/context.py) and `coderunner` prints it (cli.py); both catch the root
only, so a new caller-facing error needs no list updated anywhere. Anything else that escapes is a bug:
its text stays in the server's log.

Each class lives beside the code that raises it; the tree, with where each one is defined:

    CodeRunnerError
    ├── ConfigError                  config.py                     a setting that cannot be used
    ├── AuthError                    edge/auth.py                  the token cannot be read or made
    ├── ListenError                  edge/listener.py              the HTTP address is in use or not allowed
    ├── ClientTokenError             edge/client_tokens.py         a token command that cannot be done
    ├── SetupError                   sandbox/env.py                the sandbox environment could not be made
    │   └── ImageError               sandbox/image_build.py        the sandbox image could not be built
    ├── SandboxUnavailable           sandbox/base.py               the chosen backend cannot work here
    │   ├── BwrapUnavailable         sandbox/bwrap.py
    │   │   └── TemplateUnavailable  sandbox/bwrap_template.py     no kernel from the template (issue 41)
    │   ├── ContainerUnavailable     sandbox/container.py
    │   └── CheckpointError          sandbox/gvisor_checkpoint.py  runsc could not checkpoint or restore a sandbox
    ├── KernelStartError             kernel/process.py             the sandboxed kernel did not come up
    ├── CheckpointFailed             kernel/process.py             a kernel's memory checkpoint or restore did not work
    ├── SessionError                 here                          a session request that cannot be served
    │   ├── SessionBusy              here                          another call holds the kernel
    │   ├── GuestCallError           here                          a guest tool refused its input or failed
    │   ├── NoRoomNow                cluster/placement.py          the chosen node filled meanwhile (placed again)
    │   ├── AgentGone                cluster/host.py               the agent died before the open was sent
    │   ├── ChangesFull              sessions/changes.py           a bound of the long poll's keys or waits reached
    │   └── JobNotFound              sessions/job_runner.py        a job id this caller does not have
    ├── OneShotError                 oneshot/program.py            a one-shot run that could not be set up
    ├── MountError (+ ValueError)    policy/mounts.py              a mount that is refused
    ├── WorkspaceError               hostfs/workspaces.py          a persistent workspace that cannot be used
    ├── SnapshotError                snapshots/layout.py           a snapshot that cannot be made, found or restored
    │   ├── SnapshotTooLarge         snapshots/layout.py           ... past snapshot_limit_mb (nothing kept)
    │   └── SnapshotNotFound         snapshots/layout.py           ... no such snapshot for this client
    ├── FileAccessError              hostfs/sandbox_files.py       a file request refused or failed
    ├── VariablesError               policy/call_variables.py      a variable that cannot be passed
    ├── PackagesError                policy/requirements.py        a package list pip must not be given
    ├── EgressPolicyError            policy/egress.py              an allowlist entry refused, a host past the ceiling
    └── ProxyError                   edge/stdio_proxy.py           `coderunner proxy` cannot use the upstream server
        └── RequestNeverRan          edge/stdio_proxy.py           ... and the request certainly did not run there

Internal errors are not in the tree: they are translated where they cross into caller-facing code.
At the backend seam (sandbox/): a backend's spawn raises SandboxUnavailable only (base.start_failures
translates OSError, EngineError and CgroupsUnavailable); at construction IdentityError and
SeccompUnavailable become SandboxUnavailable, a missing cgroup tree a note on degraded isolation. In the
kernel: SandboxExited, HostFsError and timeouts at start -> KernelStartError; a broken or garbled channel
(ChannelBroken, ZmtpError) ends the kernel and the run's reply says so; CheckpointError -> CheckpointFailed,
which sessions turn into SnapshotError (a snapshot) or SessionError (a restore). In sessions: MountsError,
ExportError and OSError while preparing a sandbox's folders -> SessionError.

MountError keeps ValueError as a second base: pydantic turns it into a settings error only as such.
"""

from __future__ import annotations


class CodeRunnerError(Exception):
    """A request that cannot be served; the message is for the caller and says the fix."""


class SessionError(CodeRunnerError):
    """A request about sessions that cannot be served; the message says what to do instead."""


class GuestCallError(SessionError):
    """A guest tool refused its input or failed; the message is the reason."""


class SessionBusy(SessionError):
    """Another call holds the session's kernel."""
