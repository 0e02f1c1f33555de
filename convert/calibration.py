"""The conversion steps that run the source model on calibration text.

Both load the whole source model in the compute dtype, so they cost memory the
streaming path does not; they run only for the sensitivity recipe and GPTQ.
The text is the shipped calibration prose (`--calibration prose`), never the text
the quality report is measured on; `--calibration mixed` puts half of it beside
the source model's own samples from seed prompts of other kinds (chat, code,
arithmetic, French, Spanish, German): text with no data set and no license
behind it, of the kinds the prose lacks (bench/heldout_bench.py measures both).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlxinfer.quantize import LayerQuant
from tqdm.auto import tqdm

from mlxinfer.data import calibration_text
from mlxinfer.models.loader import LoadedModel, load_model

from .sources import Source

SENSITIVITY_TOKENS = 256  # calibration tokens per KL measurement (one forward pass per layer group)
GPTQ_BATCH = (4, 256)  # calibration sequences x tokens each for GPTQ's Hessians
CALIBRATIONS = ("prose", "mixed")
# Seeds of the source model's own samples (--calibration mixed): a few words each, of kinds the prose lacks.
SELF_PROMPTS: tuple[str | list[dict[str, str]], ...] = (
    [{"role": "user", "content": "How does a refrigerator keep food cold?"}],
    [{"role": "user", "content": "Write a short email asking a colleague to review my report by Friday."}],
    'def load_settings(path):\n    """',
    "import json\nimport sys\n\n\nclass Inventory:\n",
    "Question: A train covers 180 km in 2.5 hours. What is its average speed?\nAnswer:",
    "La recette traditionnelle de la ratatouille",
    "El sistema solar está formado por",
    "Die Geschichte der Stadt Hamburg beginnt",
)
SELF_SEED = 0  # the samples are the same on every run of the same model

Triplet = tuple[mx.array, mx.array, mx.array]


def source_path(source: Source) -> Path:
    """Where the runtime can load the source from (a folder, or the .gguf file)."""
    return getattr(source, "folder", None) or Path(source.description)


def sensitivity_layers(
    source: Source,
    bpw: float,
    group_size: int,
    layers: dict[str, LayerQuant | None],
    progress: bool = True,
    calibration: str = "prose",
) -> dict[str, LayerQuant | None]:
    """`layers` with bits chosen per layer group by measured KL within the `bpw` budget."""
    from mlxinfer.quantize.sensitivity import allocate, group_costs, layer_groups

    loaded = _load(source)
    ids = calibration_ids(loaded, calibration, SENSITIVITY_TOKENS)
    paths = [p for p, q in layers.items() if q is not None]
    tied = loaded.config.tie_word_embeddings
    passes = 1 + len(layer_groups(paths, tied))  # the float model's, then one per group
    with tqdm(total=passes, unit="pass", desc="sensitivity", disable=not progress) as bar:
        costs = group_costs(loaded.model, ids, paths, group_size, tied, progress=bar.update)
    quantized = {f"{p}.weight" for p in paths}
    fixed = sum(v.size for k, v in tree_flatten(loaded.model.parameters()) if k not in quantized)
    table = allocate(costs, bpw, group_size, fixed, 16.0 * fixed)
    del loaded
    mx.clear_cache()
    return {p: (LayerQuant(table[p], group_size) if q else None) for p, q in layers.items()}


def gptq_tensors(
    source: Source,
    layers: dict[str, LayerQuant | None],
    dtype: mx.Dtype,
    progress: bool = True,
    calibration: str = "prose",
) -> dict[str, Triplet]:
    """GPTQ-rounded (packed, scales, biases) for the quantized `layers` it can fit."""
    from mlxinfer.quantize.calibrate import gptq_model

    loaded = _load(source)
    batch, length = GPTQ_BATCH
    ids = calibration_ids(loaded, calibration, batch * length)
    batch = max(1, min(batch, len(ids) // length))
    tokens = mx.array(ids[: batch * length]).reshape(batch, -1)
    with tqdm(total=len(loaded.model.layers) + 1, unit="block", desc="GPTQ", disable=not progress) as bar:
        rounded = gptq_model(loaded.model, tokens, layers, dtype, progress=bar.update)
    del loaded
    mx.clear_cache()
    return rounded


def _load(source: Source) -> LoadedModel:
    return load_model(source_path(source))


def calibration_ids(loaded: LoadedModel, calibration: str, tokens: int) -> list[int]:
    """`tokens` calibration token ids (fewer if the prose runs out): the prose, or (mixed) its first half and the
    model's own samples from SELF_PROMPTS after it."""
    assert loaded.tokenizer is not None
    prose = loaded.tokenizer.encode(calibration_text(), add_special_tokens=False)
    if calibration == "prose":
        return prose[:tokens]
    half = tokens // 2
    return prose[:half] + _own_samples(loaded, tokens - half)


def _own_samples(loaded: LoadedModel, tokens: int) -> list[int]:
    """About `tokens` ids of the model's own text: each seed prompt and what the model writes after it (sampled at
    temperature 0.8 with a fixed seed: reproducible, and not the one most likely path)."""
    from mlxinfer.api import Model

    model = Model(loaded, prefix_cache_bytes=0, speculate="off", persist_prefixes=False)  # no prefix store on disk
    per = -(-tokens // len(SELF_PROMPTS))
    ids: list[int] = []
    for prompt in SELF_PROMPTS:
        start = model.encode_prompt(prompt, chat=not isinstance(prompt, str))
        made = model.generate(start, max_tokens=max(1, per - len(start)), temperature=0.8, seed=SELF_SEED)
        ids += (start + list(made.token_ids))[:per]
    return ids[:tokens]
