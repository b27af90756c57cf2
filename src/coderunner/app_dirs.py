"""Where CodeRunner keeps its files by default, per user (root gets system paths a sandbox's uid can enter)."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP_NAME = "coderunner"


def default_config_dir() -> Path:
    return Path(platformdirs.user_config_dir(APP_NAME))


def default_config_file() -> Path:
    return default_config_dir() / "config.toml"


def default_data_dir() -> Path:
    """Per user; for root a system path, because the unprivileged sandbox user cannot enter /root."""
    if os.getuid() == 0:
        return Path("/var/lib") / APP_NAME
    return Path(platformdirs.user_data_dir(APP_NAME))


def default_export_dir() -> Path:
    if os.getuid() == 0:
        return Path("/var/lib") / APP_NAME / "outputs"
    return Path.home() / "coderunner" / "outputs"


def default_runtime_dir() -> Path:
    """Short on purpose: ZMQ ipc socket paths must stay under 107 bytes."""
    return Path("/tmp") / f"coderunner-{os.getuid()}"
