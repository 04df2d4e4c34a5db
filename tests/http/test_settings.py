"""server.py flags and TOML settings: the file fills in, the command line wins, unknown keys are refused."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("luxjax_server_cli", ROOT / "server.py")
server_cli = importlib.util.module_from_spec(spec)
spec.loader.exec_module(server_cli)


def settings(argv):
    return server_cli.settings_from_args(server_cli.parse_args(argv))


def test_defaults_and_llama_server_flag_names():
    s = settings([])
    assert (s.model, s.host, s.port, s.max_concurrency, s.max_queue, s.dtype) == (None, "127.0.0.1", 8080, 4, 64,
                                                                                  "bfloat16")
    s = settings(["model.gguf", "--mmproj", "mm.gguf", "-c", "2048", "--port", "9000", "--api-key", "k"])
    assert (s.model, s.mmproj, s.max_ctx, s.port, s.api_key) == ("model.gguf", "mm.gguf", 2048, 9000, "k")


def test_config_file_then_command_line(tmp_path):
    config = tmp_path / "small.toml"
    config.write_text('max-ctx = 1024\nmax_concurrency = 2\nhost = "0.0.0.0"\n')
    s = settings(["--config", str(config), "--max-concurrency", "3"])
    assert (s.max_ctx, s.max_concurrency, s.host) == (1024, 3, "0.0.0.0")
    assert settings(["--config", str(ROOT / "configs" / "default.toml")]).max_body_bytes == 48 * 1024 * 1024


def test_bad_settings_are_refused(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text("max-tokens-please = 3\n")
    with pytest.raises(ValueError, match="unknown settings"):
        settings(["--config", str(config)])
    with pytest.raises(ValueError, match="max_ctx"):
        settings(["-c", "0"])
