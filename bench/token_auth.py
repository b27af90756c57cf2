"""Cost of the per-request token check: the server's own token (what every request paid before
per-client tokens; the baseline), an added client's token, and a wrong token, lanes interleaved.

    .venv/bin/python bench/token_auth.py [--clients 50] [--rounds 5] [--checks 2000]

An added or wrong token is looked up afresh on each request (one small file opened by a directory
fd, so that a revoke takes effect at once); this prints what that costs per request beside the
baseline, measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import anyio
from starlette.requests import Request

from coderunner.edge import client_tokens
from coderunner.edge.auth import AccessPolicy
from coderunner.edge.client_tokens import ClientTokens

SERVER_TOKEN = "bench-token-" + "0" * 32


def request(token: str) -> Request:
    return Request({"type": "http", "headers": [(b"authorization", f"Bearer {token}".encode())]})


async def lane(policy: AccessPolicy, token: str, checks: int, expected: str | None) -> float:
    presented = request(token)
    started = time.perf_counter()
    for _ in range(checks):
        if await policy.client_of(presented) != expected:
            raise AssertionError(f"the check of {token[:6]}… answered wrongly")
    return (time.perf_counter() - started) / checks * 1e6


async def main(clients: int, rounds: int, checks: int) -> None:
    with tempfile.TemporaryDirectory() as root:
        folder = client_tokens.tokens_dir(Path(root) / "token")
        tokens = [client_tokens.add(folder, f"client-{index}") for index in range(clients)]
        policy = AccessPolicy.for_bind(SERVER_TOKEN, "127.0.0.1", 8765, [], [], ClientTokens(folder))
        lanes = {
            "server token (baseline)": (SERVER_TOKEN, "default"),
            f"added token (1 of {clients})": (tokens[-1], f"client-{clients - 1}"),
            "wrong token": ("wrong-" + SERVER_TOKEN, None),
        }
        timings: dict[str, list[float]] = {name: [] for name in lanes}
        for _ in range(rounds):
            for name, (token, expected) in lanes.items():
                timings[name].append(await lane(policy, token, checks, expected))
        for name, values in timings.items():
            print(f"{name:28} median {statistics.median(values):7.1f} µs/request  (rounds: "
                  + ", ".join(f"{value:.1f}" for value in values) + ")")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--checks", type=int, default=2000)
    args = parser.parse_args()
    anyio.run(main, args.clients, args.rounds, args.checks)
