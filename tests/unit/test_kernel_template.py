"""The kernel template's pieces that need no sandbox (issue 41): its wire format as both sides write it, the
request's bounds, the template's own bwrap view, and the enter step's refusals (sandbox_enter.py)."""

from __future__ import annotations

import dataclasses
import errno
import itertools
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from coderunner.guest import kernel_template, sandbox_enter
from coderunner.sandbox import bwrap_template, template_kernels
from coderunner.sandbox.base import SandboxProcess, SandboxSpec
from coderunner.sandbox.bwrap_argv import BwrapCommand
from coderunner.sandbox.common import ENV_MOUNT, GUEST_LIB
from coderunner.sandbox.seccomp import CLONE_NAMESPACE_FLAGS
from coderunner.sandbox.template_kernels import STATUS, exit_code


def test_both_sides_speak_the_same_wire_format() -> None:
    for name in ("REQUEST", "REPLY", "REPORT"):
        assert getattr(bwrap_template, name).format == getattr(kernel_template, name).format
    for name in (
        "MAGIC",
        "KIND_FORK",
        "KIND_COUNTERS",
        "KIND_PLAN",
        "FLAG_MEMORY_SOFT_ONLY",
        "FLAG_STATUS_FD",
        "STALE_PREFIX",
        "STALE_REASON_BYTES",
    ):
        assert getattr(bwrap_template, name) == getattr(kernel_template, name)


def test_a_request_carries_the_kernels_environment_and_limits() -> None:
    environment = {"PATH": "/opt/coderunner/env/bin", "HTTP_PROXY": "http://127.0.0.1:3128"}
    request = bwrap_template.encode_request(
        bwrap_template.KIND_FORK, uid=1000, gid=1000, memory_bytes=2**31, memory_soft_only=True, nproc=64,
        environment=environment,
    )  # fmt: skip
    assert len(request) == kernel_template.REQUEST.size
    magic, kind, uid, gid, flags, memory, nproc, blob = kernel_template.REQUEST.unpack(request)
    assert (magic, kind, uid, gid, memory, nproc) == (kernel_template.MAGIC, 1, 1000, 1000, 2**31, 64)
    assert flags & kernel_template.FLAG_MEMORY_SOFT_ONLY
    assert kernel_template.parse_environment(blob) == environment


def test_an_environment_too_large_for_a_request_is_refused() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        bwrap_template.encode_request(bwrap_template.KIND_FORK, environment={"X": "y" * 4096})


def test_a_reply_that_is_not_one_is_refused() -> None:
    with pytest.raises(bwrap_template.TemplateUnavailable):
        bwrap_template.decode_reply(kernel_template.MAGIC + b"\0" * 3)
    good = kernel_template.REPLY.pack(kernel_template.MAGIC, 0, 42, 1, 2, 1)
    assert bwrap_template.decode_reply(good).pid == 42


def test_the_template_sees_the_sandboxes_read_only_part_at_the_sandboxes_paths(tmp_path: Path) -> None:
    command = BwrapCommand(bwrap="/usr/bin/bwrap", env_dir=tmp_path / "env", guest_dir=tmp_path / "guest")
    argv = bwrap_template.template_argv(command, 5, 6)
    pairs = list(zip(argv, argv[1:], argv[2:], strict=False))
    assert ("--ro-bind", str(tmp_path / "env"), ENV_MOUNT) in pairs
    assert ("--ro-bind", str(tmp_path / "guest"), f"{GUEST_LIB}/coderunner_guest") in pairs
    assert ("--cap-add", "ALL") in itertools.pairwise(argv)
    assert "--unshare-user" not in argv  # its forks join user namespaces: it must be the host's root
    assert argv[argv.index("--") + 1 :] == [
        f"{ENV_MOUNT}/bin/python", "-P", "-m", "coderunner_guest.kernel_template", "5", "6",
    ]  # fmt: skip
    assert "--bind" not in argv and "--dev-bind" not in argv  # nothing of the host's it could write


def test_the_enter_step_joins_every_namespace_bwrap_gives_a_sandbox() -> None:
    assert sum(CLONE_NAMESPACE_FLAGS.values()) == sandbox_enter.SANDBOX_NAMESPACES


def test_a_seccomp_program_that_is_not_one_is_refused() -> None:
    for program in (b"", b"\0" * 7):
        with pytest.raises(OSError, match="not a seccomp program"):
            sandbox_enter.load_seccomp(program)


def test_close_fds_but_keeps_only_what_it_is_told() -> None:
    """In a child process: every fd it had but the kept ones (and 0-2) is closed."""
    code = (
        "import os\n"
        "from coderunner.guest.sandbox_enter import close_fds_but\n"
        "fds = [os.open('/dev/null', os.O_RDONLY) for _ in range(5)] + [os.dup2(0, 900, inheritable=True)]\n"
        "close_fds_but((fds[2],))\n"
        "print(sorted(int(fd) for fd in os.listdir('/proc/self/fd')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ)
    kept = eval(result.stdout)  # a printed list of ints
    assert kept[:3] == [0, 1, 2] and len(kept) == 5  # 0-2, the one kept, and listdir's own


def test_an_unfinished_sandbox_is_refused() -> None:
    """A root that is not a finished sandbox's (here: the host's, writable, no sandbox-init) is refused."""
    with pytest.raises(OSError, match="not finished"):
        sandbox_enter.check_finished("/nonexistent-workspace")


def test_the_template_reads_nothing_a_sandbox_does_not_see(tmp_path: Path) -> None:
    """Every host path the template's view binds or links is bound or linked, read-only and at the same place, in
    every sandbox (what the template read before a fork is what any sandbox may read); the rest are its own."""
    command = BwrapCommand(bwrap="/usr/bin/bwrap", env_dir=tmp_path / "env", guest_dir=tmp_path / "guest")
    spec = SandboxSpec(name="s", workspace=tmp_path / "w", runtime_dir=tmp_path / "r", host_dir=tmp_path / "h")
    sandbox = command.argv(spec, ["true"], gate_fd=3)
    template = bwrap_template.template_argv(command, 5, 6)

    def exposed(argv: list[str]) -> set[tuple[str, str, str]]:
        argv = argv[: argv.index("--")]
        return {
            (flag, argv[i + 1], argv[i + 2])
            for i, flag in enumerate(argv)
            if flag in ("--ro-bind", "--bind", "--dev-bind", "--symlink", "--ro-bind-try", "--bind-try")
        }

    assert exposed(template) and exposed(template) <= exposed(sandbox)


def test_fds_beside_a_reply_that_is_not_one_are_closed() -> None:
    read, write = os.pipe()
    with pytest.raises(bwrap_template.TemplateUnavailable):
        bwrap_template.decode_reply(b"nonsense", [read, write])
    for fd in (read, write):
        with pytest.raises(OSError):
            os.fstat(fd)


def test_the_template_writes_a_reaped_kernels_wait_status_to_its_pipe_and_the_host_reads_its_exit_code() -> None:
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        os._exit(3)
    statuses = {child: write}
    while statuses:  # what the template's loop does on each SIGCHLD
        kernel_template.reap(statuses)
    said = os.read(read, 64)
    assert os.read(read, 1) == b""  # written once, then closed
    os.close(read)
    assert exit_code(STATUS.unpack(said)[0]) == 3


def test_a_kernel_killed_by_a_signal_reports_what_a_cold_kernels_sandbox_reports() -> None:
    child = os.fork()
    if child == 0:
        os.kill(os.getpid(), 9)
    _, status = os.waitpid(child, 0)
    assert exit_code(status) == 137  # the sandbox's init (guest/sandbox_init.py): 128 + the signal


def test_a_request_says_when_it_carries_a_status_pipe() -> None:
    request = bwrap_template.encode_request(bwrap_template.KIND_FORK, status_fd=True)
    flags = kernel_template.REQUEST.unpack(request)[4]
    assert flags & kernel_template.FLAG_STATUS_FD and not flags & kernel_template.FLAG_MEMORY_SOFT_ONLY


def test_the_guest_modules_the_template_imports_ahead_are_the_guests_own() -> None:
    """What the template imports for a kernel's start is named as an import would name it: the guest's by its
    package (as the sandbox's kernel imports its extension), each a module the guest holds."""
    guest = Path(kernel_template.__file__).parent
    for name in kernel_template.KERNEL_START_IMPORTS:
        assert name.isidentifier() or all(part.isidentifier() for part in name.split("."))
        if name.startswith("coderunner_guest."):
            assert (guest / f"{name.split('.', 1)[1]}.py").is_file(), name


def test_a_fork_that_exited_stale_is_told_apart_by_its_code_and_says_why_in_its_own_line() -> None:
    """The host starts a cold kernel only for a fork that exited with STALE; the reason is the line after the
    prefix it wrote last on its stderr (whatever came before it), bounded."""

    @dataclasses.dataclass
    class Ended:
        returncode: int
        said: str

        def stderr_tail(self) -> str:
            return self.said

    line = f"{kernel_template.STALE_PREFIX}ImportError: numpy would now be imported from /workspace/numpy.py\n"
    stale = typing.cast(SandboxProcess, Ended(kernel_template.STALE, "a warning\n" + line))
    assert template_kernels.stale_reason(stale) == "ImportError: numpy would now be imported from /workspace/numpy.py"
    assert template_kernels.stale_reason(typing.cast(SandboxProcess, Ended(1, line))) is None  # another end
    silent = typing.cast(SandboxProcess, Ended(kernel_template.STALE, ""))
    assert template_kernels.stale_reason(silent) == "the kernel did not say why"
    cut = typing.cast(SandboxProcess, Ended(kernel_template.STALE, kernel_template.STALE_PREFIX))  # nothing after it
    assert template_kernels.stale_reason(cut) == "the kernel did not say why"
    long = typing.cast(SandboxProcess, Ended(kernel_template.STALE, kernel_template.STALE_PREFIX + "x" * 5000))
    assert len(template_kernels.stale_reason(long) or "") == kernel_template.STALE_REASON_BYTES


@dataclasses.dataclass
class _Backend:
    """What the registry reads and writes of a backend when it looks for its template."""

    name: str
    no_kernel_starter: str | None = None
    kernel_starter: object = None


@pytest.mark.parametrize("asked", [True, False])
def test_auto_starts_a_template_only_where_it_can_be_and_says_nothing_where_not(
    asked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kernel_template 'auto' (the default) and true: where no template can run (a non-root server, a backend
    without one), kernels start cold; only a user who asked for it is told why in each kernel's status."""
    from coderunner.sandbox import registry

    monkeypatch.setattr(bwrap_template.os, "getuid", lambda: 1000)
    bwrap = _Backend("bwrap")
    assert registry.kernel_starter(bwrap, asked=asked) is None  # type: ignore[arg-type]
    assert bwrap.no_kernel_starter == ("the kernel template needs a server running as root (it joins user namespaces)"
                                       if asked else None)  # fmt: skip
    podman = _Backend("podman")
    assert registry.kernel_starter(podman, asked=asked) is None  # type: ignore[arg-type]
    assert podman.no_kernel_starter == ("the podman backend has no kernel template" if asked else None)


def test_where_it_can_be_auto_gives_the_template(monkeypatch: pytest.MonkeyPatch) -> None:
    from coderunner.sandbox import registry

    monkeypatch.setattr(bwrap_template.os, "getuid", lambda: 0)
    assert template_kernels.unavailable_here() is None
    monkeypatch.setattr(template_kernels, "kernel_starter", lambda backend, preload: ("starter", backend, preload))
    bwrap = _Backend("bwrap")
    assert registry.kernel_starter(bwrap, False, asked=False) == ("starter", bwrap, False)  # type: ignore[arg-type,comparison-overlap]
    assert bwrap.no_kernel_starter is None


class _RefusingTemplate:
    """A template whose every fork fails, as on a machine where no fork can enter a sandbox."""

    def __init__(self) -> None:
        self.asked = 0
        self.closed = False

    async def spawn_entered(self, *args: object, **kwargs: object) -> typing.NoReturn:
        self.asked += 1
        raise OSError(errno.EINVAL, "setns on a pidfd is not supported here")

    async def close(self) -> None:
        self.closed = True


@pytest.mark.anyio
async def test_a_template_whose_first_forks_all_fail_is_given_up_and_says_why() -> None:
    kernels = template_kernels.TemplateKernels(_Backend("bwrap"))  # type: ignore[arg-type]
    template = _RefusingTemplate()
    kernels.template, kernels.starting, kernels.why_not = template, False, None  # type: ignore[assignment]
    for _ in range(template_kernels.NEVER_FORKED_LIMIT):
        with pytest.raises(template_kernels.TemplateUnavailable, match="could not be forked"):
            await kernels.spawn_kernel(None, None)  # type: ignore[arg-type]
    assert kernels.given_up and template.closed and kernels.template is None
    with pytest.raises(template_kernels.TemplateUnavailable, match="off for this server: its first 3 forks all"):
        await kernels.spawn_kernel(None, None)  # type: ignore[arg-type]
    assert template.asked == template_kernels.NEVER_FORKED_LIMIT  # no sandbox built and thrown away since


@pytest.mark.anyio
async def test_a_template_that_forked_once_is_never_given_up() -> None:
    kernels = template_kernels.TemplateKernels(_Backend("bwrap"))  # type: ignore[arg-type]
    template = _RefusingTemplate()
    kernels.template, kernels.starting, kernels.why_not = template, False, None  # type: ignore[assignment]
    kernels.forked = 1  # it worked here once: later failures are a loaded machine's, not the machine's
    for _ in range(template_kernels.NEVER_FORKED_LIMIT + 2):
        with pytest.raises(template_kernels.TemplateUnavailable, match="could not be forked"):
            await kernels.spawn_kernel(None, None)  # type: ignore[arg-type]
    assert not kernels.given_up and not template.closed


@pytest.mark.anyio
async def test_waiting_for_a_starting_template_ends_when_it_is_ready_or_closed() -> None:
    """settled() (the pool's and the standbys' wait) returns once the start ended, and never outlives a close:
    a start cancelled by the server's close never says it ended itself."""
    import anyio

    for ends in ("ready", "closed"):
        kernels = template_kernels.TemplateKernels(_Backend("bwrap"))  # type: ignore[arg-type]
        kernels.starting = True
        settled = anyio.Event()

        async def wait(kernels: template_kernels.TemplateKernels = kernels, settled: anyio.Event = settled) -> None:
            await kernels.settled()
            settled.set()

        async with anyio.create_task_group() as group:
            group.start_soon(wait)
            await anyio.sleep(0.05)
            assert not settled.is_set()
            if ends == "ready":
                kernels.starting = False
                kernels.ready.set()
            else:
                await kernels.close()
            with anyio.fail_after(5):
                await settled.wait()


def test_the_module_walk_ahead_finds_the_files_the_stock_walk_finds_in_its_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What IPythonKernel.__init__'s `sys.modules.copy().values()` walk gets in a fork (kernel_ahead.py): the
    template's modules as stand-ins, then those imported since; their files are the stock walk's, in order. What
    is set on that `sys` reaches the real one."""
    import types

    from coderunner.guest import kernel_ahead

    monkeypatch.setattr(kernel_ahead, "_module_files", ())
    monkeypatch.setattr(kernel_ahead, "_modules_then", None)
    kernel_ahead.note_modules()
    assert kernel_ahead._modules_then == len(sys.modules)
    for name in ("coderunner_test_since_a", "coderunner_test_since_b"):
        module = types.ModuleType(name)
        module.__file__ = f"/nowhere/{name}.py"
        monkeypatch.setitem(sys.modules, name, module)
    ahead = kernel_ahead._SysAhead()

    def files(values: typing.Iterable[typing.Any]) -> list[str]:
        return [m.__file__ for m in values if hasattr(m, "__file__") and m.__file__]

    walked = files(ahead.modules.copy().values())
    assert walked == files(sys.modules.copy().values())
    assert walked[-2:] == ["/nowhere/coderunner_test_since_a.py", "/nowhere/coderunner_test_since_b.py"]
    assert all(type(m) is kernel_ahead.ModuleFile for m in kernel_ahead._module_files)
    assert ahead.platform == sys.platform and ahead.modules.get("sys") is sys
    monkeypatch.setattr(sys, "coderunner_test_mark", 1, raising=False)
    ahead.coderunner_test_mark = 2
    assert sys.coderunner_test_mark == 2  # type: ignore[attr-defined]


def test_the_module_names_ahead_are_the_templates_set_and_the_names_imported_since(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """IPython's init_code keeps `set(sys.modules.keys())` for `%reset --aggressive`; in a fork (kernel_ahead.py)
    it asks a `sys` that names nothing, and the set kept is the template's own with the names imported since:
    what the stock line would have made. Where init_code does not ask, the shell is left as it is."""
    import types

    from coderunner.guest import kernel_ahead

    shellapp = types.ModuleType("IPython.core.shellapp")
    shellapp.sys = sys  # type: ignore[attr-defined]
    core = types.ModuleType("IPython.core")
    core.shellapp = shellapp  # type: ignore[attr-defined]
    for name, module in (("IPython", types.ModuleType("IPython")), ("IPython.core", core),
                         ("IPython.core.shellapp", shellapp)):  # fmt: skip
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(kernel_ahead, "_module_files", ())
    monkeypatch.setattr(kernel_ahead, "_module_names", None)
    monkeypatch.setattr(kernel_ahead, "_modules_then", None)
    kernel_ahead.note_modules()
    monkeypatch.setitem(sys.modules, "coderunner_test_since", types.ModuleType("coderunner_test_since"))
    app = types.SimpleNamespace(shell=types.SimpleNamespace())

    with kernel_ahead.names_ahead(app):  # as IPython's init_code ends
        assert shellapp.sys.stdout is sys.stdout  # type: ignore[attr-defined]
        app.shell._sys_modules_keys = set(shellapp.sys.modules.keys())  # type: ignore[attr-defined]
        assert app.shell._sys_modules_keys == set()
    assert shellapp.sys is sys  # type: ignore[attr-defined]
    assert app.shell._sys_modules_keys is kernel_ahead._module_names
    assert app.shell._sys_modules_keys == set(sys.modules)

    untouched = types.SimpleNamespace(shell=types.SimpleNamespace())
    with kernel_ahead.names_ahead(untouched):
        pass
    assert not hasattr(untouched.shell, "_sys_modules_keys")


def test_a_forks_kernel_has_a_cold_kernels_command_line() -> None:
    # The template parses KERNEL_ARGS ahead for every fork; a cold kernel is started with kernel/process.py's
    # options after its private connection file. The host cannot import the guest, so each has its own copy.
    from coderunner.kernel.process import KERNEL_OPTIONS
    from coderunner.sandbox.common import PRIVATE_CONNECTION

    assert ("-f", PRIVATE_CONNECTION, *KERNEL_OPTIONS) == kernel_template.KERNEL_ARGS
