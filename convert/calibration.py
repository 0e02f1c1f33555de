"""The conversion steps that run the source model on calibration text.

Both load the whole source model in the compute dtype, so they cost memory the
streaming path does not; they run only for the sensitivity recipe and GPTQ.
The text is the shipped calibration prose, never the text the quality report
is measured on.
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

Triplet = tuple[mx.array, mx.array, mx.array]


def source_path(source: Source) -> Path:
    """Where the runtime can load the source from (a folder, or the .gguf file)."""
    return getattr(source, "folder", None) or Path(source.description)


def sensitivity_layers(
    source: Source, bpw: float, group_size: int, layers: dict[str, LayerQuant | None], progress: bool = True
) -> dict[str, LayerQuant | None]:
    """`layers` with bits chosen per layer group by measured KL within the `bpw` budget."""
    from mlxinfer.quantize.sensitivity import allocate, group_costs, layer_groups

    loaded = _load(source)
    ids = _calibration_ids(loaded)[:SENSITIVITY_TOKENS]
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
    source: Source, layers: dict[str, LayerQuant | None], dtype: mx.Dtype, progress: bool = True
) -> dict[str, Triplet]:
    """GPTQ-rounded (packed, scales, biases) for the quantized `layers` it can fit."""
    from mlxinfer.quantize.calibrate import gptq_model

    loaded = _load(source)
    ids = _calibration_ids(loaded)
    batch, length = GPTQ_BATCH
    batch = max(1, min(batch, len(ids) // length))
    tokens = mx.array(ids[: batch * length]).reshape(batch, -1)
    with tqdm(total=len(loaded.model.layers) + 1, unit="block", desc="GPTQ", disable=not progress) as bar:
        rounded = gptq_model(loaded.model, tokens, layers, dtype, progress=bar.update)
    del loaded
    mx.clear_cache()
    return rounded


def _load(source: Source) -> LoadedModel:
    return load_model(source_path(source))


def _calibration_ids(loaded: LoadedModel) -> list[int]:
    assert loaded.tokenizer is not None
    return loaded.tokenizer.encode(calibration_text(), add_special_tokens=False)
