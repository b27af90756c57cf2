"""The podman backend for real: the Containerfile built once per test session (against a base image
made offline from Debian's mirror), then the bwrap backend's own e2e scenarios and the container's
boundary checks through the official MCP client with `--backend podman`.

Needs podman, runc and mmdebstrap (install.sh installs them on Linux). Nothing here skips: a
missing tool or a failed build fails with the reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import pytest
from mcp import Client

from coderunner.sandbox.container import server_tag
from coderunner.sandbox.identity import UID_BASE, UID_SPAN

from . import test_e2e_browser as browser
from . import test_e2e_execute_code as execute_code
from . import test_e2e_files as files
from . import test_e2e_guest_tools as guest_tools
from . import test_e2e_isolation as isolation
from . import test_e2e_run_python as run_python
from . import test_e2e_sessions as sessions
from .conftest import REPO, SECRET_NAME, ServerDirs, open_client, raw_stdio_server, run, text_of, wait_until
from .image_lock import image_build_lock
from .test_e2e_files import Host, files_env, host  # noqa: F401  (the `host` fixture)

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

BASE_IMAGE = "localhost/coderunner-base:bookworm"
#: This machine's podman cannot use crun (hybrid cgroups); runc works.
OCI_RUNTIME = "runc"
BASE_TIMEOUT_S = 900
BUILD_TIMEOUT_S = 1800
#: What the image build and a test run took, printed at the end of the session (see docs/backends-and-macos.md).
TIMINGS: dict[str, float] = {}


def _require(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"{tool} is not installed: run ./install.sh (it installs podman, runc and mmdebstrap)")
    return path


def _step(argv: list[str], timeout_s: float, what: str, env: dict[str, str] | None = None) -> None:
    """Run a set-up step with its output in a log; fail with the log's tail if it fails."""
    with tempfile.TemporaryFile() as log:
        began = time.monotonic()
        try:
            done = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, env=env, check=False)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{what} took longer than {timeout_s}s: {' '.join(argv)}")
        TIMINGS[what] = time.monotonic() - began
        if done.returncode != 0:
            log.seek(0)
            pytest.fail(f"{what} failed ({done.returncode}): {' '.join(argv)}\n{log.read().decode()[-4000:]}")


@pytest.fixture(scope="session")
def podman_image() -> Iterator[str]:
    """The sandbox image, built by `coderunner setup --backend podman` (skipped when current)."""
    podman = _require("podman")
    _require("runc")
    with image_build_lock():
        exists = subprocess.run([podman, "image", "exists", BASE_IMAGE], timeout=60, check=False).returncode == 0
        if not exists:
            _require("mmdebstrap")
            base = [str(REPO / "containers" / "make-base-image.sh"), "podman", BASE_IMAGE]
            _step(base, BASE_TIMEOUT_S, "base image")
        env = {**os.environ, "CODERUNNER_OCI_RUNTIME": OCI_RUNTIME}
        env.pop("CODERUNNER_IMAGE", None)
        setup = [sys.executable, "-m", "coderunner.cli", "setup", "--backend", "podman", "--base-image", BASE_IMAGE]
        _step(setup, BUILD_TIMEOUT_S, "sandbox image build", env=env)
    from coderunner.config import Settings

    yield Settings.model_fields["image"].default
    if TIMINGS:
        print("\npodman set-up: " + ", ".join(f"{k} {v:.1f}s" for k, v in TIMINGS.items()), file=sys.stderr)


def podman_env(dirs: ServerDirs, folders: Host, **extra: str) -> dict[str, str]:
    return {
        **files_env(dirs, folders),
        "CODERUNNER_BACKEND": "podman",
        "CODERUNNER_OCI_RUNTIME": OCI_RUNTIME,
        **extra,
    }


@pytest.fixture
async def client(podman_image: str, dirs: ServerDirs, host: Host) -> AsyncIterator[Client]:  # noqa: F811
    # One-shots start cold, as in test_e2e_execute_code (whose tests run here too): a test may count what a run leaves.
    env = podman_env(dirs, host, CODERUNNER_MAX_NETWORK="internet", CODERUNNER_ONESHOT_READY="0")
    async with open_client("stdio", env) as connected:
        yield connected


def containers(dirs: ServerDirs) -> list[str]:
    """Names of this test server's containers, running or not (found by the server label)."""
    done = subprocess.run(
        ["podman", "ps", "--all", "--filter", f"label=coderunner.server={server_tag(dirs.runtime)}",
         "--format", "{{.Names}}"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return done.stdout.split()


# --- the bwrap backend's scenarios, unchanged, on podman -------------------------------------------

test_state_persists_across_calls = run_python.test_state_persists_across_calls
test_matplotlib_chart_arrives_as_image = run_python.test_matplotlib_chart_arrives_as_image
test_exception_gives_is_error_with_clean_traceback = run_python.test_exception_gives_is_error_with_clean_traceback
test_infinite_loop_is_interrupted_and_state_kept = run_python.test_infinite_loop_is_interrupted_and_state_kept
test_code_ignoring_sigint_is_restarted_and_reply_says_state_lost = (
    run_python.test_code_ignoring_sigint_is_restarted_and_reply_says_state_lost
)
test_kernel_killed_from_inside_gives_clear_error_then_works = (
    run_python.test_kernel_killed_from_inside_gives_clear_error_then_works
)
test_kernel_reset_clears_state_but_keeps_files = run_python.test_kernel_reset_clears_state_but_keeps_files
test_secret_environment_never_enters_the_sandbox = isolation.test_secret_environment_never_enters_the_sandbox
test_no_network_egress = isolation.test_no_network_egress
test_writes_outside_the_workspace_fail = isolation.test_writes_outside_the_workspace_fail
test_two_sessions_see_neither_variables_nor_files = isolation.test_two_sessions_see_neither_variables_nor_files
test_story_load_a_read_only_host_folder = files.test_story_load_a_read_only_host_folder
test_story_export_only_into_the_chosen_folder = files.test_story_export_only_into_the_chosen_folder
test_write_list_read_roundtrip_and_ranges = files.test_write_list_read_roundtrip_and_ranges
test_upload_from_an_import_folder = files.test_upload_from_an_import_folder
test_create_status_list_close = sessions.test_create_status_list_close
test_memory_limit_gives_memory_error_and_kernel_survives = (
    sessions.test_memory_limit_gives_memory_error_and_kernel_survives
)
test_status_reports_usage_against_limits = sessions.test_status_reports_usage_against_limits


# --- what is particular to containers ---------------------------------------------------------------


async def test_status_names_the_podman_backend(client: Client) -> None:
    status = json.loads(text_of(await client.call_tool("manage_sessions", {"action": "status"})))
    assert status["limits"]["pids"]["enforced_by"] == "container pids limit"
    described = json.loads(text_of(await client.call_tool("get_capabilities", {})))  # how it is built: said once
    assert described["sandbox"]["isolation"].startswith("podman container"), described["sandbox"]
    assert described["files"]["workspace"] == "/workspace"


async def test_unprivileged_user_no_capabilities_read_only_root(client: Client) -> None:
    outcome = await isolation.probe(
        client,
        "import os, json\n"
        "status = open('/proc/self/status').read()\n"
        "caps = {l.split(':')[0]: l.split()[1] for l in status.splitlines() if l.startswith('Cap')}\n"
        "nnp = [l.split()[1] for l in status.splitlines() if l.startswith('NoNewPrivs')]\n"
        "try:\n    open('/opt/coderunner/env/evil', 'w'); ro = 'WROTE'\n"
        "except OSError as exc:\n    ro = type(exc).__name__\n"
        "print(json.dumps({'uid': os.getuid(), 'caps': caps, 'nnp': nnp, 'ro': ro,"
        " 'pids': sorted(int(p) for p in os.listdir('/proc') if p.isdigit())}))",
    )
    if os.getuid() == 0:  # a root server gives each sandbox its own host uid from a reserved range
        assert UID_BASE < outcome["uid"] < UID_BASE + 2 * UID_SPAN, outcome["uid"]
    else:
        assert outcome["uid"] == os.getuid()
    assert outcome["caps"]["CapEff"] == "0000000000000000" and outcome["caps"]["CapBnd"] == "0000000000000000"
    assert outcome["nnp"] == ["1"], "no-new-privileges is set"
    assert outcome["ro"] != "WROTE", "the image is mounted read-only"
    assert max(outcome["pids"]) < 100, "only the container's own processes are visible"


async def test_host_files_and_host_users_stay_outside(client: Client, host: Host) -> None:  # noqa: F811
    """Like the bwrap story, except that the image has its own (empty, root-only) /root."""
    home = Path(os.environ.get("HOME", "/root"))
    paths = [str(REPO / "pyproject.toml"), str(home / ".bashrc"), "/etc/shadow", str(host.elsewhere / "secret.txt")]
    outcome = await isolation.probe(client, f"PATHS = {paths!r}\n{isolation.READ_ATTEMPT}")
    assert all(value != "READ" for value in outcome.values()), outcome
    listing = await isolation.probe(
        client,
        "import os, json\nprint(json.dumps({'root': sorted(os.listdir('/')), 'passwd': open('/etc/passwd').read(),"
        f" 'env': {SECRET_NAME!r} in os.environ, 'hosts': open('/etc/hosts').read(),"
        " 'resolv': open('/etc/resolv.conf').read()}))",
    )
    # Not the engine's copies of the host's /etc/hosts and resolv.conf: our own, as under bwrap.
    assert listing["hosts"] == "127.0.0.1 localhost sandbox\n::1 localhost\n" and listing["resolv"] == ""
    assert "work" not in listing["root"] and not listing["env"]
    # The image's own passwd: Debian's system users and `sandbox`, never the host's own accounts.
    assert "\ncoderunner-sandbox:" not in "\n" + listing["passwd"] and "\nsandbox:" in "\n" + listing["passwd"]


async def test_container_killed_from_outside_gives_clear_error_and_fresh_kernel(
    client: Client, dirs: ServerDirs
) -> None:
    await run(client, "before = 1")
    [name] = containers(dirs)

    async def kill_soon() -> None:
        await anyio.sleep(1.0)
        subprocess.run(["podman", "kill", name], capture_output=True, timeout=60, check=False)

    async with anyio.create_task_group() as tg:
        tg.start_soon(kill_soon)
        result = await run(client, "import time\ntime.sleep(30)")
    assert result.is_error and "kernel died" in text_of(result) and "fresh kernel is ready" in text_of(result)
    assert text_of(await run(client, "2 + 2")).splitlines()[0] == "4"
    assert len(containers(dirs)) == 1 and containers(dirs)[0] != name


async def test_closing_a_session_removes_its_container(client: Client, dirs: ServerDirs) -> None:
    created = json.loads(text_of(await client.call_tool("create_session", {})))
    assert len(containers(dirs)) == 1  # the new session's; the default one is not started yet
    closed = await client.call_tool("manage_sessions", {"action": "close", "session_id": created["session_id"]})
    assert not closed.is_error
    assert containers(dirs) == []


async def test_sigkilled_server_takes_its_containers_down_and_the_next_start_cleans_up(
    podman_image: str,
    dirs: ServerDirs,
    host: Host,  # noqa: F811
) -> None:
    """conmon keeps a container when its client dies; the server's watcher (on the host) removes it."""
    env = podman_env(dirs, host)
    with raw_stdio_server(env, [("run_python", {"code": "1"})]) as server:
        [left] = containers(dirs)
        os.kill(server.pid, signal.SIGKILL)
        server.wait(timeout=10)
    assert await wait_until(lambda: left not in containers(dirs), timeout_s=30), "container outlived its server"
    async with open_client("stdio", env) as client:
        assert text_of(await run(client, "2 + 2")).splitlines()[0] == "4"
        assert len(containers(dirs)) == 1
    assert await wait_until(lambda: containers(dirs) == [], timeout_s=30)


async def test_a_leftover_container_is_removed_at_the_next_start(
    podman_image: str,
    dirs: ServerDirs,
    host: Host,  # noqa: F811
) -> None:
    """One that outlived everything (e.g. its kernel ignored the lock) is found by label at start."""
    tag = server_tag(dirs.runtime)
    name = f"coderunner-{tag}-deadbeef-000000"
    subprocess.run(
        ["podman", "--runtime", OCI_RUNTIME, "run", "--detach", "--rm", "--name", name, "--network", "none",
         "--label", f"coderunner.server={tag}", "--label", "coderunner.session=deadbeef",
         "--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096",
         "--entrypoint", "sleep", podman_image, "600"],
        capture_output=True, timeout=60, check=True,
    )  # fmt: skip
    assert name in containers(dirs)
    async with open_client("stdio", podman_env(dirs, host)) as client:
        assert name not in containers(dirs), "the sweep at start removes containers of sessions that are gone"
        assert text_of(await run(client, "2 + 2")).splitlines()[0] == "4"


async def test_internet_mode_uses_the_engines_network(client: Client) -> None:
    created = await client.call_tool("create_session", {"network": "internet"})
    assert not created.is_error, text_of(created)
    sid = json.loads(text_of(created))["session_id"]
    outcome = await isolation.probe(
        client,
        "import socket, json\nprint(json.dumps({'ifaces': sorted(n for _, n in socket.if_nameindex())}))",
        session_id=sid,
    )
    assert outcome["ifaces"] != ["lo"], "internet mode attaches the engine's network"
    with contextlib.suppress(Exception):
        await client.call_tool("manage_sessions", {"action": "close", "session_id": sid})


# --- the guest tools (Playwright with Debian's Chromium, PDF, images with Tesseract) in the image ----


@pytest.fixture
async def tools_client(podman_image: str, dirs: ServerDirs, host: Host) -> AsyncIterator[Client]:  # noqa: F811
    """The browser and guest-tool modules' own set-up (a page to serve, PDFs and images), on podman."""
    async with open_client("stdio", podman_env(dirs, host)) as connected:
        written = await connected.call_tool("write_file", {"path": "app/index.html", "content": browser.APP})
        assert not written.is_error, text_of(written)
        made = await run(connected, guest_tools.MAKE_INPUTS)
        assert not made.is_error, text_of(made)
        yield connected


async def test_browser_single_page_app_served_inside_the_container(tools_client: Client) -> None:
    await browser.test_single_page_app_served_inside_the_sandbox(tools_client)


async def test_browser_interact_fills_a_form(tools_client: Client) -> None:
    await browser.test_interact_fills_a_form_and_reads_the_result(tools_client)


async def test_browser_with_network_off_pages_fail_and_say_why(tools_client: Client) -> None:
    await browser.test_with_network_off_web_pages_fail_and_say_why(tools_client)


async def test_browser_user_code_drives_the_page_and_reset_closes_it(tools_client: Client) -> None:
    await browser.test_user_code_drives_the_same_page_and_reset_closes_the_browser(tools_client)


async def test_every_pdf_op(tools_client: Client) -> None:
    await guest_tools.test_every_pdf_op(tools_client)


async def test_every_image_op_with_tesseract(tools_client: Client) -> None:
    await guest_tools.test_every_image_op(tools_client)


async def test_guest_tool_bad_input_keeps_the_session_serving(tools_client: Client) -> None:
    await guest_tools.test_bad_input_gets_a_clear_error_and_the_session_keeps_serving(tools_client)


def test_image_entrypoint_starts_a_kernel_from_a_mounted_connection_file(podman_image: str, dirs: ServerDirs) -> None:
    """Without a command the image serves the connection file in its runtime dir: a plain Jupyter client works."""
    from jupyter_client.blocking.client import BlockingKernelClient
    from jupyter_client.connect import write_connection_file

    runtime = dirs.root / "rt"
    runtime.mkdir(mode=0o777)
    runtime.chmod(0o777)  # the image's own user must create its sockets here
    connection = runtime / "kernel.json"
    _, info = write_connection_file(str(connection), transport="ipc", ip=str(runtime / "k"), key=b"entrypoint-test")
    connection.chmod(0o644)
    name = f"coderunner-entrypoint-{os.getpid()}"
    container = subprocess.Popen(
        ["podman", "--runtime", OCI_RUNTIME, "run", "--rm", "--init", "--name", name, "--network", "none",
         "--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096",
         "--mount", f"type=bind,source={runtime},target={runtime}",
         "--env", f"CODERUNNER_CONNECTION_FILE={connection}", podman_image],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        client = BlockingKernelClient()
        client.load_connection_info(info)
        deadline = time.monotonic() + 60
        while not all(Path(f"{runtime}/k-{info[port]}").exists() for port in ("shell_port", "iopub_port")):
            assert container.poll() is None and time.monotonic() < deadline, "the entrypoint did not start a kernel"
            time.sleep(0.05)
        client.start_channels()
        client.wait_for_ready(timeout=60)
        reply = client.execute_interactive("import coderunner_guest, os; print(6 * 7, os.getcwd())", timeout=30)
        assert reply["content"]["status"] == "ok"
        client.stop_channels()
    finally:
        subprocess.run(["podman", "rm", "--force", "--time", "0", name], capture_output=True, timeout=60, check=False)
        with contextlib.suppress(subprocess.TimeoutExpired):
            container.wait(timeout=30)


async def test_server_exit_removes_every_container(podman_image: str, dirs: ServerDirs, host: Host) -> None:  # noqa: F811
    async with open_client("stdio", podman_env(dirs, host)) as client:
        await client.call_tool("create_session", {})
        await run(client, "1")
        assert len(containers(dirs)) == 2
    assert await wait_until(lambda: containers(dirs) == [], timeout_s=30), containers(dirs)


async def test_tcp_channels_published_on_loopback_only(podman_image: str, dirs: ServerDirs, host: Host) -> None:  # noqa: F811
    """The fallback for engines that do not share the host kernel (Docker Desktop, Apple): loopback TCP."""
    env = podman_env(dirs, host, CODERUNNER_KERNEL_CHANNELS="tcp", CODERUNNER_NETWORK="internet")
    async with open_client("stdio", env) as client:
        await run(client, "x = 20")
        assert text_of(await run(client, "x + 22")).splitlines()[0] == "42"
        [name] = containers(dirs)
        ports = subprocess.run(["podman", "port", name], capture_output=True, text=True, timeout=60, check=True)
        published = [line.split("->", 1)[1].strip() for line in ports.stdout.splitlines() if "->" in line]
        assert len(published) == 5 and all(address.startswith("127.0.0.1:") for address in published), published
        refused = await client.call_tool("create_session", {"network": "none"})
        assert refused.is_error and "needs the engine's network" in text_of(refused)


async def test_an_engine_that_fails_once_to_create_a_container_is_tried_again(
    podman_image: str,
    dirs: ServerDirs,
    host: Host,  # noqa: F811
) -> None:
    """runc/netavark fail a create now and then; a session must not fail for that."""
    fake = dirs.root / "bin"
    fake.mkdir()
    failed_once = dirs.root / "failed-once"
    real = shutil.which("podman")
    (fake / "podman").write_text(
        "#!/bin/sh\n"
        f'if [ "$3" = run ] && [ ! -e {failed_once} ]; then\n'
        f"    touch {failed_once}\n"
        '    echo "Error: OCI runtime error: runc: runc create failed: (simulated)" >&2\n'
        "    exit 126\n"
        "fi\n"
        f'exec {real} "$@"\n'
    )
    (fake / "podman").chmod(0o755)
    env = podman_env(dirs, host, PATH=f"{fake}:{os.environ.get('PATH', '/usr/bin:/bin')}")
    async with open_client("stdio", env) as client:
        result = await run(client, "6 * 7")
        assert not result.is_error and text_of(result).splitlines()[0] == "42", text_of(result)
    assert failed_once.exists(), "the fake engine was not used"
    assert await wait_until(lambda: containers(dirs) == [], timeout_s=30)


# --- one-shot runs (execute_code, check_only too) in a throwaway container ----------------------------

test_one_shot_languages_stdin_variables_exit_codes = (
    execute_code.test_each_language_reads_stdin_sees_variables_and_reports_its_exit_code
)
test_one_shot_variables_arrive_as_data = execute_code.test_variables_of_every_json_type_arrive_as_data
test_one_shot_timeouts_kill_the_run_and_leave_nothing = execute_code.test_timeouts_kill_the_run_and_leave_nothing
test_one_shot_host_environment_stays_out = execute_code.test_the_host_environment_never_reaches_a_one_shot_run
test_one_shot_syntax_errors_per_language = execute_code.test_syntax_errors_per_language
