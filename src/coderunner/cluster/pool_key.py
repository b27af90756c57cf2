"""Which node agent a front door may use: a digest of every setting a session (and a warm one) is built with.

A node agent's manager is built from the settings of the front door that started it, and keeps them
for life: every session it opens, and every sandbox its pool starts ahead, has their allowlist and
ports, limits and timeouts, idle timeout and folders. A front door may use it only when its own
settings would have built the same sessions. So agents are named by the key of those settings
(`agent-<node id>-<key>`, agent.py): a front door with other settings (another team's beside it, or
the same user's after a change and a restart) finds no agent of another key, and starts its own.

Left out of the key: what never reaches a session on a node (the front door's transport, HTTP bounds,
logging and tokens, and the node labels that chose the node) and what each node takes from its own
configuration (wire.NODE_LOCAL), except whether the front door has an export folder at all. Every
other setting is in, those added later too: a setting nobody thought of makes more pools, never a
session with settings that are not its front door's.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from pydantic_core import to_jsonable_python

from coderunner.cluster.wire import NODE_LOCAL

#: Settings of the front door alone: no session on a node is built from them.
FRONT_DOOR_SETTINGS = frozenset({
    "transport", "host", "port", "log_level", "token", "token_file", "allowed_hosts", "allowed_origins",
    "http_max_connections", "http_head_timeout_s", "http_idle_timeout_s", "ray_address", "ray_node_labels",
})  # fmt: skip
#: Hex digits of the key (64 bits: the settings are the user's own, nobody picks them to collide).
KEY_CHARS = 16


def pool_key(sent: Mapping[str, Any]) -> str:
    """The key of the settings a front door sends its nodes (ClusterHost._settings_sent), the same in
    every process: computed from the values themselves, not from a Settings built again (that would
    read the environment of whoever builds it)."""
    kept = {name: value for name, value in sent.items() if name not in FRONT_DOOR_SETTINGS and name not in NODE_LOCAL}
    kept["export_dir"] = sent.get("export_dir") is not None  # node_settings: none at the front door, none there
    text = json.dumps(to_jsonable_python(kept), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:KEY_CHARS]
