"""The tokenizer: a `tokenizers` backend plus the model's special tokens and chat template.

Chat prompts are tokenized so that control tokens come only from the template:
a user who types `<|im_end|>` gets those characters as text, not a turn break.
Chats without such text tokenize exactly as transformers' apply_chat_template.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from ..errors import ChatTemplateError, TokenizerError
from ..untrusted import first_line, read_json_object, read_text, shown
from .chat_template import render_chat, template_variables

MAX_TOKENIZER_BYTES = 128 << 20  # the largest real tokenizer.json files (256k vocabularies) are ~35 MB


def _new_marker() -> str:
    # Marks special-token text that came from message content. A fresh random
    # marker per render: user text cannot forge or disarm it.
    return f"\ue000{secrets.token_hex(8)}\ue001"


Message = dict[str, Any]


class Tokenizer:
    """Encode text and chats, decode ids.

    Example:
        >>> tok = Tokenizer.from_folder(Path("SmolLM2"))
        >>> ids = tok.encode_chat([{"role": "user", "content": "Hi"}])
        >>> tok.decode(ids)
    """

    def __init__(
        self,
        backend: Backend,
        *,
        eos_token_ids: Sequence[int] = (),
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
    ):
        self.backend = backend
        # A second backend that treats special-token strings as plain text.
        self._plain = Backend.from_str(backend.to_str())
        self._plain.encode_special_tokens = True
        added = backend.get_added_tokens_decoder()
        self.special_ids = {i: t.content for i, t in added.items() if t.special}
        self._special_by_text = {text: i for i, text in self.special_ids.items()}
        self.bos_token, self.eos_token = bos_token, eos_token
        eos = list(eos_token_ids)
        eos_id = backend.token_to_id(eos_token) if eos_token else None
        if eos_id is not None:
            eos.append(eos_id)
        self.eos_token_ids = tuple(dict.fromkeys(eos))
        self.chat_template = chat_template
        self._special_pattern = "|".join(re.escape(t) for t in sorted(self._special_by_text, key=len, reverse=True))
        self._special_re = re.compile(self._special_pattern) if self._special_pattern else None

    @classmethod
    def from_folder(cls, folder: Path, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and any chat_template file."""
        path = folder / "tokenizer.json"
        if not path.exists():
            raise TokenizerError(
                f"{folder}: tokenizer.json is missing; mlxinfer needs a fast-tokenizer file "
                "(save one with transformers' tokenizer.save_pretrained)"
            )
        text = read_text(path, TokenizerError, MAX_TOKENIZER_BYTES)
        try:
            backend = Backend.from_str(text)
        except Exception as e:  # the Rust parser raises plain Exception
            raise TokenizerError(f"{path}: cannot be parsed ({first_line(e)})") from None
        config_path = folder / "tokenizer_config.json"
        config = _read_json(config_path)
        return cls(
            backend,
            eos_token_ids=eos_token_ids,
            bos_token=_token_text(config, "bos_token", config_path),
            eos_token=_token_text(config, "eos_token", config_path),
            chat_template=_chat_template(folder, config),
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of plain text; special-token strings in it stay text."""
        return self._encode_ids(self._plain, _valid_text(text), add_special_tokens)

    def encode_images(self, text: str, placeholder: str, expansions: Sequence[str]) -> list[int]:
        """A raw prompt with images: the k-th `placeholder` in `text` becomes the k-th expansion (its special
        tokens read as such; one past them stays text); the rest is plain text, encoded as `encode` does."""
        first, *rest = _valid_text(text).split(placeholder)
        ids, texts = self.encode(first), iter(expansions)
        for piece in rest:
            expansion = next(texts, None)
            image = self._encode_ids(self.backend, expansion, False) if expansion else self._plain_ids(placeholder)
            ids += image + self._plain_ids(piece)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        variables: dict[str, Any] | None = None,
    ) -> str:
        """The rendered prompt text (for display; use encode_chat to tokenize).

        `tools`: OpenAI-style function definitions the template renders (transformers' `tools=`); `variables`: more
        names the template reads (enable_thinking, reasoning_effort; see `template_variables`)."""
        marker = _new_marker()
        return self._render(messages, add_generation_prompt, marker, tools, variables).replace(marker, "")

    @property
    def template_variables(self) -> frozenset[str]:
        """The names the chat template reads that a caller may set (none without a template)."""
        return template_variables(self.chat_template) if self.chat_template else frozenset()

    def encode_chat(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        images: tuple[str, Sequence[str]] | None = None,
        variables: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of a chat rendered with the model's template (and `tools`, as apply_chat_template).

        `images`: (placeholder, expansions): the k-th placeholder the template wrote for an image part becomes the
        k-th expansion (that image's tokens) before tokenizing, as transformers' processors do (a placeholder a
        user typed stays text); placeholders past the expansions are left as they are."""
        marker = _new_marker()
        rendered = _valid_text(self._render(messages, add_generation_prompt, marker, tools, variables))
        if images is not None:
            placeholder, expansions = images
            texts = iter(expansions)
            pattern = f"(?<!{re.escape(marker)}){re.escape(placeholder)}"
            rendered = re.sub(pattern, lambda m: next(texts, m.group(0)), rendered)
        if marker not in rendered:
            return self._encode_ids(self.backend, rendered, False)
        # Message content held special-token text: split at the template's own
        # control tokens only, and encode everything between them as plain text.
        ids: list[int] = []
        text_start = 0
        for match in re.finditer(f"({re.escape(marker)})?({self._special_pattern})", rendered):
            if match.group(1):
                continue
            ids += self._plain_ids(rendered[text_start : match.start()].replace(marker, ""))
            ids.append(self._special_by_text[match.group(2)])
            text_start = match.end()
        return ids + self._plain_ids(rendered[text_start:].replace(marker, ""))

    def _plain_ids(self, text: str) -> list[int]:
        return self._encode_ids(self._plain, text, False) if text else []

    @staticmethod
    def _encode_ids(backend: Backend, text: str, add_special_tokens: bool) -> list[int]:
        # Backend.encode holds the GIL throughout: a 4 MB prompt stopped every other Python thread (the
        # scheduler's, /health) for seconds. The batch calls release it; the fast one skips offsets, unused here.
        encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)  # older tokenizers lack it
        return encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def _render(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool,
        marker: str,
        tools: list[dict[str, Any]] | None,
        variables: dict[str, Any] | None = None,
    ) -> str:
        if not self.chat_template:
            raise ChatTemplateError(
                "this model has no chat template (tokenizer_config.json, chat_template.jinja or GGUF metadata); "
                "use a raw prompt (--raw) instead"
            )
        safe = [_escape_message(m, self._special_re, marker) for m in _validate(messages)]
        # Like transformers: `tools` is defined for the template only when given.
        extra = {} if tools is None else {"tools": _escape_value(tools, self._special_re, marker)}
        return render_chat(
            self.chat_template,
            safe,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **extra,
            **(variables or {}),
        )


def _valid_text(text: str) -> str:
    if not isinstance(text, str):
        raise TokenizerError(f"expected text (str), got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise TokenizerError(
            f"text has invalid Unicode at position {e.start} ({shown(text[e.start : e.end])}); pass valid UTF-8 text"
        ) from None
    return text


def _validate(messages: Sequence[Message]) -> Sequence[Message]:
    if not messages:
        raise ChatTemplateError("a chat needs at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ChatTemplateError(f"message {i} must be a dict with 'role' and 'content', got {shown(m)}")
        # An assistant message that calls tools may have no content (OpenAI sends null, or leaves it out).
        if "content" not in m and not (m["role"] == "assistant" and m.get("tool_calls")):
            raise ChatTemplateError(f"message {i} must be a dict with 'role' and 'content', got {shown(m)}")
    return messages


def _escape_message(message: Message, specials: re.Pattern[str] | None, marker: str) -> Message:
    """Every field the client wrote, escaped: content, reasoning_content, name, tool_call_id and tool calls
    (templates render them all, and clients echo back reasoning that came from tool results and web pages).
    Only `role` is read as is: templates compare it. A missing content renders as None (tool calls only)."""
    escaped = {k: v if k == "role" else _escape_value(v, specials, marker) for k, v in message.items()}
    return {"content": None, **escaped}


def _escape_value(value: Any, specials: re.Pattern[str] | None, marker: str) -> Any:
    """Every string in `value` (keys too) with its special-token text marked, as message content is."""
    if specials is None:
        return value
    if isinstance(value, str):
        return specials.sub(lambda m: marker + m.group(0), value)
    if isinstance(value, dict):
        return {_escape_value(k, specials, marker): _escape_value(v, specials, marker) for k, v in value.items()}
    if isinstance(value, list):
        return [_escape_value(v, specials, marker) for v in value]
    return value


def _read_json(path: Path) -> dict[str, Any]:
    return read_json_object(path, TokenizerError) if path.exists() else {}


def _token_text(config: dict[str, Any], key: str, path: Path) -> str | None:
    """`bos_token`/`eos_token`: a string, an AddedToken-style {"content": ...} object, or null."""
    value = config.get(key)
    text = value.get("content") if isinstance(value, dict) else value
    if text is not None and not isinstance(text, str):
        raise TokenizerError(f"{path}: {key} must be a string or an object with a string 'content', got {shown(value)}")
    return text


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.exists():
        return read_text(jinja_file, ChatTemplateError)
    source, template = folder / "tokenizer_config.json", config.get("chat_template")
    if template is None and (folder / "chat_template.json").exists():
        source = folder / "chat_template.json"
        template = _read_json(source).get("chat_template")
    if isinstance(template, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in template):
        named = {t["name"]: t.get("template") for t in template}  # named templates: use "default"
        template = named.get("default") or next(iter(named.values()), None)
    if template is not None and not isinstance(template, str):
        raise ChatTemplateError(
            f"{source}: chat_template must be a string or a list of {{name, template}} objects, got {shown(template)}"
        )
    return template
