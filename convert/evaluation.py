"""A conversion's quality report: what it will hold (forecast before anything runs), and the run itself.

Both models are loaded with the CPU weights the forecast counted (report_cpu_weights): on a CPU, dense float32 for
quantized layers wherever 4 bytes a parameter fit the share of memory models/cpu_weights.py gives dense weights
(float32 scores the report's tokens faster there), else as stored; off the CPU, always as stored. MLXINFER_CPU_WEIGHTS
set to dense or quantized is honoured. The load's own choice ("auto") times the layers, which no forecast can know.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlxinfer.quantize import LayerQuant, QualityReport
from mlxinfer.quantize.quality import scoring_bytes
from tqdm.auto import tqdm

from mlxinfer.cache.kv import STEP as KV_STEP
from mlxinfer.errors import MemoryBudgetError
from mlxinfer.memory import machine_memory
from mlxinfer.models.config import ModelConfig
from mlxinfer.models.cpu_weights import cpu_weights_mode, dense_fits
from mlxinfer.models.dtype import choose_compute_dtype, dtype_name
from mlxinfer.models.sizing import refuse_beyond_machine

from .adapted_source import fuse_loaded
from .calibration import source_path
from .layer_bytes import kv_width, written_bytes
from .sources import Source

log = logging.getLogger(__name__)


def report_cpu_weights(parameters: int) -> str:
    """The CPU weights both models are loaded with for the report: "dense" or "quantized" (off the CPU: "auto",
    which keeps the weights as stored there)."""
    requested = cpu_weights_mode()
    if mx.default_device().type != mx.DeviceType.cpu or requested != "auto":
        return requested
    fits = dense_fits(4 * parameters, machine_memory().usable_bytes())
    return "dense" if fits and choose_compute_dtype(None) == mx.float32 else "quantized"


def source_parameters(source: Source) -> int:
    return sum(math.prod(t.shape) for t in source.tensors.values())


def evaluation_bytes(
    source: Source,
    config: ModelConfig,
    layers: dict[str, LayerQuant | None],
    names: list[str],
    tokens: int,
    shapes: dict[str, tuple[int, ...]] | None = None,
    output_dtype: mx.Dtype | None = None,
) -> int:
    """What the quality report holds on top of the runtime: both models, their KV caches, one chunk's scores.

    `shapes`: the output's tensors, when they are not the source's `names`; `output_dtype`: the one its scales
    and biases are written in (held so where narrower than the compute dtype: loader.kept_as_stored)."""
    compute = choose_compute_dtype(None)
    # Loading the source holds the tensors stored in another float type until their cast to
    # the compute dtype is done (a bf16 source on a bf16 GPU is never cast); the output is
    # loaded next, into the memory those free. Its unquantized tensors follow the compute dtype
    # too, and its scales and biases where that is narrower than their own (loader.kept_as_stored);
    # its packed weights stay as written, unless dense.
    loaded, cast = source.load_bytes(compute)
    shapes = shapes if shapes is not None else {n: source.tensors[n].shape for n in names}
    scales = output_dtype if output_dtype is not None and output_dtype.size < compute.size else compute
    output = 0
    for name, shape in shapes.items():
        quant = layers.get(name.removesuffix(".weight"))
        output += written_bytes(shape, quant, compute if quant is None else scales)
    dequantizing = 0
    if report_cpu_weights(source_parameters(source)) == "dense":
        # float32 throughout; the output's layers are dequantized all at once, so its stored bytes are held
        # beside their float32 copies until the swap (models/cpu_weights.py), then given back; MLX's dequantize
        # of the largest tensor holds a float32 temporary as large (measured: Gemma 3 270M's embedding).
        dense = [math.prod(shape) for n, shape in shapes.items() if _made_dense(n, shape, layers, config)]
        loaded = max(loaded, 4 * sum(math.prod(source.tensors[n].shape) for n in names))
        output += max(output, 4 * sum(dense))
        dequantizing = 4 * max(dense, default=0)
    positions = -(-tokens // KV_STEP) * KV_STEP  # the KV cache grows in steps of KV_STEP positions
    per_position = 2 * config.num_layers * kv_width(config)
    kv = 2 * per_position * positions * compute.size  # two models, keys and values each
    return loaded + max(cast, output) + dequantizing + kv + scoring_bytes(config.vocab_size, compute.size)


def _made_dense(name: str, shape: tuple[int, ...], layers: dict[str, LayerQuant | None], config: ModelConfig) -> bool:
    """Whether loading dense makes this output tensor float32 (models/cpu_weights.py): a quantized matrix, but
    not a stack of experts (gather kernels stay packed) nor an input embedding that is only looked up."""
    path = name.removesuffix(".weight")
    lookup = path.endswith("embed_tokens") and not config.tie_word_embeddings
    return layers.get(path) is not None and len(shape) == 2 and not lookup


def evaluation_fits(source: Source, needed: int) -> bool:
    """Whether the quality report fits in memory (a warning if not)."""
    compute = dtype_name(choose_compute_dtype(None))
    what = f"the source and the output, loaded together in {compute} for the quality report,"
    try:
        refuse_beyond_machine(needed, what, source.description)
    except MemoryBudgetError as e:
        reason = str(e).split("; use a smaller")[0]  # one line; that advice is for loading, not for converting
        log.warning("%s; converting without the quality report (--no-eval skips evaluation)", reason)
        return False
    return True


def evaluate(source: Source, tokens: int, folder: Path, bpw: float, progress: bool) -> QualityReport:
    """Score the output in `folder` against `source` on `tokens` tokens of the evaluation text."""
    from mlxinfer.quantize import compare_models

    from mlxinfer.api import load
    from mlxinfer.data import prose_text

    weights = report_cpu_weights(source_parameters(source))
    with tqdm(total=2 * tokens, unit="tok", desc="quality report", disable=not progress) as bar:
        bar.set_postfix_str("loading both models")
        # The source first: the output then fits in the memory its loading needed beyond the model.
        models: list[Any] = [load(source_path(source), cpu_weights=weights)]
        reference = models[0]  # with `--adapter`, the adapter merged in: the output is measured against that
        fuse_loaded(reference.runtime.decoder, source, getattr(mx, reference.compute_dtype), reference.config)
        models.append(load(folder, cpu_weights=weights))
        ids = models[1].tokenizer.encode(prose_text(), add_special_tokens=False)[:tokens]
        bar.reset(total=2 * len(ids))
        bar.set_postfix_str("source and output, chunk by chunk", refresh=False)
        return compare_models(*models, ids, bits_per_weight=bpw, progress=bar.update)
