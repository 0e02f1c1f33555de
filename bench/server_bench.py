"""Server figures: aggregate tokens/s and TTFT at 1, 2, 4 and 8 concurrent streams, ours against mlx_lm.server.

Both servers run as subprocesses on the same model folder, one after the other
at each concurrency level (the order alternates, so drift on this noisy
machine does not always favour one). Each stream is a streaming chat request
with its own question; TTFT is from sending the request to its first content
chunk, tokens/s is all streams' completion tokens over the level's wall time.
The 4-bit folder is stored with float32 scales and norms, so both servers
compute in float32, the fast dtype of MLX's CPU backend (on a Mac pass
`--model` with the folder you want).
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

LEVELS = (1, 2, 4, 8)
TOPICS = [
    "a lighthouse",
    "a fox",
    "the sea",
    "a robot",
    "a garden",
    "the moon",
    "a train",
    "a violin",
    "a desert",
    "snow",
]


def run_server_bench(model: Path, max_tokens: int = 48, rounds: int = 2, quick: bool = False) -> dict[str, Any]:
    from mlxinfer.speed.conditions import conditions

    levels, rounds, max_tokens = ((1, 2), 1, 8) if quick else (LEVELS, rounds, max_tokens)
    with tempfile.TemporaryDirectory(prefix="mlxinfer-server-bench-") as work:
        served = _float32_copy(model, Path(work) / model.name) if _has_bf16(model) else model
        servers = {"mlxinfer": _start_ours(served, work), "mlx_lm": _start_mlx_lm(served)}
        try:
            for server in servers.values():
                server.wait_ready()
                server.stream("Say hi.", max_tokens=4)  # warm-up: kernels, allocator, the system prompt's KV
            results = []
            for i, level in enumerate(levels):
                order = list(servers) if i % 2 == 0 else list(reversed(servers))
                row: dict[str, Any] = {"streams": level}
                for name in order:
                    row[name] = _level(servers[name], level, rounds, max_tokens, salt=f"{i}-{name}")
                row["tps_ratio"] = row["mlxinfer"]["tokens_per_s"] / row["mlx_lm"]["tokens_per_s"]
                results.append(row)
        finally:
            for server in servers.values():
                server.stop()
    return {
        "conditions": conditions(),
        "model": str(model),
        "served_folder_dtype": "float32 scales and norms (4-bit weights unchanged)",
        "max_tokens": max_tokens,
        "rounds_per_level": rounds,
        "warm_up": "one 4-token request per server before measuring",
        "results": results,
    }


class _Server:
    def __init__(self, name: str, command: list[str], port: int, ready_path: str):
        self.name, self.port, self.ready_path = name, port, ready_path
        self.url = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} server exited with {self.process.returncode}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} server did not start in {timeout:.0f} s")

    def stream(self, question: str, max_tokens: int) -> dict[str, float]:
        body = {  # no "model": each server then uses the one it loaded
            "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start, first, tokens, chunks = time.perf_counter(), None, None, 0
        with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=600) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if data.get("usage"):
                    tokens = data["usage"]["completion_tokens"]
                for choice in data.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        chunks += 1
                        first = first or time.perf_counter()
        end = time.perf_counter()
        return {"ttft_s": (first or end) - start, "tokens": tokens if tokens is not None else chunks, "end": end}

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def _level(server: _Server, streams: int, rounds: int, max_tokens: int, salt: str) -> dict[str, float]:
    ttfts, tokens, wall = [], 0, 0.0
    for r in range(rounds):
        questions = [
            f"Write a short story about {TOPICS[(k + r) % len(TOPICS)]} ({salt}-{r}-{k})." for k in range(streams)
        ]
        barrier = threading.Barrier(streams)

        def one(question: str, barrier: threading.Barrier = barrier) -> dict[str, float]:
            barrier.wait()  # all streams start together
            return server.stream(question, max_tokens)

        start = time.perf_counter()
        with ThreadPoolExecutor(streams) as pool:
            done = list(pool.map(one, questions))
        wall += max(d["end"] for d in done) - start
        ttfts += [d["ttft_s"] for d in done]
        tokens += sum(int(d["tokens"]) for d in done)
    return {
        "tokens_per_s": tokens / wall,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p95_s": _percentile(ttfts, 0.95),
        "completion_tokens": tokens,
        "requests": len(ttfts),
    }


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_ours(model: Path, work: str) -> _Server:
    port = _free_port()
    command = [sys.executable, "-m", "mlxinfer.cli", "serve", str(model), "--port", str(port), "--max-batch", "8"]
    return _Server("mlxinfer", command, port, "/health")


def _start_mlx_lm(model: Path) -> _Server:
    port = _free_port()
    command = [
        sys.executable,
        "-m",
        "mlx_lm.server",
        "--model",
        str(model),
        "--port",
        str(port),
        "--log-level",
        "ERROR",
    ]
    return _Server("mlx_lm", command, port, "/v1/models")


def _has_bf16(model: Path) -> bool:
    import mlx.core as mx

    return any(a.dtype == mx.bfloat16 for f in model.glob("*.safetensors") for a in mx.load(str(f)).values())


def _float32_copy(model: Path, target: Path) -> Path:
    """`model` with its floating-point tensors (scales, biases, norms) stored as float32."""
    import shutil

    import mlx.core as mx

    shutil.copytree(model, target, ignore=shutil.ignore_patterns("*.safetensors"))
    for file in model.glob("*.safetensors"):
        arrays = mx.load(str(file))
        floats = {k: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in arrays.items()}
        mx.save_safetensors(str(target / file.name), floats, metadata={"format": "mlx"})
    config = json.loads((target / "config.json").read_text())
    config["torch_dtype"] = "float32"
    (target / "config.json").write_text(json.dumps(config, indent=1))
    return target


def markdown(figures: dict[str, Any]) -> str:
    c = figures["conditions"]
    lines = [
        f"Server: {Path(figures['model']).name} ({figures['served_folder_dtype']}), streaming chat, "
        f"max_tokens {figures['max_tokens']}, greedy, {figures['rounds_per_level']} round(s) per level; "
        f"{c['chip']}, {c['cores']} cores, {c['memory_bytes'] / 2**30:.0f} GiB, {c['os']}, {c['backend']}; "
        f"mlx {c['versions']['mlx']}, mlx-lm {c['versions']['mlx-lm']}",
        "",
        "| streams | mlxinfer tok/s | mlx_lm.server tok/s | ratio "
        "| mlxinfer TTFT p50 / p95 (s) | mlx_lm TTFT p50 / p95 (s) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in figures["results"]:
        ours, theirs = r["mlxinfer"], r["mlx_lm"]
        lines.append(
            f"| {r['streams']} | {ours['tokens_per_s']:.1f} | {theirs['tokens_per_s']:.1f} | {r['tps_ratio']:.2f}x | "
            f"{ours['ttft_p50_s']:.2f} / {ours['ttft_p95_s']:.2f} | "
            f"{theirs['ttft_p50_s']:.2f} / {theirs['ttft_p95_s']:.2f} |"
        )
    return "\n".join(lines)
