"""The engines a benchmark can drive: ours, mlx-lm and llama.cpp, behind one small interface.

All are driven at the token level (no detokenization, EOS ignored) so they do
the same work: prefill the same prompt ids, then decode a fixed number of tokens
greedily.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..models.dtype import dtype_name, parse_dtype


class Engine(Protocol):
    name: str
    compute_dtype: str
    weights_bytes: int
    decode_weights_bytes: int  # what one decoded token reads of them (MoE: only the experts it is routed to)

    def token_times(self, prompt: list[int], n: int) -> tuple[float, list[float]]:
        """(start time, time each of `n` generated tokens became available)."""
        ...

    def model_step_s(self, prompt: list[int], steps: int) -> float:
        """Seconds per decode step of the bare model (no sampling, no engine), after `prompt`."""
        ...


class Ours:
    name = "mlxinfer"

    def __init__(self, path: Path, dtype: str | None):
        from ..api import load

        self._model = load(path, dtype=dtype)
        loaded = self._model._loaded
        self._lm = loaded.model
        self.compute_dtype = dtype_name(loaded.compute_dtype)
        self.weights_bytes = loaded.weights_bytes
        self.decode_weights_bytes = self._model.footprint.decode_weights_bytes

    def token_times(self, prompt: list[int], n: int) -> tuple[float, list[float]]:
        from ..engine import GenerationRequest, GenerationStats, generate_ids

        request = GenerationRequest(prompt_ids=prompt, max_tokens=n, eos_token_ids=())
        start = time.perf_counter()
        return start, [time.perf_counter() for _ in generate_ids(self._lm, request, GenerationStats())]

    def model_step_s(self, prompt: list[int], steps: int) -> float:
        from ..cache import make_cache

        cache = make_cache(self._lm.cache_kinds)
        return _bare_steps(lambda x: self._lm(x, cache), prompt, steps)


class MlxLm:
    name = "mlx-lm"

    def __init__(self, path: Path, dtype: str | None):
        from mlx_lm import load

        self._model, _ = load(str(path))
        if dtype:
            self._model.set_dtype(parse_dtype(dtype))  # floats only; packed weights stay
        mx.eval(self._model.parameters())
        self.compute_dtype = dtype or _float_dtype(self._model)
        self.weights_bytes = sum(v.nbytes for _, v in tree_flatten(self._model.parameters()))
        self.decode_weights_bytes = _decode_weights_bytes(self._model, path, self.weights_bytes)

    def token_times(self, prompt: list[int], n: int) -> tuple[float, list[float]]:
        from mlx_lm.generate import generate_step

        start = time.perf_counter()
        times = []
        for _ in generate_step(mx.array(prompt), self._model, max_tokens=n):
            times.append(time.perf_counter())
        return start, times

    def model_step_s(self, prompt: list[int], steps: int) -> float:
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self._model)
        return _bare_steps(lambda x: self._model(x, cache=cache), prompt, steps)


def _bare_steps(forward: Callable[[mx.array], mx.array], prompt: list[int], steps: int) -> float:
    mx.eval(forward(mx.array(prompt)[None]))
    token = mx.array([[prompt[-1]]])
    mx.eval(forward(token))  # first step after prefill may compile or allocate
    start = time.perf_counter()
    for _ in range(steps):
        mx.eval(forward(token))
    return (time.perf_counter() - start) / steps


def _decode_weights_bytes(model: nn.Module, path: Path, weights_bytes: int) -> int:
    """mlx-lm's model holds its experts in the same modules as ours: count them the same way."""
    from ..models.footprint import resident_experts

    config = json.loads((path / "config.json").read_text())
    experts = resident_experts(model, int(config.get("num_experts_per_tok") or 0))
    return weights_bytes - experts.nbytes + experts.active_nbytes


def _float_dtype(model: nn.Module) -> str:
    for _, value in tree_flatten(model.parameters()):
        if mx.issubdtype(value.dtype, mx.floating) and value.ndim > 1:
            return dtype_name(value.dtype)
    return "unknown"


class LlamaCpp:
    """llama.cpp through llama-cpp-python, on the same GGUF file: the peer on CPUs (optional, built from source)."""

    name = "llama.cpp"

    def __init__(self, path: Path, dtype: str | None):
        from llama_cpp import Llama

        if path.suffix != ".gguf":
            raise ValueError(f"{path}: llama.cpp reads .gguf files only")
        threads = os.cpu_count() or 1  # every core, as llama.cpp is run (mlxinfer's BLAS leaves one: its rows say)
        self._llm = Llama(model_path=str(path), n_ctx=4096, n_batch=512, n_threads=threads, verbose=False)
        self.compute_dtype = "gguf"
        self.weights_bytes = self.decode_weights_bytes = path.stat().st_size

    def token_times(self, prompt: list[int], n: int) -> tuple[float, list[float]]:
        # Forget the last run's tokens: generate() would otherwise reuse them as a cached prefix, and a warm
        # run would skip the prefill it is here to time (the others here have no prefix cache on this path).
        self._llm.reset()
        start = time.perf_counter()
        times = []
        # generate() never stops at EOS by itself: greedy (top_k 1), n tokens, like the others here.
        for _ in self._llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            times.append(time.perf_counter())
            if len(times) == n:
                break
        return start, times

    def model_step_s(self, prompt: list[int], steps: int) -> float:
        self._llm.reset()
        self._llm.eval(prompt)
        token = prompt[-1]
        self._llm.eval([token])
        start = time.perf_counter()
        for _ in range(steps):
            self._llm.eval([token])
        return (time.perf_counter() - start) / steps


ENGINES: dict[str, Any] = {"mlxinfer": Ours, "mlx-lm": MlxLm, "llama.cpp": LlamaCpp}
