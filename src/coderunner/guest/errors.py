"""GuestError: what every guest tool raises for a failure its caller is told as it is.

Its own module, below everything else in the guest: dispatch.py reports it, and the tools and
their helpers (paths.py among them, which dispatch.py uses) raise it without importing dispatch.
"""


class GuestError(Exception):
    """A failure to report to the caller as it is (bad input, unknown op, ...)."""
