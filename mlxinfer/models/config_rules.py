"""Checks that several families' config rules share (mlxinfer/families/): sizes, switches, expert counts.

Each raises ConfigError naming the key, the rule and the value, as the common checks in config.py do.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..formats.safetensors_header import MAX_DIM
from ..untrusted import is_finite_number, is_int, shown

MAX_EXPERTS = 65_536  # real MoE models have at most a few hundred


def positive_int(args: dict[str, Any], key: str, source: str, limit: int = MAX_DIM) -> int:
    value = args.get(key)
    if not (is_int(value) and 0 < value <= limit):
        raise ConfigError(f"{source}: {key} must be a positive integer of at most {limit}, got {shown(value)}")
    return value


def positive_number(args: dict[str, Any], key: str, source: str) -> float:
    value = args.get(key)
    if not (is_finite_number(value) and value > 0):
        raise ConfigError(f"{source}: {key} must be a positive finite number, got {shown(value)}")
    return value


def require_bools(args: dict[str, Any], source: str, keys: tuple[str, ...]) -> None:
    for key in keys:
        if not isinstance(args.get(key), bool):
            raise ConfigError(f"{source}: {key} must be true or false, got {shown(args.get(key))}")


def check_experts(args: dict[str, Any], source: str, key: str, allow_dense: bool) -> int:
    """The expert count `args[key]` (num_local_experts, num_experts: families name it differently), checked with
    num_experts_per_tok; 0 only where `allow_dense` (every layer a dense MLP)."""
    low = 0 if allow_dense else 1
    experts = args.get(key)
    if not (is_int(experts) and low <= experts <= MAX_EXPERTS):
        raise ConfigError(f"{source}: {key} must be an integer from {low} to {MAX_EXPERTS}, got {shown(experts)}")
    if experts:
        top = args.get("num_experts_per_tok")
        if not (is_int(top) and 0 < top <= experts):
            raise ConfigError(f"{source}: num_experts_per_tok must be from 1 to {key}={experts}, got {shown(top)}")
    return experts


def expert_count(args: dict[str, Any], source: str, key: str, alias: str, default: int) -> str:
    """Put the expert count under `key`, mlx-lm's name, from either name transformers accepts (its attribute_map);
    returns `key`. transformers 5 writes Qwen3-MoE's as num_local_experts, the Hub's configs say num_experts."""
    value, other = args.get(key), args.get(alias)
    if value is not None and other is not None and value != other:
        raise ConfigError(f"{source}: {key}={shown(value)} and {alias}={shown(other)} disagree; keep one of them")
    args[key] = next((v for v in (value, other) if v is not None), default)
    return key
