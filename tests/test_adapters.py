"""LoRA and DoRA adapters over one copy of a base: read as mlx-lm and PEFT write them, applied per row.

References: PEFT's own `merge_and_unload()` run by transformers (tests/fixtures/make_tiny_adapters.py writes the
adapters and those logits), and mlx-lm's own `load(path, adapter_path=...)` for adapters mlx-lm's tuner writes
(on families where mlx-lm's base model matches transformers; it is not the reference elsewhere).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np
import openai
import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten

import mlxinfer
from mlxinfer.adapters import NO_ADAPTER, read_adapter
from mlxinfer.adapters.rows import LowRankRows
from mlxinfer.cli import main
from mlxinfer.engine import Delta, Finished, Job
from mlxinfer.errors import AdapterError, BusyError, CorruptFileError
from mlxinfer.server import ModelSet, ServerSettings
from mlxinfer.server.uvicorn_host import BackgroundServer
from tests.conftest import TINY, golden
from tests.test_scheduler import Collector, batch_sizes

FIXTURES = Path(__file__).parent / "fixtures" / "adapters"
BASES = {"llama_dora": "llama_classic"}  # the others are named <base>_lora
PEFT = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
QUICK = {"qwen3_lora", "llama_dora"}  # the fast tier's: scaling rules, modules_to_save, DoRA


def base_of(fixture: str) -> str:
    return BASES.get(fixture, fixture.removesuffix("_lora"))


def write_mlx_lm_adapter(base: Path, out: Path, kind: str = "lora", rank: int = 4, seed: int = 0,
                         keys: list[str] | None = None) -> Path:  # fmt: skip
    """An adapter as `mlx_lm.lora` saves one (its tuner's own layers and parameter names), with random nonzero
    weights (mlx-lm starts lora_b at zero) and DoRA magnitudes off the base's norms."""
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = load(str(base))
    params = {"rank": rank, "scale": 2.0, "dropout": 0.0, **({"keys": keys} if keys else {})}
    linear_to_lora_layers(model, 2, params, use_dora=kind == "dora")
    mx.random.seed(seed)
    weights = {}
    for key, value in tree_flatten(model.trainable_parameters()):
        if key.endswith(("lora_a", "lora_b")):
            weights[key] = mx.random.normal(value.shape) * 0.2
        elif key.endswith(".m"):
            weights[key] = value * (1 + 0.1 * mx.random.normal(value.shape))
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    config = {"fine_tune_type": kind, "num_layers": 2, "lora_parameters": params, "model": str(base)}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def three(tmp_path_factory) -> dict[str, Path]:
    """Three mlx-lm adapters over the tiny llama: LoRA, DoRA, and a rank-8 LoRA on the MLP's down projection."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "lora": write_mlx_lm_adapter(TINY / "llama_classic", root / "lora", seed=1),
        "dora": write_mlx_lm_adapter(TINY / "llama_classic", root / "dora", "dora", seed=2),
        "down": write_mlx_lm_adapter(TINY / "llama_classic", root / "down", rank=8, seed=3, keys=["mlp.down_proj"]),
    }


@pytest.fixture(scope="module")
def tuned(three) -> mlxinfer.Model:
    return mlxinfer.load(TINY / "llama_classic", adapters=three)


def ids_of(base: str) -> list[int]:
    return np.array(golden(base)["input_ids"]).tolist()


@pytest.mark.parametrize("fixture", [pytest.param(n, marks=() if n in QUICK else pytest.mark.slow) for n in PEFT])
def test_a_peft_adapter_equals_peft_merged_into_the_weights(fixture):
    base = base_of(fixture)
    model = mlxinfer.load(TINY / base, adapters={"tuned": FIXTURES / fixture})
    want = np.array(mx.load(str(FIXTURES / fixture / "golden.safetensors"))["logits"])
    np.testing.assert_allclose(model.logits(ids_of(base), adapter="tuned"), want, atol=5e-4)
    assert np.abs(model.logits(ids_of(base)) - want).max() > 0.1  # the base itself stays the base


@pytest.mark.parametrize(
    "base, kind",
    [("llama_classic", "lora"), ("llama_classic", "dora"), ("qwen3", "lora"), ("mixtral", "lora")]
    + [pytest.param(b, "lora", marks=pytest.mark.slow) for b in ("gemma3", "qwen3_5_vl", "mistral3_vl", "deepseek_v3")],
)
def test_an_mlx_lm_adapter_equals_mlx_lm_loading_it(base, kind, tmp_path):
    # mixtral and deepseek_v3: mlx-lm's LoRA adapts every expert (LoRASwitchLinear); 72 tokens run its sorted path
    from mlx_lm import load

    path = write_mlx_lm_adapter(TINY / base, tmp_path / kind, kind)
    reference, _ = load(str(TINY / base), adapter_path=str(path))
    model = mlxinfer.load(TINY / base, adapters={"a": path})
    for ids in (ids_of(base), ids_of(base) * 3):
        want = np.array(reference(mx.array([ids]))[0].astype(mx.float32))
        np.testing.assert_allclose(model.logits(ids, adapter="a"), want, atol=1e-4)


def test_rows_of_different_expert_adapters_in_one_pass_equal_each_alone(tmp_path):
    from mlxinfer.adapters import selected

    paths = {n: write_mlx_lm_adapter(TINY / "mixtral", tmp_path / n, seed=s) for n, s in (("a", 1), ("b", 2))}
    model = mlxinfer.load(TINY / "mixtral", adapters=paths)
    decoder, rows = model.runtime.decoder, mx.array([ids_of("mixtral")[:20]] * 3)
    slots = [model.choose_adapter(n).slot for n in ("a", None, "b")]
    with selected(decoder, slots):  # 3 rows x 20 tokens x 2 experts: past 64 pairs, run sorted by expert
        together = np.array(decoder(rows))
    for i, slot in enumerate(slots):
        with selected(decoder, [slot]):
            np.testing.assert_allclose(together[i], np.array(decoder(rows[i : i + 1]))[0], atol=1e-4)


@pytest.mark.slow
def test_over_a_quantized_base_it_equals_mlx_lm(tmp_path):
    from mlx_lm import convert, load

    quantized = tmp_path / "q4"
    convert(str(TINY / "qwen3"), str(quantized), quantize=True, q_group_size=32, q_bits=4)
    for kind in ("lora", "dora"):
        path = write_mlx_lm_adapter(quantized, tmp_path / kind, kind)
        reference, _ = load(str(quantized), adapter_path=str(path))
        want = np.array(reference(mx.array([ids_of("qwen3")]))[0].astype(mx.float32))
        model = mlxinfer.load(quantized, adapters={"a": path}, cpu_weights="quantized")
        np.testing.assert_allclose(model.logits(ids_of("qwen3"), adapter="a"), want, atol=2e-4)


def tokens_into(tokens: list[int], collector: Collector):
    """A job's listener: each delta's token appended to `tokens`, every event handed to `collector`."""

    def on_event(event) -> None:
        if isinstance(event, Delta) and event.token is not None:
            tokens.append(event.token)
        collector(event)

    return on_event


def greedy(model: mlxinfer.Model, prompt: list[int], adapter: str | None, tokens: int) -> list[int]:
    """Greedy tokens from whole-sequence logits (Model.logits), a path apart from the engine's batches."""
    out: list[int] = []
    for _ in range(tokens):
        out.append(int(model.logits(prompt + out, adapter=adapter)[-1].argmax()))
    return out


def test_rows_with_three_adapters_and_the_bare_base_batch_as_each_alone(tuned, scheduler_for):
    prompt = [3, 9, 27, 81, 40]  # the same for all four rows: each differs by its adapter alone
    want = {name: greedy(tuned, prompt, name, 12) for name in ("lora", "dora", "down", None)}
    assert len({tuple(tokens) for tokens in want.values()}) == 4
    scheduler = scheduler_for(tuned, max_batch=4, prefill_chunk=8)
    sizes = batch_sizes(scheduler)
    got: dict[str | None, list[int]] = {name: [] for name in want}
    collectors = {name: Collector() for name in want}
    for name in want:
        job = Job(prompt, tokens_into(got[name], collectors[name]), max_tokens=12, use_cache=False,
                  eos_token_ids=frozenset(), adapter=tuned.choose_adapter(name))  # fmt: skip
        scheduler.submit(job)
    for collector in collectors.values():
        assert isinstance(collector.wait().end, Finished)
    assert got == want
    assert max(sizes) == 4  # all four decoded together


def test_latent_attention_decodes_its_kv_b_proj_adapter_as_the_whole_sequence_does(scheduler_for):
    # deepseek_v3's PEFT adapter adapts kv_b_proj, held here as per-head halves folded into the query and the output
    # (mlx-lm's MLA): a prompt runs it one way (its keys and values), each decode step the other (folded).
    model = mlxinfer.load(TINY / "deepseek_v3", adapters={"tuned": FIXTURES / "deepseek_v3_lora"}, prefix_cache_bytes=0)
    prompt = ids_of("deepseek_v3")[:12]
    want = {name: greedy(model, prompt, name, 8) for name in ("tuned", None)}
    assert want["tuned"] != want[None]
    scheduler = scheduler_for(model, max_batch=2)
    got: dict[str | None, list[int]] = {name: [] for name in want}
    collectors = {name: Collector() for name in want}
    for name in want:  # the two rows decode together: each its own half-pairs, or none
        scheduler.submit(Job(prompt, tokens_into(got[name], collectors[name]), max_tokens=8, eos_token_ids=frozenset(),
                             adapter=model.choose_adapter(name)))  # fmt: skip
    for collector in collectors.values():
        collector.wait()
    assert got == want


def test_the_prefix_cache_keys_kv_by_the_adapter(tuned):
    prompt = list(range(40, 80))
    fresh = {n: tuned.generate(prompt, max_tokens=8, adapter=n, use_cache=False).token_ids for n in ("lora", None)}
    first = tuned.generate(prompt, max_tokens=8, adapter="lora")
    base = tuned.generate(prompt, max_tokens=8)  # the same ids under the base: nothing of lora's KV is reused
    other = tuned.generate(prompt, max_tokens=8, adapter="dora")
    again = tuned.generate(prompt, max_tokens=8, adapter="lora")
    assert first.token_ids == again.token_ids == fresh["lora"] and base.token_ids == fresh[None]
    assert (base.stats.cached_tokens, other.stats.cached_tokens) == (0, 0)
    assert again.stats.cached_tokens >= len(prompt) - 1


def test_a_prefix_warmed_under_an_adapter_is_resumed_from_disk_under_it_alone(three):
    document = list(range(20, 90))
    first = mlxinfer.load(TINY / "llama_classic", adapters=three)
    assert first.warm(document, adapter="dora") == len(document)
    later = mlxinfer.load(TINY / "llama_classic", adapters=three)  # a new process's model: the store on disk
    asked = {n: later.generate(document + [5, 6], max_tokens=4, adapter=n) for n in ("dora", "lora", None)}
    assert asked["dora"].stats.cached_tokens == len(document)
    assert asked["lora"].stats.cached_tokens == asked[None].stats.cached_tokens == 0
    fresh = mlxinfer.load(TINY / "llama_classic", adapters=three, prefix_cache_bytes=0)
    assert asked["dora"].token_ids == fresh.generate(document + [5, 6], max_tokens=4, adapter="dora").token_ids


def test_cache_keys_of_two_adapters_and_the_base_never_meet(tuned):
    keys = {n: Job(list(range(200)), print, adapter=tuned.choose_adapter(n)).cache_ids for n in ("lora", "dora")}
    base = Job(list(range(200)), print, adapter=NO_ADAPTER).cache_ids
    assert base == list(range(200))
    assert not set(keys["lora"]) & set(keys["dora"]) and not set(keys["lora"]) & set(base)
    assert all(-(2**31) < k < 0 for k in keys["lora"] + keys["dora"])  # never a token id; int32, as prefix files


def test_adapters_load_later_and_the_least_recently_used_idle_one_makes_room(three, tmp_path, scheduler_for):
    def write(name: str, keys: list[str], rank: int) -> Path:
        return write_mlx_lm_adapter(TINY / "llama_classic", tmp_path / name, rank=rank, seed=rank, keys=keys)

    paths = {**three, "v": write("v", ["self_attn.v_proj"], 2), "q": write("q", ["self_attn.q_proj"], 6)}
    alone = {n: mlxinfer.load(TINY / "llama_classic", adapters={n: paths[n]}) for n in ("down", "v", "q", "dora")}
    model = mlxinfer.load(TINY / "llama_classic", prefix_cache_bytes=0)
    ids, bare = ids_of("llama_classic"), model.logits(ids_of("llama_classic"))
    model.load_adapter("down", paths["down"], limit=2)
    model.load_adapter("v", paths["v"], limit=2)
    held = [model.adapter_set.take("v")]  # answering a request: never the one unloaded
    model.load_adapter("q", paths["q"], limit=2)  # down goes; q takes its slot, below v's, wrapping q_proj anew
    assert set(model.adapters) == {"v", "q"}
    stacks = [m.a.shape[0] for _, m in model.runtime.decoder.named_modules() if isinstance(m, LowRankRows)]
    assert len(stacks) == 6 and set(stacks) == {3}  # 3 projections x 2 layers; each holds every slot a row may name
    assert model.adapter_set.uncounted == model.adapter_set.nbytes > 0  # a server's budget adds it to the footprint
    held.append(model.adapter_set.take("q"))
    with pytest.raises(BusyError, match="all 2 adapters"):
        model.load_adapter("dora", paths["dora"], limit=2)
    prompts = {"q": [3, 9, 27], "v": [5, 6, 7, 8], None: [9, 9]}
    want = {n: (alone[n] if n else model).generate(p, max_tokens=10, adapter=n, use_cache=False).text
            for n, p in prompts.items()}  # fmt: skip
    collectors = {name: Collector() for name in prompts}
    scheduler = scheduler_for(model, max_batch=3)
    for name, prompt in prompts.items():
        scheduler.submit(
            Job(prompt, collectors[name], max_tokens=10, use_cache=False, adapter=model.choose_adapter(name))
        )
    assert {n: c.wait().text for n, c in collectors.items()} == want  # rows of both slots and the base, one batch
    for chosen in held:  # v given back first: the least recently used
        model.adapter_set.give_back(chosen)
    model.load_adapter("dora", paths["dora"], limit=2)
    assert set(model.adapters) == {"q", "dora"}
    for name in ("q", "dora"):
        np.testing.assert_allclose(model.logits(ids, adapter=name), alone[name].logits(ids, adapter=name), atol=1e-5)
    np.testing.assert_allclose(model.logits(ids), bare, atol=1e-6)


def test_a_pass_built_on_another_thread_meanwhile_runs_the_base(tuned):
    import threading

    from mlxinfer.adapters import selected

    ids, decoder, got = ids_of("llama_classic"), tuned.runtime.decoder, {}
    with selected(decoder, [tuned.choose_adapter("lora").slot]):  # as the scheduler, building a step
        other = threading.Thread(target=lambda: got.update(base=np.array(decoder(mx.array([ids]))[0])))
        other.start()
        other.join()
        mine = np.array(decoder(mx.array([ids]))[0])
    np.testing.assert_allclose(got["base"], tuned.logits(ids), atol=1e-6)  # as a server's embeddings pass
    np.testing.assert_allclose(mine, tuned.logits(ids, adapter="lora"), atol=1e-6)


def test_the_planner_and_repr_count_the_adapters(three, tuned):
    bare = mlxinfer.load(TINY / "llama_classic")
    held = sum(a.nbytes for a in tuned.adapter_set.loaded)
    assert tuned.footprint.weights_bytes - bare.footprint.weights_bytes >= held
    assert tuned.adapter_set.uncounted == 0  # all in the footprint already
    assert set(tuned.adapters) == {"lora", "dora", "down"} and tuned.adapters["dora"] == three["dora"]


def test_reading_refuses_what_it_cannot_apply(tmp_path, three):
    def folder(name: str, config: dict, tensors: dict | None = None, weights: str = "adapter_model.safetensors"):
        path = tmp_path / name
        path.mkdir()
        (path / "adapter_config.json").write_text(json.dumps(config))
        if tensors is not None:
            mx.save_safetensors(str(path / weights), tensors)
        return path

    peft = {"peft_type": "LORA", "r": 2, "lora_alpha": 4}
    pair = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": mx.zeros((2, 64)),
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": mx.zeros((64, 2))}  # fmt: skip
    cases = {
        "pickled": (folder("pickled", peft), "pickle"),
        "full": (folder("full", {"fine_tune_type": "full"}, {"x": mx.zeros(1)}, "adapters.safetensors"), "fuse"),
        "bias": (folder("bias", {**peft, "bias": "all"}, pair), "bias"),
        "experts": (folder("experts", {**peft, "target_parameters": ["mlp.experts.gate_up_proj"]}, pair), "experts"),
        "regex": (folder("regex", {**peft, "alpha_pattern": {"q_(proj)+": 2}}, pair), "regular expressions"),
        "prompt": (folder("prompt", {"peft_type": "PROMPT_TUNING"}, pair), "PROMPT_TUNING"),
        "lonely": (folder("lonely", peft, dict(list(pair.items())[:1])), "but not its pair"),
    }
    (cases["pickled"][0] / "adapter_model.bin").write_bytes(b"\x80\x04")
    for path, words in cases.values():
        with pytest.raises(AdapterError, match=words):
            read_adapter(path)
    (tmp_path / "crafted").mkdir()
    (tmp_path / "crafted" / "adapter_config.json").write_text(json.dumps(peft))
    (tmp_path / "crafted" / "adapter_model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(CorruptFileError):
        read_adapter(tmp_path / "crafted")


def test_an_adapter_for_another_base_is_one_line_naming_what_differs(three):
    with pytest.raises(AdapterError, match=r"k_proj maps 64 -> 64 features in the adapter but 64 -> 32 in the model"):
        mlxinfer.load(TINY / "llama_classic", adapters={"x": FIXTURES / "qwen3_moe_lora"})  # head_dim 32 there
    with pytest.raises(AdapterError, match="replaces lm_head, which this model does not have"):
        mlxinfer.load(TINY / "llama_classic", adapters={"x": FIXTURES / "qwen3_lora"})  # a tied head here
    with pytest.raises(AdapterError, match="has no linear layer for"):
        mlxinfer.load(TINY / "mistral3_vl", adapters={"x": FIXTURES / "phi3_lora"})  # phi3's fused qkv_proj
    with pytest.raises(AdapterError, match="no adapter named 'nope'"):
        mlxinfer.load(TINY / "llama_classic", adapters={"lora": three["lora"]}).generate([1, 2], adapter="nope")
    with pytest.raises(AdapterError, match="adapter name"):
        mlxinfer.load(TINY / "llama_classic", adapters={"a b": three["lora"]})


@pytest.mark.slow
def test_the_server_serves_base_and_adapters_by_name(tuned):
    models = ModelSet()
    models.add(tuned)
    try:
        with BackgroundServer(models, ServerSettings(port=0)) as running:
            client = openai.OpenAI(base_url=running.url + "/v1", api_key="none")
            listed = {m.id: m for m in client.models.list().data}
            assert listed["llama_classic:dora"].model_extra["parent"] == "llama_classic"
            for name in ("lora", "dora", None):
                model = f"llama_classic:{name}" if name else "llama_classic"
                got = client.completions.create(model=model, prompt="abc", max_tokens=12, temperature=0)
                assert got.choices[0].text == tuned.generate("abc", max_tokens=12, adapter=name).text
            tags = httpx.get(running.url + "/api/tags").json()["models"]
            assert {"llama_classic:lora", "llama_classic:down"} <= {t["name"] for t in tags}
            missing = httpx.post(running.url + "/v1/completions", json={"model": "llama_classic:nope", "prompt": "a"})
            assert missing.status_code == 404
            embedded = httpx.post(running.url + "/v1/embeddings", json={"model": "llama_classic:lora", "input": "a"})
            assert embedded.status_code == 400 and "base model" in embedded.json()["error"]["message"]
    finally:
        models.close()


@pytest.mark.slow
def test_a_server_loads_a_named_adapter_on_its_first_request(three, tuned):
    folders = {**three, "wrong": FIXTURES / "qwen3_moe_lora"}  # the last trained for another model
    models = ModelSet(adapter_catalog=folders.get, max_adapters=1)
    models.add(mlxinfer.load(TINY / "llama_classic"))
    try:
        with BackgroundServer(models, ServerSettings(port=0)) as running:
            client = openai.OpenAI(base_url=running.url + "/v1", api_key="none")
            for name in ("lora", "dora", "lora"):  # one kept loaded: each request for the other swaps them
                got = client.completions.create(model=f"llama_classic:{name}", prompt="abc", max_tokens=12)
                assert got.choices[0].text == tuned.generate("abc", max_tokens=12, adapter=name).text
                assert set(models.get("llama_classic").model.adapters) == {name}
            assert {"llama_classic:lora", "llama_classic:dora"} <= {m.id for m in client.models.list().data}
            wrong = httpx.post(running.url + "/v1/completions", json={"model": "llama_classic:wrong", "prompt": "a"})
            assert wrong.status_code == 400 and "another base model" in wrong.json()["error"]["message"]
            assert set(models.get("llama_classic").model.adapters) == {"lora"}  # nothing changed by it
            assert [(r["adapters"], r["max_adapters"]) for r in models.ps()] == [(["lora"], 1)]
    finally:
        models.close()


@pytest.mark.slow
def test_the_cli_generates_with_an_adapter(three, tuned):
    args = ["generate", str(TINY / "llama_classic"), "--adapter", str(three["dora"]), "-p", "abc", "--raw"]
    result = CliRunner().invoke(main, [*args, "--max-tokens", "10", "--json", "--local"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["text"] == tuned.generate("abc", max_tokens=10, adapter="dora").text


def test_convert_merges_the_adapter_before_quantizing(tmp_path):
    adapter = FIXTURES / "qwen3_lora"
    want = np.array(mx.load(str(adapter / "golden.safetensors"))["logits"])
    args = ["convert", str(TINY / "qwen3"), "--adapter", str(adapter), "--bits", "16", "--dtype", "float32"]
    result = CliRunner().invoke(main, [*args, "-o", str(tmp_path / "merged"), "--no-eval"])
    assert result.exit_code == 0, result.output
    np.testing.assert_allclose(mlxinfer.load(tmp_path / "merged").logits(ids_of("qwen3")), want, atol=5e-4)
    manifest = json.loads((tmp_path / "merged" / "mlxinfer-manifest.json").read_text())
    assert manifest["adapter"]["sha256"] == read_adapter(adapter).digest and manifest["adapter"]["written_by"] == "peft"
    # Quantized, its quality report scores it against the merged float model (against the base, KL would be ~nats)
    from mlxinfer.convert import convert

    report = convert(TINY / "qwen3", tmp_path / "q8", bits=8, group_size=32, adapter=str(adapter), progress=False)
    assert report.quality.mean_kl < 0.01
    other = str(FIXTURES / "qwen3_moe_lora")  # head_dim 32: its k_proj is twice llama_classic's
    wrong = CliRunner().invoke(main, ["convert", str(TINY / "llama_classic"), "--adapter", other,
                                      "-o", str(tmp_path / "wrong"), "--no-eval"])  # fmt: skip
    assert wrong.exit_code == 1 and "trained for another base model" in wrong.output
    assert not (tmp_path / "wrong").exists()
    # mlx-lm's per-expert pairs name the stacked experts the layout conversion makes: merged as those are written
    from mlx_lm import load

    experts = write_mlx_lm_adapter(TINY / "mixtral", tmp_path / "experts")
    convert(TINY / "mixtral", tmp_path / "moe", bits=16, dtype="float32", adapter=str(experts), progress=False)
    reference, _ = load(str(TINY / "mixtral"), adapter_path=str(experts))
    ids = ids_of("mixtral")
    want = np.array(reference(mx.array([ids]))[0].astype(mx.float32))
    np.testing.assert_allclose(mlxinfer.load(tmp_path / "moe").logits(ids), want, atol=1e-4)


def test_ls_lists_the_models_folders_adapters(tmp_path, monkeypatch, three):
    import shutil

    monkeypatch.setenv("MLXINFER_MODELS_DIR", str(tmp_path))
    shutil.copytree(three["dora"], tmp_path / "poet")
    shutil.copytree(TINY / "llama_classic", tmp_path / "llama")  # a model: config.json beside its weights
    result = CliRunner().invoke(main, ["ls"])
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line.split()[1] for line in result.stdout.splitlines()[1:]}
    assert rows["*:poet"] == "adapter" and rows["llama"] != "adapter"
    from mlxinfer.library import find_adapter

    assert (
        find_adapter("poet") == tmp_path / "poet" and find_adapter("llama") is None and find_adapter("../poet") is None
    )
