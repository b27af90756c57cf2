"""The inside of every sandbox that the host side and the backends both write to: where the code works,
who it is, and its /etc.

The backends bind and start (sandbox/common.py has the rest of what they agree on); the host side
makes the sandbox's folders and files (hostfs/). Neither imports the other for these.
"""

from __future__ import annotations

from coderunner.vocabulary.network import NetworkMode

#: Where the code works, and the one folder of its own it may write to.
WORKSPACE = "/workspace"
#: Who the code is inside every sandbox (whatever host uid that maps to), and its home.
SANDBOX_UID = 1000
SANDBOX_GID = 1000
HOME = "/tmp/home"
#: slirp4netns's fixed DNS address inside a sandbox with network.
SLIRP_DNS = "10.0.2.3"


def etc_files(network: str) -> dict[str, str]:
    """The sandbox's own passwd, group, hosts, hostname and resolv.conf: the host's are never shown."""
    return {
        "passwd": f"sandbox:x:{SANDBOX_UID}:{SANDBOX_GID}:sandbox:{HOME}:/bin/sh\n"
        "nobody:x:65534:65534::/:/usr/sbin/nologin\n",
        "group": f"sandbox:x:{SANDBOX_GID}:\nnogroup:x:65534:\n",
        "hosts": "127.0.0.1 localhost sandbox\n::1 localhost\n",
        "hostname": "sandbox\n",
        "resolv.conf": f"nameserver {SLIRP_DNS}\n" if network == NetworkMode.INTERNET else "",
    }
