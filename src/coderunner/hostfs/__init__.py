"""The host's side of every sandbox's files: only by directory fd where the sandbox can write.

dirfd.py           the primitives (O_NOFOLLOW opens, locked dirs, no-replace renames)
leases.py          one sandbox's host side taken and handed back (dirs, uid, workspace, mounts)
session_dirs.py    its folders, who may write each, and how they go away
workspaces.py      a session's workspace, capped where the machine allows
mounts.py          which host folders a sandbox may see, and their checks
sandbox_mounts.py  what one sandbox sees besides its workspace
staging.py         host-private mount points for a root server
sandbox_files.py   the sandbox's files as the tools may touch them
transfers.py       import_dirs in, the export folder out
exports.py         /mnt/outputs to export_dir/<client>/
tree_copy.py       copying a tree the sandbox can write, bounded

sessions/leases.py puts these together into one SandboxLease per sandbox (session or one-shot run).
"""
