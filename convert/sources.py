"""What a conversion reads: a Hugging Face folder, a GGUF file, or a Hub id.

Every source offers the same small interface: a config.json-style dict, the
logical shape of each tensor (named as in Hugging Face checkpoints), `read(name)`
for one tensor at a time, and `write_side_files(folder)` (tokenizer, generation config, processor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType
from mlxinfer.quantize.affine import quantize_blocks

from mlxinfer.errors import ConversionError, UnsupportedModelError
from mlxinfer.formats.gguf_file import REPACKED, GGUFFile, QuantizedTensor
from mlxinfer.formats.recommended_sampling import GENERATION_CONFIG, from_gguf_metadata
from mlxinfer.models.checkpoint import PICKLE_SUFFIXES, Checkpoint, load_tensors, open_folder
from mlxinfer.models.gguf import from_llama_cpp, gguf_config, gguf_tensors, hf_names
from mlxinfer.models.multimodal import text_checkpoint, text_config
from mlxinfer.models.quantized import DEQUANTIZE_BLOCK_ELEMENTS, dequantize_blocks
from mlxinfer.tokenizer.gguf_vocab import backend_from_gguf, tokenizer_config_from_gguf
from mlxinfer.untrusted import listed

from .vision_half import PROCESSOR_FILES, VisionHalf
from .writer import TOKENIZER_FILES, copy_file, write_json, write_text

FLOAT_DTYPES = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}
PACKED_TYPES = {GGMLQuantizationType(t).name for t in REPACKED}  # GGUF types the loader keeps quantized


@dataclass(frozen=True)
class Tensor:
    shape: tuple[int, ...]  # logical shape (a quantized GGUF tensor reports its unpacked shape)
    dtype: str  # safetensors dtype name, or the GGUF type ("Q4_1", ...)
    nbytes: int


@dataclass(frozen=True)
class Quantized:
    """A tensor that arrives already quantized in an MLX format: affine, or mxfp4 (uint8 scales, no biases)."""

    weight: mx.array
    scales: mx.array
    biases: mx.array | None
    bits: int
    group_size: int
    mode: str = "affine"

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape: the packed weight's, its last axis unpacked."""
        return (*self.weight.shape[:-1], self.weight.shape[-1] * 32 // self.bits)

    def rows(self, start: int, stop: int) -> mx.array:
        """The float32 values of rows [start, stop) of it flattened to 2-D: a tensor rounded afresh is never
        dequantized whole (`rounded`)."""
        weight, scales, biases = (
            None if a is None else a.reshape(-1, a.shape[-1])[start:stop]
            for a in (self.weight, self.scales, self.biases)
        )
        return dequantize_blocks(weight, scales, biases, self.group_size, self.bits, self.mode)

    def rounded(self, bits: int, group_size: int, dtype: mx.Dtype, mode: str = "affine") -> tuple:
        """quantize_rows of the values it stands for, a block of rows dequantized at a time."""
        return quantize_blocks(self.shape, self.rows, bits, group_size, dtype, mode, DEQUANTIZE_BLOCK_ELEMENTS)


class Source(Protocol):
    description: str
    config: dict[str, Any]
    tensors: dict[str, Tensor]
    mapped_bytes: int  # file bytes mapped into the process and all touched by a conversion (a GGUF file's)

    def read(self, name: str) -> mx.array | Quantized: ...

    def write_side_files(self, folder: Path) -> None: ...

    def load_bytes(self, compute: mx.Dtype) -> tuple[int, int]: ...

    def close(self) -> None: ...


class FolderSource:
    """A local Hugging Face (or MLX) checkpoint folder."""

    mapped_bytes = 0  # each tensor is read into its own buffer

    is_lazy = True  # read() hands out mapped arrays: their bytes are read only when evaluated

    def __init__(self, folder: Path, description: str | None = None):
        # A vision-language checkpoint's image half is kept where mlxinfer reads the family's images
        # (convert/vision_half.py); otherwise it converts to its text model (the tower skipped, with one line).
        whole = open_folder(folder)
        self.vision = VisionHalf.of(whole)
        why = "the output holds the text model alone (convert keeps the image half where mlxinfer reads its images)"
        checkpoint: Checkpoint = text_checkpoint(whole, self.vision is not None, why)
        self.folder = folder
        self.description = description or str(folder)
        self.config = text_config(checkpoint.config, str(folder / "config.json"))
        if "quantization" in self.config:
            raise ConversionError(f"{folder}: already quantized (has a 'quantization' block); convert the original")
        self.tensors = {
            name: Tensor(info.shape, info.dtype, int(np.prod(info.shape)) * _itemsize(info.dtype))
            for name, info in checkpoint.tensors.items()
        }
        bad = sorted(f"{n} ({t.dtype})" for n, t in self.tensors.items() if t.dtype not in FLOAT_DTYPES)
        if bad:
            mxfp4 = " (MXFP4 experts: convert a bf16 copy or the GGUF)" if any("_blocks" in b for b in bad) else ""
            raise ConversionError(
                f"{folder}: {len(bad)} tensors of unsupported dtype (need F32, F16 or BF16){mxfp4}: {listed(bad, 4)}"
            )
        self._arrays = load_tensors(checkpoint)  # lazy: bytes are read per tensor

    def read(self, name: str) -> mx.array:
        # Handed over, not kept: once evaluated, a kept array would hold its bytes until the end.
        return self._arrays.pop(name)

    def write_side_files(self, folder: Path) -> None:
        for name in TOKENIZER_FILES + (PROCESSOR_FILES if self.vision is not None else ()):
            if (self.folder / name).is_file():
                copy_file(self.folder / name, folder / name)

    def load_bytes(self, compute: mx.Dtype) -> tuple[int, int]:
        """(bytes the runtime's loader holds once the model is loaded in `compute`, bytes of the
        stored tensors it holds on top while it casts them)."""
        loaded = sum(math.prod(t.shape) for t in self.tensors.values()) * compute.size
        return loaded, _cast_bytes(self.tensors, compute)

    def close(self) -> None:
        self._arrays.clear()


class GGUFSource:
    """A GGUF file (the architectures models/gguf_arch.py reads); Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 arrive quantized (group
    size 32, float16 scales), Q4_K/Q5_K too (4/5 bits, float32 scales: d*sc exactly), MXFP4 as MLX mxfp4."""

    # gguf_arch.py names every tensor as the runtime's (mlx-lm's) modules hold it: no layout conversion to run.
    in_runtime_layout = True

    def __init__(self, path: Path):
        self.description = str(path)
        self._file = GGUFFile(path)
        self.mapped_bytes = path.stat().st_size  # read through one map: every page ends up resident
        self.config = gguf_config(self._file)
        self._names = hf_names(self._file)  # refuses two tensors that map to one name
        self.tensors = {
            hf: Tensor(info.shape, GGMLQuantizationType(info.ggml_type).name, info.nbytes)
            for hf, info in ((hf, self._file.tensors[name]) for hf, name in self._names.items())
        }

    def read(self, name: str) -> mx.array | Quantized:
        value = from_llama_cpp(name, self._file.read(self._names[name]), self.config)
        if isinstance(value, QuantizedTensor):
            biases = None if value.biases is None else mx.array(value.biases)
            weight, scales = mx.array(value.weight), mx.array(value.scales)
            return Quantized(weight, scales, biases, value.bits, value.group_size, value.mode)
        array = mx.array(value)
        return array.view(mx.bfloat16) if value.dtype == np.uint16 else array

    def write_side_files(self, folder: Path) -> None:
        metadata = self._file.metadata
        write_text(folder / "tokenizer.json", backend_from_gguf(metadata).to_str())
        write_json(folder / "tokenizer_config.json", tokenizer_config_from_gguf(metadata))
        sampling = from_gguf_metadata(metadata, f"{self.description}: GGUF metadata").values
        if sampling:  # the sampling the file recommends, kept in the form the loader reads from a folder
            sampled = {"do_sample": sampling["temperature"] > 0} if "temperature" in sampling else {}
            write_json(folder / GENERATION_CONFIG, {**sampled, **sampling})

    def load_bytes(self, compute: mx.Dtype) -> tuple[int, int]:
        """As FolderSource.load_bytes; the REPACKED types (gguf_file.py) stay packed, as the loader keeps them."""
        loaded = sum(t.loaded_bytes for t in gguf_tensors(self._file, compute.size).values())
        return loaded, _cast_bytes(self.tensors, compute)

    def close(self) -> None:
        self._file.close()  # safe twice: the file and its map ignore a second close


def _itemsize(dtype: str) -> int:
    return {"F32": 4, "F16": 2, "BF16": 2}.get(dtype, 1)


def _cast_bytes(tensors: dict[str, Tensor], compute: mx.Dtype) -> int:
    """Bytes of float tensors stored in a type other than `compute` that loading holds at once until their cast
    is done: the two largest. The casts run as the model is evaluated and each stored tensor is freed once cast
    (measured: a 157M-parameter bf16 MoE's 300 MiB of bf16 held 114 MiB at most, its two largest 96 MiB). GGUF's
    other block types (Q6_K, Q2_K, ...) arrive quantized, as the loader keeps them."""
    held = []
    for t in tensors.values():
        stored = FLOAT_DTYPES.get(t.dtype, None if t.dtype in PACKED_TYPES else mx.float32)
        if stored is not None and stored != compute:
            held.append(math.prod(t.shape) * stored.size)
    return sum(sorted(held)[-2:])


def open_source(src: str | Path) -> Source:
    """Open SRC: a folder, a .gguf file, or a Hugging Face Hub id (downloaded after a preflight check)."""
    path = Path(src).expanduser()
    if path.is_dir():
        return FolderSource(path)
    if path.is_file():
        if path.suffix == ".gguf":
            return GGUFSource(path)
        if path.suffix in PICKLE_SUFFIXES:
            raise UnsupportedModelError(f"{path}: pickle checkpoints are never loaded; use a safetensors or GGUF file")
        raise ConversionError(f"{path}: not a model folder, .gguf file or Hub id")
    if _looks_like_hub_id(str(src)):
        from .hub import fetch

        return FolderSource(fetch(str(src)), description=f"hf://{src}")
    raise ConversionError(f"{src}: no such folder or file (and not a Hub id like 'org/name')")


def _looks_like_hub_id(text: str) -> bool:
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not text.startswith((".", "~"))
