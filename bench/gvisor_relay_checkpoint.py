"""Spike (issue 19): checkpoint and restore of a LIVE ipykernel under runsc, through a relay.

This copy of bench/gvisor_checkpoint.py adds `--inner relay`: the production guest programs
(src/coderunner/guest/channel_relay.py as init, coderunner_guest.kernel_boot as the kernel, this
worktree's guest dir bound read-only over the image's) started with the backend's contract
(common.CHANNEL_RELAY --run-dir RUN_INSIDE -- KERNEL_ARGV, the connection file in HOST_INSIDE,
state in RUN_INSIDE/RELAY_STATE, sockets RUN_INSIDE/k0-PORT). Nothing else differs.

    .venv/bin/python bench/gvisor_relay_checkpoint.py --inner relay --claim [--size-mb 50] [--stop]

The read-only root has no /run/coderunner/{run,host}, and runsc cannot make a bind's mount point
in it ("mkdir /proc/root/run/coderunner/host: read-only file system", the gofer), so a host dir
holding both points is bound at /run/coderunner first (the backend uses an overlay root instead).

RESULT (2026-11-23, this machine, one run each, --claim): WORKS. Live lane and restore lane, 50
and 500 MB: the thread kept counting, the forks diverge, and a forked child's print reached iopub
before the checkpoint, in the live copy after it and in the restored copy (kernel_boot's ipc pipe).
- 50 MB, leave-running: quiesce 0.03 s, checkpoint 2.7 s, image 62 MB, reopen to first answer
  0.41 s live / 0.32 s restored, restore 0.87 s; warm 1+1 21.4 ms (direct kernel 22.3 ms, the
  same run, interleaved), 21.8 live after, 31.3 restored.
- 50 MB, --stop: checkpoint 0.43 s, restore 0.52 s, reopen to first answer 0.33 s.
- 500 MB, leave-running: checkpoint 4.9 s, image 485 MB, restore 2.1 s, reopen to first answer
  0.40 / 0.31 s; warm 1+1 21.7 ms (direct 20.2), 20.8 live after, 21.6 restored.
- Control: the same with kernel_boot's override off (stock IOPub pipe on tcp://127.0.0.1) fails
  as the spike found: "encoding error at object tcp.endpoint{...}" and the container is stopped.

Original text follows.

    .venv/bin/python bench/gvisor_checkpoint.py [--size-mb 500] [--warm 20] [--stop]
        [--inner ipc|tcp|relay] [--variant other-dirs|open-file-missing|open-file-copied|
         rootfs-elsewhere|extra-mount|no-quiesce] [--debug-log DIR]

VERDICT (Debian's runsc 0.0~20221219, ptrace, this machine): YES. A live ipykernel holding 500 MB
of numpy data and a thread that keeps a local counter survives `runsc checkpoint` (stopping, or
--leave-running) and `runsc restore` into a new container, the host talking ZMQ to it before and
after, provided the sandbox holds no host socket and no epoll-watched TCP socket at the moment of
the checkpoint. The thread keeps counting from where it was (the list it fills stays 1..n, with no
restart); the original and the restored copy then diverge (fork).

What this needs and why (each found by a run of this script; the exact texts):
1. No host socket at checkpoint. A kernel binding its channels in the bound run dir
   (host-uds=create, what the gvisor backend does) cannot be saved: "Cannot save endpoint with bound
   host socket" (earlier session); with a connection accepted on one (--variant no-quiesce):
   "encoding error at object transport.connectionedEndpoint{...}: runtime error: invalid memory
   address or nil pointer dereference". Either way the failed save leaves the container "stopped":
   the kernel is gone. Hence the relay (bench/gvisor_relay.py, the container's init):
   it binds the host-visible sockets and relays each connection to the kernel; SIGUSR1 (`runsc kill
   ID USR1`) closes every listener and connection and reports "closed N"; SIGUSR2 binds again.
2. No TCP socket that anything epolls. The brief's plan (kernel on TCP 127.0.0.1 in gVisor's
   netstack; network=none does give a loopback: "Network is disabled, create loopback interface
   only") fails in this runsc (--inner tcp): "encoding error at object tcp.endpoint{... listenCtx:
   ...}: endpoint still has waiters upon save". Its TCP endpoint's beforeSave panics while any
   waiter (ZMQ's epoll) is registered; newer gVisor checkpoints epoll'd TCP servers, this one cannot.
   So the kernel binds ZMQ ipc sockets in the sandbox's own tmpfs (/tmp/k-PORT: Sentry sockets, not
   host ones), which save fine, and the relay dials those.
   ipykernel itself binds one TCP socket: IOPubThread's PULL "pipe" on tcp://127.0.0.1:<random>
   (it forwards forked subprocesses' output). It fails the save the same way, so the kernel here is
   started with that pipe off (KERNEL_BOOT); output printed by forked children then goes to the
   kernel's stdout, not to iopub. Production would rather bind that pipe on ipc in /tmp.
3. gVisor refuses to unlink a host socket file from inside ("Operation not permitted", also for
   the relay's own): the host removes the closed ones (by dir fd) before asking for "open". With
   --claim the host does what the product does with a kernel's sockets: it moves them out of run/
   into a host-only sock/ dir (rename by dir fds) and connects there. run/ is then free for the
   relay to bind again; the host claims the new sockets over the dead ones and ZMQ reconnects to the
   same claimed path (checked live and restored, 50 and 500 MB).
4. This runsc's `checkpoint --leave-running` saves, restores the sandbox in place (a new sandbox
   process, same container id) and then WAITS on the container like `runsc run`: it returns only
   when the container exits. Run it in the background (stdio to a file: the restored sandbox
   inherits it) and take "the container runs under a new pid" as done. Its time is a save plus a
   restore.
5. Podman 4.3 refuses `podman container checkpoint` with runsc, and podman cannot adopt a restored
   sandbox, so this runs runsc directly: its own --root, its own OCI bundle (rootfs = `podman image
   mount` of the sandbox image, read-only).
6. After the relay re-binds, ZMQ on the host reconnects by itself (DEALER/SUB reconnect when the
   path is back; no new client needed for the live sandbox). iopub is PUB/SUB: what the kernel
   publishes before the host's SUB is back is lost, so the first request after a reconnect must be
   a wait_for_ready-style kernel_info loop (a bare execute once waited forever for its idle status).

7. Checkpoint only between cells. With a cell running at the checkpoint (--variant busy: a 3 s
   sleep, checkpoint 0.5 s in), the cell finishes in both copies (the restored one has its result)
   but the live host client never gets its execute_reply ("no reply within 30.0 s"): the kernel's
   ROUTER drops a reply for a peer that is not connected. The session's own lock (one run at a
   time) gives this; a snapshot must take it.

What a restore must match (variants, 50 MB, --stop): the host dirs of the binds may differ (the run
and conf dirs of the restored container are other host dirs: restored); the rootfs may be at
another host path (a bind of the same tree: restored); an extra mount in the new spec is not
refused (restored). A file the kernel holds open in a bind must exist at the same path in the new
bind: without it "restoring container "cr-b": no such file or directory" (restore fails); with a
copy (as a workspace copy would give) the restored kernel keeps writing to the copy. Resource
limits (--limits: memory, pids and cpu quota in the spec's linux.resources, with a cgroupsPath)
are set by runsc on the host's cgroups (v1 here) for the started, the in-place restored and the
newly restored container alike, each from its own spec. Not tried: a
rootfs with other contents, other mount destinations, another runsc version or flags.

Figures (500 MB of random float64, --warm 20, this 2-core shared machine; three runs each):
- --leave-running lane: quiesce (USR1 to "closed") 0.02-0.04 s; checkpoint (save + in-place
  restore) 6.0 / 8.1 / 7.8 s; image 484 MB; reopen (USR2) to first answer 0.33-0.48 s; warm 1+1
  before 18.5 / 19.7 / 21.0 ms, after 21.3 / 22.9 / 22.5 ms.
- restore of that image into a new container (while the original runs): 4.3 / 5.9 / 2.5 s;
  reopen to first answer 0.31-0.33 s; warm 1+1 after 23.1 / 26.2 / 29.2 ms.
- --claim --limits (500 MB, one run): checkpoint (leave-running) 7.9 s, restore 4.0 s, reopen to
  first answer 0.35 / 0.31 s, warm 1+1 18.9 before (direct 18.9), 22.3 live after, 24.3 restored.
- --stop lane: checkpoint 2.23 / 1.40 / 1.45 s; restore 2.77 / 2.23 / 2.03 s; reopen to first
  answer 0.10-0.33 s; warm 1+1 before 22.3 / 18.1 / 18.6 ms, after 23.4 / 24.1 / 22.3 ms.
- the relay's own cost: warm 1+1 through it vs a kernel bound directly on host sockets (the
  gvisor backend's way), trips interleaved: 18.5 vs 16.4, 19.7 vs 19.1, 21.0 vs 18.5, 22.3 vs 18.7,
  18.1 vs 17.2, 18.6 vs 16.3 ms: 1-3 ms. (These round trips are jupyter_client's execute_interactive,
  which also waits for iopub's idle; the product's own client is faster on both.)
  The first-answer figures include wait_for_ready's 0.2 s iopub poll; a bare 1+1 right after the
  re-bind answered in 0.06-0.18 s.

What it does, all under one tmp dir (runsc --root there too):
- bundle: rootfs = `podman image mount` of the sandbox image (read-only), /proc, a tmpfs /tmp,
  an empty read-only /sys, a read-only conf dir at /mnt (kernel.json, the relay script) and a
  writable run dir at /run/coderunner; runsc flags as the gvisor backend's (ptrace, network=none,
  host-uds=create, overlay2=none); uid 65534, no capabilities, no-new-privileges.
- the container's init is the relay: it starts the kernel (ZMQ ipc in /tmp, or --inner tcp) and
  binds the host-visible unix sockets run/k-PORT; the host connects a jupyter_client with transport
  ipc, ip run/k (as the product does after claiming them).
- the kernel gets --size-mb MB of numpy data (random, so runsc's compression cannot hide it) and
  a thread keeping a local counter it appends to a list: the counter is held only by that thread.
- a second kernel bound directly on host sockets (no relay) is the warm 1+1 baseline, interleaved.
- live lane (unless --stop): USR1; `runsc checkpoint --leave-running`; USR2; the same client
  reconnects; warm 1+1; the thread must have kept counting.
- restore lane: `runsc restore` of that image into a new container whose binds are other host
  dirs (--variant varies more); USR2; a new client; the data and the thread's count must be there;
  with the live lane, both kernels then diverge (fork).
Every subprocess has a timeout; every container is killed and deleted at the end, even on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import stat
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from jupyter_client import BlockingKernelClient

from coderunner.config import Settings
from coderunner.sandbox.common import CHANNEL_RELAY, GUEST_LIB, HOST_INSIDE, RELAY_STATE, RUN_INSIDE
from coderunner.sandbox.gvisor import RUNTIME_FLAGS

RELAY = Path(__file__).resolve().parent / "gvisor_relay.py"
#: --inner relay: this worktree's guest package, bound over the image's (which lacks the relay).
GUEST = Path(__file__).resolve().parents[1] / "src" / "coderunner" / "guest"
PYTHON = "/opt/coderunner/env/bin/python"
PORTS = {"shell_port": 50001, "iopub_port": 50002, "stdin_port": 50003, "control_port": 50004, "hb_port": 50005}
GUEST_UID = 65534
#: The kernel's own ipc sockets with --inner ipc: in the sandbox's tmpfs, so the Sentry's, not the host's.
INNER_IPC = "/tmp/k"
TIMEOUT_S = 300.0
CHECKPOINT_S = 90.0
REPLY_S = 120.0

#: ipykernel's IOPubThread binds a PULL socket on tcp://127.0.0.1:<random> (the pipe that forwards
#: forked subprocesses' output); ZMQ's I/O thread waits on it with epoll, and this runsc refuses to
#: save a TCP endpoint with waiters. Without that pipe the kernel holds no TCP socket at all.
KERNEL_BOOT = """
import ipykernel.iostream as iostream
from ipykernel import kernelapp
_init = iostream.IOPubThread.__init__
def _no_pipe(self, socket, pipe=False, session=False):
    _init(self, socket, pipe=False, session=session)
iostream.IOPubThread.__init__ = _no_pipe
kernelapp.launch_new_instance()
"""

SETUP = """
import threading, time
import numpy as np
data = np.random.default_rng(7).random({size_mb} * 2**20 // 8)
checksum = float(data.sum())
counts = []
def _count():
    n = 0  # held only by this thread
    while True:
        n += 1
        if len(counts) < 100_000:
            counts.append(n)
        time.sleep(0.02)
threading.Thread(target=_count, daemon=True, name="counter").start()
time.sleep(0.2)
"""
PROBE = "(len(counts), counts[-1], float(data.sum()) == checksum, threading.active_count())"


@dataclass
class Run:
    work: Path
    runsc: list[str]
    ids: list[str] = field(default_factory=list)
    figures: dict[str, object] = field(default_factory=dict)
    waiting: list[tuple[subprocess.Popen[bytes], object]] = field(default_factory=list)
    unmount: list[Path] = field(default_factory=list)

    def call(self, *args: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.runsc, *args], capture_output=True, text=True, timeout=timeout)

    def cleanup(self) -> None:
        for each in self.ids:
            self.call("kill", each, "KILL", timeout=60)
            self.call("delete", "--force", each, timeout=60)
        for process, log in self.waiting:  # a --leave-running checkpoint waits on its container's end
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=30)
            log.close()  # type: ignore[attr-defined]
        for each in self.unmount:
            subprocess.run(["umount", str(each)], capture_output=True, timeout=60)


def runsc_base(root: Path) -> list[str]:
    return ["runsc", f"--root={root}", *(f"--{flag}" for flag in RUNTIME_FLAGS)]


ENV = ["PATH=/opt/coderunner/env/bin:/usr/bin:/bin", "HOME=/tmp", "IPYTHONDIR=/tmp/.ipython", "MPLCONFIGDIR=/tmp/.mpl"]


#: The state file's and the sockets' names: the spike relay's, or the production relay's (--inner relay).
NAMES = {"state": "relay.state", "prefix": "k"}


def make_bundle(work: Path, name: str, rootfs: str, inner: str, limits: bool = False) -> Path:
    """A bundle whose conf (read-only) and run (writable, host sockets) dirs are its own host dirs."""
    if inner == "relay":
        return make_relay_bundle(work, name, rootfs, limits)
    bundle = work / name
    conf, run = bundle / "conf", bundle / "run"
    for each in (conf, run):
        each.mkdir(parents=True)
    bundle.chmod(0o711)
    os.chown(run, GUEST_UID, GUEST_UID)
    shutil.copy(RELAY, conf / "channel_relay.py")
    where = {
        "tcp": {"transport": "tcp", "ip": "127.0.0.1"},
        "ipc": {"transport": "ipc", "ip": INNER_IPC},
        "direct": {"transport": "ipc", "ip": "/run/coderunner/k"},  # the gvisor backend's way: no relay
    }[inner]
    kernel = {**where, "key": KEY, "signature_scheme": "hmac-sha256", **PORTS}
    (conf / "kernel.json").write_text(json.dumps(kernel))
    for each in conf.iterdir():
        each.chmod(0o644)
    conf.chmod(0o755)
    argv = [PYTHON, "-I", "-S", "/mnt/channel_relay.py", "/run/coderunner", "k", "relay.state",
            "tcp" if inner == "tcp" else INNER_IPC,
            *(str(port) for port in PORTS.values()), "--",
            PYTHON, "-c", KERNEL_BOOT, "-f", "/mnt/kernel.json"]  # fmt: skip
    if inner == "direct":
        argv = argv[argv.index("--") + 1 :]
    spec = {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": GUEST_UID, "gid": GUEST_UID},
            "args": argv,
            "env": ENV,
            "cwd": "/tmp",
            "capabilities": {"bounding": [], "effective": [], "inheritable": [], "permitted": [], "ambient": []},
            "noNewPrivileges": True,
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 4096, "soft": 4096}],
        },
        "root": {"path": rootfs, "readonly": True},
        "hostname": "sandbox",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev", "size=256m"]},
            {"destination": "/sys", "type": "tmpfs", "source": "tmpfs", "options": ["ro", "nosuid", "nodev"]},
            {"destination": "/mnt", "type": "bind", "source": str(conf), "options": ["rbind", "ro"]},
            {"destination": "/run/coderunner", "type": "bind", "source": str(run), "options": ["rbind", "rw"]},
        ],
        "linux": {"namespaces": [{"type": kind} for kind in ("pid", "ipc", "uts", "mount", "network")]},
    }
    if limits:  # what a runsc-direct backend would set in place of podman's --memory/--cpus/--pids-limit
        spec["linux"]["cgroupsPath"] = f"/{cgroup_name(work, name)}"
        spec["linux"]["resources"] = {
            "memory": {"limit": LIMIT_MEMORY},
            "pids": {"limit": LIMIT_PIDS},
            "cpu": {"quota": 100_000, "period": 100_000},
        }
    (bundle / "config.json").write_text(json.dumps(spec, indent=1))
    return bundle


KEY = uuid.uuid4().hex


def make_relay_bundle(work: Path, name: str, rootfs: str, limits: bool) -> Path:
    """The production relay's contract: host dir at HOST_INSIDE (ro), run dir at RUN_INSIDE (rw)."""
    bundle = make_bundle(work, name, rootfs, "ipc", limits)
    conf = bundle / "conf"
    # the original ip, as kernel.py writes it (the host's run dir + k<generation>): only its basename counts
    kernel = {"transport": "ipc", "ip": f"{bundle / 'run'}/k0", "key": KEY, "signature_scheme": "hmac-sha256", **PORTS}
    (conf / "kernel-0.json").write_text(json.dumps(kernel))
    (conf / "kernel-0.json").chmod(0o644)
    argv = [PYTHON, "-I", "-S", CHANNEL_RELAY, "--run-dir", RUN_INSIDE, "--",
            "/usr/bin/prlimit", "--nproc=4096", "--",
            PYTHON, "-m", "ipykernel_launcher", "-f", f"{HOST_INSIDE}/kernel-0.json",
            "--HistoryManager.hist_file=:memory:", "--IPKernelApp.extensions=coderunner_guest"]  # fmt: skip
    points = bundle / "points"
    for each in ("host", "run"):
        (points / each).mkdir(parents=True)
    spec = json.loads((bundle / "config.json").read_text())
    spec["process"]["args"] = argv
    spec["process"]["env"] = [*ENV, f"PYTHONPATH={GUEST_LIB}"]
    mounts = [each for each in spec["mounts"] if each["destination"] not in ("/mnt", "/run/coderunner")]
    mounts += [
        # runsc cannot make mount points in a read-only root: a host dir that has them, bound first
        {"destination": "/run/coderunner", "type": "bind", "source": str(points), "options": ["rbind", "ro"]},
        {"destination": HOST_INSIDE, "type": "bind", "source": str(conf), "options": ["rbind", "ro"]},
        {"destination": RUN_INSIDE, "type": "bind", "source": str(bundle / "run"), "options": ["rbind", "rw"]},
        {
            "destination": f"{GUEST_LIB}/coderunner_guest",
            "type": "bind",
            "source": str(GUEST),
            "options": ["rbind", "ro"],
        },
    ]
    spec["mounts"] = mounts
    (bundle / "config.json").write_text(json.dumps(spec, indent=1))
    return bundle


LIMIT_MEMORY = 2 << 30
LIMIT_PIDS = 4096


def cgroup_name(work: Path, name: str) -> str:
    return f"crspike-{work.name}-{name}"


def cgroup_limits(work: Path, name: str) -> dict[str, str]:
    """What the host's cgroup v1 files say for a container made with limits."""
    found = {}
    for key, path in (("memory", "memory/{}/memory.limit_in_bytes"), ("pids", "pids/{}/pids.max"),
                      ("cpu_quota", "cpu/{}/cpu.cfs_quota_us")):  # fmt: skip
        try:
            found[key] = (Path("/sys/fs/cgroup") / path.format(cgroup_name(work, name))).read_text().strip()
        except OSError as error:
            found[key] = f"unreadable: {error.strerror}"
    return found


def wait_state(run_dir: Path, word: str, generation_after: int, bound_s: float = 60.0) -> int:
    """Wait for the relay's "<word> <n>" with n past generation_after; the generation."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        try:
            said, number = (run_dir / NAMES["state"]).read_text().split()
            if said == word and int(number) > generation_after:
                return int(number)
            if said == "failed" and int(number) > generation_after:
                raise RuntimeError("the relay could not bind its sockets (see its stderr in the log)")
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.005)
    raise TimeoutError(f"the relay did not report {word!r} within {bound_s} s")


def remove_sockets(run_dir: Path) -> None:
    """The relay cannot unlink its closed host sockets (gVisor: EPERM); the host does, by dir fd."""
    fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for port in PORTS.values():
            name = f"{NAMES['prefix']}-{port}"
            try:
                if stat.S_ISSOCK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                    os.unlink(name, dir_fd=fd)
            except FileNotFoundError:
                pass
    finally:
        os.close(fd)


def claim_sockets(bundle: Path) -> Path:
    """Move the relay's sockets from run/ (the sandbox's) to a host-only sock/ dir, by dir fds, as
    the product claims a kernel's (session_dirs.py); a rename over a dead socket of an earlier
    generation replaces it, so ZMQ reconnects to the same host path. The dir to connect in."""
    sock = bundle / "sock"
    sock.mkdir(mode=0o700, exist_ok=True)
    source = os.open(bundle / "run", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    target = os.open(sock, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for port in PORTS.values():
            name = f"{NAMES['prefix']}-{port}"
            if not stat.S_ISSOCK(os.stat(name, dir_fd=source, follow_symlinks=False).st_mode):
                raise RuntimeError(f"run/{name} is not a socket")
            os.rename(name, name, src_dir_fd=source, dst_dir_fd=target)
    finally:
        os.close(source)
        os.close(target)
    return sock


def client_for(run_dir: Path, prefix: str | None = None) -> BlockingKernelClient:
    client = BlockingKernelClient()
    client.load_connection_info(
        {
            "transport": "ipc",
            "ip": str(run_dir / (prefix or NAMES["prefix"])),
            "key": KEY,
            "signature_scheme": "hmac-sha256",
            **PORTS,
        }
    )
    client.start_channels(hb=False)
    return client


def execute(client: BlockingKernelClient, code: str, timeout: float = REPLY_S) -> object:
    """Run code; its last expression's value (text/plain), or raise with the kernel's error."""
    probing = code == "PROBE"
    reply = client.execute_interactive(
        "" if probing else code,
        timeout=timeout,
        output_hook=lambda msg: None,
        store_history=False,
        user_expressions={"_r": PROBE} if probing else {},
    )
    content = reply["content"]
    if content["status"] != "ok":
        raise RuntimeError(f"{content.get('ename')}: {content.get('evalue')}")
    if "_r" in content.get("user_expressions", {}):
        found = content["user_expressions"]["_r"]
        if found.get("status") != "ok":
            raise RuntimeError(f"probe: {found.get('ename')}: {found.get('evalue')}")
        return found["data"]["text/plain"]
    return None


FORK_CELL = """
import os
child = os.fork()
if child == 0:
    print("forked-output-{tag}", flush=True)
    os._exit(0)
os.waitpid(child, 0)
"""


def forked_output(client: BlockingKernelClient, tag: str, bound_s: float = 30.0) -> bool:
    """Does a forked child's print reach iopub (kernel_boot's ipc fork pipe)?"""
    seen: list[str] = []

    def hook(message: dict[str, object]) -> None:
        if message["msg_type"] == "stream":
            seen.append(message["content"]["text"])  # type: ignore[index]

    client.execute_interactive(FORK_CELL.format(tag=tag), timeout=bound_s, output_hook=hook, store_history=False)
    deadline = time.monotonic() + bound_s  # the child's output may trail the parent's idle
    while f"forked-output-{tag}" not in "".join(seen) and time.monotonic() < deadline:
        try:
            hook(client.get_iopub_msg(timeout=1))
        except Exception:  # queue.Empty
            continue
    return f"forked-output-{tag}" in "".join(seen)


def probe(client: BlockingKernelClient) -> tuple[int, int, bool, int]:
    value = execute(client, "PROBE")
    length, last, same, threads = str(value).strip("()").split(", ")
    return int(length), int(last), same == "True", int(threads)


def warm_pair(first: BlockingKernelClient, second: BlockingKernelClient, rounds: int) -> tuple[float, float]:
    """Median 1+1 round trips (ms) of two kernels, trips interleaved so both see the same machine."""
    trips: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        for client, found in zip((first, second), trips, strict=True):
            began = time.perf_counter()
            execute(client, "1+1")
            found.append(time.perf_counter() - began)
    return statistics.median(trips[0]) * 1000, statistics.median(trips[1]) * 1000


def warm(client: BlockingKernelClient, rounds: int) -> float:
    trips = []
    for _ in range(rounds):
        began = time.perf_counter()
        execute(client, "1+1")
        trips.append(time.perf_counter() - began)
    return statistics.median(trips) * 1000


def first_answer(client: BlockingKernelClient, bound_s: float = 60.0) -> float:
    """Seconds until a (re)connecting client has shell AND iopub back and the kernel answers 1+1.

    iopub is a PUB/SUB pair: what the kernel publishes before the host's SUB is connected again
    is lost (ZMQ's late joiner), so a bare execute can wait for an idle status that already went
    by. wait_for_ready repeats kernel_info until iopub delivers too, as any Jupyter client must.
    """
    began = time.perf_counter()
    client.wait_for_ready(timeout=bound_s)
    execute(client, "1+1", timeout=bound_s)
    return time.perf_counter() - began


def panic_of(said: str) -> str:
    """The lines of runsc's output that say why (a panic's message, an error), not its stack."""
    lines = said.strip().splitlines()
    wanted = [line for line in lines if "panic" in line.lower() or "error" in line.lower()]
    # an encoding error quotes the whole object before its reason: keep the ends
    return " | ".join(line if len(line) < 400 else f"{line[:200]} ... {line[-300:]}" for line in wanted)[:1200] or (
        "\n".join(lines[:8])
    )


def checkpoint_stopping(run: Run, image: Path) -> str | None:
    """`runsc checkpoint`: the image is written and the container stops. Why not, or None."""
    try:
        done = run.call("checkpoint", f"--image-path={image}", "cr-a", timeout=CHECKPOINT_S)
    except subprocess.TimeoutExpired:
        return f"runsc checkpoint did not return within {CHECKPOINT_S} s"
    if done.returncode != 0:
        (run.work / "checkpoint.err").write_text(done.stderr)
        return panic_of(done.stderr)
    return None


def checkpoint_leaving_running(run: Run, image: Path) -> str | None:
    """`runsc checkpoint --leave-running`: this runsc saves, then restores the sandbox in place (a new
    sandbox process under the same container id) and then WAITS on the container, as `runsc run`
    would: it returns only when the container exits. So it runs in the background (its stdio,
    which the restored sandbox inherits, to a file), and the checkpoint is done when the container
    runs under a new pid."""
    first = json.loads(run.call("state", "cr-a", timeout=60).stdout)["pid"]
    log = open(run.work / "checkpoint.log", "w")  # noqa: SIM115 (closed by cleanup, with the process)
    run.waiting.append((subprocess.Popen(
        [*run.runsc, "checkpoint", "--leave-running", f"--image-path={image}", "cr-a"],
        stdin=subprocess.DEVNULL, stdout=log, stderr=log,
    ), log))  # fmt: skip
    process = run.waiting[-1][0]
    deadline = time.monotonic() + CHECKPOINT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            said = panic_of((run.work / "checkpoint.log").read_text())
            return said or f"runsc exited {process.returncode}"
        state = json.loads(run.call("state", "cr-a", timeout=60).stdout or "{}")
        if state.get("pid") not in (None, first, -1) and state.get("status") == "running":
            return None
        time.sleep(0.01)
    return f"the container did not run again within {CHECKPOINT_S} s of runsc checkpoint --leave-running"


def start(run: Run, bundle: Path, name: str) -> None:
    with open(run.work / f"{name}.log", "w") as log:
        done = subprocess.run(
            [*run.runsc, "run", "--detach", f"--bundle={bundle}", name],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, timeout=TIMEOUT_S,
        )  # fmt: skip
    run.ids.append(name)
    if done.returncode != 0:
        raise RuntimeError(f"runsc run: {(run.work / f'{name}.log').read_text()[-400:]}")


def signal_relay(run: Run, name: str, signal: str) -> None:
    done = run.call("kill", name, signal, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"runsc kill {signal}: {done.stderr.strip()[-300:]}")


#: What the restore's bundle varies from the original's (default: its own host dirs, else the same).
VARIANTS = (
    "other-dirs",
    "open-file-missing",
    "open-file-copied",
    "rootfs-elsewhere",
    "extra-mount",
    "no-quiesce",
    "busy",  # a cell is running at the checkpoint: does its reply still reach the host?
)
BUSY_CELL = "import time; time.sleep(3); busy_done = 42"
OPEN_FILE_VARIANTS = ("open-file-missing", "open-file-copied")


def vary_restore(run: Run, variant: str, live: Path, fork: Path) -> None:
    """Make the restore bundle differ from the checkpointed one as the variant says."""
    spec = json.loads((fork / "config.json").read_text())
    if variant == "open-file-copied":  # as a snapshot's workspace copy would
        shutil.copy2(live / "run" / "notes.txt", fork / "run" / "notes.txt")
        os.chown(fork / "run" / "notes.txt", GUEST_UID, GUEST_UID)
    elif variant == "rootfs-elsewhere":
        elsewhere = run.work / "rootfs-elsewhere"
        elsewhere.mkdir()
        subprocess.run(["mount", "--bind", spec["root"]["path"], str(elsewhere)], check=True, timeout=60)
        run.unmount.append(elsewhere)
        spec["root"]["path"] = str(elsewhere)
    elif variant == "extra-mount":
        spec["mounts"].append({"destination": "/media", "type": "tmpfs", "source": "tmpfs", "options": ["ro"]})
    (fork / "config.json").write_text(json.dumps(spec, indent=1))


def spike(run: Run, rootfs: str, args: argparse.Namespace) -> None:
    size_mb, rounds, inner, leave_running = args.size_mb, args.warm, args.inner, not args.stop
    figures = run.figures
    figures["variant"] = args.variant
    figures["inner"] = inner
    live = make_bundle(run.work, "a", rootfs, inner, args.limits)
    began = time.perf_counter()
    start(run, live, "cr-a")
    generation = wait_state(live / "run", "open", 0)
    client = client_for(claim_sockets(live) if args.claim else live / "run")
    client.wait_for_ready(timeout=120)
    figures["cold_s"] = time.perf_counter() - began
    baseline = make_bundle(run.work, "d", rootfs, "direct")
    start(run, baseline, "cr-d")
    direct = client_for(baseline / "run", "k")
    direct.wait_for_ready(timeout=120)
    figures["warm_before_ms"], figures["warm_direct_baseline_ms"] = warm_pair(client, direct, rounds)
    direct.stop_channels()
    run.call("kill", "cr-d", "KILL", timeout=60)
    began = time.perf_counter()
    execute(client, SETUP.format(size_mb=size_mb), timeout=TIMEOUT_S)
    if args.variant in OPEN_FILE_VARIANTS:  # a file the kernel holds open in a writable bind
        execute(client, "notes = open('/run/coderunner/notes.txt', 'a'); notes.write('before\\n'); notes.flush()")
    figures["setup_s"] = time.perf_counter() - began
    if inner == "relay":
        figures["forked_output_before"] = forked_output(client, "before")
    before = probe(client)
    figures["probe_before"] = before
    if args.limits:
        figures["cgroup_before"] = cgroup_limits(run.work, "a")

    busy = None
    if args.variant == "busy":
        busy = client.execute(BUSY_CELL, store_history=False)
        time.sleep(0.5)  # well inside the cell
    began = time.perf_counter()
    if args.variant != "no-quiesce":
        signal_relay(run, "cr-a", "USR1")
        generation = wait_state(live / "run", "closed", generation)
        if not args.claim:  # claimed sockets are no longer in run/
            remove_sockets(live / "run")
    figures["quiesce_s"] = time.perf_counter() - began
    image = run.work / "image"
    image.mkdir()
    began = time.perf_counter()
    error = checkpoint_leaving_running(run, image) if leave_running else checkpoint_stopping(run, image)
    figures["checkpoint_s"] = time.perf_counter() - began
    if error:
        figures["checkpoint_error"] = error
        figures["state_after_failed_checkpoint"] = run.call("state", "cr-a", timeout=60).stdout[-300:]
        return
    figures["image_mb"] = sum(path.stat().st_size for path in image.rglob("*") if path.is_file()) / 2**20
    live_ok = False
    if leave_running:
        began = time.perf_counter()
        signal_relay(run, "cr-a", "USR2")
        generation = wait_state(live / "run", "open", generation)
        if args.claim:
            claim_sockets(live)
        if busy:  # before wait_for_ready, which would swallow the reply
            figures["busy_reply_live"] = reply_to(client, busy)
        figures["reconnect_live_s"] = first_answer(client)
        figures["reopen_to_answer_live_s"] = time.perf_counter() - began
        figures["warm_after_live_ms"] = warm(client, rounds)
        after = probe(client)
        figures["probe_after_live"] = after
        if inner == "relay":
            figures["forked_output_live_after"] = forked_output(client, "live")
        figures["thread_kept_counting_live"] = after[1] > before[1] and after[0] == after[1]

        live_ok = True
    else:
        client.stop_channels()

    fork = make_bundle(run.work, "b", rootfs, inner, args.limits)  # other host dirs than the original's
    vary_restore(run, args.variant, live, fork)
    began = time.perf_counter()
    with open(run.work / "restore.log", "w") as log:
        done = subprocess.run(
            [*run.runsc, "restore", "--detach", f"--image-path={image}", f"--bundle={fork}", "cr-b"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, timeout=TIMEOUT_S,
        )  # fmt: skip
    run.ids.append("cr-b")
    figures["restore_s"] = time.perf_counter() - began
    if done.returncode != 0:
        figures["restore_error"] = (run.work / "restore.log").read_text()[-600:]
        return
    figures["restored_state"] = json.loads(run.call("state", "cr-b").stdout or "{}").get("status")
    began = time.perf_counter()
    signal_relay(run, "cr-b", "USR2")
    wait_state(fork / "run", "open", 0)
    restored = client_for(claim_sockets(fork) if args.claim else fork / "run")
    figures["reconnect_restored_s"] = first_answer(restored)
    figures["reopen_to_answer_restored_s"] = time.perf_counter() - began
    figures["warm_after_restore_ms"] = warm(restored, rounds)
    again = probe(restored)
    figures["probe_restored"] = again
    if inner == "relay":
        figures["forked_output_restored"] = forked_output(restored, "restored")
    if busy:
        figures["busy_done_restored"] = branch_like(restored)
    if args.limits:
        figures["cgroup_restored"] = cgroup_limits(run.work, "b")
        figures["cgroup_live_after"] = cgroup_limits(run.work, "a") if leave_running else "-"
    figures["thread_kept_counting_restored"] = again[1] > before[1] and again[0] == again[1] and again[2]
    if args.variant in OPEN_FILE_VARIANTS:
        execute(restored, "notes.write('after\\n'); notes.flush()")
        figures["open_file_after_restore"] = (fork / "run" / "notes.txt").read_text().split()
    if live_ok:
        execute(client, "branch = 'a'")
        execute(restored, "branch = 'b'")
        figures["forks_diverge"] = branch_of(client) == "a" and branch_of(restored) == "b"
        client.stop_channels()
    restored.stop_channels()


def reply_to(client: BlockingKernelClient, msg_id: str, bound_s: float = 30.0) -> str:
    """The status of the execute_reply to msg_id, or why none came."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        try:
            message = client.get_shell_msg(timeout=1)
        except Exception:  # queue.Empty
            continue
        if message["parent_header"].get("msg_id") == msg_id:
            return f"{message['content']['status']} after {bound_s - (deadline - time.monotonic()):.1f} s"
    return f"no reply within {bound_s} s"


def branch_like(client: BlockingKernelClient) -> str:
    reply = client.execute_interactive(
        "", timeout=30, output_hook=lambda m: None, store_history=False, user_expressions={"b": "busy_done"}
    )
    found = reply["content"]["user_expressions"]["b"]
    return found.get("data", {}).get("text/plain") or f"{found.get('ename')}: {found.get('evalue')}"


def branch_of(client: BlockingKernelClient) -> str:
    reply = client.execute_interactive(
        "", timeout=30, output_hook=lambda m: None, store_history=False, user_expressions={"b": "branch"}
    )
    return reply["content"]["user_expressions"]["b"]["data"]["text/plain"].strip("'")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=500)
    parser.add_argument("--warm", type=int, default=20)
    parser.add_argument("--inner", choices=("ipc", "tcp", "relay"), default="ipc", help="the kernel's own channels")
    parser.add_argument("--variant", choices=VARIANTS, default=VARIANTS[0], help="what the restore varies")
    parser.add_argument("--limits", action="store_true", help="memory/pids/cpu cgroup limits in the specs")
    parser.add_argument("--claim", action="store_true", help="connect through claimed sockets, as the product")
    parser.add_argument("--stop", action="store_true", help="checkpoint without --leave-running")
    parser.add_argument("--debug-log", type=Path, help="runsc --debug logs go to this dir (kept)")
    parser.add_argument("--image", default=Settings.model_fields["image"].default)
    args = parser.parse_args()
    if args.inner == "relay":
        NAMES.update(state=RELAY_STATE, prefix="k0")
    work = Path(tempfile.mkdtemp(prefix="gvck-", dir="/tmp"))
    work.chmod(0o711)
    (work / "root").mkdir()
    run = Run(work, runsc_base(work / "root"))
    if args.debug_log:
        args.debug_log.mkdir(parents=True, exist_ok=True)
        run.runsc[1:1] = ["--debug", f"--debug-log={args.debug_log}/"]
    mounted = subprocess.run(["podman", "image", "mount", args.image], capture_output=True, text=True, timeout=120)
    try:
        if mounted.returncode != 0:
            raise RuntimeError(f"podman image mount: {mounted.stderr.strip()}")
        spike(run, mounted.stdout.strip(), args)
    except Exception as error:  # the spike's verdict is the report, failures included
        run.figures["error"] = f"{type(error).__name__}: {error}"
    finally:
        run.cleanup()
        if mounted.returncode == 0:
            subprocess.run(["podman", "image", "unmount", args.image], capture_output=True, timeout=120)
        for log in sorted(work.glob("*.log")):
            tail = log.read_text()[-1500:]
            if tail.strip():
                print(f"--- {log.name} (tail)\n{tail}", file=sys.stderr)
        for each in sorted(work.glob(f"*/run/{NAMES['state']}")):
            print(f"--- {each}: {each.read_text().strip()}", file=sys.stderr)
        shutil.rmtree(work, ignore_errors=True)
    for key, value in run.figures.items():
        print(f"{key:32} {value:.3f}" if isinstance(value, float) else f"{key:32} {value}")
    return 0 if "error" not in run.figures else 1


if __name__ == "__main__":
    sys.exit(main())
