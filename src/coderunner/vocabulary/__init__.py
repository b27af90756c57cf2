"""The vocabulary floor: the value types every layer shares and that cross process boundaries as they are.

Nothing here imports anything of coderunner's but itself, so config, sandbox, hostfs and egress can all
stand on it without standing on each other (pyproject's import contract keeps it the bottom layer).

    network.py          NetworkMode, the order the user's ceiling ranks modes in, and how a refusal words
                        the way to more network (within the ceiling)
    mounts.py           MountSpec (a mount as asked for) and Mount (as granted)
    host_identity.py    HostIdentity: the host user a root server's sandbox runs as
    sandbox_layout.py   the workspace path, the sandbox's user and its /etc files
    backends.py         every sandbox backend's entry: names, modules as text, setup, platform default
    sandbox_request.py  SandboxRequest: what a caller asks of a sandbox, one value for every door
    clients.py          LOCAL_CLIENT, the owner when no HTTP client is named
"""
