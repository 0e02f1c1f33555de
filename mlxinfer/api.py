"""The Python API: `load()` a model, then generate, stream, chat or score with it."""

from __future__ import annotations

import html
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Union

import mlx.core as mx
import numpy as np

from .adapters import MAX_ADAPTERS, NO_ADAPTER, AdapterSet, Chosen, selected
from .adapters.loading import add_adapter, with_adapters
from .cache import PrefixCache, PrefixCacheStats, make_cache
from .default_model import default_model_path
from .defaults import DEFAULT_MAX_TOKENS, PREFILL_CHUNK_TOKENS
from .display import html_table, mib
from .engine import (
    SNAPSHOT_EVERY,
    DraftRuntime,
    GenerationRequest,
    GenerationStats,
    ModelRuntime,
    PromptImages,
    SamplingParams,
    StepCosts,
    Structure,
    TextGeneration,
    check_mode,
    encode_chat,
    encode_text,
    prefix_store_for,
    structure_of,
    warm_alone,
    with_defaults,
)
from .errors import AdapterError, ConfigError, SamplingError, TokenizerError
from .formats.recommended_sampling import SamplingDefaults
from .library import located
from .memory import MemoryPlan, ModelFootprint, default_prefix_cache_bytes, hold_limits, machine_memory, plan_memory
from .models import LoadedModel, load_model
from .models.dtype import dtype_name
from .models.footprint import check_kv_bits, footprint
from .models.vision import VisionModel
from .tokenizer import Tokenizer, check_same_vocabulary
from .untrusted import is_int, shown

log = logging.getLogger(__name__)

Message = dict[str, Any]
Prompt = Union[str, Sequence[int], Sequence[Message]]
# A text longer than this many characters per context token cannot fit: refused before it is tokenized.
MAX_CHARS_PER_TOKEN = 64


@dataclass
class GenerationResult:
    """The outcome of `Model.generate` / `Model.chat`."""

    text: str
    token_ids: list[int]
    stats: GenerationStats
    structure: Structure | None = field(default=None, repr=False)  # the schema, regex or choices it followed

    @property
    def finish_reason(self) -> str:
        return self.stats.finish_reason

    @cached_property
    def parsed(self) -> Any:
        """The answer to a `schema=` generation as an object: an instance of the pydantic class given, else the
        JSON value; None without a schema. GrammarError if the answer was cut short (raise max_tokens)."""
        return None if self.structure is None else self.structure.parse(self.text, self.finish_reason)

    def __str__(self) -> str:
        return self.text

    def _repr_html_(self) -> str:
        return f"<p>{html.escape(self.text)}</p>{self.stats._repr_html_()}"


class Model:
    """A loaded model. Create it with `mlxinfer.load`.

    Example:
        >>> model = mlxinfer.load()
        >>> model.chat([{"role": "user", "content": "What is the capital of France?"}]).text
        'The capital of France is Paris.'
        >>> for chunk in model.stream("Once upon a time", max_tokens=20):
        ...     print(chunk, end="")
    """

    def __init__(
        self,
        loaded: LoadedModel,
        prefix_cache_bytes: int | None = None,
        kv_bits: int | None = None,
        draft: LoadedModel | None = None,
        speculate: str = "auto",
        persist_prefixes: bool = True,
    ):
        self._loaded, self._draft = loaded, draft
        self.sampling_defaults = _stated_sampling(loaded)
        if draft is not None:
            check_same_vocabulary(self.tokenizer, draft.tokenizer, str(loaded.path), str(draft.path))
        self.speculate = check_mode(speculate, draft.model if draft else None)
        self._step_costs = StepCosts()  # what speculation's auto learns of this model's forward passes
        self.kv_bits = check_kv_bits(kv_bits, loaded.config)
        self.footprint = footprint(loaded, kv_bits)
        budget = prefix_cache_bytes if prefix_cache_bytes is not None else default_prefix_cache_bytes()
        self._drafting = _drafting(draft, self.footprint, budget)
        self.prefix_cache = PrefixCache(
            budget - self._draft_prefix_budget,
            store=prefix_store_for(loaded, self.footprint, self.kv_bits, self.context_tokens)
            if persist_prefixes
            else None,
        )
        self.memory_limits = hold_limits(self, self.memory_plan())

    def memory_plan(self, context: int | None = None, prefill_chunk: int = PREFILL_CHUNK_TOKENS) -> MemoryPlan:
        """What this model needs at `context` tokens (default: its trained length, at most 32k) on this machine."""
        if context is None:
            context = min(self.context_tokens, 32768)
        return plan_memory(
            machine_memory(),
            self.footprint,
            context,
            prefill_chunk=prefill_chunk,
            prefix_cache_bytes=self.prefix_cache.budget_bytes + self._draft_prefix_budget,
            already_ours=mx.get_active_memory() + mx.get_cache_memory(),
        )

    @property
    def draft(self) -> LoadedModel | None:
        """The draft model loaded for speculative decoding, if any."""
        return self._draft

    @property
    def _draft_prefix_budget(self) -> int:
        drafting = self._drafting
        return drafting.prefix_cache.budget_bytes if drafting is not None and drafting.prefix_cache else 0

    def warm(self, prefix: Prompt, *, chat: bool | None = None, adapter: str | None = None) -> int:
        """Prefill `prefix` once and keep its KV in memory and on disk, for every later prompt that starts with it
        (with `adapter`, those that run with that adapter: KV is kept under the adapter's content).

        A list of messages (a system prompt, a document to ask about) is rendered
        without the assistant's turn, so later chats that continue it match. Returns
        the number of tokens warmed.

        Example:
            >>> model.warm([{"role": "system", "content": open("manual.txt").read()}])
        """
        ids, images = self._prefix_ids(prefix, chat)
        chosen = self.choose_adapter(adapter)
        store = self.prefix_cache.store
        if store is None:  # no tokenizer, or the model files could not be fingerprinted (warned at load)
            log.warning("%s: warming the prefix in memory only; it will not be kept on disk", self.path)
        else:
            store.check_room(len(ids))  # a full or unwritable cache folder fails now, not after the prefill
        warm_alone(self.runtime, ids, images=images, adapter=chosen)
        return len(ids)

    def _prefix_ids(self, prefix: Prompt, chat: bool | None) -> tuple[list[int], PromptImages | None]:
        """The ids to warm (and their images); SamplingError if empty or longer than the context, checked before
        any prefill."""
        context = self.context_tokens
        if _text_chars(prefix) > context * MAX_CHARS_PER_TOKEN:
            raise SamplingError(f"the prefix to warm is far longer than the model's context of {context} tokens")
        images = None
        if isinstance(prefix, (list, tuple)) and prefix and isinstance(prefix[0], dict):
            ids, images = encode_chat(self.tokenizer, self.vision, prefix, context, add_generation_prompt=False)
        else:
            ids = self.encode_prompt(prefix, chat=chat)
        if not ids:
            raise SamplingError("the prefix to warm is empty; give some text, messages or token ids")
        if len(ids) > context:
            raise SamplingError(
                f"the prefix to warm has {len(ids)} tokens; the model's context is {context}; shorten it"
            )
        return ids, images

    @property
    def runtime(self) -> ModelRuntime:
        """The parts a ServingThread serves requests with (this model's weights, tokenizer and prefix cache)."""
        return ModelRuntime(
            decoder=self._loaded.model,
            tokenizer=self._loaded.tokenizer,
            prefix_cache=self.prefix_cache,
            footprint=self.footprint,
            kv_bits=self.kv_bits,
            eos_token_ids=frozenset(self.eos_token_ids),
            context_tokens=self.context_tokens,
            draft=self._drafting,
            step_costs=self._step_costs,
        )

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Tokens that end a generation: the tokenizer's and the model config's."""
        tokenizer = self._loaded.tokenizer
        return tuple(dict.fromkeys((tokenizer.eos_token_ids if tokenizer else ()) + self.config.eos_token_ids))

    @property
    def context_tokens(self) -> int:
        """The longest sequence (prompt + answer) this model was trained for."""
        return int(self.config.args.get("max_position_embeddings") or 4096)

    @property
    def cache_stats(self) -> PrefixCacheStats:
        """Prefix-cache totals: hits, cached tokens, hit rate, bytes held, evictions."""
        return self.prefix_cache.stats

    @property
    def tokenizer(self) -> Tokenizer:
        if self._loaded.tokenizer is None:
            raise TokenizerError(f"{self._loaded.path}: this model was loaded without a tokenizer")
        return self._loaded.tokenizer

    @property
    def config(self) -> Any:
        return self._loaded.config

    @property
    def path(self) -> Path:
        return self._loaded.path

    @property
    def compute_dtype(self) -> str:
        return dtype_name(self._loaded.compute_dtype)

    def generate(
        self,
        prompt: Prompt,
        *,
        chat: bool | None = None,
        schema: Any = None,
        regex: str | None = None,
        choices: Sequence[str] | None = None,
        **options: Any,
    ) -> GenerationResult:
        """Generate a completion. A string is a raw prompt unless `chat=True`; a list of
        messages always uses the chat template. `images` (a model that reads them): paths,
        bytes, PIL images or NumPy arrays, placed before the prompt's text (or at each of
        the model's placeholders in a raw prompt: Gemma 3's <start_of_image>, SmolVLM's
        <image>); in messages, image parts instead:
        {"type": "image", "image": ...}. Options: max_tokens, temperature, top_p,
        top_k, min_p, repetition_penalty, seed, stop, prefill_chunk_tokens, use_cache, snapshot_every,
        speculate ("auto", "off", "lookup" or "draft"; default: the model's, see `load`).
        A sampling field left out takes the model's own (its generation_config.json, see
        `model.sampling_defaults`), else greedy decoding's.

        Structured output (one of): `schema` (a pydantic model class, a JSON-schema dict or its
        JSON text; `result.parsed` is the answer as an object), `regex` (the whole answer
        matches it), `choices` (the answer is one of these strings).

        Example:
            >>> city = model.chat("What is the capital of France?", schema=City).parsed  # a City instance
            >>> model.chat("Is the sky blue?", choices=["yes", "no"]).text in ("yes", "no")
            True
        """
        structure = structure_of(schema, regex, choices)
        run = self._stream(prompt, chat, structure, **options)
        for _ in run:
            pass
        return GenerationResult(text=run.text(), token_ids=list(run.ids), stats=run.stats, structure=structure)

    def chat(self, messages: str | Sequence[Message], **options: Any) -> GenerationResult:
        """Answer a conversation (or a single user message given as a string)."""
        return self.generate(messages, chat=True, **options)

    def stream(
        self,
        prompt: Prompt,
        *,
        chat: bool | None = None,
        schema: Any = None,
        regex: str | None = None,
        choices: Sequence[str] | None = None,
        **options: Any,
    ) -> TextGeneration:
        """Iterate over text chunks as they are generated; `.stats` is filled when done.
        Options as in `generate`.

        With `use_cache` (the default) a prompt that starts like an earlier one
        (a system prompt, a document, the earlier turns of a chat) reuses its KV.
        On models with sliding-window or recurrent layers it resumes from the
        deepest state snapshot within the shared part; `snapshot_every` sets how
        many prompt tokens lie between snapshots. `schema`, `regex` and `choices`
        constrain the text as in `generate`; the grammar is compiled before this returns."""
        return self._stream(prompt, chat, structure_of(schema, regex, choices), **options)

    def _stream(
        self,
        prompt: Prompt,
        chat: bool | None,
        structure: Structure | None,
        *,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        stop: str | Sequence[str] | None = None,
        prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS,
        use_cache: bool = True,
        snapshot_every: int = SNAPSHOT_EVERY,
        speculate: str | None = None,
        images: Sequence[Any] | None = None,
        adapter: str | None = None,
        **sampling: Any,
    ) -> TextGeneration:
        try:
            params = with_defaults(sampling, self.sampling_defaults.values)
        except TypeError as e:
            raise SamplingError(f"unknown generation option: {e}") from None
        ids, placed = self._encode_images(prompt, chat, images, use_cache)
        eos = self.eos_token_ids
        # Compiled here, before any prefill: a schema the matcher cannot enforce fails at the call.
        constraint = structure.constraint(self.tokenizer, self.config.vocab_size, eos) if structure else None
        request = GenerationRequest(
            prompt_ids=ids,
            max_tokens=max_tokens,
            sampling=params,
            eos_token_ids=eos,
            prefill_chunk_tokens=prefill_chunk_tokens,
            kv_bits=self.kv_bits,
            snapshot_every=snapshot_every,
            constraint=constraint,
            speculate=check_mode(self.speculate if speculate is None else speculate, self.runtime.draft),
            images=placed,
            adapter=self.choose_adapter(adapter),
        )
        if stop is not None and not isinstance(stop, (str, list, tuple)):
            raise SamplingError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        return TextGeneration(self.runtime, request, stop=stops, use_cache=use_cache)

    def _encode_images(
        self, prompt: Prompt, chat: bool | None, images: Sequence[Any] | None, use_cache: bool = True
    ) -> tuple[list[int], PromptImages | None]:
        """Ids and the images placed among them: image parts in messages, or `images` with a raw prompt (at each
        placeholder, else first) or a single user message. With `use_cache`, frames the prefix cache holds
        already skip the tower."""
        prefix = self.prefix_cache if use_cache else None
        if images is not None and not isinstance(images, (list, tuple)):
            raise SamplingError(f"images must be a list (of paths, bytes, PIL images or arrays), got {shown(images)}")
        messages = _as_messages(prompt, chat)
        if messages is not None:
            if images:
                raise SamplingError("with messages, put images in their content as {'type': 'image', 'image': ...}")
            return encode_chat(self.tokenizer, self.vision, messages, self.context_tokens, prefix=prefix)
        if isinstance(prompt, str) and images:
            if chat:
                parts = [*({"type": "image", "image": image} for image in images), {"type": "text", "text": prompt}]
                messages = [{"role": "user", "content": parts}]
                return encode_chat(self.tokenizer, self.vision, messages, self.context_tokens, prefix=prefix)
            return encode_text(self.tokenizer, self.vision, prompt, images, self.context_tokens, prefix=prefix)
        if images:
            raise SamplingError("images need a text prompt or messages, not token ids")
        return self.encode_prompt(prompt, chat=chat), None

    @property
    def vision(self) -> VisionModel | None:
        """The vision tower of a model that reads images (Gemma 3, SmolVLM), else None."""
        return self._loaded.vision

    def encode_prompt(self, prompt: Prompt, chat: bool | None = None) -> list[int]:
        """Token ids for a raw string, a chat (list of messages or a string with chat=True) or ids."""
        if isinstance(prompt, np.ndarray):
            prompt = prompt.tolist()
        if isinstance(prompt, str):
            if chat:
                return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(prompt)
        items = list(prompt)
        if items and all(is_int(t) for t in items):
            return _check_ids(items, self.config.vocab_size)
        if chat is False:
            raise SamplingError("a list of messages needs the chat template; drop chat=False")
        return self.tokenizer.encode_chat(items)

    @property
    def adapter_set(self) -> AdapterSet | None:
        """The adapters' slots over this model (adapters/adapter_set.py), None where none was ever loaded."""
        return getattr(self._loaded.model, "adapters", None)

    @property
    def adapters(self) -> dict[str, Path]:
        """The adapters loaded over this model (`load(..., adapters=...)`), {name for `adapter=`: folder}."""
        return {a.name: a.path for a in self.adapter_set.loaded} if self.adapter_set else {}

    def load_adapter(self, name: str, path: str | Path, limit: int = MAX_ADAPTERS) -> None:
        """Load one more adapter over this model, the least recently used idle one unloaded past `limit`."""
        add_adapter(self._loaded, name, path, limit)

    def choose_adapter(self, adapter: str | None) -> Chosen:
        """What a request naming `adapter` (None: the bare base) runs with; AdapterError if none is called so."""
        if adapter is None:
            return NO_ADAPTER
        if self.adapter_set is None:
            raise AdapterError(f"adapter {shown(adapter)}: loaded without adapters (see load's adapters=)")
        return self.adapter_set.choose(adapter)

    def logits(
        self, token_ids: Iterable[int], chunk_tokens: int = PREFILL_CHUNK_TOKENS, adapter: str | None = None
    ) -> np.ndarray:
        """Next-token logits at every position, float32 numpy of shape (T, vocab); with `adapter`, its."""
        return np.concatenate(list(self.logit_chunks(token_ids, chunk_tokens, adapter)), axis=0)

    def logit_chunks(
        self, token_ids: Iterable[int], chunk_tokens: int = PREFILL_CHUNK_TOKENS, adapter: str | None = None
    ) -> Iterator[np.ndarray]:
        """`logits` one chunk at a time, (chunk_tokens, vocab) each: for a progress bar, or to keep
        only one chunk of a long text's logits in memory. Bad arguments raise here, not at the first chunk."""
        if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise SamplingError(f"chunk_tokens must be a positive integer, got {shown(chunk_tokens)}")
        if isinstance(token_ids, np.ndarray):
            token_ids = token_ids.tolist()
        ids = mx.array(_check_ids(list(token_ids), self.config.vocab_size), dtype=mx.uint32)
        return self._logit_chunks(ids, chunk_tokens, self.choose_adapter(adapter).slot)

    def _logit_chunks(self, ids: mx.array, chunk_tokens: int, slot: int) -> Iterator[np.ndarray]:
        cache = make_cache(self._loaded.model.cache_kinds, self.kv_bits, positions=ids.size)
        for start in range(0, ids.size, chunk_tokens):
            model = self._loaded.model
            with selected(model, [slot]):
                part = model.head(model.hidden(ids[None, start : start + chunk_tokens], cache))[0]
            part = part.astype(mx.float32)
            mx.eval(part)
            yield np.array(part)

    @property
    def verified(self) -> bool:
        """Whether the family was checked against transformers; False for mlx-lm's model code run as it is."""
        return self._loaded.config.verified

    @property
    def architecture(self) -> str:
        """The model_type, labelled when unverified."""
        kind = self._loaded.config.model_type
        return kind if self.verified else f"{kind} (unverified)"

    def __repr__(self) -> str:
        loaded = self._loaded
        quant = f", {loaded.quantized_layers} quantized layers" if loaded.quantized_layers else ""
        quant += " run from float32" if loaded.weights.kept == "dense" else ""
        return (
            f"Model({loaded.path.name}: {self.architecture}, {loaded.config.num_layers} layers{quant}, "
            f"{mib(loaded.weights_bytes)}, compute {self.compute_dtype})"
        )

    def _repr_html_(self) -> str:
        loaded = self._loaded
        rows = [
            ("path", loaded.path),
            ("architecture", f"{self.architecture}, {loaded.config.num_layers} layers"),
            ("weights", f"{mib(loaded.weights_bytes)}, {loaded.quantized_layers} quantized layers"),
            ("compute dtype", self.compute_dtype),
            ("KV cache", f"{self.kv_bits}-bit" if self.kv_bits else self.compute_dtype),
            ("context", f"{self.context_tokens} tokens"),
            ("sampling", self.sampling_defaults.describe()),
            ("prefix cache", f"{mib(self.cache_stats.bytes_held)} of {mib(self.cache_stats.budget_bytes)}"),
        ]
        return html_table(f"Model {loaded.path.name}", rows)

    def embed(
        self,
        inputs: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        *,
        pooling: str = "mean",
        normalize: bool = True,
        chunk_tokens: int = PREFILL_CHUNK_TOKENS,
    ) -> np.ndarray:
        """Embeddings: the final hidden states (after the last norm, before the LM head) pooled over each
        input's tokens ("mean", or "last": the last token's), unit length unless `normalize=False`; float32 numpy
        of shape (inputs, hidden). A string or a list of token ids is one input; text is encoded as it is (no
        chat template). EmbeddingError for a model whose hidden states cannot be had (an unverified family).

        Example:
            >>> vectors = model.embed(["a cat", "a dog"])
            >>> float(vectors[0] @ vectors[1])  # cosine similarity
        """
        from .engine import embed, split_inputs

        items = split_inputs(inputs)
        ids = [self.tokenizer.encode(item) if isinstance(item, str) else item for item in items]
        return embed(
            self._loaded.model,
            ids,
            pooling,
            normalize,
            vocab_size=self.config.vocab_size,
            kv_bits=self.kv_bits,
            chunk_tokens=chunk_tokens,
        )


def _as_messages(prompt: Prompt, chat: bool | None) -> list[Message] | None:
    """`prompt` if it is a list of messages, else None."""
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        if chat is False:
            raise SamplingError("a list of messages needs the chat template; drop chat=False")
        return list(prompt)
    return None


def _text_chars(prompt: Any) -> int:
    """Characters of text in a prompt or in its messages' string contents (token ids: 0)."""
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, (list, tuple)):
        return sum(len(m["content"]) for m in prompt if isinstance(m, dict) and isinstance(m.get("content"), str))
    return 0


def _stated_sampling(loaded: LoadedModel) -> SamplingDefaults:
    """The sampling the model's files recommend, checked as a request's would be: a value out of range is the
    file's fault, named with it."""
    try:
        SamplingParams(**loaded.sampling.values)
    except SamplingError as e:
        raise ConfigError(f"{loaded.path}: {loaded.sampling.source}: {e}") from None
    return loaded.sampling


def _check_ids(ids: list[Any], vocab_size: int) -> list[int]:
    if not ids:
        raise SamplingError("token_ids is empty")
    bad = [t for t in ids if not is_int(t) or not 0 <= t < vocab_size]
    if bad:
        raise SamplingError(f"token ids must be integers in [0, {vocab_size}), got {bad[:5]}")
    return [int(t) for t in ids]


def _drafting(draft: LoadedModel | None, target: ModelFootprint, prefix_budget: int) -> DraftRuntime | None:
    """What serves a draft model: its footprint, and a share of the prefix cache's budget that keeps as many
    tokens of a prompt as the target's share does (so the draft model rarely reads a prompt the target resumes)."""
    if draft is None:
        return None
    draft_footprint = footprint(draft)
    per_token = [f.cache_bytes(1024) for f in (target, draft_footprint)]
    share = per_token[1] / max(1, sum(per_token))
    return DraftRuntime(draft.model, PrefixCache(int(prefix_budget * share)), draft_footprint)


def load(
    path: str | Path | None = None,
    *,
    dtype: str | None = None,
    prefix_cache_bytes: int | None = None,
    kv_bits: int | None = None,
    draft_model: str | Path | None = None,
    speculate: str = "auto",
    cpu_weights: str | None = None,
    adapters: dict[str, str | Path] | None = None,
) -> Model:
    """Load a model folder or .gguf file, or a model by the name `mlxinfer ls` shows; with no path, the default
    model (fetched once).

    `prefix_cache_bytes` caps the prompt-prefix cache (default: from the memory planner; 0 turns it off).
    `kv_bits` 8 or 4 stores the KV cache quantized (about 2x / 3.5x less memory per token than 16 bits).
    `draft_model`: a small model with the same tokenizer, for speculative decoding. `speculate` (the default
    of every call): "auto" speculates while it measures it faster (with the draft model if given, else prompt
    lookup), "lookup" or "draft" always do, "off" never; output is the same either way (greedy: token for
    token; sampled: the same distribution). `cpu_weights` (on a CPU): "dense" runs quantized layers from float32
    copies, "quantized" from their stored bits, "auto" (the default, or MLXINFER_CPU_WEIGHTS) whichever measures
    faster and fits. `adapters` ({name: folder}): LoRA or DoRA adapters as mlx-lm or PEFT save them, over this
    one copy of the base; a call names one with `adapter=` (none: the base), and calls for different ones batch
    together.

    Example:
        >>> model = mlxinfer.load("~/models/Qwen3-0.6B-4bit")
        >>> tuned = mlxinfer.load("~/models/Qwen3-0.6B-4bit", adapters={"sql": "~/adapters/sql"})
        >>> tuned.chat("List the tables.", adapter="sql").text
    """
    loaded = load_model(located(path) if path is not None else default_model_path(), dtype=dtype,
                        cpu_weights=cpu_weights)  # fmt: skip
    loaded = with_adapters(loaded, adapters) if adapters else loaded
    draft = load_model(located(draft_model), dtype=dtype, cpu_weights=cpu_weights) if draft_model is not None else None
    return Model(loaded, prefix_cache_bytes=prefix_cache_bytes, kv_bits=kv_bits, draft=draft, speculate=speculate)
