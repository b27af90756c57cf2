"""Command line: serve | proxy | run | token | config | doctor | setup.

Logs go to stderr; stdout is MCP's in stdio mode.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

# Only what the parser needs is imported here: `--help` and a bad argument answer without loading the
# MCP SDK, the settings or the sessions (seconds on a cold disk); each command imports its own below.
from coderunner import __version__
from coderunner.edge.client_configs import CLIENTS
from coderunner.policy.tool_groups import ALL, DEFAULT_GROUPS, GROUP_NAMES
from coderunner.vocabulary.backends import BACKEND_NAMES

if TYPE_CHECKING:
    from collections.abc import Callable

    from coderunner.config import Settings

BACKEND_CHOICES = list(BACKEND_NAMES)
CONFIG_HELP = "TOML settings file (default ~/.config/coderunner/config.toml)"


def _parser() -> argparse.ArgumentParser:
    # Over 80 lines on purpose: one add_argument per flag of every subcommand, read top to bottom.
    parser = argparse.ArgumentParser(prog="coderunner", description=__doc__)
    parser.add_argument("--version", action="version", version=f"coderunner {__version__}")
    parser.add_argument("--config", type=Path, help=CONFIG_HELP)
    # `coderunner serve --config X` as well as `coderunner --config X serve`: a subcommand's own flag
    # is SUPPRESSed when absent, so it never overwrites the one given before the subcommand.
    config_flag = argparse.ArgumentParser(add_help=False)
    config_flag.add_argument("--config", type=Path, default=argparse.SUPPRESS, help=CONFIG_HELP)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", parents=[config_flag], help="run the MCP server")
    serve.add_argument(
        "--transport",
        choices=["stdio", "streamable-http", "http", "sse"],
        help="stdio (the default: an MCP client launches the server), streamable-http (also spelled http: "
        "http://HOST:PORT/mcp, one server for several clients) or sse (legacy clients: /sse)",
    )
    serve.add_argument("--host", help="HTTP bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="HTTP port (default 8765)")
    _add_session_flags(serve)
    serve.add_argument("--max-sessions", type=int)
    serve.add_argument(
        "--tools",
        help=f"tool groups to offer, e.g. python,files ({', '.join([ALL, *GROUP_NAMES])}; single tool names "
        "too); default " + ",".join(DEFAULT_GROUPS),
    )
    serve.add_argument(
        "--mount",
        dest="mounts",
        action="append",
        metavar="HOST:SANDBOX[:ro|rw]",
        help="share a host folder with every session (repeatable; read-only unless :rw)",
    )
    serve.add_argument("--network", choices=["none", "allowlist", "internet"], help="default network of sessions")
    serve.add_argument(
        "--max-network",
        choices=["none", "allowlist", "internet"],
        help="the most network an agent may ask for (default: what --network and --allow-domain turn on)",
    )
    serve.add_argument(
        "--allow-domain",
        dest="allowed_domains",
        action="append",
        metavar="NAME",
        help="a host network 'allowlist' may reach (repeatable): a name, *.example.com, an IP, or a preset "
        "(python-packages, github)",
    )
    serve.add_argument("--export-dir", type=Path, help="where exports land, one subfolder per client")
    serve.add_argument(
        "--import-dir", dest="import_dirs", type=Path, action="append", help="where transfer_file uploads from"
    )
    serve.add_argument("--token-file", type=Path, help="HTTP bearer token file (default: made on first use)")
    serve.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    serve.add_argument(
        "--ray",
        dest="ray_address",
        metavar="ADDRESS",
        help="cluster mode: sessions live on this Ray cluster (HOST:PORT, or auto); needs the ray extra",
    )

    run = commands.add_parser(
        "run", parents=[config_flag], help="run code once in a fresh sandboxed session and print the result"
    )
    run.add_argument("code", help="Python source, or - to read it from stdin")
    _add_session_flags(run)

    proxy = commands.add_parser(
        "proxy", parents=[config_flag], help="bridge stdio to a running HTTP server (for command-launching clients)"
    )
    proxy.add_argument("url", help="the server's MCP endpoint, e.g. http://127.0.0.1:8765/mcp (or .../sse)")
    proxy.add_argument("--token", help="its bearer token (default: $CODERUNNER_TOKEN, else this machine's token file)")
    proxy.add_argument(
        "--transport",
        dest="proxy_transport",
        choices=["streamable-http", "http", "sse"],
        help="how the server speaks (http is streamable-http); default: sse for a URL ending in /sse",
    )
    proxy.add_argument(
        "--client",
        dest="client_name",
        help="a stable name for this client (its export folder and named workspaces follow it across "
        "restarts); default: a fresh name per proxy process",
    )

    token = commands.add_parser(
        "token",
        parents=[config_flag],
        help="print the server's bearer token (made on first use), or manage one token per client",
        description="With no action: print the server's own token (the client 'default'). "
        "add NAME: make a token for a new client and print it (only once: it is stored hashed). "
        "list: the clients' names, never their tokens. revoke NAME: refuse that token from the next request on.",
    )
    token.add_argument("action", nargs="?", choices=["add", "list", "revoke"], help="manage per-client tokens")
    token.add_argument("name", nargs="?", help="the client's name for add and revoke (e.g. laptop-agent)")
    token.add_argument("--rotate", action="store_true", help="replace it with a new one (old clients are refused)")
    token.add_argument("--file", dest="token_file", type=Path, help="the token file (default: token_file setting)")

    config = commands.add_parser(
        "config", parents=[config_flag], help="print the snippet that adds CodeRunner to an MCP client"
    )
    config.add_argument("client", choices=CLIENTS)
    config.add_argument(
        "--url", help="reach a running HTTP server instead (apps through `coderunner proxy URL`, libraries directly)"
    )

    doctor = commands.add_parser(
        "doctor", parents=[config_flag], help="check that sandboxes work here; say how to fix what does not"
    )
    doctor.add_argument("--all", action="store_true", help="also check each backend not in use, with its fix")
    commands.add_parser(
        "node-resources",
        parents=[config_flag],
        help="cluster mode: the Ray resources this node offers (the backends that work here), as JSON for "
        "`ray start --resources`",
    )

    setup = commands.add_parser(
        "setup", parents=[config_flag], help="create the sandbox's Python environment (or image)"
    )
    setup.add_argument("--recreate", action="store_true", help="delete and rebuild it")
    setup.add_argument("--backend", choices=BACKEND_CHOICES, help="build for this backend")
    setup.add_argument("--base-image", help="container backends: the image the sandbox image is built FROM")
    return parser


def _add_session_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--timeout", dest="timeout_s", type=float, help="default run timeout in seconds")
    parser.add_argument("--memory-mb", type=int, help="memory limit per session")
    parser.add_argument("--sandbox-env", type=Path, help="the sandbox Python environment")
    parser.add_argument("--backend", choices=BACKEND_CHOICES, help="how sessions are isolated")


def _settings(args: argparse.Namespace) -> Settings:
    from coderunner.config import load_settings

    flags = {
        key: getattr(args, key, None)
        for key in (
            "transport",
            "host",
            "port",
            "timeout_s",
            "memory_mb",
            "sandbox_env",
            "max_sessions",
            "log_level",
            "mounts",
            "network",
            "max_network",
            "allowed_domains",
            "export_dir",
            "import_dirs",
            "token_file",
            "backend",
            "base_image",
            "tools",
            "ray_address",
        )
    }
    return load_settings(args.config, **flags)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import logging

    from coderunner.errors import CodeRunnerError

    try:
        settings = _settings(args)
    except CodeRunnerError as exc:  # a ConfigError: exit 2, as for bad arguments
        print(f"coderunner: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level if args.command == "serve" else logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return COMMANDS[args.command](args, settings)
    except CodeRunnerError as exc:  # the message says the fix; anything else is a bug, with its traceback
        print(f"coderunner: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _serve_command(_args: argparse.Namespace, settings: Settings) -> int:
    import anyio

    from coderunner.edge.listener import open_listener

    # An address that is not allowed, or a port in use, is refused before the server's modules load.
    listener = open_listener(settings) if settings.transport != "stdio" else None
    from coderunner.serve import serve

    anyio.run(serve, settings, listener)
    return 0


def _run_command(args: argparse.Namespace, settings: Settings) -> int:
    import anyio

    return anyio.run(_run_once, settings, sys.stdin.read() if args.code == "-" else args.code)


def _proxy_command(args: argparse.Namespace, settings: Settings) -> int:
    import anyio

    from coderunner.edge.auth import read_token
    from coderunner.edge.stdio_proxy import UpstreamTransport, run_proxy

    secret = args.token or (settings.token.get_secret_value() if settings.token else None)
    if secret is None and settings.token_file.exists():
        secret = read_token(settings.token_file)
    upstream: UpstreamTransport | None = "streamable-http" if args.proxy_transport == "http" else args.proxy_transport
    anyio.run(run_proxy, args.url, secret, upstream, args.client_name)
    return 0


def _config_command(args: argparse.Namespace, _settings: Settings) -> int:
    from coderunner.edge.client_configs import CONFIG_LOCATIONS, LaunchCommand, snippet

    print(snippet(args.client, LaunchCommand.for_install(args.url, args.client), args.url))
    print(f"# goes into: {CONFIG_LOCATIONS[args.client]}", file=sys.stderr)
    return 0


def _doctor_command(args: argparse.Namespace, settings: Settings) -> int:
    from coderunner import doctor

    checks = doctor.run_checks(settings, every_backend=args.all)
    print(doctor.report(checks))
    return 0 if all(check.ok for check in checks) else 1


def _node_resources_command(_args: argparse.Namespace, settings: Settings) -> int:
    import json

    from coderunner.cluster.placement import node_resources

    found = node_resources(settings)
    print(json.dumps(found))
    if not found:
        print("coderunner: no backend works on this node (coderunner doctor says why)", file=sys.stderr)
    return 0 if found else 1


def _setup_command(args: argparse.Namespace, settings: Settings) -> int:
    from coderunner.sandbox import env as sandbox_env
    from coderunner.sandbox import image_build as image
    from coderunner.vocabulary.backends import Setup, entry

    if entry(settings.backend).setup is Setup.IMAGE:
        print(f"sandbox image ready: {image.build(settings, recreate=args.recreate)}")
        return 0
    sandbox_env.create(settings.sandbox_env, settings.sandbox_python, recreate=args.recreate)
    print(f"sandbox environment ready: {settings.sandbox_env}")
    return 0


def _token_command(args: argparse.Namespace, settings: Settings) -> int:
    """`coderunner token [add NAME | list | revoke NAME]`: secrets go to stdout, notes to stderr."""
    from coderunner.edge import client_tokens
    from coderunner.edge.auth import ensure_token

    folder = client_tokens.tokens_dir(settings.token_file)
    if args.action is None:
        if args.name is not None:
            print("coderunner: token takes add NAME, list or revoke NAME", file=sys.stderr)
            return 2
        print(ensure_token(settings.token_file, rotate=args.rotate))
        return 0
    if args.rotate:
        print("coderunner: --rotate is for the server's own token; revoke and add a client's token instead",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.action == "list":
        origin = "CODERUNNER_TOKEN" if settings.token else str(settings.token_file)
        print(f"{client_tokens.PRIMARY_CLIENT}\t(the server's own token: {origin})")
        for name in client_tokens.names(folder):
            print(name)
        return 0
    if args.name is None:
        print(f"coderunner: token {args.action} needs the client's NAME", file=sys.stderr)
        return 2
    if args.action == "add":
        print(client_tokens.add(folder, args.name))
        print(
            f"# the token of client {args.name!r}: shown only now (kept hashed in {folder}); a running "
            f"server accepts it at once. Clients send it as 'Authorization: Bearer <token>'.",
            file=sys.stderr,
        )
        return 0
    client_tokens.revoke(folder, args.name)
    print(f"# revoked {args.name!r}: a running server refuses its token from the next request on", file=sys.stderr)
    return 0


async def _run_once(settings: Settings, code: str) -> int:
    # One process, one session: a pool of one, started as the manager opens, is taken (waiting for its
    # start rather than starting a second, cold one beside it) and never refilled.
    import base64

    from coderunner.sandbox import make_backend
    from coderunner.sessions import SessionManager
    from coderunner.tools.replies import execution_reply

    settings = settings.model_copy(update={"pool_size": min(settings.pool_size, 1)})
    async with SessionManager(settings, make_backend(settings)) as manager:
        session = await manager.create(pool_wait_s=settings.startup_timeout_s)
        await manager.pool.drain()
        result = await session.run(code, None, None)
    call = execution_reply(result)
    for block in call.content:
        if block.type == "text":
            print(block.text)
        elif block.type == "image":
            print(f"[{block.mime_type} image, {len(base64.b64decode(block.data)):,} bytes]")
    return 1 if call.is_error else 0


#: Each subcommand's function: it imports what it needs, so `--help` loads none of it.
COMMANDS: dict[str, Callable[[argparse.Namespace, Settings], int]] = {
    "serve": _serve_command,
    "run": _run_command,
    "proxy": _proxy_command,
    "token": _token_command,
    "config": _config_command,
    "doctor": _doctor_command,
    "node-resources": _node_resources_command,
    "setup": _setup_command,
}

if __name__ == "__main__":
    sys.exit(main())
