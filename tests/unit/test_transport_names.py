"""`http` is what users type for the HTTP transport: it is streamable-http, by flag, environment and file alike."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from coderunner.cli import _parser
from coderunner.config import ConfigError, load_settings

from ..conftest import REPO


@pytest.mark.parametrize("via", ["flag", "environment", "file"])
def test_http_is_streamable_http(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, via: str) -> None:
    config = tmp_path / "config.toml"
    config.write_text('transport = "http"\n' if via == "file" else "")
    monkeypatch.delenv("CODERUNNER_TRANSPORT", raising=False)
    if via == "environment":
        monkeypatch.setenv("CODERUNNER_TRANSPORT", "http")
    flag = _parser().parse_args(["serve", "--transport", "http"]).transport if via == "flag" else None
    settings = load_settings(config, transport=flag)
    assert settings.transport == "streamable-http"  # kept by its real name: what status and logs show


def test_the_real_names_still_hold_and_others_are_refused(tmp_path: Path) -> None:
    for name in ("stdio", "streamable-http", "sse"):
        assert load_settings(Path(os.devnull), transport=name).transport == name
    with pytest.raises(ConfigError, match="transport"):
        load_settings(Path(os.devnull), transport="https")


@pytest.mark.parametrize(("command", "says"), [("serve", "also spelled http"), ("proxy", "http is streamable-http")])
def test_serve_and_proxy_help_name_http(command: str, says: str) -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "coderunner.cli", command, "--help"],
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    text = " ".join(shown.stdout.split())
    assert "streamable-http,http," in text and says in text, text
