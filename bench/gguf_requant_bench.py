"""Which MLX affine type each GGUF type that no MLX group holds should be rounded onto (formats/gguf_requant.py).

For every such type: the relative RMS error that rounding its dequantized values onto each MLX affine grid
(2-8 bits, groups of 32/64/128) adds, per row averaged, and the bits per weight each grid holds (codes plus a
16-bit scale and bias per group). The pick is the least error among the grids within 1.1x the source's bits per
weight (IQ1 and IQ2: gguf_requant.USABLE_BITS in groups of 64; IQ4: groups of 32; the end-to-end rows show why).
Sources: the real Q6_K tensors of a Q4_K_M file when one is given (--gguf), and random blocks of every type (bytes
below 0x78, so every f16 field is finite). Every row rounds as the loader rounds (gguf_requant.round_affine).

`--real DIR` adds a row per type found in DIR's GGUF files (bench/make_gguf_types.sh writes them with llama.cpp's
llama-quantize): all tensors of that type in the file holding most of them, rounded as the loader rounds them
(a comment line adds mx.quantize's rounding and plain min-max rounding, the loader's rule before 2026-12-08).

`--real DIR --end-to-end` instead loads each file as a user would: mlxinfer.load's defaults, cpu_weights=
"quantized", and a reference holding every tensor as the gguf package dequantizes it (float32); each is scored on
bench/heldout_bench.py's held-out texts (code, technical prose, chat; BOS first where the tokenizer adds one):
perplexity, and the mean KL(reference || model) per position. More loads, each with mlxinfer.load's defaults:
`--grid IQ2_XXS=4,64` another grid for that type; `--rounding mlx` mx.quantize's rounding (`min-max`: plain
min-max rounding); `--per-type` one per requantized type in the file, only its tensors requantized (the others
as the reference holds them). `--llama-cpp BIN` adds llama.cpp's llama-perplexity on the same file, beside
mlxinfer's perplexity on exactly its windows and tokens.

    python -m bench.gguf_requant_bench [--gguf gemma-3-270m-q4_k_m.gguf] [--real DIR] [--no-random]
    python -m bench.gguf_requant_bench --real DIR --end-to-end [--files IQ2_XXS,Q2_K-pure] [--tokens 512]
        [--no-quantized] [--grid TYPE=BITS,GROUP ...] [--rounding mlx|min-max ...] [--per-type]
        [--llama-cpp /tmp/llamacpp/build/bin]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import subprocess
import tempfile
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from mlxinfer.formats import gguf_file, gguf_requant
from mlxinfer.formats.gguf_file import GGUFFile
from mlxinfer.formats.gguf_kquants import pack_bits
from mlxinfer.formats.gguf_requant import BLOCK_ALIGNED, HELD_WIDER, REQUANTIZED, USABLE_BITS, round_affine

GRIDS = [(bits, group) for bits in (2, 3, 4, 5, 6, 8) for group in (32, 64, 128)]
SIZE_BOUND = 1.1
TOKENS = 512  # tokens scored per kind of text, as bench/heldout_bench.py's default
LLAMA_CTX, LLAMA_CHUNKS = 256, 2  # llama-perplexity's window and windows per text (it scores each one's 2nd half)


def relative_rms(values: np.ndarray, back: np.ndarray) -> np.ndarray:
    """Per row: the RMS of back - values over the RMS of values."""
    return np.sqrt(((back - values) ** 2).mean(axis=1) / np.maximum((values**2).mean(axis=1), 1e-30))


def added_error(values: np.ndarray, bits: int, group: int) -> float:
    """MLX's mx.quantize round trip, averaged over rows."""
    w = mx.array(values)
    back = np.array(mx.dequantize(*mx.quantize(w, group_size=group, bits=bits), group_size=group, bits=bits))
    return float(relative_rms(values, back).mean())


def loader_errors(values: np.ndarray, bits: int, group: int, how=round_affine) -> np.ndarray:
    """Per row: what the loader adds (gguf_requant.round_affine, or `how`; then MLX's dequantize)."""
    packed, scales, biases = (mx.array(a) for a in how(values, bits, group))
    return relative_rms(values, np.array(mx.dequantize(packed, scales, biases, group_size=group, bits=bits)))


def random_values(kind: GGMLQuantizationType, rows: int = 2048, cols: int = 256) -> np.ndarray:
    per, size = GGML_QUANT_SIZES[kind]
    raw = np.random.default_rng(int(kind)).integers(0, 0x78, size=(rows, cols // per * size), dtype=np.uint8)
    return dequantize(raw, kind).reshape(rows, cols).astype(np.float32)


def source_bpw(kind: GGMLQuantizationType) -> float:
    per, size = GGML_QUANT_SIZES[kind]
    return 8 * size / per


def fitting(kind: GGMLQuantizationType) -> list[tuple[int, int]]:
    """The grids holding at most SIZE_BOUND x the source's bits per weight (2-bit group 128 when none does); for the
    IQ1 and IQ2 types, gguf_requant's USABLE_BITS in groups of 64, for the IQ4 types 4 bits in groups of 32 (the
    end-to-end rows show why)."""
    if int(kind) in HELD_WIDER:
        return [(USABLE_BITS, 64)]
    if int(kind) in BLOCK_ALIGNED:
        return [(4, 32)]
    return [g for g in GRIDS if g[0] + 32 / g[1] <= SIZE_BOUND * source_bpw(kind)] or [(2, 128)]


def pick(kind: GGMLQuantizationType, values: np.ndarray) -> tuple[tuple[int, int], dict]:
    errors = {(bits, group): float(loader_errors(values, bits, group).mean()) for bits, group in GRIDS}
    return min(fitting(kind), key=errors.__getitem__), {"source_bpw": source_bpw(kind), "errors": errors}


def table_row(label: str, kind: GGMLQuantizationType, errors: dict, measured: str) -> str:
    """One row: the pick within the bound, gguf_requant.py's grid (and its error where it differs)."""
    chosen, current = min(fitting(kind), key=errors.__getitem__), REQUANTIZED[int(kind)]
    agrees = "same" if current == chosen else f"DIFFERS: {current}, {errors[current]:.4f}"
    cells = [label, f"{source_bpw(kind):.3f}", chosen, f"{errors[chosen]:.4f}", f"{errors[(8, 32)]:.4f}", agrees]
    return "| " + " | ".join(str(c) for c in [*cells, measured]) + " |"


# Real tensors: llama.cpp's files of each type


def real_sources(folder: Path) -> dict[GGMLQuantizationType, tuple[Path, list[str]]]:
    """Per REQUANTIZED type in folder's files: the file holding most tensors of it, and their names."""
    found: dict[GGMLQuantizationType, tuple[Path, list[str]]] = {}
    for path in sorted(folder.glob("*.gguf")):
        with GGUFFile(path) as f:
            by_type: dict[int, list[str]] = {}
            for name, info in f.tensors.items():
                by_type.setdefault(info.ggml_type, []).append(name)
        for kind, names in by_type.items():
            if kind in REQUANTIZED and len(names) > len(found.get(GGMLQuantizationType(kind), (None, []))[1]):
                found[GGMLQuantizationType(kind)] = (path, names)
    return dict(sorted(found.items()))


def real_errors(path: Path, names: list[str], kind: GGMLQuantizationType) -> tuple[dict, int]:
    """Every grid's per-row error (the loader's rounding; ("mx", bits, group): mx.quantize's, ("min-max", bits,
    group): min-max rounding's, for the grids within the bound), averaged over all rows of `names`; and the rows."""
    sums: dict = dict.fromkeys(GRIDS, 0.0)
    rows = 0
    with GGUFFile(path) as f:
        for name in names:
            cols = f.tensors[name].shape[-1]
            values = np.asarray(dequantize(f.raw(name), kind), dtype=np.float32).reshape(-1, cols)
            for grid in GRIDS:
                sums[grid] += float(loader_errors(values, *grid).sum())
            for bits, group in fitting(kind):
                mlx = added_error(values, bits, group) * len(values)
                plain = float(loader_errors(values, bits, group, min_max_rounding).sum())
                sums["mx", bits, group] = sums.get(("mx", bits, group), 0.0) + mlx
                sums["min-max", bits, group] = sums.get(("min-max", bits, group), 0.0) + plain
            rows += len(values)
    return {key: total / rows for key, total in sums.items()}, rows


def real_rows(folder: Path) -> list[str]:
    """Per type: the table's row (the loader's rounding), then the errors within the bound, each rounding."""
    lines = []
    for kind, (path, names) in real_sources(folder).items():
        errors, rows = real_errors(path, names, kind)
        shown = f"{path.name}: {len(names)} tensors, {rows:,} rows"
        lines.append(table_row(f"{kind.name} (real, llama.cpp)", kind, errors, shown))
        fits = [
            f"{b}b g{g} {errors[(b, g)]:.4f} ({errors[('mx', b, g)]:.4f}, {errors[('min-max', b, g)]:.4f})"
            for b, g in fitting(kind)
        ]
        lines.append("<!-- within the bound, round_affine (mx.quantize, min-max): " + ", ".join(fits) + " -->")
    return lines


# End to end: each file loaded as a user would, against its own dequantized values


@contextmanager
def dequantized_reads(only: int | None = None) -> Iterator[None]:
    """GGUFFile.read gives every quantized tensor as the gguf package dequantizes it, in float32 (but the tensors of
    type `only`, read as the loader reads them)."""
    read, kept = GGUFFile.read, (gguf_file.F32, gguf_file.F16, gguf_file.BF16, only)

    def dequantized(self: GGUFFile, name: str):
        info = self.tensors[name]
        if info.ggml_type in kept:
            return read(self, name)
        values = dequantize(self.raw(name), GGMLQuantizationType(info.ggml_type))
        return values.astype(np.float32).reshape(info.shape)

    GGUFFile.read = dequantized
    try:
        yield
    finally:
        GGUFFile.read = read


@contextmanager
def grids(overrides: dict[int, tuple[int, int]]) -> Iterator[None]:
    """REQUANTIZED (and the loader's sizing table) with `overrides`, in this process only."""
    saved = dict(REQUANTIZED), dict(gguf_file.AFFINE)
    REQUANTIZED.update(overrides)
    gguf_file.AFFINE.update(overrides)
    try:
        yield
    finally:
        for table, before in zip((REQUANTIZED, gguf_file.AFFINE), saved):
            table.clear()
            table.update(before)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def load_logged(path: Path, cpu_weights: str | None = None):
    """(mlxinfer.load(path), what the GGUF reader logged about requantized types)."""
    import mlxinfer

    handler, logger = _Lines(), logging.getLogger("mlxinfer.models.gguf")
    logger.addHandler(handler)
    try:
        model = mlxinfer.load(path, cpu_weights=cpu_weights, speculate="off", prefix_cache_bytes=0)
    finally:
        logger.removeHandler(handler)
    return model, [line for line in handler.lines if "rounded once more" in line]


def scored_texts(model) -> dict[str, list[int]]:
    """bench/heldout_bench.py's held-out texts, whole, BOS first where the tokenizer adds one. A model without a
    chat template (Gemma 3 270M's GGUF is the base model) reads the chat as plain "role: content" lines."""
    from bench.heldout_bench import ROOT, texts
    from mlxinfer.errors import ChatTemplateError

    bos = model.tokenizer.encode("")
    try:
        found = texts(model)
    except ChatTemplateError:
        encode_prompt = model.encode_prompt
        turns = json.loads((ROOT / "bench" / "data" / "chat_turns.json").read_text())
        plain = "\n\n".join(f"{t['role']}: {t['content']}" for t in turns)
        model.encode_prompt = lambda _chat, chat: model.tokenizer.encode(plain)
        try:
            found = texts(model)
        finally:
            model.encode_prompt = encode_prompt
    return {kind: ids if kind == "chat" else bos + ids for kind, ids in found.items()}


def score(models: list, ids: list[int]) -> tuple[list[float], list[float]]:
    """Each model's perplexity on ids, and each one's mean KL(models[0] || it) per scored position."""
    from quantize.quality import log_probs

    nll, kl = [0.0] * len(models), [0.0] * len(models)
    chunks = zip(*(m.logit_chunks(ids, 32) for m in models))
    for start, parts in zip(range(0, len(ids), 32), chunks):
        targets = np.asarray(ids[start + 1 : start + 1 + len(parts[0])])
        probs = [log_probs(p[: len(targets)].astype(np.float64)) for p in parts]
        for i, p in enumerate(probs):
            nll[i] -= float(p[np.arange(len(targets)), targets].sum())
            kl[i] += float((np.exp(probs[0]) * (probs[0] - p)).sum())
    return [math.exp(n / (len(ids) - 1)) for n in nll], [k / (len(ids) - 1) for k in kl]


def parse_grids(specs: list[str]) -> list[dict[int, tuple[int, int]]]:
    """["IQ2_XXS=4,64", ...] -> one override each."""
    found = []
    for spec in specs:
        name, _, grid = spec.partition("=")
        bits, group = (int(x) for x in grid.split(","))
        found.append({int(GGMLQuantizationType[name]): (bits, group)})
    return found


def file_types(path: Path) -> str:
    with GGUFFile(path) as f:
        counts = Counter(GGMLQuantizationType(t.ggml_type).name for t in f.tensors.values())
    return ", ".join(f"{n} {kind}" for kind, n in counts.most_common())


def end_to_end(path: Path, args: argparse.Namespace) -> tuple[list[str], dict]:
    """Rows for one file: the reference, mlxinfer's default load, the quantized load, each override's."""
    with dequantized_reads():
        reference, _ = load_logged(path, cpu_weights="dense")
    ids = scored_texts(reference)
    loads = planned_loads(path, args)
    models, notes = [reference], []
    for load in loads:
        with grids(load.override), rounding(load.how), dequantized_reads(load.only) if load.only else nullcontext():
            model, logged = load_logged(path, cpu_weights=load.mode)
        models.append(model)
        kept = f"{load.label}: kept {model._loaded.weights.kept}; "
        notes.append(kept + (" / ".join(logged) or "no requantized line"))
    results = {kind: score(models, kind_ids[: args.tokens]) for kind, kind_ids in ids.items()}
    rows = []
    for i, label in enumerate(["reference (gguf.quants, float32)"] + [load.label for load in loads]):
        cells = [f"{results[k][0][i]:.2f} / {results[k][1][i]:.4f}" for k in ids]
        gaps = [results[k][0][i] / results[k][0][0] - 1 for k in ids]
        mean_kl = sum(results[k][1][i] for k in ids) / len(ids)
        rows.append(
            f"| {path.stem} | {label} | " + " | ".join(cells) + f" | {100 * np.mean(gaps):+.2f}% | {mean_kl:.4f} |"
        )
    return rows + [f"<!-- {n} -->" for n in notes], {"models": models, "ids": ids}


class Load(NamedTuple):
    label: str
    mode: str | None = None  # cpu_weights; None: mlxinfer.load's default
    override: dict = {}  # REQUANTIZED entries replaced (grids)
    how: str | None = None  # the rounding (rounding)
    only: int | None = None  # requantize only this type's tensors, the others as the reference holds them


def planned_loads(path: Path, args: argparse.Namespace) -> list[Load]:
    present = _types_in(path)
    loads = [Load("default")] + [Load("quantized", "quantized")] * (not args.no_quantized)
    loads += [Load(f"default, {_shown(o)}", override=o) for o in parse_grids(args.grid) if set(o) & present]
    loads += [Load(f"default, {r} rounding", how=r) for r in args.rounding]
    if args.per_type:
        each = sorted(present & set(REQUANTIZED))
        loads += [Load(f"default, only {GGMLQuantizationType(k).name} requantized", only=k) for k in each]
    return loads


def mlx_rounding(values: np.ndarray, bits: int, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """mx.quantize's rounding (one edge of each group kept exact, zero near a code) instead of min-max."""
    return tuple(np.array(a) for a in mx.quantize(mx.array(values), group_size=group, bits=bits))


def min_max_rounding(values: np.ndarray, bits: int, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Plain min-max rounding to nearest: the loader's rule before its per-group grid search."""
    groups = values.reshape(len(values), -1, group)
    low, high = groups.min(axis=-1), groups.max(axis=-1)
    scale = (high - low) / ((1 << bits) - 1)
    scale = np.where(scale > 0, scale, np.float32(1))
    q = np.clip(np.rint((groups - low[..., None]) / scale[..., None]), 0, (1 << bits) - 1)
    return pack_bits(q.astype(np.uint8).reshape(values.shape), bits), scale.astype(np.float32), low.astype(np.float32)


@contextmanager
def rounding(how: str | None) -> Iterator[None]:
    """gguf_requant's rounding replaced by "mlx" or "min-max" (every requantized tensor), in this process only."""
    saved = gguf_requant.round_affine
    gguf_requant.round_affine = {None: saved, "mlx": mlx_rounding, "min-max": min_max_rounding}[how]
    try:
        yield
    finally:
        gguf_requant.round_affine = saved


def _shown(override: dict[int, tuple[int, int]]) -> str:
    return ", ".join(f"{GGMLQuantizationType(k).name} {b}-bit g{g}" for k, (b, g) in override.items())


def _types_in(path: Path) -> set[int]:
    with GGUFFile(path) as f:
        return {t.ggml_type for t in f.tensors.values()}


# llama.cpp's llama-perplexity on the same file, beside mlxinfer's perplexity on exactly its windows and tokens


def llama_run(binary: Path, path: Path, text: Path, *flags: str) -> str:
    command = [str(binary), "-m", str(path), "-f", str(text), "-t", "2", "--no-escape", *flags]
    done = subprocess.run(["nice", "-n", "19", *command], capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{binary.name} on {path.name} failed ({done.returncode}): {done.stderr[-400:]}")
    return done.stdout + done.stderr


def llama_perplexity(bin_dir: Path, path: Path, text: Path) -> float:
    flags = ("-c", str(LLAMA_CTX), "-b", str(LLAMA_CTX), "--chunks", str(LLAMA_CHUNKS), "--no-repack")
    out = llama_run(bin_dir / "llama-perplexity", path, text, *flags)
    return float(re.search(r"Final estimate: PPL = ([0-9.]+)", out).group(1))


def window_perplexity(model, ids: list[int], bos: int) -> float:
    """llama-perplexity's score on ids: per window of LLAMA_CTX tokens, its first replaced by BOS, the second
    half's tokens each predicted from the window before it."""
    nll, count, first = 0.0, 0, LLAMA_CTX // 2
    for start in range(0, LLAMA_CHUNKS * LLAMA_CTX, LLAMA_CTX):
        window = [bos] + ids[start + 1 : start + LLAMA_CTX]
        logits = model.logits(window)[first : LLAMA_CTX - 1].astype(np.float64)
        logits -= logits.max(axis=-1, keepdims=True)
        picked = logits[np.arange(len(logits)), window[first + 1 :]]
        nll -= float((picked - np.log(np.exp(logits).sum(axis=-1))).sum())
        count += len(logits)
    return math.exp(nll / count)


def llama_rows(bin_dir: Path, path: Path, loaded: dict) -> list[str]:
    """Per kind: llama-perplexity's PPL, and mlxinfer's on the same windows (reference, default)."""
    reference, default = loaded["models"][:2]
    cells = []
    with tempfile.TemporaryDirectory() as scratch:
        for ids in loaded["ids"].values():
            text = Path(scratch) / "text.txt"  # llama.cpp tokenizes the text itself: special tokens stay text
            bos = reference.tokenizer.encode("")
            text.write_text(reference.tokenizer.decode(ids[len(bos) :], skip_special_tokens=False))
            out = llama_run(bin_dir / "llama-tokenize", path, text, "--ids", "--no-parse-special", "--log-disable")
            llama_ids = [int(x) for x in re.findall(r"\d+", out.strip().splitlines()[-1])]
            if len(llama_ids) < LLAMA_CHUNKS * LLAMA_CTX:
                cells.append(f"{len(llama_ids)} tokens: too few")
                continue
            ours = [window_perplexity(m, llama_ids, llama_ids[0]) for m in (reference, default)]
            cells.append(f"{llama_perplexity(bin_dir, path, text):.2f} / {ours[0]:.2f} / {ours[1]:.2f}")
    return [f"| {path.stem} | " + " | ".join(cells) + " |"]


def end_to_end_tables(folder: Path, args: argparse.Namespace) -> None:
    wanted = args.files.split(",") if args.files else None
    files = [
        p for p in sorted(folder.glob("*.gguf")) if wanted is None or any(p.stem.endswith("-" + w) for w in wanted)
    ]
    kinds = ("code", "technical prose", "chat")
    print(f"\n{args.tokens} tokens per kind; each cell: perplexity / mean KL(reference || row)")
    print("| file | weights | " + " | ".join(f"{k}: ppl / KL" for k in kinds) + " | mean ppl gap | mean KL |")
    print("|---|---|" + "---|" * (len(kinds) + 2))
    llama = []
    for path in files:
        print(f"<!-- {path.name}: {file_types(path)} -->")
        rows, loaded = end_to_end(path, args)
        print("\n".join(rows), flush=True)
        if args.llama_cpp:
            llama += llama_rows(args.llama_cpp, path, loaded)
        del loaded
        mx.clear_cache()
    if llama:
        print(f"\nllama-perplexity -c {LLAMA_CTX} --chunks {LLAMA_CHUNKS}; each cell: llama.cpp / mlxinfer reference")
        print("on the same windows and token ids / mlxinfer default on them")
        print("| file | " + " | ".join(kinds) + " |")
        print("|---|" + "---|" * len(kinds))
        print("\n".join(llama))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, help="a GGUF file with real Q6_K tensors (a Q4_K_M file)")
    parser.add_argument("--real", type=Path, help="a folder of GGUF files (bench/make_gguf_types.sh OUT)")
    parser.add_argument("--end-to-end", action="store_true", help="with --real: load and score each file, only")
    parser.add_argument("--grid", action="append", default=[], help="with --end-to-end: TYPE=BITS,GROUP, a row more")
    parser.add_argument("--llama-cpp", type=Path, help="with --end-to-end: llama.cpp's build/bin folder")
    parser.add_argument("--files", help="with --end-to-end: only these files (their names' last part: Q6_K,...)")
    parser.add_argument("--tokens", type=int, default=TOKENS, help="with --end-to-end: tokens per kind of text")
    parser.add_argument("--no-quantized", action="store_true", help="with --end-to-end: skip the quantized load")
    parser.add_argument("--per-type", action="store_true", help="with --end-to-end: a load per requantized type")
    parser.add_argument(
        "--rounding", action="append", default=[], choices=("mlx", "min-max"), help="with --end-to-end: a load more"
    )
    parser.add_argument("--no-random", action="store_true", help="skip the random and --gguf rows")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    if args.real and args.end_to_end:
        return end_to_end_tables(args.real, args)
    print("| source | bits/weight | pick (bits, group) | its added error | 8-bit g32 | gguf_requant.py | measured on |")
    print("|---|---|---|---|---|---|---|")
    if args.real:
        print("\n".join(real_rows(args.real)), flush=True)
    if not args.no_random:
        random_rows(args.gguf)


def random_rows(gemma: Path | None) -> None:
    sources = []
    if gemma:
        with GGUFFile(gemma) as f:
            names = [n for n, t in f.tensors.items() if t.ggml_type == GGMLQuantizationType.Q6_K][:3]
            if names:
                rows = [np.asarray(dequantize(f.raw(n), GGMLQuantizationType.Q6_K)) for n in names]
                sources.append(
                    ("Q6_K (real)", GGMLQuantizationType.Q6_K, np.concatenate([r.reshape(-1, 256) for r in rows]))
                )
    sources += [
        (f"{GGMLQuantizationType(k).name} (random)", GGMLQuantizationType(k), None) for k in sorted(REQUANTIZED)
    ]
    for label, kind, values in sources:
        values = random_values(kind) if values is None else values
        _, info = pick(kind, values)
        measured = "Q4_K_M file, 3 tensors" if label.endswith("(real)") else f"{len(values):,} random rows"
        print(table_row(label, kind, info["errors"], measured), flush=True)


if __name__ == "__main__":
    main()
