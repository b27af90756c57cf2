"""Every egress test fails if the proxy or asyncio logged an error: a crash in a connection handler
is otherwise invisible to the client, which only sees the connection close."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def no_logged_errors(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    caplog.set_level(logging.WARNING)
    yield
    errors = [r for r in caplog.get_records("call") if r.levelno >= logging.ERROR]
    assert not errors, "\n".join(r.getMessage() + (f"\n{r.exc_text}" if r.exc_text else "") for r in errors)
