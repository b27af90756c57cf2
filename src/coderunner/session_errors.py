"""The errors of sessions and of the sandboxes they lease, in a leaf module.

Leaf so that the option policy, the leases and the one-shot runner can raise them without
importing the sessions package (which imports them). Each message says what to do instead.
"""

from __future__ import annotations


class SessionError(Exception):
    """A request about sessions that cannot be served; the message says what to do instead."""


class GuestCallError(SessionError):
    """A guest tool refused its input or failed; the message is the reason."""


class SessionBusy(SessionError):
    """Another call holds the session's kernel."""
