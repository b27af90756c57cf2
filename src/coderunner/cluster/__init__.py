"""Cluster mode (`coderunner serve --ray ADDRESS`): sessions in one node agent (a detached Ray actor) per node.

host.py is the front door's SessionHost; agent.py the node's agent, session_side.py a session on its
node, agents.py the front door's agent handles and placement; remote_session.py,
remote_job.py and remote_files.py the handle, jobs and files the tools use; placement.py where a
session may go; wire.py what crosses. Needs the optional `ray` extra; nothing else imports this.
"""
