"""What a create may take from the warm pool and what the pooled sandbox is given at take (warm_take.py),
then through the SessionManager on scripted kernels, with a backend that lowers limits live and one that
cannot; and the cgroup writes that lower a running sandbox's limits (live_limits.py), on plain files."""

from __future__ import annotations

import dataclasses
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from coderunner.sandbox import Limits, SandboxUnavailable
from coderunner.sandbox.cgroups import SessionCgroup
from coderunner.sandbox.live_limits import lower_limits, raised
from coderunner.sessions import SessionManager
from coderunner.sessions.sandbox_options import SandboxOptions
from coderunner.sessions.session_status import session_status
from coderunner.sessions.warm_take import address_space_code, take_problem, warm_why
from coderunner.vocabulary.mounts import Mount
from coderunner.vocabulary.sandbox_request import SandboxRequest
from tests.fakes.kernel import FakeKernel, FakeKernels

from .conftest import ManagerFactory
from .test_session_states import run, text, until

pytestmark = pytest.mark.anyio

POOLED = SandboxOptions(
    network="none", limits=Limits(memory_mb=2048, cpus=None, pids=256, disk_mb=2048, tmp_mb=512), timeout_s=900
)
LIVE = None  # a backend that lowers limits live: no problem
NOT_LIVE = "the fake backend sets a sandbox's limits only when it starts"


def asked(**changes: Any) -> SandboxOptions:
    limits = changes.pop("limits", {})
    return dataclasses.replace(POOLED, limits=dataclasses.replace(POOLED.limits, **limits), **changes)


def test_lower_limits_an_allowlist_a_run_limit_and_a_client_may_be_given_at_take() -> None:
    for options in (
        asked(),
        asked(limits={"memory_mb": 1024}),
        asked(limits={"cpus": 0.5, "memory_mb": 512}),
        asked(timeout_s=30, client="t.alice"),
        dataclasses.replace(asked(network="allowlist", allow=("example.org",)), network="none"),
    ):
        assert take_problem(POOLED, options, LIVE) is None, options
    allowlist = dataclasses.replace(POOLED, network="allowlist")
    assert take_problem(allowlist, dataclasses.replace(allowlist, allow=("example.org",)), LIVE) is None
    said = warm_why(POOLED, asked(limits={"memory_mb": 1024}, timeout_s=30))
    assert said == "taken with memory_mb 1024, timeout_s 30 given at take", said


def test_what_a_running_sandbox_cannot_be_given_is_refused_with_why() -> None:
    cases = {
        "above the warm pool's sandboxes (2048)": asked(limits={"memory_mb": 4096}),
        "cpus 2.0: above": dataclasses.replace(
            POOLED, limits=dataclasses.replace(POOLED.limits, cpus=2.0)
        ),  # pooled with no cap, asked 2: lower
        "network 'allowlist': the warm pool's sandboxes have 'none'": asked(network="allowlist"),
        "mounts are bound": asked(mounts=(Mount(Path("/srv"), "/mnt/srv", writable=False),)),
        "a named session's workspace": asked(name="proj"),
        "disk_mb and tmp_mb": asked(limits={"tmp_mb": 256}),
    }
    capped = dataclasses.replace(POOLED, limits=dataclasses.replace(POOLED.limits, cpus=1.0))
    for why, options in cases.items():
        pooled = capped if why.startswith("cpus") else POOLED
        problem = take_problem(pooled, options, LIVE)
        assert problem is not None and why in problem, (why, problem)
    # Uncapped CPU asked of a capped pool: more, never given.
    assert "above" in (take_problem(capped, dataclasses.replace(capped, limits=POOLED.limits), LIVE) or "")
    # Lower limits on a backend that cannot lower them live: its reason.
    assert take_problem(POOLED, asked(limits={"memory_mb": 1024}), NOT_LIVE) == NOT_LIVE
    # The same limits need nothing of the backend.
    assert take_problem(POOLED, asked(timeout_s=5), NOT_LIVE) is None


def test_raised_names_every_limit_above_and_none_is_the_most() -> None:
    built = Limits(memory_mb=2048, cpus=1.0, pids=256)
    assert raised(built, Limits(memory_mb=1024, cpus=0.5, pids=256)) == []
    assert raised(built, Limits(memory_mb=4096, cpus=None, pids=512)) == ["memory_mb", "cpus", "pids"]
    assert raised(Limits(cpus=None), Limits(cpus=8.0)) == []


def test_the_address_space_cell_lowers_only_the_limit_the_pool_gave() -> None:
    pooled = Limits(memory_mb=4096)
    assert address_space_code(pooled, Limits(memory_mb=4096)) is None
    assert address_space_code(pooled, Limits(memory_mb=8192)) is None
    code = address_space_code(pooled, Limits(memory_mb=1024))
    assert code is not None
    probe = (
        "import resource\n"
        f"resource.setrlimit(resource.RLIMIT_AS, ({4096 * 2**20}, resource.RLIM_INFINITY))\n"
        f"{code}\n"
        "print(resource.getrlimit(resource.RLIMIT_AS), sorted(k for k in globals() if not k.startswith('__')))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"({1024 * 2**20}, {resource.RLIM_INFINITY}) ['resource']", out
    # A process whose soft limit is not the pool's (it set its own) keeps it.
    other = probe.replace(str(4096 * 2**20), str(3000 * 2**20), 1)
    out = subprocess.run([sys.executable, "-c", other], capture_output=True, text=True, check=True).stdout
    assert out.startswith(f"({3000 * 2**20},"), out


@pytest.mark.parametrize("version", [1, 2])
def test_lowering_a_cgroup_writes_only_what_changed(tmp_path: Path, version: int) -> None:
    if version == 1:
        dirs = {name: tmp_path / name for name in ("memory", "pids", "cpu")}
    else:
        dirs = {"unified": tmp_path, "memory": tmp_path, "pids": tmp_path}
    for path in dirs.values():
        path.mkdir(exist_ok=True)
    group = SessionCgroup(version, dirs)
    lower_limits(group, Limits(memory_mb=2048, pids=256), Limits(memory_mb=512, cpus=0.5, pids=256))
    written = {str(path.relative_to(tmp_path)): path.read_text() for path in tmp_path.rglob("*") if path.is_file()}
    if version == 1:
        assert written == {
            "memory/memory.limit_in_bytes": str(512 * 2**20),
            "memory/memory.memsw.limit_in_bytes": str(512 * 2**20),
            "cpu/cpu.cfs_period_us": "100000",
            "cpu/cpu.cfs_quota_us": "50000",
        }
    else:
        assert written == {"memory.max": str(512 * 2**20), "memory.swap.max": "0", "cpu.max": "50000 100000"}
    with pytest.raises(ValueError, match="memory_mb would rise"):
        lower_limits(group, Limits(memory_mb=512), Limits(memory_mb=1024))


# Through the manager, on scripted kernels.


def live_backend(manager: SessionManager, fail: bool = False) -> list[tuple[Limits, Limits]]:
    """Make the manager's fake backend one that lowers limits live; the calls it gets."""
    calls: list[tuple[Limits, Limits]] = []

    def lower(process: object, built: Limits, limits: Limits) -> None:
        if fail:
            raise SandboxUnavailable("the cgroup refused")
        calls.append((built, limits))

    manager.backend.live_limits_problem = lambda: None  # type: ignore[method-assign]
    manager.backend.lower_limits = lower  # type: ignore[method-assign]
    return calls


def started(session: Any) -> dict[str, Any]:
    described: dict[str, Any] = session_status(session).started
    return described


async def test_a_create_with_lower_limits_takes_a_pooled_sandbox_and_lowers_them(
    make_scripted: ManagerFactory,
) -> None:
    async with make_scripted(pool_size=1) as manager:
        calls = live_backend(manager)
        await until(lambda: manager.pool.stats().ready == 1, "the pool to fill")
        session = await manager.create(manager.options(SandboxRequest(memory_mb=1024, timeout_s=30)))
        assert manager.pool.stats().taken == 1
        assert (
            calls == [(manager.options().limits, session.options.limits)] and session.options.limits.memory_mb == 1024
        )
        kernel = session.kernel
        assert isinstance(kernel, FakeKernel) and address_space_code(calls[0][0], calls[0][1]) in kernel.executed
        assert kernel.address_space_lowered == 1 and kernel.preloads == 1  # the pooled kernel, lowered
        assert kernel.execution_count == 0  # silent: the user's first cell is still cell 1
        assert started(session) == {
            "sandbox": "warm pool",
            "why": "taken with memory_mb 1024, timeout_s 30 given at take",
        }
        assert "2" in text(await run(session, "print 2"))
        # Its standby and any later kernel start with the limits asked for.
        assert session.spec.limits.memory_mb == 1024


async def test_a_backend_without_live_limits_starts_such_a_create_cold_and_says_why(
    make_scripted: ManagerFactory,
) -> None:
    async with make_scripted(pool_size=1) as manager:
        await until(lambda: manager.pool.stats().ready == 1, "the pool to fill")
        cold = await manager.create(manager.options(SandboxRequest(memory_mb=1024)))
        assert manager.pool.stats().taken == 0
        assert started(cold) == {"sandbox": "cold start", "why": manager.backend.live_limits_problem()}
        warm = await manager.create(manager.options(SandboxRequest(timeout_s=30)))  # a run limit needs nothing
        assert manager.pool.stats().taken == 1 and started(warm)["sandbox"] == "warm pool"


async def test_a_pooled_sandbox_that_cannot_be_lowered_is_closed_and_the_create_starts_cold(
    make_scripted: ManagerFactory, kernels: FakeKernels
) -> None:
    async with make_scripted(pool_size=1) as manager:
        live_backend(manager, fail=True)
        await until(lambda: manager.pool.stats().ready == 1, "the pool to fill")
        session = await manager.create(manager.options(SandboxRequest(memory_mb=1024)))
        how = started(session)
        assert how["sandbox"] == "cold start" and "the cgroup refused" in how["why"], how
        assert manager.pool.stats().taken == 1 and session.options.limits.memory_mb == 1024
        assert manager.list() == [session]  # the pooled one was never handed out
        assert kernels.made[0].preloads == 1 and not kernels.made[0].alive  # and it was closed
        await until(lambda: manager.pool.stats().ready == 1, "the pool to refill")


async def test_without_pool_take_apply_only_default_creates_are_warm(make_scripted: ManagerFactory) -> None:
    async with make_scripted(pool_size=1, pool_take_apply=False) as manager:
        live_backend(manager)
        await until(lambda: manager.pool.stats().ready == 1, "the pool to fill")
        cold = await manager.create(manager.options(SandboxRequest(memory_mb=1024)))
        assert "without pool_take_apply" in started(cold)["why"] and manager.pool.stats().taken == 0
        warm = await manager.create()
        assert started(warm) == {"sandbox": "warm pool", "why": "taken with the pool's own options"}


async def test_every_cold_create_says_why(make_scripted: ManagerFactory) -> None:
    async with make_scripted(pool_size=0) as manager:
        session = await manager.create()
        assert started(session) == {"sandbox": "cold start", "why": "no warm pool (pool_size 0)"}
