"""The conversion: validate, plan, stream tensors through the recipe, write, evaluate.

plan = plan_conversion("SmolLM2-135M", "SmolLM2-4bit", ConvertSettings(bits=4))
print(plan.summary())            # expected size and peak memory, before any work
result = run_conversion(plan)    # atomic: OUT appears only when everything succeeded
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from gguf import GGMLQuantizationType
from mlx.utils import tree_flatten
from mlxinfer.quantize import LayerQuant, QualityReport, make_recipe
from mlxinfer.quantize.affine import bits_per_weight, quantize_rows
from mlxinfer.quantize.recipes import uniform
from tqdm.auto import tqdm

from mlxinfer.disk import file_size_errors
from mlxinfer.errors import ConversionError
from mlxinfer.formats.gguf_file import AFFINE
from mlxinfer.memory import peak_rss_bytes
from mlxinfer.models.config import ModelConfig, normalize_config
from mlxinfer.models.decoder import build_model
from mlxinfer.models.dtype import choose_compute_dtype, parse_dtype
from mlxinfer.models.quantized import FLOAT_FORMATS
from mlxinfer.models.sizing import check_checkpoint
from mlxinfer.untrusted import first_line, shown_path

from .adapted_source import AdaptedSource
from .calibration import (
    CALIBRATIONS,
    awq_tensors,
    dwq_peak_bytes,
    dwq_tensors,
    gptq_tensors,
    sensitivity_layers,
    source_path,
)
from .default_recipe import LEARNED_BPW, why_not_learned
from .default_recipe import choose as choose_default
from .evaluation import evaluate, evaluation_bytes, evaluation_fits
from .layer_bytes import MXFP4Quant, copied, stream_peak_bytes, written_bytes
from .layout import Sanitize, converted_tensors, output_shapes
from .mlx_lm_rules import apply_quant_predicate, mlx_lm_predicates, routers_at_8_bits
from .output_config import output_config
from .output_folder import AtomicFolder, check_apart, check_output, check_space, write_manifest
from .sources import Quantized, Source, open_source
from .vision_half import image_half, text_prefix, vision_bytes, vision_names, wrapped, write_vision
from .writer import (
    DEFAULT_SHARD_BYTES,
    ShardWriter,
    check_tokenizer_files,
    header_bound,
    os_error,
    write_json,
)

log = logging.getLogger(__name__)

# GGUF types the loader keeps on an MLX affine grid, by name -> (bits, group size): their own codes (Q4_0 to Q8_0,
# Q4_K, Q5_K) or rounded once more (formats/gguf_requant.py).
BLOCK_GRIDS = {GGMLQuantizationType(kind).name: grid for kind, grid in AFFINE.items()}
METHODS = ("rtn", "gptq", "awq", "dwq")
CALIBRATED = ("gptq", "awq", "dwq")  # methods that run the source model on calibration text
RUNTIME_BYTES = 200 * 2**20  # Python, MLX, the tokenizer and what the steps before left allocated


@dataclass
class ConvertSettings:
    """What the output should be. bits None: 4, or the float format's own; group_size None: the format's own, 32
    for GGUF block-quantized sources, else 64."""

    bits: int | None = None
    group_size: int | None = None
    mode: str = "affine"  # or an MLX float format: mxfp4, nvfp4, mxfp8 (every quantized layer alike, to nearest)
    recipe: str | None = None
    bpw: float | None = None
    method: str | None = None  # "rtn" (round to nearest), "gptq", "awq" or "dwq"; None: gptq for sensitivity
    # What GPTQ, AWQ, DWQ and the sensitivity recipe run the source on: "prose" or "mixed"; None: mixed for the learned
    # default (no recipe flag given), else prose.
    calibration: str | None = None
    dtype: str | None = None  # None: the source's 16-bit float type (bfloat16 for float32 sources)
    evaluate: bool = True
    eval_tokens: int = 512
    shard_bytes: int = DEFAULT_SHARD_BYTES
    adapter: str | None = None  # a LoRA or DoRA folder merged into the float weights before quantizing


@dataclass
class ConversionPlan:
    """Everything decided before the first byte is written."""

    source: Source
    out: Path
    settings: ConvertSettings
    config: ModelConfig
    layers: dict[str, LayerQuant | None]  # quantizable module path -> its quantization
    names: list[str]  # source tensors to read, in order
    dtype: mx.Dtype
    output_bytes: int
    peak_bytes: int  # the most the process will hold, over every step that runs
    params: int
    force: bool = False  # replace an existing OUT (only an empty folder or an earlier conversion)
    no_eval_peak_bytes: int | None = None  # the same without the quality report; None: peak_bytes
    # Output tensors (the runtime's layout) and their shapes; None: the source's names and shapes.
    shapes: dict[str, tuple[int, ...]] | None = None
    sanitize: Sanitize | None = None  # the source layout -> the runtime's (the loader's model.mlx_sanitize)
    uncast: frozenset[str] = frozenset()  # float tensors kept in their stored type (mlx-lm's cast_predicate)
    default_note: str | None = None  # no recipe flag given: what the default chose, and why
    learned_possible: bool = False  # the learned 4-bit default could run on this source and machine

    def summary(self) -> str:
        quantized = sum(q is not None for q in self.layers.values())
        mode = "" if self.settings.mode == "affine" else f" {self.settings.mode}"
        what = f"{self.settings.bits}-bit{mode} {self.settings.method}" if self.settings.bits != 16 else "unquantized"
        peak = f"expected peak memory {self.peak_bytes / 2**20:.0f} MiB"
        no_eval = self.peak_bytes if self.no_eval_peak_bytes is None else self.no_eval_peak_bytes
        if self.settings.evaluate and no_eval < self.peak_bytes:
            peak += f" ({no_eval / 2**20:.0f} MiB with --no-eval)"
        if self.default_note:
            what += f" ({self.default_note})"
        return (
            f"{self.source.description} -> {self.out}: {what}, {quantized} quantized layers; "
            f"expected output {self.output_bytes / 2**20:.0f} MiB, {peak}"
        )


@dataclass
class ConversionResult:
    out: Path
    files: list[str]
    output_bytes: int
    seconds: float
    peak_rss_bytes: int
    bits_per_weight: float
    quality: QualityReport | None = None
    manifest: dict[str, Any] = field(default_factory=dict)

    @property
    def warning(self) -> str | None:
        """The quality report's warning: the output answers noticeably worse than its source."""
        return self.quality.warning if self.quality else None

    def summary(self) -> str:
        quality = f"; {self.quality.summary()}" if self.quality else ""
        return (
            f"wrote {self.out} ({self.output_bytes / 2**20:.0f} MiB, {self.bits_per_weight:.2f} bits/weight) "
            f"in {self.seconds:.1f} s, peak memory {self.peak_rss_bytes / 2**20:.0f} MiB{quality}"
        )

    def _repr_html_(self) -> str:
        quality = self.quality._repr_html_() if self.quality else ""
        return f"<p>{self.summary()}</p>{quality}"


def convert(src: str | Path, out: str | Path, force: bool = False, progress: bool = True, **settings: Any):
    """Convert SRC (folder, .gguf or Hub id) into an MLX model folder OUT.

    Example:
        >>> from mlxinfer.convert import convert
        >>> convert("SmolLM2-135M-Instruct", "SmolLM2-4bit", bits=4, group_size=64).quality.summary()
    """
    plan = plan_conversion(src, out, ConvertSettings(**settings), force=force, progress=progress)
    return run_conversion(plan, progress=progress)


def plan_conversion(
    src: str | Path, out: str | Path, settings: ConvertSettings, force: bool = False, progress: bool = True
):
    """Open and validate the source and decide every layer's format; writes nothing.

    The sensitivity recipe measures the source here (`progress` shows that)."""
    src_path = Path(src).expanduser()
    out = check_output(out, force, [src_path] if os.path.lexists(src_path) else [])
    source = open_source(src)
    try:
        source = AdaptedSource(source, settings.adapter) if settings.adapter is not None else source
        check_apart(source_path(source), out)  # a Hub id's files are found only once it is opened
        plan = _plan(source, out, settings, progress)
    except BaseException:
        source.close()
        raise
    plan.force = force
    return plan


def _plan(source: Source, out: Path, settings: ConvertSettings, progress: bool) -> ConversionPlan:
    config = normalize_config(source.config, source=f"{source.description} config")
    check_checkpoint(config, {n: t.shape for n, t in source.tensors.items()}, source.description)  # before building
    if isinstance(getattr(source, "folder", None), Path):
        check_tokenizer_files(source.folder)  # not after the weights are written
    model = build_model(config)  # parameters stay lazy: only shapes are used
    names = _source_names(source, config)
    # The loader's own conversion into the modules' layout, for families whose checkpoints need one
    # (a GGUF source is read in that layout already).
    in_layout = getattr(source, "in_runtime_layout", False)
    sanitize = model.mlx_sanitize if config.spec.mlx_sanitize and not in_layout else None
    shapes = _check_tensors(source, model, output_shapes(source, names, sanitize))
    moe = any(len(shape) == 3 for name, shape in shapes.items() if name.endswith(".weight"))
    block_quantized = any(t.dtype in BLOCK_GRIDS or t.dtype == "MXFP4" for t in source.tensors.values())
    params = sum(math.prod(shape) for shape in shapes.values())
    matrices = [name.removesuffix(".weight") for name in shapes if name.endswith(".weight")]
    learned_bytes = int(params * LEARNED_BPW / 8)
    learned = ConvertSettings(method="dwq", calibration="mixed")
    learned_peak = _calibrated_peak(source, shapes, params, learned_bytes, learned, True, matrices, config)
    default = choose_default(settings, config, params, moe, block_quantized, learned_peak, source.description)
    settings.calibration = settings.calibration or "prose"
    _resolve_mode(settings, moe)
    if settings.group_size is None:
        settings.group_size = 32 if block_quantized else 64
    if settings.mode == "affine":
        recipe = make_recipe(settings.recipe, settings.bits, settings.group_size, settings.bpw)
    else:  # the format fixes bits and group (nvfp4's 16 is no affine group size)
        recipe = uniform(settings.bits, settings.group_size)
    quant_predicate, cast_predicate = mlx_lm_predicates(config)
    modules = _quantizable_modules(model, shapes)
    layers = {path: (recipe(path, shapes[f"{path}.weight"]) if recipe else None) for path in modules}
    sensitivity = settings.recipe == "sensitivity" or (settings.recipe is None and settings.bpw is not None)
    settings.method = _method(settings, sensitivity)
    if settings.calibration not in CALIBRATIONS:
        raise ConversionError(f"--calibration {settings.calibration!r} is not one of {', '.join(CALIBRATIONS)}")
    if settings.calibration != "prose" and not (sensitivity or settings.method in CALIBRATED or default):
        raise ConversionError(
            "--calibration matters only to --method gptq, awq or dwq and --recipe sensitivity; add one, or drop it"
        )
    _check_calibration(config, shapes, sensitivity, settings.method)
    if sensitivity:
        layers = sensitivity_layers(source, settings.bpw, settings.group_size, layers, progress, settings.calibration)
    layers = apply_quant_predicate(layers, modules, shapes, quant_predicate)  # routers at 8 bits, as mlx-lm
    layers = routers_at_8_bits(layers, shapes, moe)
    if settings.mode == "affine":
        layers = _keep_finer_blocks(source, layers)
    else:  # a float format holds every quantized layer alike
        layers = {
            path: quant and LayerQuant(settings.bits, settings.group_size, settings.mode)
            for path, quant in layers.items()
        }
    layers = _keep_mxfp4(source, layers)
    dtype = parse_dtype(settings.dtype) if settings.dtype else _default_dtype(source)
    output_bytes = vision_bytes(source, dtype) + sum(
        written_bytes(shape, layers.get(n.removesuffix(".weight")), dtype) for n, shape in shapes.items()
    )
    peak = stream_peak_bytes(source, shapes, layers, dtype, BLOCK_GRIDS)
    if sensitivity or settings.method in CALIBRATED:
        rounded = [path for path, quant in _calibrated_layers(source, layers).items() if quant]
        peak = max(peak, _calibrated_peak(source, shapes, params, output_bytes, settings, sensitivity, rounded, config))
    evaluation = evaluation_bytes(source, config, layers, names, settings.eval_tokens, shapes, dtype)
    if settings.evaluate:
        settings.evaluate = evaluation_fits(source, evaluation)
    no_eval_peak = peak
    if settings.evaluate:  # the steps run one after another: the process peaks in the larger one
        peak = max(peak, RUNTIME_BYTES + evaluation)
    uncast = frozenset(n for n in shapes if cast_predicate is not None and not cast_predicate(n))
    return ConversionPlan(
        source, out, settings, config, layers, names, dtype, output_bytes, peak, params,
        no_eval_peak_bytes=no_eval_peak, shapes=shapes, sanitize=sanitize, uncast=uncast,
        default_note=default and default.note,
        learned_possible=why_not_learned(config, moe, block_quantized, learned_peak, source.description) is None,
    )  # fmt: skip


def _calibrated_peak(
    source: Source,
    shapes: dict[str, tuple[int, ...]],
    params: int,
    output_bytes: int,
    settings: ConvertSettings,
    sensitivity: bool,
    rounded: list[str],
    config: ModelConfig,
) -> int:
    """What the steps that run the source model peak at: the whole model in its compute dtype (for DWQ, most often
    twice) and the larger of two transients: the output beside working
    copies of the largest tensor a step rounds (GPTQ's float32 weight, codes, rounded values and errors in numpy:
    16 bytes a value; the sensitivity measurement's rounded copies: 12; AWQ works a layer group at a time), or,
    loading a GGUF's quantized blocks as dense CPU weights, two float copies of its largest tensor. Distillation's
    step can outgrow all that (a large vocabulary's logits). Measured in bench/README.md, "Calibrated converter
    peaks"."""
    compute = choose_compute_dtype(None)
    fixed = RUNTIME_BYTES  # a GGUF's mapped pages: read by the loader, not resident past it (measured)
    blocks = any(t.dtype in BLOCK_GRIDS for t in source.tensors.values())
    # DWQ held the model twice over in two measured cases: from a GGUF's blocks made dense, and on mixed
    # calibration (8 batches against the prose's 3); once from prose-calibrated checkpoints of any dtype.
    method = settings.method
    copies = 2 if method == "dwq" and (blocks or settings.calibration == "mixed") else 1
    largest = max((math.prod(shapes[f"{path}.weight"]) for path in rounded), default=0)
    working = max(16 if method in ("gptq", "dwq") else 0, 12 if sensitivity else 0) * largest + output_bytes
    loading = 2 * compute.size * max(map(math.prod, shapes.values())) if blocks else 0
    peak = fixed + copies * params * compute.size + max(working, loading)
    if method == "dwq":
        peak = max(peak, fixed + dwq_peak_bytes(params, config.vocab_size, compute.size, copies))
    return peak


def _quantizable_modules(model: nn.Module, shapes: dict[str, tuple[int, ...]]) -> dict[str, nn.Module]:
    """{path: module} of every module the loader can quantize: matrices, embeddings and mlx-lm's per-expert
    SwitchLinear (the modules with `to_quantized`, as loader.quantize_like and mlx-lm's converter)."""
    return {
        path: module
        for path, module in model.named_modules()
        if hasattr(module, "to_quantized") and f"{path}.weight" in shapes
    }


def _check_calibration(config: ModelConfig, shapes: dict[str, tuple[int, ...]], sensitivity: bool, method: str) -> None:
    """Refuse what calibration cannot do: run recurrent layers (it runs each block on a batch without their
    state), and GPTQ-round experts (it rounds plain matrices; experts would silently stay round-to-nearest)."""
    flag = "--recipe sensitivity" if sensitivity else f"--method {method}" if method in CALIBRATED else None
    if flag and (config.spec.recurrent_kinds or not config.verified):
        why = "recurrent layers" if config.verified else "unverified: mlx-lm's model code runs it"
        raise ConversionError(
            f"{flag} is not supported for model_type {config.model_type!r} ({why}) yet; "
            "use round-to-nearest: --bits 4 or 8 without --recipe, --bpw or --method"
        )
    if method in CALIBRATED and any(len(shape) == 3 for name, shape in shapes.items() if name.endswith(".weight")):
        default = " (the default with --recipe sensitivity)" if sensitivity and method == "gptq" else ""
        raise ConversionError(
            f"--method {method}{default} cannot round the experts of model_type {config.model_type!r} yet; "
            "add --method rtn (round-to-nearest)"
        )


def _resolve_mode(settings: ConvertSettings, moe: bool) -> None:
    """Settle bits (and, for a float format, the group size) from --mode; refuse what a float format cannot do."""
    if settings.mode == "affine":
        settings.bits = 4 if settings.bits is None else settings.bits
        return
    grids = {mode: grid for grid, mode in FLOAT_FORMATS.items()}
    if settings.mode not in grids:
        raise ConversionError(f"--mode {settings.mode!r} is not one of affine, {', '.join(grids)}")
    bits, group = grids[settings.mode]
    if settings.bits not in (None, bits) or settings.group_size not in (None, group):
        raise ConversionError(
            f"--mode {settings.mode} is {bits}-bit in groups of {group}; drop --bits and --group-size"
        )
    if settings.recipe not in (None, "uniform") or settings.bpw is not None or settings.method in CALIBRATED:
        raise ConversionError(
            f"--mode {settings.mode} rounds every layer to nearest alike; drop --recipe, --bpw and --method"
        )
    if moe:
        raise ConversionError(f"--mode {settings.mode} is not supported for mixture-of-experts models yet; use affine")
    settings.bits, settings.group_size = bits, group


def _method(settings: ConvertSettings, sensitivity: bool) -> str:
    method = settings.method or ("gptq" if sensitivity else "rtn")
    if method not in METHODS:
        raise ConversionError(f"--method {method!r} is not one of {', '.join(METHODS)}")
    if method in CALIBRATED and settings.bits == 16:
        raise ConversionError(f"--method {method} rounds quantized weights; pick --bits 4 or 8, or drop --method")
    return method


def _source_names(source: Source, config: ModelConfig) -> list[str]:
    """The source tensors to convert: all but precomputed rotary tables and a tied head (as the loader)."""

    def kept(name: str) -> bool:
        tied_head = config.tie_word_embeddings and name == "lm_head.weight"
        return not (tied_head or name.endswith("rotary_emb.inv_freq"))

    return sorted(n for n in source.tensors if kept(n))


def _check_tensors(source: Source, model: nn.Module, given: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """`given` (the output's tensors and shapes), once they are exactly the model's parameters."""
    expected = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    missing = sorted(set(expected) - set(given))
    unexpected = sorted(set(given) - set(expected))
    wrong = sorted(f"{n} {given[n]} != {expected[n]}" for n in set(given) & set(expected) if given[n] != expected[n])
    groups = (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong))
    problems = [f"{label}: {', '.join(items)}" for label, items in groups if items]
    if problems:
        raise ConversionError(f"{source.description}: tensors do not match config.json; " + "; ".join(problems))
    return given


def _calibrated_layers(source: Source, layers: dict[str, LayerQuant | None]) -> dict[str, LayerQuant | None]:
    """`layers` less those a calibrated method leaves alone: a GGUF block copied onto the same grid is already as
    rounded as it will be."""

    def copies(path: str) -> bool:
        stored = _source_dtype(source, path)
        return copied(layers[path], stored, BLOCK_GRIDS.get(stored))

    return {path: quant for path, quant in layers.items() if not copies(path)}


def _keep_finer_blocks(source: Source, layers: dict[str, LayerQuant | None]) -> dict[str, LayerQuant | None]:
    # A GGUF tensor already quantized on a grid at least as fine as the target
    # (Q8_0 embeddings in a Q4_1 file, say) is kept as it is: re-rounding it to
    # fewer bits would throw away what the GGUF's own quantizer chose to keep.
    kept = dict(layers)
    for path, quant in layers.items():
        bits, group = BLOCK_GRIDS.get(_source_dtype(source, path), (0, 0))
        if quant is not None and bits >= quant.bits and group == quant.group_size:
            kept[path] = LayerQuant(bits, group)
    return kept


def _keep_mxfp4(source: Source, layers: dict[str, LayerQuant | None]) -> dict[str, LayerQuant | None]:
    """MXFP4 layers stay mxfp4 where the plan quantizes them to 4 bits or fewer (more bits: rounded afresh
    from their exact values, as is an unquantized output)."""
    kept = dict(layers)
    for path, quant in layers.items():
        if quant is not None and quant.bits <= 4 and _source_dtype(source, path) == "MXFP4":
            kept[path] = MXFP4Quant()
    return kept


def _source_dtype(source: Source, path: str) -> str:
    return getattr(source.tensors.get(f"{path}.weight"), "dtype", "")


def _default_dtype(source: Source) -> mx.Dtype:
    # GGUF scales are float16, so a GGUF source stays in float16; safetensors keep their 16-bit type.
    kinds = {t.dtype for t in source.tensors.values()}
    if kinds & set(BLOCK_GRIDS) or ("F16" in kinds and "BF16" not in kinds):
        return mx.float16
    return mx.bfloat16


def run_conversion(plan: ConversionPlan, progress: bool = True) -> ConversionResult:
    """Write the output folder atomically; evaluate it unless settings.evaluate is False."""
    start = time.perf_counter()
    try:
        with file_size_errors():
            files, bpw, quality, manifest = _write_output(plan, progress)
    finally:
        plan.source.close()
    size = sum((plan.out / f).stat().st_size for f in files)
    return ConversionResult(
        plan.out, files, size, time.perf_counter() - start, peak_rss_bytes(), bpw, quality, manifest
    )


def _write_output(plan: ConversionPlan, progress: bool) -> tuple[list[str], float, QualityReport | None, dict]:
    folder = AtomicFolder(plan.out, force=plan.force)
    try:
        check_space(folder.path, plan.output_bytes)
        rounded = {}
        if plan.settings.method in CALIBRATED:
            calibrated = {"gptq": gptq_tensors, "awq": awq_tensors, "dwq": dwq_tensors}[plan.settings.method]
            layers = _calibrated_layers(plan.source, plan.layers)
            rounded = calibrated(plan.source, layers, plan.dtype, progress, plan.settings.calibration)
        files, data_bytes = _write_tensors(plan, folder.path, progress, rounded)
        plan.source.write_side_files(folder.path)
        config = wrapped(
            plan.source, output_config(plan.source.config, plan.config, plan.layers, plan.settings, plan.dtype)
        )
        write_json(folder.path / "config.json", config)
        plan.source.close()  # read to the end: its mapped pages must not count against the quality report
        bpw = 8 * data_bytes / plan.params
        quality = _evaluate_or_warn(plan, folder.path, bpw, progress) if plan.settings.evaluate else None
        adapter = plan.source.identity() if isinstance(plan.source, AdaptedSource) else None
        manifest = write_manifest(folder.path, plan.source.description, asdict(plan.settings), bpw, quality,
                                  image_half(plan.source, plan.dtype), adapter)  # fmt: skip
        folder.commit()
    except OSError as e:  # one the writer did not already name (reading back our own files, say)
        folder.abort()
        raise os_error(e, e.filename or plan.out) from e
    except BaseException:
        folder.abort()
        raise
    return files, bpw, quality, manifest


def _write_tensors(plan: ConversionPlan, folder: Path, progress: bool, rounded: dict) -> tuple[list[str], int]:
    shapes = plan.shapes or {n: plan.source.tensors[n].shape for n in plan.names}
    writer = ShardWriter(folder, plan.settings.shard_bytes, header_bound(_written_names(plan, shapes)))
    try:
        with tqdm(total=plan.params, unit="", unit_scale=True, desc="converting weights", disable=not progress) as bar:
            for name, value in converted_tensors(plan.source, plan.names, plan.sanitize):
                for out_name, array in _encode(plan, name, value, rounded):
                    writer.add(text_prefix(plan.source) + out_name, array)
                del value  # evaluated, its bytes (or, lazy, the tensors it was made of) are not needed again
                bar.update(math.prod(shapes[name]))
                bar.set_postfix_str(name, refresh=False)
        if rounded:  # a calibrated tensor no output tensor took: the output would not be what was fitted
            raise ConversionError(f"{shown_path(plan.out)}: calibrated tensors never written: {', '.join(rounded)}")
        vision = write_vision(plan.source, writer, plan.dtype)  # not counted in the language model's bits per weight
        return writer.finish(), writer.total_bytes - vision
    except BaseException:
        writer.abandon()
        raise


def _written_names(plan: ConversionPlan, shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """{name: dimensions} of every tensor `_encode` may write: a quantized layer's scales and biases too."""
    names = {}
    for name, shape in shapes.items():
        names[name] = len(shape)
        path = name.removesuffix(".weight")
        stored = getattr(plan.source.tensors.get(name), "dtype", "")
        if name.endswith(".weight") and (plan.layers.get(path) or stored in BLOCK_GRIDS or stored == "MXFP4"):
            names |= {f"{path}.scales": len(shape), f"{path}.biases": len(shape)}
    return {text_prefix(plan.source) + n: d for n, d in names.items()} | vision_names(plan.source)


def _encode(plan: ConversionPlan, name: str, value: mx.array | Quantized, rounded: dict):
    """The tensors written for output tensor `name`: itself, or its packed weight, scales and biases. `rounded`
    holds what a calibrated method made: a layer's (packed, scales, biases) under its path, or a tensor's new
    float value (AWQ's scaled weights and norms) under its name."""
    if name in rounded:
        value = rounded.pop(name)
    path = name.removesuffix(".weight")
    quant = plan.layers.get(path) if name.endswith(".weight") else None
    if quant is not None and path in rounded:
        packed, scales, biases = rounded.pop(path)
        return [(name, packed), (f"{path}.scales", scales), (f"{path}.biases", biases)]
    if isinstance(value, Quantized):
        if quant is not None and _same_format(quant, value):
            # Same grid as the source (GGUF Q4_1 or Q4_K -> 4-bit group 32, MXFP4 -> mxfp4): copy the codes, never
            # round them twice. Float scales and biases take the output's dtype, as every other layer's (Q4_K's
            # float32 d*sc rounds there); mxfp4's uint8 exponents stay.
            kept = [(name, value.weight), (f"{path}.scales", _as_output(value.scales, plan.dtype))]
            return kept if value.biases is None else [*kept, (f"{path}.biases", value.biases.astype(plan.dtype))]
        if quant is None:
            value = value.rows(0, math.prod(value.shape[:-1])).reshape(value.shape)
    if quant is None:
        cast = mx.issubdtype(value.dtype, mx.floating) and name not in plan.uncast
        return [(name, value.astype(plan.dtype) if cast else value)]
    if isinstance(value, Quantized):  # rounded afresh
        packed, scales, biases = value.rounded(quant.bits, quant.group_size, plan.dtype, quant.mode)
    else:
        packed, scales, biases = quantize_rows(value, quant.bits, quant.group_size, plan.dtype, quant.mode)
    written = [(name, packed), (f"{path}.scales", scales)]
    return written if biases is None else [*written, (f"{path}.biases", biases)]


def _as_output(scales: mx.array, dtype: mx.Dtype) -> mx.array:
    return scales.astype(dtype) if mx.issubdtype(scales.dtype, mx.floating) else scales


def _same_format(quant: LayerQuant, value: Quantized) -> bool:
    return (quant.bits, quant.group_size, quant.mode) == (value.bits, value.group_size, value.mode)


def _evaluate_or_warn(plan: ConversionPlan, folder: Path, bpw: float, progress: bool) -> QualityReport | None:
    """The quality report; a failed evaluation is a warning, never the loss of the finished output."""
    mx.clear_cache()  # the tensor stream's buffers: the report needs that memory for the models
    try:
        report = evaluate(plan.source, plan.settings.eval_tokens, folder, bpw, progress)
    except Exception as e:  # the output is complete: keep it, without a quality block
        log.warning("%s: skipping the quality report: evaluation failed (%s)", shown_path(plan.out), first_line(e))
        return None
    finally:
        mx.clear_cache()  # both models are gone; give their memory back (a notebook lives on)
    sensitivity = _sensitivity_flags(plan.config, plan.shapes or {})
    report.advice = _advice(plan.settings, sensitivity, plan.learned_possible)
    if report.warning:  # logged once, here: a script or notebook shows it as the CLI does
        log.warning("%s", report.warning)
    return report


def _sensitivity_flags(config: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> str | None:
    """The flags of a sensitivity-recipe rerun that _check_calibration lets through; None: none can run."""
    if config.spec.recurrent_kinds:
        return None
    experts = any(len(shape) == 3 for name, shape in shapes.items() if name.endswith(".weight"))
    return "--recipe sensitivity --method rtn" if experts else "--recipe sensitivity"


def _advice(
    settings: ConvertSettings, sensitivity: str | None = "--recipe sensitivity", learned: bool = False
) -> str | None:
    """What to convert with instead when the report warns: on SmolLM2-135M-Instruct the sensitivity
    recipe at a quarter bit over 4-bit (group size 64, 4.75 bits/weight) came within the limits, and
    8 bits matched the source (numbers in quality.py). A budget is named with its group size: a rerun
    without --group-size uses 64, where 4.5 bits/weight (a quarter bit over 4-bit at 128) is plain 4-bit.
    `sensitivity`: the flags of a sensitivity-recipe rerun the model allows (None: it allows none); `learned`: the
    learned 4-bit default could run here, which measures better still (convert/default_recipe.py)."""
    if settings.bits == 16:
        return None  # nothing was rounded
    uniform = settings.recipe in (None, "uniform") and settings.bpw is None
    flags = "" if uniform else " with no --recipe or --bpw"
    if learned and uniform and settings.bits == 4 and settings.method == "rtn" and settings.mode == "affine":
        return "try plain `--bits 4` without --method rtn (the learned default) or, safest, `--bits 8`"
    most = bits_per_weight(8, settings.group_size)
    if (uniform and settings.bits == 8) or (settings.bpw is not None and settings.bpw >= most):
        return f"try `--bits 16`{flags} (unquantized): every layer already has 8 bits"
    if settings.bpw is not None:
        return f"try a larger `--bpw` than {settings.bpw:g} (at most {most:g}), or, safest, `--bits 8`{flags}"
    if sensitivity is None:
        return f"try `--bits 8`{flags}"
    quarter_over = bits_per_weight(4, settings.group_size) + 0.25
    return (
        f"try `{sensitivity} --group-size {settings.group_size} --bpw {quarter_over:g}` "
        f"(more bits where they matter) or, safest, `--bits 8`{flags}"
    )
