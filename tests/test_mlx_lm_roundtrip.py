"""Every verified family converts to a folder that mlx-lm's own `load()` runs, with the tokens we produce.

Ours follow transformers (tests/test_parity.py). Where mlx-lm's module computes something else, its tokens
may differ from ours: such a family is listed below with the reason, and mlx-lm must still load and run it.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlxinfer.convert import convert

import mlxinfer
from tests.conftest import ARCHITECTURES, TINY, golden

TOKENS = 8
EOS = 258  # every fixture's end-of-text id (tests/fixtures/make_tiny_models.py)
# family -> what mlx-lm 0.32.2 computes differently from transformers (and so from us).
MLX_LM_DIFFERS: dict[str, str] = {
    "gemma2": "its gemma2 attends to every position: it ignores sliding_window (the fixture's is 8)",
    # Checked: with the window removed from the converted config.json, ours gives mlx-lm's tokens.
    "qwen3_moe_sliding": "its qwen3_moe attends to every position: it ignores use_sliding_window (window 8 here)",
    "mixtral_sliding": "its mixtral attends to every position: it ignores sliding_window (8 here)",
    "gpt_oss": "its YaRN always rounds the correction range (gpt-oss says truncate: false)",
    "granitemoehybrid_nope": "its gated norm spans every Mamba group; transformers normalizes each (2 here)",
    "deepseek_v3_plain": "its MLA always rotates interleaved pairs (rope_interleave: false asks for half-split) "
    "and a top-1 router skips norm_topk_prob",
}


def mlx_lm_greedy(folder: Path, ids: list[int], n: int) -> list[int]:
    """mlx-lm's own load() and decode loop on our output, in float32 like ours."""
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, _ = load(str(folder))
    model.set_dtype(mx.float32)
    tokens = [int(token) for token, _ in generate_step(mx.array(ids), model, max_tokens=n)]
    return tokens[: tokens.index(EOS)] if EOS in tokens else tokens


# One case stays in the fast tier so the inner loop still proves that mlx-lm loads what we write.
CASES = [
    pytest.param(name, bits, marks=() if (name, bits) == (ARCHITECTURES[0], 4) else pytest.mark.slow)
    for name in ARCHITECTURES
    for bits in (8, 4)
]


@pytest.mark.parametrize(("name", "bits"), CASES)
def test_converted_output_runs_in_mlx_lm_with_our_tokens(name, bits, tmp_path):
    out = tmp_path / f"{name}-{bits}bit"
    convert(TINY / name, out, bits=bits, dtype="float32", evaluate=False, progress=False)
    ids = golden(name)["input_ids"].tolist()
    ours = mlxinfer.load(out).generate(ids, max_tokens=TOKENS).token_ids
    theirs = mlx_lm_greedy(out, ids, TOKENS)
    assert ours and theirs, name
    if name not in MLX_LM_DIFFERS:
        assert theirs == ours, f"{name}: mlx-lm {theirs} vs ours {ours}"
