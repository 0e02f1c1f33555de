"""Tokenizers, chat templates and streaming detokenization."""

from .detokenizer import IncrementalDetokenizer
from .tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer"]
