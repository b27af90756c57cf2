"""A kernel's state saved to files and loaded back, inside the sandbox (never on the host).

The host calls `run(op="save", dir=..., limit_bytes=...)` in the session's kernel; it writes the
user's namespace into `dir` as manifest.json plus one pickle per variable (v-0001.pkl, ...), made
with cloudpickle so that functions and classes defined in cells travel by value. Imported modules
are recorded by name and imported again at load. A variable that cannot be pickled is left out and
named with the reason. The host moves the folder into its store; at restore it puts a copy in the
new sandbox's read-only host dir, and `run(op="load", dir=...)` loads it into the fresh kernel.

Save returns:
    {"saved": [{"name", "type", "bytes"}], "modules": [{"name", "module"}],
     "skipped": [{"name", "type", "reason"}], "bytes": total, "not_carried": [what never travels],
     "cwd": the kernel's working directory}
Load returns:
    {"restored": [names], "modules": [names], "failed": [{"name", "reason"}], "not_carried": [...]}

Loading unpickles only what the save wrote from this user's own objects; each variable is loaded
on its own, so one that fails (its class's module is gone, say) is named and the others come back.
"""


def run(op, dir, limit_bytes=None):
    raise NotImplementedError
