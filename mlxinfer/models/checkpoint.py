"""Find and open the files of a model folder (Hugging Face or MLX layout).

Only safetensors are read. Pickle checkpoints (.bin, .pt, .pth) are refused,
never unpickled. Every header is validated before MLX maps the file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..errors import ConfigError, CorruptFileError, ModelNotFoundError, UnsupportedModelError
from ..formats.recommended_sampling import GENERATION_CONFIG
from ..formats.safetensors_header import TensorInfo, read_header
from ..untrusted import is_int, listed, read_json_object, shown
from .config import MAX_TOKEN_IDS

INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


@dataclass(frozen=True)
class Checkpoint:
    """A model folder's config and the tensors its safetensors files declare."""

    folder: Path
    config: dict[str, Any]
    files: tuple[Path, ...]
    tensors: dict[str, TensorInfo]
    owners: dict[str, Path] = field(default_factory=dict)  # the file holding each stored tensor
    # {name in the model: stored name} when they differ or only some tensors are used (a vision-language
    # checkpoint's text model, see multimodal.py); then only these tensors are loaded.
    stored_names: dict[str, str] | None = None
    generation: dict[str, Any] = field(default_factory=dict)  # generation_config.json, or {} without one


def open_folder(folder: Path) -> Checkpoint:
    """Read config.json and validate every weights file's header."""
    if not folder.is_dir():
        raise ModelNotFoundError(f"{folder}: no such model folder")
    config = read_json(folder / "config.json")
    generation = folder / GENERATION_CONFIG
    gen = read_json(generation) if generation.exists() else {}
    if gen.get("eos_token_id") is not None:
        config["eos_token_id"] = _merge_ids(config.get("eos_token_id"), gen["eos_token_id"], generation)
    files = _weight_files(folder)
    tensors: dict[str, TensorInfo] = {}
    owner: dict[str, Path] = {}
    for path in files:
        for name, info in read_header(path).items():
            if name in owner:
                raise CorruptFileError(f"{path}: tensor {shown(name)} also appears in {owner[name].name}")
            owner[name], tensors[name] = path, info
    _check_index(folder, owner)
    return Checkpoint(folder, config, tuple(files), tensors, owner, generation=gen)


def load_tensors(checkpoint: Checkpoint) -> dict[str, mx.array]:
    """Map every tensor lazily; bytes are read when the arrays are evaluated (tensors left out never are)."""
    weights: dict[str, mx.array] = {}
    for path in checkpoint.files:
        weights.update(mx.load(str(path)))
    if checkpoint.stored_names is None:
        return weights
    return {name: weights[stored] for name, stored in checkpoint.stored_names.items()}


def read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ModelNotFoundError(f"{path}: missing; a model folder needs config.json and *.safetensors")
    return read_json_object(path, ConfigError)


def _merge_ids(config_ids: Any, generation_ids: Any, source: Path) -> list[Any]:
    extra = generation_ids if isinstance(generation_ids, list) else [generation_ids]
    bad = next((v for v in extra if not is_int(v)), None)
    if bad is not None:
        raise ConfigError(f"{source}: eos_token_id must be an integer or a list of integers, got {shown(bad)}")
    # config.json's own ids are checked with the rest of it (normalize_config), which also
    # refuses a list one past MAX_TOKEN_IDS: the merge never scans more than that.
    merged: list[Any] = []
    for v in [*(config_ids if isinstance(config_ids, list) else [config_ids]), *extra][: MAX_TOKEN_IDS + 1]:
        if v is not None and v not in merged:
            merged.append(v)
    return merged


def _weight_files(folder: Path) -> list[Path]:
    index = folder / INDEX_FILE
    if index.exists():
        names = sorted(set(_weight_map(index).values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ModelNotFoundError(f"{index}: shard(s) {listed(missing)} named in the index do not exist")
        return [folder / n for n in names]
    files = sorted(folder.glob("model*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise UnsupportedModelError(
            f"{folder}: only pickle checkpoints found ({', '.join(pickles)}); mlxinfer never unpickles. "
            "Use the model's safetensors release instead"
        )
    raise ModelNotFoundError(f"{folder}: no model*.safetensors weights found")


def _check_index(folder: Path, owner: dict[str, Path]) -> None:
    index = folder / INDEX_FILE
    if not index.exists():
        return
    weight_map = _weight_map(index)
    wrong = sorted(n for n, f in weight_map.items() if n in owner and owner[n].name != f)
    absent = sorted(n for n in weight_map if n not in owner)
    if wrong or absent:
        detail = "; ".join(
            part
            for part in (
                f"not found in their shard: {listed(absent)}" if absent else "",
                f"stored in another shard than the index says: {listed(wrong)}" if wrong else "",
            )
            if part
        )
        raise CorruptFileError(f"{index}: tensors {detail}")


def _weight_map(index: Path) -> dict[str, str]:
    """The index's tensor -> shard map; a shard must be a plain file name in the folder (never a path out of it)."""
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConfigError(f"{index}: 'weight_map' must map tensor names to shard files")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or shard in ("", ".", "..") or Path(shard).name != shard or "\\" in shard:
            raise CorruptFileError(
                f"{index}: tensor {shown(name)} is mapped to {shown(shard)}, not a shard file name in this folder"
            )
    return weight_map
