"""Grammars compiled for one tokenizer, cached by grammar text, and the per-request matcher state.

Compiling a schema into a matcher is the expensive part (milliseconds to a second for
large schemas; llguidance drops the GIL while it runs): it happens once per grammar
and tokenizer, on the thread that prepares the request, never on the scheduler's,
and only after the same grammar compiled in a child process (`isolated.py`).
Each request then gets a cheap copy of the compiled matcher, whose state advances
with the tokens it draws.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import numpy as np

from ..errors import GrammarError
from ..tokenizer import Tokenizer
from .isolated import LIMITS, check_in_child, first_line
from .spec import Grammar

CACHED_GRAMMARS = 64  # compiled matchers kept per tokenizer (least recently used go first)


@dataclass
class Vocabulary:
    """One tokenizer as llguidance sees it, sized to the model's logits, with its compiled grammars."""

    tokens: llguidance.LLTokenizer
    size: int  # the model's vocabulary (logits per position); may exceed the tokenizer's

    def __post_init__(self) -> None:
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.compiled_now = 0  # grammars compiled (not found in the cache), for stats and tests

    def compile(self, grammar: Grammar) -> llguidance.LLMatcher:
        """The matcher at the start of `grammar`, compiled once (GrammarError naming what llguidance refused)."""
        with self._lock:
            found = self._compiled.get(grammar.text)
            if found is not None:
                self._compiled.move_to_end(grammar.text)
                return found
        matcher = self._build(grammar)  # outside the lock: another request's grammar need not wait for this one
        with self._lock:
            self.compiled_now += 1
            self._compiled[grammar.text] = matcher
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return matcher

    def forget(self, grammar: Grammar) -> None:
        """Drop `grammar`'s compiled matcher: its copies share one lexer, which a failure (a limit hit) leaves
        spent for every later copy, so the next request compiles it afresh."""
        with self._lock:
            self._compiled.pop(grammar.text, None)

    def _build(self, grammar: Grammar) -> llguidance.LLMatcher:
        # First in a child, where a crash or a runaway ends only the child.
        refused = check_in_child([grammar.text], grammar.where)[0]
        if refused is not None:
            raise GrammarError(f"{grammar.where}: {refused}")
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar.text, self.tokens, limits=llguidance.LLParserLimits(**LIMITS)
        )
        if failed:
            raise GrammarError(f"{grammar.where}: {first_line(messages)}")
        if messages:  # warnings are features the grammar would drop: say so rather than enforce less
            raise GrammarError(f"{grammar.where} uses what the matcher does not support: {first_line(messages)}")
        # Silent: a failure is raised as a GrammarError to the request, not printed on the server's stderr.
        matcher = llguidance.LLMatcher(
            self.tokens, grammar.text, log_level=0, limits=llguidance.LLParserLimits(**LIMITS)
        )
        if matcher.is_error():
            raise GrammarError(f"{grammar.where}: {first_line([matcher.get_error()])}")
        return matcher


_VOCABULARIES: weakref.WeakKeyDictionary[Tokenizer, dict[tuple[int, tuple[int, ...]], Vocabulary]] = (
    weakref.WeakKeyDictionary()
)
_VOCABULARIES_LOCK = threading.Lock()


def vocabulary(tokenizer: Tokenizer, size: int, eos_token_ids: Sequence[int]) -> Vocabulary:
    """The llguidance view of `tokenizer` for a model with `size` logits, built once per tokenizer (about 1 s
    for a 150k vocabulary). EOS ends a grammar's output: the matcher allows it only once the output is complete."""
    key = (size, tuple(eos_token_ids))
    with _VOCABULARIES_LOCK:
        found = _VOCABULARIES.setdefault(tokenizer, {}).get(key)
    if found is not None:
        return found
    tokens = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=size, eos_token=list(eos_token_ids) or None)
    built = Vocabulary(tokens, size)
    with _VOCABULARIES_LOCK:
        return _VOCABULARIES[tokenizer].setdefault(key, built)


class Constraint:
    """One request's place in its grammar: which tokens may come next, advanced by each token drawn."""

    def __init__(self, start: llguidance.LLMatcher, vocab: Vocabulary, grammar: Grammar):
        self._matcher = start.deep_copy()
        self.vocab, self.grammar = vocab, grammar

    def fill_mask(self, bitmask_row: np.ndarray) -> None:
        """Write the allowed next tokens into one row of an llguidance bitmask (int32 words, bit i = token i)."""
        self._matcher.unsafe_compute_mask_ptr(bitmask_row.ctypes.data, bitmask_row.nbytes)

    def advance(self, token: int) -> None:
        """Take the token drawn; a token the mask forbade is a bug, reported rather than silently accepted."""
        if not self._matcher.consume_token(token):
            raise GrammarError(f"token {token} does not fit the {self.grammar.where}: {self._failed()}")

    def check(self) -> None:
        """A GrammarError if the matcher failed, e.g. hit a limit while computing the last mask: llguidance then
        allows EOS only, which must end the request in error rather than pass for a complete answer."""
        if self._matcher.is_error():
            raise GrammarError(f"the {self.grammar.where} could not be followed: {self._failed()}")

    def _failed(self) -> str:
        """llguidance's error, once the compiled grammar is forgotten (its shared lexer may be what failed)."""
        self.vocab.forget(self.grammar)
        return self._matcher.get_error().split("\n<state>")[0]  # the rest is llguidance's multi-line state dump

    @property
    def finished(self) -> bool:
        """The output is complete: the grammar admits nothing more (EOS or stopping is all that is left)."""
        return self._matcher.is_stopped()

    @property
    def complete(self) -> bool:
        """What was drawn so far is a whole match (more may still be allowed)."""
        return self._matcher.is_accepting()

    def rollback(self, tokens: int) -> None:
        """Forget the last `tokens` tokens drawn (for speculative decoding's rejected drafts)."""
        if not self._matcher.rollback(tokens):
            raise GrammarError(f"cannot roll the {self.grammar.where} back by {tokens} tokens")

    @property
    def matcher(self) -> llguidance.LLMatcher:
        """The llguidance matcher (for computing several rows' masks in parallel)."""
        return self._matcher


def constraint_for(grammar: Grammar, tokenizer: Tokenizer, size: int, eos_token_ids: Sequence[int]) -> Constraint:
    """A fresh constraint for one request (compiling `grammar` for this tokenizer unless cached)."""
    vocab = vocabulary(tokenizer, size, eos_token_ids)
    return Constraint(vocab.compile(grammar), vocab, grammar)
