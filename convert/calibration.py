"""The conversion steps that run the source model on calibration text.

They load the whole source model in the compute dtype, so they cost memory the
streaming path does not; they run only for the sensitivity recipe, GPTQ, AWQ and DWQ.
The text is the shipped calibration prose (`--calibration prose`), never the text
the quality report is measured on; `--calibration mixed` puts half of it beside
the source model's own samples from seed prompts of other kinds (chat, code,
arithmetic, French, Spanish, German): text with no data set and no license
behind it, of the kinds the prose lacks (bench/heldout_bench.py measures both).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlxinfer.quantize import LayerQuant
from tqdm.auto import tqdm

from mlxinfer.data import calibration_text
from mlxinfer.models.cpu_weights import dequantize, quantized_layers
from mlxinfer.models.loader import LoadedModel, load_model

from .adapted_source import fuse_loaded
from .sources import Source

SENSITIVITY_TOKENS = 256  # calibration tokens per KL measurement (one forward pass per layer group)
GPTQ_BATCH = (4, 256)  # calibration sequences x tokens each for GPTQ's Hessians
DWQ_TOKENS = 4096  # calibration tokens DWQ distils on (mixed: the prose's ~1,400 and the model's own samples)
DWQ_BATCH = (2, 256)  # sequences x tokens per distillation step
DWQ_EPOCHS = 2  # passes over the batches: more fit the calibration tokens, not other text (bench/README.md)
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
    tokens = _batch_tokens(loaded, calibration)
    with tqdm(total=len(loaded.model.layers) + 1, unit="block", desc="GPTQ", disable=not progress) as bar:
        rounded = gptq_model(loaded.model, tokens, layers, dtype, progress=bar.update)
    del loaded
    mx.clear_cache()
    return rounded


def dwq_tensors(
    source: Source,
    layers: dict[str, LayerQuant | None],
    dtype: mx.Dtype,
    progress: bool = True,
    calibration: str = "prose",
) -> dict[str, Triplet]:
    """GPTQ's codes for the quantized `layers`, with scales and biases then distilled toward the float model's
    next-token distributions (quantize/distill.py)."""
    from mlxinfer.quantize.calibrate import gptq_model
    from mlxinfer.quantize.distill import distill_model, teacher_targets

    if not any(layers.values()):  # every layer kept as the source holds it (a GGUF's own codes): nothing to train
        return {}
    loaded = _load(source)
    rows, length = DWQ_BATCH
    ids = calibration_ids(loaded, calibration, DWQ_TOKENS)
    sequences = mx.array(ids[: len(ids) // length * length]).reshape(-1, length)
    batches = [sequences[i : i + rows] for i in range(0, sequences.shape[0], rows)]
    targets = teacher_targets(loaded.model, batches)  # before GPTQ changes the weights in place
    mx.clear_cache()  # the teacher's logits buffers (569 MiB for SmolLM2 on mixed calibration): GPTQ's numpy copies
    # would come on top of them in the process's memory
    gptq_rows = sequences[:: max(1, len(sequences) // GPTQ_BATCH[0])][: GPTQ_BATCH[0]]  # across the prose and samples
    steps = len(batches) * DWQ_EPOCHS
    with tqdm(total=len(loaded.model.layers) + 1 + steps, unit="step", desc="DWQ", disable=not progress) as bar:
        start = gptq_model(loaded.model, gptq_rows, layers, dtype, progress=bar.update)
        distilled = distill_model(
            loaded.model, batches, targets, layers, dtype, start, DWQ_EPOCHS, progress=lambda loss: bar.update()
        )
    del loaded
    mx.clear_cache()
    return distilled


def awq_tensors(
    source: Source,
    layers: dict[str, LayerQuant | None],
    dtype: mx.Dtype,
    progress: bool = True,
    calibration: str = "prose",
) -> dict[str, mx.array]:
    """{tensor name: float value} of every tensor activation-aware scaling changed (quantize/awq.py): the layers
    it scaled and the norms or layers it divided; the writer rounds them to nearest as any other."""
    from mlxinfer.quantize.awq import awq_model

    if not any(layers.values()):
        return {}
    loaded = _load(source)
    tokens = _batch_tokens(loaded, calibration)
    with tqdm(total=len(loaded.model.layers), unit="block", desc="AWQ", disable=not progress) as bar:
        changed = awq_model(loaded.model, tokens, layers, progress=bar.update)
    del loaded
    mx.clear_cache()
    return changed


def dwq_peak_bytes(params: int, vocab: int, compute_size: int, copies: int = 2) -> int:
    """What a distillation step holds at its peak beside the runtime: the model in its compute dtype `copies` times
    (twice as measured on mixed calibration and from a GGUF's blocks made dense) and a batch's logits in float32
    twice (the student's and their gradient; the teacher's are kept as its top TOP_K only). Measured: bench/README.md,
    "Calibrated converter peaks"."""
    rows, length = DWQ_BATCH
    return copies * params * compute_size + 2 * rows * length * vocab * 4


def _batch_tokens(loaded: LoadedModel, calibration: str) -> mx.array:
    """GPTQ_BATCH's (sequences, tokens) of calibration ids, fewer sequences when the text runs out: what GPTQ and
    AWQ record their layers' inputs on."""
    batch, length = GPTQ_BATCH
    ids = calibration_ids(loaded, calibration, batch * length)
    batch = max(1, min(batch, len(ids) // length))
    return mx.array(ids[: batch * length]).reshape(batch, -1)


def _load(source: Source) -> LoadedModel:
    """The source model with every layer float, in the compute dtype, on any device: calibrated methods read and
    replace float weights, so a GGUF's blocks are made dense (the CPU's own choice might keep some packed)."""
    loaded = load_model(source_path(source), cpu_weights="quantized")
    layers = quantized_layers(loaded.model)
    if layers:
        dequantize(loaded.model, layers, loaded.compute_dtype)
    # `convert --adapter`: the fine-tune is the source
    fuse_loaded(loaded.model, source, loaded.compute_dtype, loaded.config)
    return loaded


def calibration_ids(loaded: LoadedModel, calibration: str, tokens: int) -> list[int]:
    """`tokens` calibration token ids: the prose (fewer if it runs out), or (mixed) up to half of them from the
    prose and the model's own samples from SELF_PROMPTS after it."""
    assert loaded.tokenizer is not None
    prose = loaded.tokenizer.encode(calibration_text(), add_special_tokens=False)
    if calibration == "prose":
        return prose[:tokens]
    kept = prose[: tokens // 2]  # at most half; the model's own samples fill the rest
    return kept + _own_samples(loaded, tokens - len(kept))


def _own_samples(loaded: LoadedModel, tokens: int) -> list[int]:
    """About `tokens` ids of the model's own text: each seed prompt and what the model writes after it (sampled at
    temperature 0.8 with a fixed seed: reproducible, and not the one most likely path), all seeds decoding in one
    batch (the engine's loop, one sampler per row: the same text as one at a time, several times sooner)."""
    from mlxinfer.api import Model
    from mlxinfer.engine import BatchLoop, Job, SamplingParams, SchedulerConfig

    model = Model(loaded, prefix_cache_bytes=0, speculate="off", persist_prefixes=False)  # no prefix store on disk
    per = -(-tokens // len(SELF_PROMPTS))
    starts = [_seed_ids(model, prompt) for prompt in SELF_PROMPTS]
    made: list[list[int]] = [[] for _ in starts]
    loop = BatchLoop(model.runtime, SchedulerConfig(max_batch=len(starts)), log_failures=False)
    for start, out in zip(starts, made):
        sampling = SamplingParams(temperature=0.8, seed=SELF_SEED)
        limit = max(1, per - len(start))
        loop.add(Job(start, on_event=_recorder(out), max_tokens=limit, sampling=sampling, use_cache=False))
    while loop.has_work():
        loop.turn()
    ids: list[int] = []
    for start, out in zip(starts, made):
        ids += (start + out)[:per]
    del loop, model
    mx.clear_cache()  # the decode's freed buffers (480 MiB for SmolLM2), before the next step allocates its own
    return ids[:tokens]


def _seed_ids(model: Any, prompt: str | list[dict[str, str]]) -> list[int]:
    """A seed's ids: a chat seed through the model's template, or, for a model without one (a base model), its
    message text as plain text."""
    if isinstance(prompt, str):
        return model.encode_prompt(prompt, chat=False)
    if model.tokenizer.chat_template:
        return model.encode_prompt(prompt, chat=True)
    return model.encode_prompt("\n".join(message["content"] for message in prompt), chat=False)


def _recorder(out: list[int]) -> Callable[[Any], None]:
    """A job's event handler that keeps the tokens it decodes."""
    from mlxinfer.engine import Delta

    def record(event: Any) -> None:
        if isinstance(event, Delta) and event.token is not None:
            out.append(event.token)

    return record
