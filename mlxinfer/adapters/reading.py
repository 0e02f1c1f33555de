"""One reader for fine-tuning adapters, in the two layouts people have: mlx-lm's (`adapter_config.json` +
`adapters.safetensors`, written by `mlx_lm.lora`) and PEFT's (`adapter_config.json` + `adapter_model.safetensors`,
written by `save_pretrained`), LoRA and DoRA both.

Either becomes an `Adapter`: per adapted module, the low-rank pair as `x @ a @ b` uses it (the adapter's scale
folded into `b`) and DoRA's learned magnitudes; PEFT's `modules_to_save` as whole tensors. What either writer
means by its scale: mlx-lm multiplies by `lora_parameters.scale`; PEFT by `lora_alpha / r` (`/ sqrt(r)` with
rank-stabilized LoRA), per module where `alpha_pattern` says.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..errors import AdapterError
from ..formats.safetensors_header import DTYPE_BYTES, read_header
from ..memory import machine_memory
from ..untrusted import is_finite_number, listed, read_json_object, shown

CONFIG = "adapter_config.json"
MLX_LM_WEIGHTS = "adapters.safetensors"
PEFT_WEIGHTS = "adapter_model.safetensors"
PICKLED = ("adapter_model.bin", "adapters.bin", "adapter_model.pt", "adapter_model.pth", "adapters.pkl")
PEFT_PREFIX = "base_model.model."
MAX_CONFIG_BYTES = 1 << 20
MAX_RANK = 1024  # published adapters use 4 to 256
MAX_TENSORS = 65536  # a 100-layer model with every matrix adapted and DoRA holds about 2,100
# PEFT options that change what the adapter computes in ways this reader does not: refused by name, never ignored.
PEFT_REFUSED = {
    "fan_in_fan_out": "GPT-2's Conv1D layout",
    "lora_bias": "trained biases on lora_B",
    "use_qalora": "QA-LoRA's pooled inputs",
    "layer_replication": "replicated layers",
    "target_parameters": "LoRA on raw parameters (MoE experts)",
    "trainable_token_indices": "trainable token rows",
    "use_bdlora": "block-diagonal LoRA",
}


@dataclass(frozen=True)
class LowRank:
    """One module's update: `x @ a @ b` added to its output (DoRA: then each output rescaled, see rows.py)."""

    a: mx.array  # (in, rank); per expert (experts, in, rank)
    b: mx.array  # (rank, out), the adapter's scale folded in; per expert (experts, rank, out)
    magnitude: mx.array | None = None  # DoRA's learned norm of each output row, (out,)

    @property
    def rank(self) -> int:
        return self.a.shape[-1]

    @property
    def per_expert(self) -> bool:
        """A pair per expert of an MoE layer's projection: a (experts, in, rank), b (experts, rank, out)."""
        return self.a.ndim == 3


@dataclass(frozen=True)
class Adapter:
    """A fine-tune's difference from its base model, read from `path`."""

    name: str
    path: Path
    writer: str  # "mlx-lm" or "peft"
    kind: str  # "lora" or "dora"
    modules: dict[str, LowRank]  # by the module's path in the model ("model.layers.0.self_attn.q_proj")
    replaced: dict[str, mx.array] = field(default_factory=dict)  # PEFT's modules_to_save: parameter path -> tensor
    base_model: str | None = None  # what the adapter says it was trained on (a name or path), when it says
    digest: str = ""  # sha256 of its config and weights: what the prefix cache and a manifest know it by

    @property
    def nbytes(self) -> int:
        pairs = [t for m in self.modules.values() for t in (m.a, m.b, m.magnitude) if t is not None]
        return sum(t.nbytes for t in (*pairs, *self.replaced.values()))

    @property
    def rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)


def read_adapter(path: str | Path, name: str | None = None) -> Adapter:
    """The adapter in folder `path` (mlx-lm's or PEFT's layout), named `name` (default: the folder's name)."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise AdapterError(f"{folder}: not an adapter folder (one holding {CONFIG} and its safetensors weights)")
    if not (folder / CONFIG).is_file():
        raise AdapterError(f"{folder}: no {CONFIG}; an adapter folder holds it beside its safetensors weights")
    config = read_json_object(folder / CONFIG, AdapterError, MAX_CONFIG_BYTES)
    peft = "peft_type" in config
    weights_path = folder / (PEFT_WEIGHTS if peft else MLX_LM_WEIGHTS)
    if not weights_path.is_file():
        pickled = [p for p in PICKLED if (folder / p).exists()]
        if pickled:
            raise AdapterError(f"{folder / pickled[0]}: pickle files are never loaded (they can run code); "
                               "re-save the adapter as safetensors (PEFT: safe_serialization=True)")  # fmt: skip
        raise AdapterError(f"{folder}: no {weights_path.name} beside its {CONFIG}")
    header = read_header(weights_path)  # a crafted header is a CorruptFileError before MLX reads anything
    if len(header) > MAX_TENSORS:
        raise AdapterError(f"{weights_path}: {len(header)} tensors, more than an adapter's {MAX_TENSORS}")
    nbytes = sum(math.prod(t.shape) * DTYPE_BYTES[t.dtype] for t in header.values())
    if nbytes > machine_memory().usable_bytes() // 2:  # read whole: bounded before a byte of it is
        raise AdapterError(f"{weights_path}: {nbytes / 2**30:.1f} GiB of tensors, more than half of this machine's "
                           "usable memory; an adapter is low-rank and small")  # fmt: skip
    tensors = mx.load(str(weights_path))
    read = _peft if peft else _mlx_lm
    kind, modules, replaced, base = read(config, tensors, str(weights_path))
    if not modules and not replaced:
        raise AdapterError(f"{weights_path}: no adapter tensors in it")
    digest = _digest(folder / CONFIG, weights_path)
    return Adapter(name or folder.name, folder, "peft" if peft else "mlx-lm", kind, modules, replaced, base, digest)


def _mlx_lm(config: dict[str, Any], tensors: dict[str, mx.array], source: str) -> tuple:
    kind = config.get("fine_tune_type", "lora")
    if kind == "full":
        raise AdapterError(f"{source}: a full fine-tune is a whole model, not an adapter; fuse it with "
                           "`mlx_lm.fuse` and load the result as a model")  # fmt: skip
    if kind not in ("lora", "dora"):
        raise AdapterError(f"{source}: fine_tune_type {shown(kind)} is not one of lora, dora")
    params = config.get("lora_parameters")
    scale = params.get("scale") if isinstance(params, dict) else None
    if not is_finite_number(scale):
        raise AdapterError(f"{source}: lora_parameters.scale must be a number, got {shown(scale)}")
    parts = _grouped(tensors, ("lora_a", "lora_b", "m"), source)
    modules = {}
    for module, got in parts.items():
        a, b, m = got.get("lora_a"), got.get("lora_b"), got.get("m")
        if a is not None and b is not None and a.ndim == 3:  # LoRASwitchLinear: (experts, rank, in), (.., out, rank)
            if kind == "dora":
                raise AdapterError(f"{source}: {module}: DoRA on MoE experts is not a thing mlx-lm writes")
            a, b = a.swapaxes(-1, -2), b.swapaxes(-1, -2)
        _check_pair(module, a, b, source, "lora_a", "lora_b", experts=True)
        modules[module] = _low_rank(module, a, (b * scale), m if kind == "dora" else None, kind, source)
    return kind, modules, {}, _text(config.get("model"))


def _peft(config: dict[str, Any], tensors: dict[str, mx.array], source: str) -> tuple:
    if config.get("peft_type") != "LORA":
        raise AdapterError(f"{source}: peft_type {shown(config.get('peft_type'))} is not supported; only LORA (and "
                           "DoRA, LORA with use_dora) adapters are")  # fmt: skip
    refused = [f"{k} ({why})" for k, why in PEFT_REFUSED.items() if config.get(k) not in (None, False, {}, [])]
    if config.get("bias", "none") != "none":
        refused.append(f"bias {shown(config.get('bias'))} (trained biases)")
    if refused:
        raise AdapterError(f"{source}: uses {listed(refused)}, which mlxinfer does not apply yet")
    alpha, rslora = config.get("lora_alpha"), bool(config.get("use_rslora"))
    if not is_finite_number(alpha):
        raise AdapterError(f"{source}: lora_alpha must be a number, got {shown(alpha)}")
    alphas = _patterns(config.get("alpha_pattern") or {}, source)
    kind = "dora" if config.get("use_dora") else "lora"
    saved = {_text(n) for n in config.get("modules_to_save") or [] if isinstance(n, str)}
    stripped = {}
    for key, value in tensors.items():
        if not key.startswith(PEFT_PREFIX):
            raise AdapterError(f"{source}: tensor {shown(key)} is not under {PEFT_PREFIX!r}, as PEFT saves them")
        stripped[key.removeprefix(PEFT_PREFIX)] = value
    low = {k: v for k, v in stripped.items() if ".lora_" in k}
    replaced = {k: v for k, v in stripped.items() if ".lora_" not in k}
    strays = [k for k in replaced if _pattern_for(dict.fromkeys(saved), k.rsplit(".", 1)[0]) is None]
    if strays:
        raise AdapterError(f"{source}: tensors {listed(strays)} are neither LoRA pairs nor modules_to_save")
    modules = {}
    for module, got in _grouped(low, ("lora_A.weight", "lora_B.weight", "lora_magnitude_vector"), source).items():
        a, b, m = got.get("lora_A.weight"), got.get("lora_B.weight"), got.get("lora_magnitude_vector")
        _check_pair(module, a.T if a is not None else None, b.T if b is not None else None, source, "lora_A", "lora_B")
        rank = a.shape[0]
        scale = alphas.get(_pattern_for(alphas, module), alpha) / (math.sqrt(rank) if rslora else rank)
        modules[module] = _low_rank(module, a.T, (b * scale).T, m if kind == "dora" else None, kind, source)
    return kind, modules, replaced, _text(config.get("base_model_name_or_path"))


def _grouped(tensors: dict[str, mx.array], suffixes: tuple[str, ...], source: str) -> dict[str, dict[str, mx.array]]:
    """{module path: {suffix: tensor}}; a tensor with another suffix is refused by name."""
    out: dict[str, dict[str, mx.array]] = {}
    for key, value in tensors.items():
        suffix = next((s for s in suffixes if key.endswith("." + s)), None)
        if suffix is None:
            embedding = "embedding" in key
            why = "LoRA on embeddings is not applied yet" if embedding else f"expected names ending in {suffixes}"
            raise AdapterError(f"{source}: unexpected tensor {shown(key)} ({why})")
        out.setdefault(key[: -len(suffix) - 1], {})[suffix] = value
    return out


def _check_pair(module: str, a: mx.array | None, b: mx.array | None, source: str, a_name: str, b_name: str,
                experts: bool = False) -> None:  # fmt: skip
    """`a` (in, rank) and `b` (rank, out) as x @ a @ b uses them; with `experts`, also a pair per expert (experts,
    in, rank) and (experts, rank, out)."""
    if a is None or b is None:
        raise AdapterError(f"{source}: {module} has {a_name if a is not None else b_name} but not its pair")
    dims = (2, 3) if experts else (2,)
    if a.ndim != b.ndim or a.ndim not in dims or (a.ndim == 3 and a.shape[0] != b.shape[0]):
        what = "LoRA on raw expert tensors is not applied yet" if a.ndim == 3 else "must both be 2-D"
        raise AdapterError(f"{source}: {module}: {what} (shapes {tuple(a.shape)} and {tuple(b.shape)})")
    if a.shape[-1] != b.shape[-2] or not 0 < a.shape[-1] <= MAX_RANK:
        raise AdapterError(f"{source}: {module}: {a_name} and {b_name} disagree on the rank or it is past "
                           f"{MAX_RANK} (shapes {tuple(a.shape)} and {tuple(b.shape)})")  # fmt: skip
    if not (mx.issubdtype(a.dtype, mx.floating) and mx.issubdtype(b.dtype, mx.floating)):
        raise AdapterError(f"{source}: {module}: adapter weights must be floats, got {a.dtype} and {b.dtype}")


def _low_rank(module: str, a: mx.array, b: mx.array, m: mx.array | None, kind: str, source: str) -> LowRank:
    if kind == "dora" and (m is None or m.shape != (b.shape[1],)):
        got = "none" if m is None else str(tuple(m.shape))
        raise AdapterError(f"{source}: {module}: a DoRA adapter needs a magnitude of shape ({b.shape[1]},), got {got}")
    return LowRank(a, b, m)


def _patterns(patterns: Any, source: str) -> dict[str, float]:
    """PEFT's alpha_pattern, {module name or suffix: alpha}; names only (a regular expression is refused: PEFT
    matches them as such, and a crafted one could take unbounded time)."""
    if not isinstance(patterns, dict) or len(patterns) > MAX_TENSORS:
        raise AdapterError(f"{source}: alpha_pattern must map module names to numbers")
    for key, value in patterns.items():
        if not key.replace(".", "").replace("_", "").isalnum() or not is_finite_number(value):
            raise AdapterError(f"{source}: alpha_pattern entry {shown(key)}: {shown(value)} is not a module name "
                               "and a number (regular expressions are not supported)")  # fmt: skip
    return patterns


def _pattern_for(patterns: dict[str, float], module: str) -> str | None:
    """The alpha_pattern key that names `module`, as PEFT matches it: the whole path or its last components."""
    return next((k for k in patterns if module == k or module.endswith("." + k)), None)


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and len(value) <= 4096 else None


def _digest(*paths: Path) -> str:
    h = hashlib.sha256()
    for path in paths:
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()
