"""The real default model (SmolLM2-135M-Instruct, GGUF Q4_1) answers correctly."""

from __future__ import annotations

import json

from click.testing import CliRunner

from mlxinfer.cli import main

QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."


def test_api_chat_answers_the_capital_of_france(smol):
    result = smol.chat([{"role": "user", "content": QUESTION}], max_tokens=32)
    assert result.text == ANSWER
    assert result.finish_reason == "stop"
    assert result.stats.prompt_tokens == 37


def test_streamed_answer_equals_the_whole_answer(smol):
    assert "".join(smol.stream(QUESTION, chat=True, max_tokens=32)) == ANSWER


def test_model_describes_itself(smol):
    assert smol.config.model_type == "llama" and smol.config.num_layers == 30
    assert "211 quantized layers" in repr(smol)


def test_cli_generate_answers_with_the_default_model(smol_path, default_cache, monkeypatch):
    monkeypatch.setenv("MLXINFER_CACHE_DIR", str(default_cache))
    result = CliRunner().invoke(main, ["generate", "-p", QUESTION, "--max-tokens", "32"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == ANSWER


def test_cli_generate_json(smol_path):
    result = CliRunner().invoke(main, ["generate", str(smol_path), "-p", QUESTION, "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["text"] == ANSWER
    assert payload["stats"]["generated_tokens"] == 7
    assert set(payload["stats"]) >= {"prompt_tokens", "ttft_s", "prefill_tps", "decode_tps", "peak_memory_bytes"}
