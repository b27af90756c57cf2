"""Settings precedence: defaults < TOML file < CODERUNNER_* environment < flags."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from coderunner.cli import _parser, main
from coderunner.config import ConfigError, load_settings


def test_defaults_without_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-user default file may be absent (a first run has none)."""
    monkeypatch.delenv("CODERUNNER_TIMEOUT_S", raising=False)
    monkeypatch.delenv("CODERUNNER_CONFIG", raising=False)
    monkeypatch.setattr("coderunner.config.default_config_file", lambda: tmp_path / "absent.toml")
    settings = load_settings()
    assert settings.transport == "stdio" and settings.network == "none" and settings.timeout_s == 900
    assert settings.detach_after_s == 40
    assert load_settings(Path(os.devnull)).timeout_s == 900  # os.devnull: read no file, on purpose


def test_a_named_file_that_is_missing_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A typo in --config or $CODERUNNER_CONFIG would otherwise drop its mounts and domains unseen."""
    missing = tmp_path / "typo.toml"
    with pytest.raises(ConfigError, match=r"no configuration file at .*typo\.toml \(named by --config\)"):
        load_settings(missing)
    monkeypatch.setenv("CODERUNNER_CONFIG", str(missing))
    with pytest.raises(ConfigError, match=r"typo\.toml \(named by CODERUNNER_CONFIG\)"):
        load_settings()
    with pytest.raises(ConfigError, match="no configuration file"):
        load_settings(tmp_path)  # a folder is not a file either


@pytest.mark.parametrize("via", ["flag", "flag after the command", "environment"])
def test_cli_stops_on_a_missing_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], via: str
) -> None:
    missing = tmp_path / "typo.toml"
    monkeypatch.setenv("CODERUNNER_CONFIG", str(missing))
    argv = {
        "flag": ["--config", str(missing), "doctor"],
        "flag after the command": ["doctor", "--config", str(missing)],
        "environment": ["doctor"],
    }[via]
    if via != "environment":
        monkeypatch.setenv("CODERUNNER_CONFIG", os.devnull)  # only the flag names the missing file
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and str(missing) in err and "correct the path" in err, err


def test_config_flag_before_or_after_the_command(tmp_path: Path) -> None:
    """`coderunner serve --config X` is what users type; the flag before the command works as ever."""
    parser = _parser()
    assert parser.parse_args(["serve", "--config", "/a.toml"]).config == Path("/a.toml")
    assert parser.parse_args(["--config", "/b.toml", "serve"]).config == Path("/b.toml")
    assert parser.parse_args(["--config", "/b.toml", "doctor", "--config", "/c.toml"]).config == Path("/c.toml")
    assert parser.parse_args(["serve"]).config is None


def test_file_then_env_then_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "config.toml"
    config.write_text('timeout_s = 11\nmemory_mb = 1024\nmax_sessions = 3\nhost = "127.0.0.2"\n')
    monkeypatch.setenv("CODERUNNER_MEMORY_MB", "1536")
    monkeypatch.setenv("CODERUNNER_MAX_SESSIONS", "4")
    settings = load_settings(config, max_sessions=5, host=None)
    assert settings.timeout_s == 11  # file
    assert settings.memory_mb == 1536  # env beats file
    assert settings.max_sessions == 5  # flag beats env
    assert settings.host == "127.0.0.2"  # a flag left unset does not override


def test_config_path_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "elsewhere.toml"
    config.write_text("timeout_s = 7\n")
    monkeypatch.setenv("CODERUNNER_CONFIG", str(config))
    assert load_settings().timeout_s == 7


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("timeout_s = -1\n", "timeout_s"),
        ("no_such_setting = 1\n", "no_such_setting"),
        ('transport = "carrier-pigeon"\n', "transport"),
        ("memory_mb = 100\n", "memory_mb"),
        ("this is not toml", "cannot read"),
    ],
)
def test_bad_configuration_is_a_clear_error(tmp_path: Path, text: str, needle: str) -> None:
    config = tmp_path / "config.toml"
    config.write_text(text)
    with pytest.raises(ConfigError, match=needle) as caught:
        load_settings(config)
    assert str(config) in str(caught.value)


def test_mounts_from_flags_strings_and_an_empty_export_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODERUNNER_EXPORT_DIR", "")
    monkeypatch.setenv(
        "CODERUNNER_MOUNTS", '["/srv/data:/data", {"host": "/srv/out", "sandbox": "/out", "mode": "rw"}]'
    )
    settings = load_settings(Path(os.devnull))
    assert settings.export_dir is None
    assert [(str(m.host), m.sandbox, m.mode) for m in settings.mounts] == [
        ("/srv/data", "/data", "ro"),
        ("/srv/out", "/out", "rw"),
    ]
    flagged = load_settings(Path(os.devnull), mounts=["/x:/y:rw"])
    assert [(str(m.host), m.sandbox, m.mode) for m in flagged.mounts] == [("/x", "/y", "rw")]
    with pytest.raises(ConfigError, match="HOST:SANDBOX"):
        load_settings(Path(os.devnull), mounts=["/just-a-path"])
