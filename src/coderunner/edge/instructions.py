"""What the server tells every client at initialize; the stdio proxy repeats it word for word."""

INSTRUCTIONS = """\
CodeRunner runs Python in a persistent Jupyter kernel inside a sandbox on the user's machine.
Variables, imports and files in the workspace persist across run_python calls until the kernel is reset.
The sandbox has no network and sees none of the user's files: only its own workspace
(the current directory, /workspace). Charts (matplotlib) come back as images.
Files saved under /mnt/outputs are copied to the user's export folder after each call.
Without session_id every call uses one default session; create_session gives an independent one."""
