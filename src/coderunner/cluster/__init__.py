"""Cluster mode (`coderunner serve --ray ADDRESS`): sessions as detached Ray actors across nodes.

host.py is the front door's SessionHost; actor.py the session on its node; remote_session.py,
remote_job.py and remote_files.py the handle, jobs and files the tools use; placement.py where a
session may go; wire.py what crosses. Needs the optional `ray` extra; nothing else imports this.
"""
