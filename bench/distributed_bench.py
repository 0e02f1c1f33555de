"""One model served by 1 rank, a pipeline over 2 and 3 ranks, and tensor parallelism over 3 ranks, in one run.

Each configuration is `mlxinfer serve MODEL [--hostfile hosts.json --parallel MODE] --port 0` in its own process
group (ranks 1..N-1 are its children, joined by MLX's ring backend over loopback), started, warmed up with one
request, then sent `--runs` streamed greedy /v1/completions requests one after another (run k gets the k-th slice
of the shipped prose, the same in every configuration, so the prefix cache never helps). Client side: time to
first token (request sent to first non-empty SSE delta), decode tokens/s (completion tokens after the first over
the time after the first delta), and the text, which must equal the 1-rank text (greedy decoding).

Inter-rank traffic is computed from the shapes (hidden size x activation bytes per token), not measured. All ranks
share this machine's cores and talk over loopback: a stand-in for Thunderbolt, not a measurement of it.

    python -m bench.distributed_bench [--model PATH] [--prompt-tokens 128] [--decode-tokens 64] [--runs 2]
                                      [--out bench/results/<date>-vm-distributed]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path
from typing import Any

import httpx
import psutil

from mlxinfer.data import prose_text
from mlxinfer.default_model import default_model_path
from mlxinfer.distributed.estimate import DEFAULT_HOP_LATENCY_S
from mlxinfer.distributed.layer_sizes import read_layer_sizes
from mlxinfer.models import load_tokenizer
from mlxinfer.models.dtype import DTYPES, choose_compute_dtype, dtype_name
from mlxinfer.speed.conditions import conditions

CONFIGS = (("1 rank", None, 1), ("pipeline", "pipeline", 2), ("pipeline", "pipeline", 3), ("tensor", "tensor", 3))
CLI = [sys.executable, "-c", "from mlxinfer.cli import main; main()"]
WARMUP_TOKENS = 8
START_S = 600.0
LINKS_GBPS = {"Thunderbolt 4 (40 Gb/s)": 40.0, "10 Gigabit Ethernet": 10.0}


def prompts(tokenizer: Any, tokens: int, count: int) -> list[str]:
    """`count` texts of about `tokens` tokens each, disjoint slices of the shipped prose (prompt 0: the warm-up)."""
    ids = tokenizer.encode(prose_text(), add_special_tokens=False)
    while len(ids) < tokens * count:
        ids += ids
    return [tokenizer.decode(ids[k * tokens : (k + 1) * tokens]).strip() for k in range(count)]


def traffic(parallel: str | None, ranks: int, hidden_bytes: int, layers: int) -> dict[str, Any]:
    """Bytes each token's hidden states put on the ring, from the shapes (computed, not measured).

    Pipeline: N-1 hops of one hidden state, then the last rank's output summed into every rank (ring all-reduce:
    each rank sends 2(N-1)/N of it, in 2(N-1) steps). Tensor: two such all-reduces per layer. The same bytes per
    token in prefill (every prompt token's hidden state travels), but one message per chunk, not per token."""
    if ranks == 1:
        return {"bytes_per_token_total": 0, "bytes_per_token_busiest_rank": 0, "messages_per_step": 0}
    share = 2 * (ranks - 1) * hidden_bytes / ranks  # one rank's part of one ring all-reduce
    if parallel == "pipeline":
        total = (ranks - 1) * hidden_bytes + ranks * share
        busiest = hidden_bytes + share  # ranks 0..N-2: the hop and their part of the sum
        messages = (ranks - 1) + 2 * (ranks - 1)  # in sequence: the hops, then the all-reduce's steps
        collectives = 1
    else:
        total = 2 * layers * ranks * share
        busiest = 2 * layers * share
        messages = 2 * layers * 2 * (ranks - 1)
        collectives = 2 * layers
    out: dict[str, Any] = {
        "bytes_per_token_total": round(total),
        "bytes_per_token_busiest_rank": round(busiest),
        "all_reduces_per_step": collectives,
        "messages_per_step": messages,
    }
    # What the link alone costs one decode step, as mlxinfer.distributed.estimate models it: each message in
    # sequence pays the latency, the busiest rank's bytes go at the nominal rate.
    for name, gbps in LINKS_GBPS.items():
        out[f"link_ms_per_token {name}"] = 1e3 * (messages * DEFAULT_HOP_LATENCY_S + busiest / (gbps * 1e9 / 8))
    return out


class Server:
    """`mlxinfer serve` in its own process group, with every line it writes kept."""

    def __init__(self, model: Path, hostfile: Path | None, parallel: str | None, runtime_dir: str):
        command = [*CLI, "serve", str(model), "--port", "0"]
        if hostfile is not None:
            command += ["--hostfile", str(hostfile), "--parallel", parallel]
        env = {**os.environ, "MLXINFER_RUNTIME_DIR": runtime_dir}  # never the user's own server's state file
        self.lines: list[str] = []
        self.url: str | None = None
        self.started = time.perf_counter()
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,  # the other ranks write here too
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,  # one process group: the ranks are its children
            stdin=subprocess.DEVNULL,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip())
            found = re.search(r"Serving .* on (http://\S+)/v1", line)
            if found:
                self.url = found.group(1)

    def wait_ready(self, timeout: float = START_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                time.sleep(0.5)  # the reader's last lines
                raise RuntimeError("serve exited:\n" + "\n".join(self.lines[-20:]))
            if self.url:
                with contextlib.suppress(httpx.TransportError):
                    response = httpx.get(self.url + "/health", timeout=10)
                    if response.status_code == 200:
                        return response.json()
            time.sleep(0.3)
        raise RuntimeError(f"serve did not answer /health within {timeout:.0f} s:\n" + "\n".join(self.lines[-20:]))

    def complete(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        body = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        text, usage, first, last = [], {}, None, None
        start = time.perf_counter()
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=900) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    raise RuntimeError(f"the stream ended with an error: {data['error']}")
                usage = data.get("usage") or usage
                for choice in data.get("choices") or []:
                    if choice.get("text"):
                        last = time.perf_counter()
                        first = first or last
                        text.append(choice["text"])
        tokens = usage.get("completion_tokens", 0)
        after = (last - first) if first is not None else 0.0
        return {
            "ttft_s": (first or time.perf_counter()) - start,
            "decode_tps": (tokens - 1) / after if tokens > 1 and after > 0 else None,
            "completion_tokens": tokens,
            "prompt_tokens": usage.get("prompt_tokens"),
            "text": "".join(text),
        }

    def peak_rss(self) -> list[int]:
        """Each process's peak resident memory (rank 0 first, then its children: the other ranks)."""
        out = []
        with contextlib.suppress(psutil.Error):
            for process in [psutil.Process(self.process.pid), *psutil.Process(self.process.pid).children(True)]:
                with contextlib.suppress(OSError, psutil.Error):
                    status = Path(f"/proc/{process.pid}/status").read_text()
                    out.append(int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024)
        return out

    def stop(self) -> None:
        """SIGTERM the group (the server ends its ranks), then SIGKILL whatever of it is left."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(15)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)


def run_config(model: Path, label: str, parallel: str | None, ranks: int, texts: list[str], args, work: str) -> dict:
    hostfile = None
    if ranks > 1:
        hostfile = Path(work) / f"hosts{ranks}.json"
        hostfile.write_text(json.dumps([{"ssh": "localhost", "ips": ["127.0.0.1"]}] * ranks))
    row: dict[str, Any] = {"config": label, "parallel": parallel, "ranks": ranks}
    server = Server(model, hostfile, parallel, work)
    try:
        health = server.wait_ready()
        row["start_s"] = time.perf_counter() - server.started
        row["rank0_weights_bytes"] = sum(m["weights_bytes"] for m in health["models"])
        warm = server.complete(texts[0], WARMUP_TOKENS)
        row["warmup_s"] = warm["ttft_s"]
        row["runs"] = [server.complete(text, args.decode_tokens) for text in texts[1:]]
        row["peak_rss_bytes"] = server.peak_rss()
    except Exception as error:  # noqa: BLE001 - recorded: one configuration failing must not lose the others
        row["error"] = f"{type(error).__name__}: {error}"
        print(f"!! {label} x{ranks} failed: {row['error']}", flush=True)
    finally:
        server.stop()
        row["log"] = [line for line in server.lines if line.strip() and not line.startswith("INFO:")][:12]
    if "runs" in row:
        row["ttft_s"] = statistics.median(r["ttft_s"] for r in row["runs"])
        row["decode_tps"] = statistics.median(r["decode_tps"] or 0.0 for r in row["runs"])
        print(f"{label} x{ranks}: TTFT {row['ttft_s']:.2f} s, decode {row['decode_tps']:.2f} tok/s", flush=True)
    return row


def loaded_as(model: Path) -> str:
    """How one process holds the model by default on this machine (quantized, or run from float32)."""
    code = "import sys, mlxinfer; print(repr(mlxinfer.load(sys.argv[1])))"
    done = subprocess.run([sys.executable, "-c", code, str(model)], capture_output=True, text=True, timeout=300)
    return done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else "unknown"


def compare(rows: list[dict]) -> None:
    """Ratios to the 1-rank row, and whether each run's text is the 1-rank text."""
    one = rows[0]
    for row in rows:
        if "runs" not in row or "runs" not in one:
            continue
        row["ttft_vs_1_rank"] = row["ttft_s"] / one["ttft_s"]
        row["decode_vs_1_rank"] = row["decode_tps"] / one["decode_tps"] if one["decode_tps"] else None
        row["text_matches_1_rank"] = all(
            a["text"] == b["text"] for a, b in zip(row["runs"], one["runs"], strict=True)
        )  # fmt: skip
        if not row["text_matches_1_rank"]:
            print(f"!!! TEXT MISMATCH: {row['config']} x{row['ranks']} differs from 1 rank !!!", flush=True)
            for a, b in zip(row["runs"], one["runs"], strict=True):
                if a["text"] != b["text"]:
                    print(f"    1 rank: {b['text']!r}\n    this:   {a['text']!r}", flush=True)


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def markdown(report: dict) -> str:
    c, s = report["conditions"], report["settings"]
    lines = [
        f"# One model across ranks on one machine ({c['date']})",
        "",
        f"{c['chip']}, {c['cores']} cores, {c['memory_bytes'] / 2**30:.0f} GiB, {c['os']}, backend {c['backend']}; "
        f"mlx {c['versions']['mlx']}, mlx-lm {c['versions']['mlx-lm']}, mlxinfer {c['versions']['mlxinfer']}; "
        f"BLAS: {c['blas']['name']}. Model: {report['loaded_as']}, hidden size "
        f"{report['hidden_size']}, {report['layers']} layers, activations {report['activation_dtype']}. "
        f"Prompt ~{s['prompt_tokens']} tokens, {s['decode_tokens']} decoded, greedy; {s['warmup']}; "
        f"medians of {s['runs']} runs. {s['setting']}",
        "",
        "| config | ranks | TTFT s, median (min-max) | x 1 rank | decode tok/s, median (min-max) | x 1 rank "
        "| same text | start s "
        "| peak RSS MiB per rank |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        if "error" in r:
            lines.append(f"| {r['config']} | {r['ranks']} | failed: {r['error'].splitlines()[0]} | | | | | | |")
            continue
        rss = " / ".join(f"{b / 2**20:.0f}" for b in r.get("peak_rss_bytes", []))
        same = {True: "yes", False: "**NO**"}[r.get("text_matches_1_rank", True)]
        ttft, tps = _spread([x["ttft_s"] for x in r["runs"]]), _spread([x["decode_tps"] or 0 for x in r["runs"]])
        lines.append(
            f"| {r['config']} | {r['ranks']} | {ttft} | {r.get('ttft_vs_1_rank', 1):.2f}x "
            f"| {tps} | {r.get('decode_vs_1_rank') or 0:.2f}x | {same} | {r['start_s']:.1f} | {rss} |"
        )
    hop = report["hidden_bytes"]
    lines += [
        "",
        f"Inter-rank traffic, computed from the shapes (not measured): one hidden state is {report['hidden_size']} x "
        f"{DTYPES[report['activation_dtype']].size} bytes = {hop:,} bytes per token; prefill moves the same bytes per "
        f"prompt token. Link time per decoded token at {DEFAULT_HOP_LATENCY_S * 1e6:g} us per message "
        "(mlxinfer.distributed.estimate's model).",
        "",
        "| config | ranks | bytes/token, all links | bytes/token, busiest rank | all-reduces per step "
        "| messages in sequence per step | " + " | ".join(f"link ms/token, {n}" for n in LINKS_GBPS) + " |",
        "|---|---|---|---|---|---|" + "---|" * len(LINKS_GBPS),
    ]
    for r in report["rows"]:
        t = r["traffic"]
        if r["ranks"] == 1:
            continue
        links = " | ".join(f"{t[f'link_ms_per_token {n}']:.2f}" for n in LINKS_GBPS)
        lines.append(
            f"| {r['config']} | {r['ranks']} | {t['bytes_per_token_total']:,} | {t['bytes_per_token_busiest_rank']:,} "
            f"| {t['all_reduces_per_step']} | {t['messages_per_step']} | {links} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="default: SmolLM2-135M-Instruct (Q4_1 GGUF)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / f"{date.today().isoformat()}-vm-distributed"
    )
    args = parser.parse_args()
    model = (args.model or default_model_path(download=False)).expanduser().resolve()
    texts = prompts(load_tokenizer(model), args.prompt_tokens, args.runs + 1)
    activation = dtype_name(choose_compute_dtype())  # what every rank computes in on this machine
    sizes = read_layer_sizes(model, dtype=activation)
    hidden_bytes = sizes.activation_bytes
    layers = len(sizes.layer_weight_bytes)
    begin = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="mlxinfer-distributed-bench-") as work:
        for label, parallel, ranks in CONFIGS:
            row = run_config(model, label, parallel, ranks, texts, args, work)
            row["traffic"] = traffic(parallel, ranks, hidden_bytes, layers)
            rows.append(row)
    compare(rows)
    wall = time.perf_counter() - begin
    report = {
        "conditions": conditions(),
        "model": str(model),
        "loaded_as": loaded_as(model),
        "hidden_size": sizes.hidden_size,
        "layers": layers,
        "activation_dtype": activation,
        "hidden_bytes": hidden_bytes,
        "settings": {
            "prompt_tokens": args.prompt_tokens,
            "decode_tokens": args.decode_tokens,
            "runs": args.runs,
            "warmup": f"one {WARMUP_TOKENS}-token request on its own prompt per configuration, excluded",
            "setting": f"All ranks are processes on this one machine ({os.cpu_count()} cores), joined by MLX's "
            "ring backend over loopback: a stand-in for Thunderbolt, not a measurement of it.",
            "traffic": "computed from the shapes, not measured",
        },
        "wall_s": wall,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    print(f"wall {report['wall_s']:.0f} s; wrote {args.out.with_suffix('.json')} and .md")


if __name__ == "__main__":
    main()
