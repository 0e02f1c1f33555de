"""A request that names no sampling field samples as the model's files say (generation_config.json, a GGUF's
general.sampling keys), else greedily: the same on the CLI, in Python and on every API route.

The rule is tested on the reader with real published generation configs; one tiny model whose
generation_config.json asks for a repetition penalty (deterministic, and visibly not plain greedy on it) shows
each front end applying it, against the same fields given explicitly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import anthropic
import gguf
import httpx
import ollama
import pytest
from click.testing import CliRunner
from mlxinfer.convert import convert

import mlxinfer
from mlxinfer.cli import main
from mlxinfer.errors import ConfigError
from mlxinfer.formats.recommended_sampling import GGUF_KEYS, from_generation_config
from mlxinfer.server import ModelSet, ServerSettings
from mlxinfer.server.uvicorn_host import BackgroundServer
from tests.conftest import TINY

PENALTY = {"repetition_penalty": 50.0}  # the tiny llama repeats a token within 8 greedy ones; this stops it
HI = [{"role": "user", "content": "Hi"}]
PROMPT = "Once upon a time"


@pytest.mark.parametrize(
    "published, in_force",
    [
        # Qwen2.5-0.5B-Instruct's generation_config.json, as published (ids left out)
        (
            {"do_sample": True, "repetition_penalty": 1.1, "temperature": 0.7, "top_p": 0.8, "top_k": 20},
            {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.1},
        ),
        # Gemma 3: it asks to sample and names no temperature, so transformers' 1.0
        (
            {"cache_implementation": "hybrid", "do_sample": True, "top_k": 64, "top_p": 0.95},
            {"temperature": 1.0, "top_p": 0.95, "top_k": 64, "min_p": 0.0, "repetition_penalty": 1.0},
        ),
        # SmolLM2: ids only, so mlxinfer's default, greedy
        (
            {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2},
            {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0},
        ),
        # do_sample false: greedy, whatever else is said (transformers ignores the rest)
        (
            {"do_sample": False, "temperature": 0.6, "top_p": 0.9},
            {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0},
        ),
        # no do_sample: the fields stated are used, as vLLM does; top_k 0 disables it
        (
            {"temperature": 0.6, "top_k": 0, "min_p": 0.05},
            {"temperature": 0.6, "top_p": 1.0, "top_k": 0, "min_p": 0.05, "repetition_penalty": 1.0},
        ),
    ],
)
def test_generation_config_rules(published, in_force):
    assert from_generation_config(published, "generation_config.json").in_force == in_force


@pytest.mark.parametrize(
    "published, words",
    [
        ({"do_sample": "yes"}, "do_sample must be true or false"),
        ({"temperature": "hot"}, "temperature must be a finite number"),
        ({"top_p": float("nan")}, "top_p must be a finite number"),
        ({"top_k": 2.5}, "top_k must be a whole number"),
        ({"repetition_penalty": True}, "repetition_penalty must be a finite number"),
    ],
)
def test_a_malformed_generation_config_names_its_file_and_field(published, words):
    with pytest.raises(ConfigError, match=f"^g/generation_config.json: {words}"):
        from_generation_config(published, "g/generation_config.json")


def test_an_out_of_range_recommendation_refuses_the_load_naming_the_file(tiny_copy):
    folder = tiny_copy()
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 500}))
    with pytest.raises(ConfigError, match=r"generation_config.json: temperature must be a finite number in \[0, 100\]"):
        mlxinfer.load(folder)


def test_the_gguf_keys_read_are_the_ones_the_gguf_package_writes():
    general = gguf.Keys.General
    written = {general.SAMPLING_TEMP, general.SAMPLING_TOP_P, general.SAMPLING_TOP_K, general.SAMPLING_MIN_P}
    assert set(GGUF_KEYS) == written | {general.SAMPLING_PENALTY_REPEAT}


def test_a_gguf_files_sampling_is_used_and_kept_by_a_conversion(tmp_path):
    from tests.test_gguf import write_tiny_gguf

    stated = {"temp": 0.6, "top_k": -1, "top_p": 0.9, "min_p": 0.05, "penalty_repeat": 1.1}
    path = write_tiny_gguf(tmp_path / "tiny.gguf", sampling=stated)
    expected = {"temperature": 0.6, "top_p": 0.9, "top_k": 0, "min_p": 0.05, "repetition_penalty": 1.1}
    model = mlxinfer.load(path)
    assert model.sampling_defaults.in_force == pytest.approx(expected)  # float32 in the file
    out = tmp_path / "converted"
    convert(path, out, bits=8, group_size=32, evaluate=False, progress=False)
    written = json.loads((out / "generation_config.json").read_text())
    assert written["do_sample"] is True
    assert mlxinfer.load(out).sampling_defaults.in_force == pytest.approx(expected)


@pytest.fixture(scope="module")
def penalized(tmp_path_factory) -> Path:
    """The tiny llama whose generation_config.json states only a repetition penalty."""
    folder = tmp_path_factory.mktemp("sampling") / "penalized"
    shutil.copytree(TINY / "llama_classic", folder, ignore=shutil.ignore_patterns("golden.safetensors"))
    generation = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**generation, **PENALTY}))
    return folder


@pytest.fixture(scope="module")
def model(penalized) -> mlxinfer.Model:
    return mlxinfer.load(penalized)


def test_python_and_the_cli_sample_as_the_model_says(model, penalized, monkeypatch):
    left_out = model.generate(PROMPT, max_tokens=8).text
    assert left_out == model.generate(PROMPT, max_tokens=8, temperature=0, **PENALTY).text
    assert left_out != model.generate(PROMPT, max_tokens=8, repetition_penalty=1.0).text  # it does change it
    # a request's field wins over the model's; the others stay the model's
    seeded = model.generate(PROMPT, max_tokens=8, temperature=3.0, top_k=2, seed=3).text
    assert seeded == model.generate(PROMPT, max_tokens=8, temperature=3.0, top_k=2, seed=3, **PENALTY).text
    args = ["generate", str(penalized), "-p", PROMPT, "--max-tokens", "8", "--raw", "--json", "--local"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["text"] == left_out
    monkeypatch.setenv("MLXINFER_MODELS_DIR", str(penalized.parent))  # `show` takes the names `ls` lists
    shown = CliRunner().invoke(main, ["show", "penalized"])
    assert "sampling      greedy, repetition_penalty 50 (from generation_config.json)" in shown.output


@pytest.fixture(scope="module")
def server(model):
    models = ModelSet()
    models.add(model)
    with BackgroundServer(models, ServerSettings(port=0)) as running:
        yield running


def test_every_route_samples_as_the_model_says(server, model):
    url, name = server.url, "penalized"
    chat = model.chat(HI, max_tokens=8).text
    assert chat != model.chat(HI, max_tokens=8, repetition_penalty=1.0).text
    completion = httpx.post(f"{url}/v1/completions", json={"model": name, "prompt": PROMPT, "max_tokens": 8})
    assert completion.json()["choices"][0]["text"] == model.generate(PROMPT, max_tokens=8).text
    openai_chat = httpx.post(f"{url}/v1/chat/completions", json={"model": name, "messages": HI, "max_tokens": 8})
    assert openai_chat.json()["choices"][0]["message"]["content"] == chat
    ollama_chat = ollama.Client(host=url).chat(model=name, messages=HI, options={"num_predict": 8})
    assert ollama_chat.message.content == chat
    claude = anthropic.Anthropic(base_url=url, api_key="unused").messages.create(model=name, max_tokens=8, messages=HI)
    assert claude.content[0].text == chat


def test_the_defaults_in_force_are_listed(server):
    listed = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    assert listed["sampling_defaults"] == {
        "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 50.0,
    }  # fmt: skip
    parameters = ollama.Client(host=server.url).show("penalized").parameters
    assert parameters.split("\n") == [
        f"{name:<30} {value}"
        for name, value in (("temperature", 0), ("top_p", 1), ("top_k", 0), ("min_p", 0), ("repeat_penalty", 50))
    ]


def test_the_cli_through_a_server_leaves_out_what_the_user_left_out():
    """`mlxinfer generate` with a server running sends only the sampling fields given: the server fills the rest
    from the model, as a local load does (test_every_route_... above)."""
    from mlxinfer.resident_client import _request_body

    _, body = _request_body(PROMPT, False, {"max_tokens": 8, "temperature": None, "top_p": 0.5})
    assert {name for name in ("temperature", "top_p", "top_k", "repetition_penalty") if name in body} == {"top_p"}
