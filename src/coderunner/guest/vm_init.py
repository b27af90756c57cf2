"""The kernel's first process inside an Apple `container` VM: reap, mark readiness, bind narrowly.

    python -m coderunner_guest.vm_init --ready FILE [--socket PATH ...] [--tcp-own-address]
        -- KERNEL ARGV...

Why it exists (the host side is coderunner.sandbox.apple):
- Before `container` 0.10.0 there is no `run --init` (Flags.swift grows `--init` in 0.10.0), so
  the kernel would be PID 1 and nothing would reap the orphans of user code. This process reaps
  every child and forwards SIGTERM/SIGINT/SIGHUP to the kernel; it exits with the kernel's status.
- `--publish-socket` makes the host-side socket files exist as soon as the VM starts, long before
  the kernel binds (the relay listens on the host and dials into the guest per connection), so the
  host cannot tell readiness from those files. This process watches the guest-side sockets (on
  the VM's own disk) and, once all are bound, creates FILE in the shared state dir: the host waits
  for that marker instead.
- With `--tcp-own-address` (the TCP fallback) the kernel binds the VM's own address on the
  container network, not 0.0.0.0: `--publish` forwards to that address (RuntimeService.swift),
  so nothing narrower is reachable, and nothing wider is needed.

Stdlib only: it runs with the sandbox's interpreter before anything else is imported.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import sys
import time

#: How often the guest looks for its kernel's sockets, and for how long at most.
POLL_S = 0.01
READY_WAIT_S = 300.0
#: Nothing is sent to it: a UDP connect only picks the source address of the default route.
ROUTE_PROBE = ("192.0.2.1", 9)


def own_address() -> str:
    """The VM's IPv4 address on its network (the source address of its default route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(ROUTE_PROBE)
        address = probe.getsockname()[0]
    if address.startswith(("0.", "127.")):
        raise OSError(f"no usable address on the container network (got {address})")
    return address


def bind_own_address(argv: list[str]) -> tuple[list[str], list[int]]:
    """The kernel argv reading a private copy of its connection file with `ip` = own address."""
    index = argv.index("-f") + 1
    with open(argv[index], encoding="utf-8") as handle:
        info = json.load(handle)
    info["ip"] = own_address()
    copy = f"/tmp/coderunner-kernel-{os.getpid()}.json"
    fd = os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(info, handle)
    ports = [int(info[name]) for name in ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")]
    return [*argv[:index], copy, *argv[index + 1 :]], ports


def _listening_tcp_ports() -> set[int]:
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as handle:
                next(handle, None)
                for line in handle:
                    fields = line.split()
                    if len(fields) > 3 and fields[3] == "0A":  # TCP_LISTEN
                        ports.add(int(fields[1].rsplit(":", 1)[1], 16))
        except OSError:
            continue
    return ports


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False


def bound(sockets: list[str], ports: list[int]) -> bool:
    return all(_is_socket(path) for path in sockets) and (not ports or set(ports) <= _listening_tcp_ports())


def mark_ready(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    os.close(fd)


def parse(args: list[str]) -> tuple[str, list[str], bool, list[str]]:
    if "--" not in args:
        raise SystemExit("usage: vm_init --ready FILE [--socket PATH ...] [--tcp-own-address] -- ARGV...")
    split = args.index("--")
    options, argv = args[:split], args[split + 1 :]
    ready, sockets, tcp = "", [], False
    while options:
        flag = options.pop(0)
        if flag == "--ready" and options:
            ready = options.pop(0)
        elif flag == "--socket" and options:
            sockets.append(options.pop(0))
        elif flag == "--tcp-own-address":
            tcp = True
        else:
            raise SystemExit(f"vm_init: unknown option {flag}")
    if not ready or not argv:
        raise SystemExit("vm_init: --ready FILE and a command are required")
    return ready, sockets, tcp, argv


def main(args: list[str]) -> int:
    ready, sockets, tcp, argv = parse(args)
    ports: list[int] = []
    if tcp:
        argv, ports = bind_own_address(argv)
    child = os.fork()
    if child == 0:
        try:
            os.execvp(argv[0], argv)
        finally:
            os._exit(127)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda sig, _frame: os.kill(child, sig))
    marked = False
    deadline = time.monotonic() + READY_WAIT_S
    while True:
        # Reap everything (PID 1 inherits every orphan); return when the kernel itself is gone.
        # Until the marker is written, poll; after it, block in waitpid.
        try:
            pid, status = os.waitpid(-1, 0 if marked else os.WNOHANG)
        except ChildProcessError:
            return 0
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            return code if code >= 0 else 128 - code  # killed by a signal: as a shell reports it
        if pid == 0:
            if time.monotonic() > deadline:
                marked = True  # never marked: the host's own bound has given up long since
            elif bound(sockets, ports):
                mark_ready(ready)
                marked = True
            else:
                time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
