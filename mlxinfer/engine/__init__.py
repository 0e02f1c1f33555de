"""The generation engine: sampling, prefill, decode, text streaming."""

from .generate import GenerationRequest, generate_ids, prefill
from .sampling import SamplingParams
from .stats import GenerationStats
from .text import TextGeneration

__all__ = ["GenerationRequest", "GenerationStats", "SamplingParams", "TextGeneration", "generate_ids", "prefill"]
