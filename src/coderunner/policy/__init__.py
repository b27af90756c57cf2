"""Pure policy: functions of the settings and of what a caller asked, no I/O and no state.

sandbox_options.py  SandboxOptions: what a sandbox may be given (limits, network, mounts)
requirements.py     what install_packages accepts
call_variables.py   variables a caller hands to code
owners.py           which client owns what a session leaves behind
tool_groups.py      named groups of tools (`--tools`)
"""
