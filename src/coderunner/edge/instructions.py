"""What the server tells every client at initialize; the stdio proxy repeats it word for word.

It names only tools a server started with no `tools` setting offers (the proxy's copy is written before
it knows the server's setting; the server's own copy leaves out what its setting does not offer), as
tests/unit/test_tool_contract.py checks.
"""

INSTRUCTIONS = """\
CodeRunner runs Python in a persistent Jupyter kernel inside a sandbox on the user's machine.
Variables, imports and files in the workspace persist across run_python calls; kernel_reset starts a
fresh interpreter and browser (files kept), for an unrelated task or a stale page.
The sandbox has no network unless the user allowed it, and sees none of the user's files: only its own
workspace (the current directory, /workspace) and folders the user shared. Charts come back as images.
browser_navigate and browser_extract drive a Chromium inside the sandbox; pdf_ops and image_ops work
on files in the workspace. Files saved under /mnt/outputs are copied to the user's export folder.
get_capabilities says what this server allows (limits, network, tools) and which tool groups the user
can turn on. Without session_id every call uses your default session."""
