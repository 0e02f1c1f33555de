"""Ollama's /api/copy and /api/delete through the official `ollama` client, on a private models folder.

What may be deleted over HTTP is the library's rule (only what mlxinfer wrote, with the user's token or the
server's key); a copy shares the source's files where it can and never replaces a name.
"""

from __future__ import annotations

import ollama
import pytest

import mlxinfer
from mlxinfer import library
from mlxinfer.errors import LibraryError
from mlxinfer.server import ModelSet, ServerSettings
from mlxinfer.server.model_pool import local_catalog
from mlxinfer.server.uvicorn_host import BackgroundServer
from tests.test_ollama_api import tiny_model

TOKEN = "user-token"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("ollama_models")
    with pytest.MonkeyPatch.context() as env:
        for name, folder in (("MLXINFER_MODELS_DIR", "models"), ("MLXINFER_CACHE_DIR", "cache"),
                             ("MLXINFER_CONFIG_DIR", "config"), ("HF_HUB_CACHE", "hub")):  # fmt: skip
            env.setenv(name, str(root / folder))
        tiny_model(root / "models" / "alpha")
        models = ModelSet(catalog=local_catalog)
        with BackgroundServer(models, ServerSettings(port=0, local_token=TOKEN)) as running:
            running.root = root
            running.client = ollama.Client(host=running.url, timeout=60)
            running.user = ollama.Client(host=running.url, timeout=60, headers={"Authorization": f"Bearer {TOKEN}"})
            yield running
        models.close()


def names(client: ollama.Client) -> set[str]:
    return {model.model for model in client.list().models}


def test_copy_shares_the_files_and_delete_needs_the_users_token(server):
    source = server.root / "models" / "alpha"
    server.client.copy("alpha", "beta")
    copied = server.root / "models" / "beta"
    assert {"alpha", "beta"} <= names(server.client)
    assert (copied / "model.safetensors").stat().st_ino == (source / "model.safetensors").stat().st_ino  # a link
    answer = server.client.chat(model="beta", messages=[{"role": "user", "content": "Hi"}], options={"num_predict": 2})
    assert answer.eval_count == 2  # the copy loads and answers (and is then loaded: delete stops serving it)

    with pytest.raises(ollama.ResponseError) as refused:
        server.client.delete("beta")
    assert refused.value.status_code == 403 and "API key" in str(refused.value)
    assert "beta" in {model.model for model in server.client.ps().models}
    assert server.user.delete("beta").status == "success"
    assert "beta" not in {model.model for model in server.client.ps().models}  # no longer served
    assert not copied.exists() and (source / "model.safetensors").is_file()  # the source keeps its files
    assert "beta" not in names(server.client)


@pytest.mark.parametrize(
    "call, status, words",
    [
        (lambda c: c.copy("alpha", "alpha"), 409, "exists already"),
        (lambda c: c.copy("alpha", "../escape"), 400, "not a model name"),
        (lambda c: c.copy("nope", "gamma"), 404, "not found"),
        (lambda c: c.delete("nope"), 404, "not found"),
    ],
)
def test_refusals(server, call, status, words):
    with pytest.raises(ollama.ResponseError) as refused:
        call(server.user)
    assert refused.value.status_code == status and words in str(refused.value)
    assert not (server.root / "escape").exists() and not (server.root / "models" / "gamma").exists()


def test_an_added_model_is_only_unregistered_and_a_gguf_copies_as_a_file(server, tmp_path):
    from tests.test_gguf import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "mine.gguf")
    library.add_model(gguf)
    copied = library.copy_model(library.find_model("mine"), "mine-copy")
    assert copied == server.root / "models" / "mine-copy.gguf" and mlxinfer.load(copied).config.num_layers == 2
    with pytest.raises(LibraryError, match="exists already"):
        library.copy_model(library.find_model("mine"), "mine-copy")
    assert server.user.delete("mine").status == "success"
    assert gguf.is_file() and library.find_model("mine") is None  # the user's file stays where it was
    server.user.delete("mine-copy")
    assert not copied.exists()
