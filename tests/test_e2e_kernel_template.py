"""Sessions whose kernels are forks of the warm template (`kernel_template`, issue 41), through the MCP client.

A session says in manage_sessions status how its kernel started (`kernel_start`): "template", or
"cold start: <why>". Each fallback is forced here and the session still starts and answers: a request the
template cannot carry (an environment over its field), the template dead, a fork the template refused, a
workspace module shadowing one the template imported. Every network mode comes from the template with its
network: 'internet''s interface, 'allowlist''s proxy port and environment. And what a forked kernel is not
the sandbox's own child for: its exit code reaches the host (the template reaps it) and its sandbox ends
with it; what it writes to stderr is kept; without cgroups it gets the backend's RLIMIT_NPROC and its
memory counts.
Root only (the template joins user namespaces), bwrap only.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import AsyncIterator
from typing import Any
from unittest import mock

import anyio
import pytest
from mcp import Client

from coderunner.kernel.incarnation import Kernel
from coderunner.oneshot.local import LocalOneShots
from coderunner.sandbox import bwrap_template, make_backend, template_kernels
from coderunner.sandbox.template_kernels import TemplateKernels
from coderunner.server import build_server
from coderunner.sessions.manager import SessionManager

from .conftest import ServerDirs, run, sandbox_processes_alive, server_env, server_settings, text_of

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

TEMPLATE = "template"


@contextlib.asynccontextmanager
async def template_server(dirs: ServerDirs, ready: bool = True, **extra: str) -> AsyncIterator[tuple[Any, Client]]:
    """The real server in this process with kernel_template on, once its template is ready (`ready`)."""
    if os.getuid() != 0 or shutil.which("bwrap") is None:
        pytest.skip("the kernel template needs root and bwrap")
    env = server_env(dirs, CODERUNNER_KERNEL_TEMPLATE="1", CODERUNNER_RESET_STANDBY="0", **extra)
    settings = server_settings(env)
    if settings.backend != "bwrap":
        pytest.skip("the kernel template is bwrap's")
    with mock.patch.dict(os.environ, env):
        backend = make_backend(settings)
        async with (
            SessionManager(settings, backend) as manager,
            Client(build_server(manager, LocalOneShots.for_manager(manager)), read_timeout_seconds=120) as client,
        ):
            assert isinstance(manager.template, TemplateKernels)
            if ready:
                with anyio.fail_after(180):
                    await manager.template.ready.wait()
                assert manager.template.template is not None, manager.template.why_not
            yield manager, client


async def status(client: Client, session_id: str) -> dict[str, Any]:
    result = await client.call_tool("manage_sessions", {"action": "status", "session_id": session_id})
    assert not result.is_error, text_of(result)
    return json.loads(text_of(result))


async def create(client: Client, **arguments: object) -> str:
    result = await client.call_tool("create_session", arguments)
    assert not result.is_error, text_of(result)
    return str(json.loads(text_of(result))["session_id"])


async def value(client: Client, session_id: str, code: str) -> str:
    result = await run(client, code, session_id=session_id)
    assert not result.is_error, text_of(result)
    return text_of(result).splitlines()[0]


async def kill_template(manager: Any) -> None:
    """Kill the server's template and wait until the server has let it go: its next kernels start cold."""
    assert manager.template is not None and manager.template.template is not None
    manager.template.template.process.kill()
    with anyio.fail_after(10):
        while manager.template.template is not None:
            await anyio.sleep(0.05)


async def test_a_session_kernel_is_a_fork_of_the_template_and_its_exit_ends_its_sandbox(dirs: ServerDirs) -> None:
    async with template_server(dirs) as (manager, client):
        sid = await create(client)
        assert (await status(client, sid))["kernel_start"] == TEMPLATE
        # Before any code of the user's ran, the template learned from its first kernel which of its pages a start
        # copies (guest/page_plan.py): the kernels forked from now on copy them while their sandbox is built.
        assert manager.template.plan_pages is not None and manager.template.plan_pages > 1000
        # The template's imports are there before any cell imported them; the kernel is the sandbox's user.
        assert await value(client, sid, "import sys, os; ('numpy' in sys.modules, os.getuid())") == "(True, 1000)"
        assert manager.template is not None and manager.template.forked == 1
        # Its command line was parsed and its shell built once in the template (kernel_ahead.py), and the fork made
        # the shell its own: its config (the history in memory, the guest's extension), its kernel, its environment
        # and working directory, a history of its own that the user's In and _dh are.
        said = (
            "import os, coderunner_guest.kernel_ahead as a; ip = get_ipython(); loaded = ip.extension_manager.loaded\n"
            "print((a._parsed is not None, a._shell_built, ip.history_manager.hist_file,\n"
            " 'coderunner_guest' in loaded, ip.kernel is not None and ip.kernel.shell is ip, os.environ.get('PAGER'),\n"
            " _dh, In is ip.history_manager.input_hist_parsed, ip.starting_dir))"
        )
        expected = "(True, True, ':memory:', True, True, 'cat', [PosixPath('/workspace')], True, '/workspace')"
        assert await value(client, sid, said) == expected
        # The kernel's list of its modules' files (its debugger's) was walked over the template's stand-ins: it
        # is the files of the modules there were as the kernel was built, the template's and those imported
        # since the fork (kernel_boot), as plain strings; ipykernel's own `sys` is the real one again.
        said = (
            "import sys, ipykernel.ipkernel as ik, coderunner_guest.kernel_ahead as a\n"
            "files = get_ipython().kernel._kernel_modules\n"
            "now = {getattr(m, '__file__', None) for m in list(sys.modules.values())}\n"
            "print((all(type(f) is str for f in files), set(files) <= now, len(files) >= len(a._module_files) > 500,\n"
            " sys.modules['numpy'].__file__ in files, sys.modules['coderunner_guest.kernel_boot'].__file__ in files,\n"
            " ik.sys is sys))"
        )
        assert await value(client, sid, said) == "(True, True, True, True, True, True)"
        # The names IPython keeps for `%reset --aggressive` are the template's set with the fork's imports added
        # (tornado's asyncio platform is imported by the kernel's start, never by the template); its display
        # formatters are the ones built in the template; no shell channel thread was built (a stand-in, falsy, and
        # three event loops: the kernel's, control's and IOPub's; a built one left a fourth); and the abstract
        # collections already knew what the builtin types are not (a question nothing in a start asks).
        said = (
            "import abc, collections.abc, sys, coderunner_guest.kernel_ahead as a; ip = get_ipython()\n"
            "from tornado.ioloop import IOLoop\n"
            "keys = ip._sys_modules_keys; _, _, isnot, version = abc._get_dump(collections.abc.Sequence)\n"
            "print((keys is a._module_names, 'tornado.platform.asyncio' in keys, keys <= set(sys.modules),\n"
            " len(keys) > a._modules_then > 500, ip.display_formatter.formatters is a._formatters,\n"
            " type(ip.kernel.shell_channel_thread).__name__, len(IOLoop._ioloop_for_asyncio),\n"
            " any(ref() is complex for ref in isnot)))"
        )
        expected = "(True, True, True, True, True, 'NoShellChannelThread', 3, True)"
        assert await value(client, sid, said) == expected
        # ... and what that set is for still holds: an aggressive reset drops a module imported by a cell only.
        said = "import tabnanny\n%reset -f --aggressive"
        assert await value(client, sid, said) == "culling sys module..."
        said = "import sys\nprint(('tabnanny' in sys.modules, 'numpy' in sys.modules))"
        assert await value(client, sid, said) == "(False, True)"
        # No heartbeat (the host never uses it): no thread of it, nor a ZMQ context of its own (one I/O thread: the
        # kernel's own context's).
        said = (
            "import os, threading; from ipykernel.kernelapp import IPKernelApp\n"
            "tasks = [open(f'/proc/self/task/{t}/comm').read().strip() for t in os.listdir('/proc/self/task')]\n"
            "beats = [t for t in threading.enumerate() if 'Heartbeat' in type(t).__name__]\n"
            "print((IPKernelApp.instance().heartbeat, beats, sum(name.startswith('ZMQbg/IO') for name in tasks)))"
        )
        assert await value(client, sid, said) == "(None, [], 1)"
        session = next(each for each in manager.list() if each.session_id == sid)
        assert session.kernel is not None and session.kernel.process is not None
        process = session.kernel.process
        # The suites' count of sandbox processes has the forked kernel, not the template (the server's helper).
        counted = sandbox_processes_alive(dirs)
        assert process.program_pid in counted and manager.template.template.pid not in counted, counted
        # What it writes to stderr (its fd 2, not the ZMQ stream) is the sandbox's stderr tail.
        await value(client, sid, "import os; os.write(2, b'said on fd 2\\n')")
        with anyio.fail_after(10):
            while "said on fd 2" not in process.stderr_tail():
                await anyio.sleep(0.05)
        # Its exit code is relayed (the template reaped it), and its sandbox ends with it.
        died = await run(client, "import os; os._exit(3)", session_id=sid)
        assert died.is_error and "3" in text_of(died), text_of(died)
        with anyio.fail_after(15):
            await process.wait()
        assert process.returncode == 3
        # The next call starts it again, from the template again.
        assert await value(client, sid, "1 + 1") == "2"
        assert (await status(client, sid))["kernel_start"] == TEMPLATE


async def test_without_cgroups_a_forked_kernel_gets_the_backends_nproc_limit_and_its_memory_counts(
    dirs: ServerDirs,
) -> None:
    async with template_server(dirs, CODERUNNER_CGROUPS="0", CODERUNNER_PIDS="64") as (_, client):
        sid = await create(client)
        said = await status(client, sid)
        assert said["kernel_start"] == TEMPLATE
        soft = int(await value(client, sid, "import resource; resource.getrlimit(resource.RLIMIT_NPROC)[0]"))
        assert 64 <= soft < 100_000, soft  # its user's tasks now plus the pids limit, not unlimited
        # Its memory is read from its own process tree (it is the template's child, not the sandbox's).
        assert said["usage"]["memory_mb"] > 20, said


NETWORK_PROBE = """
import os, socket
interfaces = [line.split(":")[0].strip() for line in open("/proc/net/dev").read().splitlines()[2:]]
try:
    socket.create_connection(("127.0.0.1", 3128), timeout=5).close()
    port = "open"
except OSError:
    port = "closed"
print(sorted(interfaces), port, os.environ.get("HTTP_PROXY"))
"""


@pytest.mark.parametrize(
    ("mode", "said"),
    [
        ("internet", "['lo', 'tap0'] closed None"),
        ("allowlist", "['lo'] open http://127.0.0.1:3128"),
    ],
)
async def test_every_network_mode_comes_from_the_template_with_its_network(
    dirs: ServerDirs, mode: str, said: str
) -> None:
    extra = {"CODERUNNER_NETWORK": mode}
    if mode == "allowlist":
        extra["CODERUNNER_ALLOWED_DOMAINS"] = '["example.com"]'
    async with template_server(dirs, **extra) as (_, client):
        sid = await create(client)
        assert (await status(client, sid))["kernel_start"] == TEMPLATE
        assert await value(client, sid, NETWORK_PROBE) == said


async def test_the_warm_pools_first_member_waits_for_a_starting_template_where_a_user_would_start_cold(
    dirs: ServerDirs,
) -> None:
    """A user's create waits for a starting template only so long (here not at all), then starts cold; nobody
    waits for a pooled start, so it forks from the template once it is up rather than start cold beside it."""
    with mock.patch.object(template_kernels, "STARTING_WAIT_S", 0.0):
        async with template_server(dirs, ready=False, CODERUNNER_POOL_SIZE="1") as (manager, client):
            assert manager.template.starting  # its imports take seconds: the pool's first start is under way
            user = await create(client)
            said = (await status(client, user))["kernel_start"]
            assert said == "cold start: the kernel template is starting", said
            with anyio.fail_after(180):
                while manager.pool.stats().ready == 0:
                    await anyio.sleep(0.05)
            pooled = await status(client, await create(client))
            assert (pooled["started"]["sandbox"], pooled["kernel_start"]) == ("warm pool", TEMPLATE), pooled


async def test_a_request_the_template_cannot_carry_starts_cold_and_says_why(dirs: ServerDirs) -> None:
    async with template_server(dirs) as (_, client):
        # The kernel's environment goes in a fixed-size field of the request: one larger starts cold.
        with mock.patch.object(bwrap_template, "ENVIRONMENT_BYTES", 16):
            sid = await create(client)
        assert await value(client, sid, "1 + 1") == "2"
        said = (await status(client, sid))["kernel_start"]
        assert said.startswith("cold start: the kernel's environment") and "does not fit" in said, said


async def test_a_dead_template_means_cold_starts_that_say_so(dirs: ServerDirs) -> None:
    async with template_server(dirs) as (manager, client):
        await kill_template(manager)
        sid = await create(client)
        assert await value(client, sid, "1 + 1") == "2"
        said = (await status(client, sid))["kernel_start"]
        assert said.startswith("cold start: the kernel template exited"), said


async def test_a_fork_the_template_refuses_means_a_cold_start_that_says_why(dirs: ServerDirs) -> None:
    async with template_server(dirs) as (manager, client):
        # A uid the sandbox's user namespace does not map: the fork cannot become it, and refuses.
        with mock.patch.object(bwrap_template, "SANDBOX_UID", 4242):
            sid = await create(client)
        assert await value(client, sid, "1 + 1") == "2"
        said = (await status(client, sid))["kernel_start"]
        assert said.startswith("cold start: a fork of the kernel template could not enter its sandbox"), said
        assert manager.template is not None and manager.template.refused == 1
        # The template lives on, and the next kernel comes from it.
        assert (await status(client, await create(client)))["kernel_start"] == TEMPLATE


async def test_a_start_cancelled_during_its_page_lesson_leaves_no_sandbox(dirs: ServerDirs) -> None:
    """A kernel the template learns its pages from runs one silent cell after it answered (Kernel._teach_starter).
    A session closed then (a warm pool's start cut short by the server's close, say) ends that sandbox too: it
    was left running, found when the conformance suite's teardown saw a held bwrap sandbox outlive its server."""
    async with template_server(dirs) as (manager, _):
        assert manager.template is not None
        in_lesson = anyio.Event()
        execute = Kernel.execute

        async def a_long_lesson(self: Kernel, code: str, *args: Any, **kwargs: Any) -> Any:
            if code == "pass" and kwargs.get("silent"):
                in_lesson.set()
                await anyio.sleep_forever()
            return await execute(self, code, *args, **kwargs)

        with (
            mock.patch.object(Kernel, "execute", a_long_lesson),
            mock.patch.object(manager.template, "wants_pages_from", lambda process: True),
        ):
            async with anyio.create_task_group() as group:
                group.start_soon(manager.create)
                with anyio.fail_after(60):
                    await in_lesson.wait()
                assert sandbox_processes_alive(dirs), "the lesson's kernel has no sandbox"
                group.cancel_scope.cancel()
        with anyio.fail_after(20):
            while sandbox_processes_alive(dirs):
                await anyio.sleep(0.1)
        assert manager.list() == []


async def test_a_workspace_module_shadowing_the_templates_imports_means_a_cold_kernel(dirs: ServerDirs) -> None:
    async with template_server(dirs) as (_, client):
        sid = await create(client)
        await value(client, sid, "open('numpy.py', 'w').write('shadowed = True')")
        result = await client.call_tool("kernel_reset", {"session_id": sid})
        assert not result.is_error, text_of(result)
        said = (await status(client, sid))["kernel_start"]
        assert said.startswith("cold start: the template's imports are not current here"), said
        assert "numpy would now be imported from" in said and "numpy.py" in said, said  # the fork's own words
        # The user's import finds the workspace's module, as in any cold kernel.
        assert await value(client, sid, "import numpy\nprint(getattr(numpy, 'shadowed', False))") == "True"


async def test_a_forked_kernel_stops_at_an_interrupt_and_keeps_its_state(dirs: ServerDirs) -> None:
    """A fork carries the template's imports (its debugger's among them) and signal state: an endless cell is
    interrupted at its timeout and the kernel, and what it holds, are kept."""
    async with template_server(dirs) as (_manager, client):
        session = await create(client)
        assert (await status(client, session))["kernel_start"] == TEMPLATE
        assert await value(client, session, "kept = 'still here'\nkept") == "'still here'"
        result = await run(client, "while True:\n    pass", session_id=session, timeout_s=2)
        text = text_of(result)
        assert result.is_error and "interrupted" in text and "state are kept" in text, text
        assert await value(client, session, "kept") == "'still here'"


async def test_without_preload_imports_a_forked_kernel_has_no_data_stack_imported(dirs: ServerDirs) -> None:
    """A fork has what its template imported: with preload_imports off, the template imports a kernel's own
    modules only, so the user's kernel holds no numpy, pandas or matplotlib until a cell imports them."""
    async with template_server(dirs, CODERUNNER_PRELOAD_IMPORTS="false") as (_manager, client):
        session = await create(client)
        assert (await status(client, session))["kernel_start"] == TEMPLATE
        loaded = "import sys; sorted(n for n in ('numpy', 'pandas', 'matplotlib') if n in sys.modules)"
        assert await value(client, session, loaded) == "[]"
        assert await value(client, session, "import numpy; int(numpy.arange(4).sum())") == "6"


#: What a kernel's shell holds from its construction, asked of a forked kernel and of a cold one: the answers must
#: be the same (the fork's shell was built in the template, kernel_ahead.py). One line each.
SHELL_PROBES = (
    "import os; print(sorted((k, os.environ.get(k)) for k in ('TERM', 'PAGER', 'GIT_PAGER', 'CLICOLOR', 'HOME')))",
    "print(get_ipython().profile_dir.location, os.path.isdir(get_ipython().profile_dir.startup_dir))",
    "x = 40 + 2\nprint(x, In[-1].splitlines()[0], _dh, type(get_ipython().compile).__name__)",
    "print(len(get_ipython().history_manager.input_hist_raw), get_ipython().execution_count)",
    "print(sorted(k for k in get_ipython().user_ns if not k.startswith('_i') and k not in ('x',)))",
    "ip = get_ipython(); print(ip.stdin_encoding, ip.kernel.shell is ip, ip.parent is not None)",
    "%store x\nprint('stored')",
    "print(sorted(get_ipython().display_formatter.active_types))",
    "!echo from a shell",
    "print(sorted(get_ipython().magics_manager.magics['line'])[:8], len(get_ipython().magics_manager.magics['line']))",
)


async def answers(client: Client, session_id: str) -> list[str]:
    said = []
    for probe in SHELL_PROBES:
        result = await run(client, probe, session_id=session_id)
        lines = [line for line in text_of(result).splitlines() if not re.match(r"\[(ok in|kernel \d)", line)]
        said.append(("error: " if result.is_error else "") + "\n".join(lines).strip())  # its footer aside
    return said


async def test_a_forked_kernels_shell_answers_as_a_cold_kernels_does(dirs: ServerDirs) -> None:
    async with template_server(dirs) as (manager, client):
        forked = await create(client)
        assert (await status(client, forked))["kernel_start"] == TEMPLATE
        from_template = await answers(client, forked)
        await kill_template(manager)
        cold = await create(client)
        assert (await status(client, cold))["kernel_start"].startswith("cold start"), "the second was not cold"
        assert from_template == await answers(client, cold)
        assert "stored" in from_template[6] and "from a shell" in from_template[8], from_template
