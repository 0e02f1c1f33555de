"""Full (unmasked) attention over one image's patches, a block of queries at a time.

A CPU's attention holds every query's scores against every key: a 1540-pixel Pixtral image is 12,100 patches, whose
scores for 16 heads in float32 would be 9.4 GB at once. In blocks of QUERY_BLOCK queries they are 0.8 GB; the
result is the same (each query's softmax runs over all keys either way).
"""

from __future__ import annotations

import mlx.core as mx

QUERY_BLOCK = 1024  # queries whose attention scores are held at once


def blocked_attention(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """(heads, n, dim) queries against (kv heads, n, dim) keys and values -> (heads, n, dim)."""
    n = q.shape[1]
    if n <= QUERY_BLOCK:
        return mx.fast.scaled_dot_product_attention(q[None], k[None], v[None], scale=scale)[0]
    blocks = []
    for i in range(0, n, QUERY_BLOCK):
        block = mx.fast.scaled_dot_product_attention(q[None, :, i : i + QUERY_BLOCK], k[None], v[None], scale=scale)
        # Evaluated one by one: left lazy, the CPU's unfused attention computed every block's scores before any
        # softmax, and a 5,329-patch Pixtral image held them all (2.3 GiB measured against 1.1 predicted).
        mx.eval(block)
        blocks.append(block[0])
    return mx.concatenate(blocks, axis=1)


def scores_bytes(heads: int, patches: int) -> int:
    """What one layer's attention scores and their softmax hold at most (float32, every head, one block)."""
    return 2 * heads * min(patches, QUERY_BLOCK) * patches * 4


def rotated(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """rotate_half RoPE over the whole head: x (heads, n, dim), cos / sin (n, dim) (a 2-D tower's row and column
    angles: Pixtral's, Qwen's)."""
    half = x.shape[-1] // 2
    turned = mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + turned * sin
