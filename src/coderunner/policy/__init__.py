"""Pure policy: functions of the settings and of what a caller asked, no I/O and no state.

    requirements.py     what install_packages accepts (requirement specifiers only)
    call_variables.py   variables a caller hands to code: checked names, JSON values
    tool_groups.py      the names of the tool groups (`--tools`); the tools declare which is theirs

This is the bottom layer above errors: it imports nothing of the machinery (pyproject's import contract).
"""
