"""Converter peak memory: the forecast `mlxinfer convert` prints against the peak it measures, per source and flags.

Each conversion runs in a process of its own; both figures come from its output (the plan line's "expected peak
memory", the result line's "peak memory": the process's peak RSS). `--gguf FILE` adds F16 and Q8_0 copies of that
GGUF (same metadata, its values re-encoded with the `gguf` package) beside the file itself. The issue's bound: the
forecast at most 15% above the measured peak, never more than 5% below it.

    python -m bench.forecast_bench --source ~/.cache/mlxinfer-tests/bench-models/SmolLM2-135M-Instruct-bf16 \\
        --gguf ~/.cache/mlxinfer-tests/models/SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FLOAT_CASES = {  # a float checkpoint: streamed, with the report, and every method that runs the model
    "rtn": ["--method", "rtn", "--no-eval"],
    "rtn+report": ["--method", "rtn"],
    "8bit": ["--bits", "8", "--no-eval"],
    "gptq": ["--method", "gptq", "--no-eval"],
    "awq": ["--method", "awq", "--no-eval"],
    "dwq": ["--method", "dwq", "--no-eval"],
    "default+report": [],
}
GGUF_CASES = {  # a GGUF file: its blocks kept or rounded, with the report, and GPTQ
    "4bit": ["--bits", "4", "--no-eval"],
    "8bit": ["--bits", "8", "--no-eval"],
    "8bit+report": ["--bits", "8"],
    "gptq-8bit": ["--bits", "8", "--method", "gptq", "--no-eval"],
}
GGUF_COPIES = ("F16", "Q8_0")


def measure(source: Path, flags: list[str], out: Path) -> tuple[int, int, float]:
    """(forecast MiB, measured MiB, seconds) of one conversion in its own process."""
    command = [sys.executable, "-m", "mlxinfer.cli", "convert", str(source), "-o", str(out), "--force", *flags]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed: {done.stderr.strip().splitlines()[-1]}")
    forecast = int(re.search(r"expected peak memory (\d+) MiB", done.stderr).group(1))
    measured = int(re.search(r"peak memory (\d+) MiB", done.stdout).group(1))
    return forecast, measured, time.perf_counter() - started


def write_gguf_copy(source: Path, target: Path, kind_name: str) -> Path:
    """`source` with every matrix re-encoded as F16 or Q8_0 (gguf.quants), read through our one GGUF reader
    (formats/gguf_file.py); metadata and other tensors as they are, each value written with the type its Python
    value takes (strings, 32-bit integers and floats, booleans and arrays of them, as llama.cpp writes these keys)."""
    import gguf
    import numpy as np

    from mlxinfer.formats.gguf_file import GGUFFile

    kind = gguf.GGMLQuantizationType[kind_name]
    with GGUFFile(source) as reader:
        writer = gguf.GGUFWriter(str(target), reader.metadata["general.architecture"])
        for key, value in reader.metadata.items():
            if key not in ("general.architecture", "general.alignment"):  # the writer writes these itself
                _add_value(writer, key, value.tolist() if isinstance(value, np.ndarray) else value)
        for name, info in reader.tensors.items():
            stored = gguf.GGMLQuantizationType(info.ggml_type)
            if len(info.shape) < 2 or stored == gguf.GGMLQuantizationType.F32:  # norms and biases: as stored
                writer.add_tensor(name, np.array(reader.read(name)))
                continue
            values = gguf.quants.dequantize(reader.raw(name), stored).reshape(info.shape).astype(np.float32)
            if kind == gguf.GGMLQuantizationType.F16:
                writer.add_tensor(name, values.astype(np.float16))
            else:
                writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return target


# A llama whose every row is a whole number of 256-value blocks (Gemma 3 270M's 640 and SmolLM2's 576 are not,
# so their files hold no K or IQ type in most matrices): the stand-in for the K and IQ files we have none of.
SYNTHETIC = {"embedding_length": 1024, "feed_forward_length": 2816, "block_count": 6, "attention.head_count": 16,
             "attention.head_count_kv": 4, "rope.dimension_count": 64}  # fmt: skip
# Byte offsets of each block's float16 scale fields (ggml's block layouts); IQ1_M spreads its scale over bits.
F16_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
F16_FIELDS |= dict.fromkeys(("IQ1_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_XS"), (0,))
WEIGHT_STD = 0.02


def write_synthetic_gguf(tokenizer_source: Path, target: Path, kind_name: str, sizes: dict = SYNTHETIC) -> Path:
    """A llama of `sizes` (SYNTHETIC's keys) with `tokenizer_source`'s tokenizer and chat template, whose matrices are
    random `kind_name` blocks (every byte below 0x78, the float16 scale fields set so values have a standard
    deviation of WEIGHT_STD) and whose norms are float32 ones; the embedding is tied, as SmolLM2's."""
    import gguf
    import numpy as np

    from mlxinfer.formats.gguf_file import GGUFFile

    kind, rng = gguf.GGMLQuantizationType[kind_name], np.random.default_rng(0)
    per, size = gguf.GGML_QUANT_SIZES[kind]
    with GGUFFile(tokenizer_source) as reader:
        tokenizer = {k: v for k, v in reader.metadata.items() if k.startswith("tokenizer.")}
    hidden, ffn = sizes["embedding_length"], sizes["feed_forward_length"]
    kv = hidden // sizes["attention.head_count"] * sizes["attention.head_count_kv"]
    vocab = len(tokenizer["tokenizer.ggml.tokens"])

    def blocks(rows: int, cols: int, scale: float) -> np.ndarray:
        raw = rng.integers(0, 0x78, size=(rows, cols // per, size), dtype=np.uint8)
        for offset in F16_FIELDS[kind_name]:
            raw[..., offset : offset + 2] = np.frombuffer(np.float16(scale).tobytes(), np.uint8)
        return raw.reshape(rows, -1)

    probe = gguf.quants.dequantize(blocks(8, 1024, 1e-3), kind)
    scale = 1e-3 * WEIGHT_STD / float(probe.std())
    writer = gguf.GGUFWriter(str(target), "llama")
    for key, value in tokenizer.items():
        _add_value(writer, key, value.tolist() if isinstance(value, np.ndarray) else value)
    for key, value in {**sizes, "context_length": 4096, "vocab_size": vocab}.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.rope.freq_base", 100000.0)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_tensor("token_embd.weight", blocks(vocab, hidden, scale), raw_dtype=kind)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    shapes = {"attn_q": (hidden, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden),
              "attn_output": (hidden, hidden), "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden),
              "ffn_down": (hidden, ffn)}  # fmt: skip
    for layer in range(sizes["block_count"]):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(hidden, np.float32))
        for name, (rows, cols) in shapes.items():
            writer.add_tensor(f"blk.{layer}.{name}.weight", blocks(rows, cols, scale), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def _add_value(writer, key: str, value) -> None:
    import gguf

    if isinstance(value, (list, tuple)):
        sub_type = gguf.GGUFValueType.get_type(value[0]) if value else gguf.GGUFValueType.INT32
        writer.add_key_value(key, list(value), gguf.GGUFValueType.ARRAY, sub_type=sub_type)
    else:
        writer.add_key_value(key, value, gguf.GGUFValueType.get_type(value))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, help="a float checkpoint folder")
    parser.add_argument("--gguf", type=Path, action="append", default=[], help="a GGUF file (repeatable)")
    parser.add_argument("--no-copies", action="store_true", help="measure the GGUF files as given only")
    parser.add_argument("--cases", default="", help="comma-separated case names to run (default: all)")
    parser.add_argument(
        "--synthetic",
        default="",
        help="comma-separated K or IQ types (F16_FIELDS): a synthetic llama of each, with the first --gguf's tokenizer",
    )
    args = parser.parse_args()
    wanted = set(filter(None, args.cases.split(",")))
    with tempfile.TemporaryDirectory(prefix="forecast-bench-") as folder:
        work = Path(folder)
        runs = [(args.source, name, flags) for name, flags in FLOAT_CASES.items()] if args.source else []
        for gguf_file in args.gguf:
            copies = [] if args.no_copies else [
                write_gguf_copy(gguf_file, work / f"{gguf_file.stem}-{kind}.gguf", kind) for kind in GGUF_COPIES
            ]  # fmt: skip
            runs += [(path, name, flags) for path in (gguf_file, *copies) for name, flags in GGUF_CASES.items()]
        for kind in filter(None, args.synthetic.split(",")):
            path = write_synthetic_gguf(args.gguf[0], work / f"synthetic-llama-{kind}.gguf", kind)
            runs += [(path, name, flags) for name, flags in GGUF_CASES.items()]
        print(f"{platform.node()} ({platform.machine()}); {time.strftime('%Y-%m-%d')}")
        print("\n| source | case | flags | forecast MiB | measured MiB | forecast / measured | within | s |")
        print("|---|---|---|---|---|---|---|---|")
        for source, name, flags in runs:
            if not wanted or name in wanted:
                _row(source, name, flags, work / "out")


def _row(source: Path, name: str, flags: list[str], out: Path) -> None:
    forecast, measured, seconds = measure(source, flags, out)
    within = "yes" if 0.95 * measured <= forecast <= 1.15 * measured else "NO"
    ratio = f"{forecast / measured - 1:+.1%}"
    print(f"| {source.name} | {name} | `{' '.join(flags)}` | {forecast} | {measured} | {ratio} | {within} | "
          f"{seconds:.0f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
