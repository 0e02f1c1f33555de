"""Embeddings (engine/embed.py, POST /v1/embeddings): transformers' final hidden states pooled, through the
Python API and the official openai client; the refusals and the limits."""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor

import httpx
import mlx.nn as nn
import numpy as np
import openai
import pytest

import mlxinfer
from mlxinfer.engine import SchedulerConfig
from mlxinfer.engine.embed import embed, embeddable
from mlxinfer.errors import EmbeddingError, SamplingError
from mlxinfer.server import ModelSet, ServerSettings
from mlxinfer.server.routes.embeddings import MAX_INPUTS, MAX_TOTAL_TOKENS
from mlxinfer.server.uvicorn_host import BackgroundServer
from tests.conftest import TINY, golden

# llama: plain RMSNorm; gemma3: scaled embeddings, (1+w) norms, sliding windows, tied head with a softcap
# (which embeddings must not see); granite and cohere2: the head's scaling folded into the final norm (which
# unnormalized vectors must not see); gemma3_vl: a multimodal wrapper run as its text model; qwen3_5: recurrent
# layers whose state crosses the chunks.
PARITY = ["llama_classic", "gemma3", "granite", "cohere2", "gemma3_vl", "qwen3_5"]


def unit(vector: np.ndarray) -> np.ndarray:
    return vector / np.linalg.norm(vector)


def transformers_states(name: str, ids: list[int]) -> np.ndarray:
    """transformers' last_hidden_state (after the final norm), float32 (tokens, hidden)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModel.from_pretrained(TINY / name, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return model(torch.tensor([ids])).last_hidden_state[0].numpy()


@pytest.mark.parametrize("name", PARITY)
def test_pooled_states_match_transformers(name):
    ids = golden(name)["input_ids"].tolist()  # 24 tokens
    reference = transformers_states(name, ids)
    model = mlxinfer.load(TINY / name)
    # 7-token chunks: the prefill crosses chunk boundaries (and gemma3's 8-token windows) as a long input would.
    mean = model.embed(ids, chunk_tokens=7)
    last = model.embed(ids, pooling="last", chunk_tokens=7)
    assert mean.shape == last.shape == (1, model.config.hidden_size) and mean.dtype == np.float32
    np.testing.assert_allclose(mean[0], unit(reference.mean(axis=0)), atol=1e-4)
    np.testing.assert_allclose(last[0], unit(reference[-1]), atol=1e-4)
    assert np.abs(mean - last).max() > 1e-2  # the two poolings are told apart
    raw = model.embed(ids, normalize=False)[0]
    np.testing.assert_allclose(raw, reference.mean(axis=0), rtol=1e-3, atol=1e-4)


def test_a_model_without_final_hidden_states_is_refused():
    unverified = mlxinfer.load(TINY / "starcoder2")  # mlx-lm's own class: its forward pass ends in logits
    with pytest.raises(EmbeddingError, match="unverified"):
        unverified.embed("hello")
    with pytest.raises(EmbeddingError, match="hidden states"):
        embed(nn.Linear(4, 4), [[1, 2]], vocab_size=10)  # not a decoder at all
    tiny = mlxinfer.load(TINY / "llama_classic")
    assert embeddable(tiny.runtime.decoder) is None
    with pytest.raises(SamplingError, match="pooling"):
        tiny.embed("hi", pooling="max")
    with pytest.raises(SamplingError, match=r"input\[1\]"):
        tiny.embed([[1, 2], [3, 10**6]])


@pytest.fixture(scope="module")
def server(tiny_llama):
    models = ModelSet()
    llama = models.add(tiny_llama, SchedulerConfig(max_batch=4, max_queue=16))
    unverified = models.add(mlxinfer.load(TINY / "starcoder2"))
    gemma4 = models.add(mlxinfer.load(TINY / "gemma4"))
    with BackgroundServer(models, ServerSettings(port=0)) as running:
        running.ids = {"llama": llama.id, "starcoder2": unverified.id, "gemma4": gemma4.id}
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/embeddings", json=body, timeout=120)


def test_openai_client_gets_unit_vectors_of_the_raw_text(server, client, tiny_llama):
    reply = client.embeddings.create(model=server.ids["llama"], input=["a", "b"], encoding_format="float")
    vectors = np.array([item.embedding for item in reply.data], dtype=np.float32)
    assert [item.index for item in reply.data] == [0, 1] and reply.model == server.ids["llama"]
    assert vectors.shape == (2, tiny_llama.config.hidden_size)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    ids = [tiny_llama.tokenizer.encode(text) for text in ("a", "b")]  # plain encode: no chat template
    np.testing.assert_allclose(vectors, tiny_llama.embed(ids), atol=1e-6)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(map(len, ids))


def test_token_ids_base64_and_last_pooling(server, client, tiny_llama):
    text = "hello there"
    ids = tiny_llama.tokenizer.encode(text)
    as_text = post(server, model=server.ids["llama"], input=text).json()["data"][0]["embedding"]
    flat = post(server, model=server.ids["llama"], input=ids).json()["data"][0]["embedding"]
    nested = post(server, model=server.ids["llama"], input=[ids, ids[:3]]).json()["data"]
    assert as_text == flat == nested[0]["embedding"] and nested[1]["embedding"] != flat
    encoded = post(server, model=server.ids["llama"], input=text, encoding_format="base64").json()
    decoded = np.frombuffer(base64.b64decode(encoded["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(decoded, np.array(as_text, dtype=np.float32))
    # The openai client asks for base64 when no format is given, and decodes it.
    default = client.embeddings.create(model=server.ids["llama"], input=text).data[0].embedding
    np.testing.assert_array_equal(np.array(default, dtype=np.float32), decoded)
    last = post(server, model=server.ids["llama"], input=text, pooling="last").json()["data"][0]["embedding"]
    np.testing.assert_allclose(last, tiny_llama.embed(text, pooling="last")[0], atol=1e-6)
    assert np.abs(np.array(last) - np.array(as_text)).max() > 1e-2
    same_size = client.embeddings.create(model=server.ids["llama"], input="x", dimensions=64).data[0].embedding
    assert len(same_size) == 64


def refusal(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    return error["message"]


def test_limits_and_refusals_then_the_server_keeps_serving(server, client):
    llama = server.ids["llama"]
    with pytest.raises(openai.BadRequestError, match=str(MAX_INPUTS)):
        client.embeddings.create(model=llama, input=["a"] * (MAX_INPUTS + 1))
    too_long = refusal(post(server, model=llama, input=["a", "b", "x" * 300]), "input")  # context: 256
    assert "input[2]" in too_long and "300 tokens" in too_long and "256" in too_long
    budget = refusal(post(server, model=llama, input=["y" * 200] * 200), "input")  # 40000 tokens together
    assert str(MAX_TOTAL_TOKENS) in budget
    assert "input[1]" in refusal(post(server, model=llama, input=[[5, 6], [5, 272]]), "input")  # vocab 272
    assert "input[1]" in refusal(post(server, model=llama, input=["a", ""]), "input")
    assert "empty" in refusal(post(server, model=llama, input=[]), "input")
    assert "64" in refusal(post(server, model=llama, input="a", dimensions=32), "dimensions")
    refusal(post(server, model=llama, input="a", encoding_format="int8"), "encoding_format")
    refusal(post(server, model=llama, input="a", pooling="max"), "pooling")
    assert "unverified" in refusal(post(server, model=server.ids["starcoder2"], input="a"), "model")
    assert "per-pass state" in refusal(post(server, model=server.ids["gemma4"], input="a"), "model")
    assert post(server, model="no-such-model", input="a").status_code == 404
    # After all of that, a good request still works.
    reply = client.embeddings.create(model=llama, input="still here", encoding_format="float")
    assert len(reply.data[0].embedding) == 64


def test_embeddings_run_beside_a_generation_without_disturbing_it(server, client, tiny_llama):
    llama = server.ids["llama"]
    alone = client.completions.create(model=llama, prompt="Once upon", max_tokens=48, temperature=0)
    expected = tiny_llama.embed(["one", "two", "three"])
    with ThreadPoolExecutor(4) as pool:
        generation = pool.submit(
            client.completions.create, model=llama, prompt="Once upon", max_tokens=48, temperature=0
        )
        embeddings = [
            pool.submit(client.embeddings.create, model=llama, input=["one", "two", "three"], encoding_format="float")
            for _ in range(6)
        ]
        for future in embeddings:
            vectors = np.array([item.embedding for item in future.result().data])
            np.testing.assert_allclose(vectors, expected, atol=1e-6)
        assert generation.result().choices[0].text == alone.choices[0].text


def test_ollama_client_embeds_as_v1_does_and_truncates_past_the_context(server, tiny_llama):
    import ollama

    client = ollama.Client(host=server.url, timeout=120)
    llama = server.ids["llama"]
    reply = client.embed(model=llama, input=["a", "hello there"])
    reference = post(server, model=llama, input=["a", "hello there"], encoding_format="float").json()["data"]
    assert reply.embeddings == [item["embedding"] for item in reference] and reply.model == llama
    assert reply.prompt_eval_count == sum(len(tiny_llama.tokenizer.encode(t)) for t in ("a", "hello there"))
    assert client.embed(model=llama, input="a").embeddings == reply.embeddings[:1]
    # Ollama truncates an input past the context by default (its first tokens kept); asked not to, it refuses.
    context = tiny_llama.context_tokens
    long = "ab " * context
    kept = tiny_llama.tokenizer.encode(long)[:context]
    np.testing.assert_allclose(client.embed(model=llama, input=long).embeddings[0], tiny_llama.embed([kept])[0],
                               atol=1e-6)  # fmt: skip
    with pytest.raises(ollama.ResponseError, match=f"the model's context is {context} tokens") as refused:
        client.embed(model=llama, input=long, truncate=False)
    assert refused.value.status_code == 400
    with pytest.raises(ollama.ResponseError, match="cannot give embeddings"):
        client.embed(model=server.ids["starcoder2"], input="a")
    assert client.embed(model=llama, input="still here").embeddings
