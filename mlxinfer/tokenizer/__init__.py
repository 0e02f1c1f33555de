"""Tokenizers, chat templates and streaming detokenization."""

from .compare import check_same_vocabulary
from .detokenizer import IncrementalDetokenizer
from .tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer", "check_same_vocabulary"]
