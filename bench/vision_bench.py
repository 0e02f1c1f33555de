"""Images at a real size: SmolVLM-256M-Instruct's configuration (random weights: real ones cannot be downloaded
here) asked about a photograph scaled to 2048 pixels, 4 x 4 tiles and the whole image, 17 frames of 64 tokens:
a 1,088-token image span. mlxinfer and, where it is installed, mlx-vlm read the same folder, each in its own
process, in one run.

Rows: time to the first token of the first question, of a second question about the same picture (mlxinfer's
prefix cache resumes past the image; the tower does not run again), decode tokens/s, peak resident memory.

    python -m bench.vision_bench [--out bench/results/DATE-vm-vision] [--folder DIR]
    (mlx-vlm is not a dependency: pip install --no-deps mlx-vlm num2words to add its rows)
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

IMAGE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "images" / "hopper.jpg"
QUESTIONS = ("Describe this picture.", "Who is in it?")
DECODE_TOKENS = 64
# HuggingFaceTB/SmolVLM-256M-Instruct's sizes: a SmolLM2-135M text model and a 93M-parameter SigLIP tower.
TEXT = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
            rope_theta=100000.0, vocab_size=49280, tie_word_embeddings=True)  # fmt: skip
VISION = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              image_size=512, patch_size=16)  # fmt: skip
PREPROCESSOR = {"image_processor_type": "SmolVLMImageProcessor", "processor_class": "SmolVLMProcessor",
                "do_resize": True, "size": {"longest_edge": 2048}, "max_image_size": {"longest_edge": 512},
                "do_image_splitting": True, "resample": 1, "do_rescale": True, "rescale_factor": 1 / 255,
                "do_normalize": True, "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "do_pad": True}  # fmt: skip
TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"] + [
    f"<row_{r}_col_{c}>" for r in range(1, 5) for c in range(1, 5)
]

OURS = r"""
import json, resource, sys, time
import mlxinfer
path, image, first, second, n = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
model = mlxinfer.load(path, speculate="off")
ask = lambda q: [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": q}]}]
one = model.chat(ask(first), max_tokens=1, temperature=0)
two = model.chat(ask(second), max_tokens=1, temperature=0)
run = model.chat(ask(first), max_tokens=n, temperature=0)
print(json.dumps({"ttft_first": one.stats.ttft_s, "ttft_second": two.stats.ttft_s, "prompt": one.stats.prompt_tokens,
                  "cached_second": two.stats.cached_tokens, "decode_tps": run.stats.decode_tps,
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""

MLX_VLM = r"""
import json, resource, sys
import mlx.core as mx
from mlx_vlm import generate, load
from mlx_vlm.prompt_utils import apply_chat_template
path, image, first, second, n = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
model, processor = load(path)
model.set_dtype(mx.float32)  # as mlxinfer computes on a CPU (MLX's CPU bf16 matmuls are far slower)
rows = []
for q, tokens in ((first, 1), (second, 1), (first, n)):
    prompt = apply_chat_template(processor, model.config, q, num_images=1)
    rows.append(generate(model, processor, prompt, image=[image], max_tokens=tokens, temperature=0.0, verbose=False))
# mlx-vlm reports prompt tokens/s, not a time to the first token: its prefill is the prompt over that rate.
print(json.dumps({"ttft_first": rows[0].prompt_tokens / rows[0].prompt_tps, "prompt": rows[0].prompt_tokens,
                  "ttft_second": rows[1].prompt_tokens / rows[1].prompt_tps, "decode_tps": rows[2].generation_tps,
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def build(folder: Path, tokenizer_from: Path) -> Path:
    """The random-weight SmolVLM-256M folder (transformers writes it), once."""
    if (folder / "config.json").exists():
        return folder
    import torch
    from tokenizers import AddedToken, Tokenizer
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration

    tok = Tokenizer.from_file(str(tokenizer_from / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TOKENS])
    torch.manual_seed(0)
    config = SmolVLMConfig(text_config=TEXT, vision_config=VISION, scale_factor=4,
                           image_token_id=tok.token_to_id("<image>"))  # fmt: skip
    model = SmolVLMForConditionalGeneration(config).to(torch.bfloat16)
    folder.mkdir(parents=True)
    model.save_pretrained(str(folder))
    tok.save(str(folder / "tokenizer.json"))
    from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE

    tokenizer_config = {"chat_template": DEFAULT_CHAT_TEMPLATE, "eos_token": "<end_of_utterance>",
                        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 8192}  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    (folder / "processor_config.json").write_text(
        json.dumps({"image_seq_len": 64, "processor_class": "SmolVLMProcessor"})
    )
    return folder


def measure(child: str, folder: Path) -> dict | str:
    """One runtime's row, or why it could not run."""
    argv = [sys.executable, "-c", child, str(folder), str(IMAGE), *QUESTIONS, str(DECODE_TOKENS)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        return (done.stderr.strip().splitlines() or ["failed"])[-1][:200]
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--folder", type=Path, default=Path.home() / ".cache" / "mlxinfer-bench" / "smolvlm-256m-random"
    )
    parser.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    parser.add_argument("--runtimes", default="mlxinfer,mlx-vlm", help="which rows to measure (comma-separated)")
    args = parser.parse_args()
    from bench.models import prepare_models

    folder = build(args.folder, prepare_models(["bf16"])["bf16"])
    wanted = args.runtimes.split(",")
    rows = {"mlxinfer": measure(OURS, folder)} if "mlxinfer" in wanted else {}
    if "mlx-vlm" in wanted:
        try:
            import mlx_vlm  # noqa: F401

            rows["mlx-vlm"] = measure(MLX_VLM, folder)
        except ImportError:
            rows["mlx-vlm"] = "not installed (pip install --no-deps mlx-vlm num2words)"
    lines = [
        f"# Images: SmolVLM-256M configuration, random weights, a 1,088-token image span ({platform.machine()}, "
        f"{platform.system()})",
        "",
        "| runtime | prompt tokens | first question TTFT | second question TTFT | speedup | decode tok/s | peak RSS |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in rows.items():
        if isinstance(row, str):
            lines.append(f"| {name} | {row} | | | | | |")
            continue
        speedup = row["ttft_first"] / max(row["ttft_second"], 1e-9)
        lines.append(
            f"| {name} | {row['prompt']} | {row['ttft_first']:.2f} s | {row['ttft_second']:.3f} s | {speedup:.1f}x "
            f"| {row['decode_tps']:.1f} | {row['peak_rss'] / 2**20:.0f} MiB |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=2))
        args.out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
