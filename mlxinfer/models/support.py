"""What each architecture gets, made from the registries: the README's architecture table.

`python -m mlxinfer.models.support` prints the table; tests/test_readme.py checks that the README holds
exactly this text, so a family added to the registry (or a GGUF architecture) shows up there or fails CI.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass

from .gguf_arch import ARCHITECTURES as GGUF_ARCHITECTURES
from .gguf_arch import WRITTEN_AS
from .multimodal import WRAPPERS, Wrapper
from .registry import ARCHITECTURES, ArchSpec
from .vision import vision_builder

HEADER = ("family", "status", "GGUF import", "converter", "prefix cache", "batching", "KV quantization")


@dataclass(frozen=True)
class Support:
    family: str
    status: str
    gguf: str
    converter: str
    prefix_cache: str
    batching: str
    kv_quantization: str


def support_rows() -> list[Support]:
    """One row per verified model_type, then the unverified fallback's."""
    rows = [_verified(model_type, spec) for model_type, spec in sorted(ARCHITECTURES.items())]
    rows.append(
        Support(
            "any other model_type mlx-lm ships a module for",
            "unverified (mlx-lm's model code, labelled)",
            "no",
            "yes",
            "cut at any position; state snapshots where it keeps a window or a state",
            "one request at a time",
            "no",
        )
    )
    return rows


def _verified(model_type: str, spec: ArchSpec) -> Support:
    wrappers = sorted(name for name, w in WRAPPERS.items() if w.text_type == model_type)
    family = f"`{model_type}`" + "".join(f", `{w}` ({_reads(WRAPPERS[w], w)})" for w in wrappers)
    gguf = [f"`{name}`" for name, arch in sorted(GGUF_ARCHITECTURES.items()) if arch.model_type == model_type]
    if model_type in WRITTEN_AS:
        gguf.append(f"`{WRITTEN_AS[model_type]}` (as llama.cpp writes it)")
    windows = spec.sliding != "none"
    if spec.recurrent_kinds or spec.sliding in ("alternate", "pattern"):  # always windows or a state
        prefix = "state snapshots"
    else:
        prefix = "cut at any position" + ("; snapshots with a sliding window" if windows else "")
    if spec.float_kv_only:
        kv = "no"
    else:
        kv = "8 or 4 bits" + (" (attention layers)" if spec.recurrent_kinds else "")
    return Support(family, "verified", ", ".join(gguf) or "no", "yes", prefix, "yes", kv)


def support_markdown() -> str:
    lines = [_row(HEADER), _row(("---",) * len(HEADER))]
    lines += [_row(astuple(row)) for row in support_rows()]
    return "\n".join(lines) + "\n"


def _row(cells: tuple[str, ...]) -> str:
    return "| " + " | ".join(cells) + " |"


def _reads(wrapper: Wrapper, model_type: str) -> str:
    """What a vision-language wrapper runs: its images too where the family file has a vision tower."""
    return (
        "vision-language: images and text" if vision_builder(wrapper, model_type) else "vision-language: its text model"
    )


if __name__ == "__main__":
    print(support_markdown(), end="")
