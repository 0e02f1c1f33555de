"""The source's tensors in the layout the runtime's modules hold (mlx-lm's), converted group by group.

The loader turns a checkpoint into that layout with `model.mlx_sanitize` (models/decoder.py and the
families' adapters: conv weights transposed, per-expert matrices stacked, fused experts split, Qwen
norms + 1). The converter applies the same function, once, to the whole checkpoint's *lazy* arrays:
nothing is read then. Each output is evaluated on its own, which reads only the tensors it is made of
(one layer's experts, say), and handed over before the next: memory holds one group, not the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import mlx.core as mx

from mlxinfer.errors import ConversionError, MlxInferError
from mlxinfer.untrusted import first_line

from .sources import FLOAT_DTYPES, Quantized, Source

Sanitize = Callable[[dict[str, mx.array]], dict[str, mx.array]]


def output_shapes(source: Source, names: list[str], sanitize: Sanitize | None) -> dict[str, tuple[int, ...]]:
    """{output tensor name: shape}, in the order they will be written; reads no tensor.

    The conversion runs on lazy zeros of the source's shapes, which are never evaluated."""
    if sanitize is None:
        return {name: tuple(source.tensors[name].shape) for name in names}
    stand_ins = {
        n: mx.zeros(source.tensors[n].shape, FLOAT_DTYPES.get(source.tensors[n].dtype, mx.float32)) for n in names
    }
    return {name: tuple(value.shape) for name, value in _apply(sanitize, stand_ins, source).items()}


def converted_tensors(
    source: Source, names: list[str], sanitize: Sanitize | None
) -> Iterator[tuple[str, mx.array | Quantized]]:
    """(output name, value) for every output tensor, one at a time; a source that merges an adapter into the
    output layout (`convert --adapter`'s per-expert pairs) merges each as it passes.

    Drop each value once it is written: a lazy output still holds the tensors it is made of, and an
    evaluated one its bytes."""
    merged = getattr(source, "merged", lambda name, value: value)
    for name, value in _converted(source, names, sanitize):
        yield name, merged(name, value)
    if hasattr(source, "check_merged"):
        source.check_merged()


def _converted(
    source: Source, names: list[str], sanitize: Sanitize | None
) -> Iterator[tuple[str, mx.array | Quantized]]:
    if sanitize is None:
        for name in names:
            yield name, source.read(name)
        return
    if not getattr(source, "is_lazy", False):
        raise ConversionError(f"{source.description}: this model's layout conversion needs a safetensors folder")
    converted = _apply(sanitize, {n: source.read(n) for n in names}, source)  # lazy: nothing read yet
    # In the order the conversion made them: tensors cut from one source tensor (gate and up) come together.
    for name in list(converted):
        yield name, converted.pop(name)


def _apply(sanitize: Sanitize, weights: dict[str, mx.array], source: Source) -> dict[str, mx.array]:
    try:
        return sanitize(weights)
    except MlxInferError:
        raise
    except (KeyError, IndexError, ValueError) as e:  # mlx-lm's sanitize assumes a complete checkpoint
        raise ConversionError(
            f"{source.description}: cannot bring its tensors into the MLX layout ({type(e).__name__}: "
            f"{first_line(e)}); is a layer's tensor missing?"
        ) from e
