#!/usr/bin/env bash
# The CUDA backend in a few minutes, on a Linux machine with an NVIDIA GPU (run from the repository root):
#   1. installs mlxinfer with MLX's CUDA build into .venv-cuda (mlx-cpu removed: both write mlx/lib/libmlx.so);
#   2. parity on the tiny fixtures (tests/test_parity.py against transformers' golden outputs);
#   3. the real default model's answer to "What is the capital of France?";
#   4. prefill and decode tok/s with the fraction of the bandwidth ceiling at batch 1, 2, 4 and 8, for the
#      8-bit model (the issue's goal: decode at batch 1 at least 80% of the ceiling);
#   5. host work per token against mlx-lm and a bare loop, and pipelined batches on and off, on a dispatch-bound
#      fixture (bench/host_bench.py, written with NumPy: no torch needed);
#   6. prefill of 1k, 8k and 32k-token prompts against mlx-lm at SmolLM2-135M's layer sizes, with peak memory
#      (bench/long_prefill_bench.py).
# Figures land in $OUT (default: bench/results/gpu-<date>); record them in bench/README.md with their conditions.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu-$(date +%Y-%m-%d)}
CUDA_EXTRA=${CUDA_EXTRA:-cuda}  # cuda (CUDA 12) or cuda13
mkdir -p "$OUT"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.csv"

python3 -m venv .venv-cuda && . .venv-cuda/bin/activate
pip install -q -e ".[$CUDA_EXTRA]" pytest
mlx_version=$(python -c "import importlib.metadata as m; print(m.version('mlx'))")
backend=$([ "$CUDA_EXTRA" = cuda13 ] && echo mlx-cuda-13 || echo mlx-cuda-12)
pip uninstall -q -y mlx-cpu || true
pip install -q --force-reinstall --no-deps "$backend==$mlx_version"
python -c "import mlx.core as mx; assert mx.cuda.is_available(), 'MLX sees no CUDA GPU'; print(mx.default_device(), mx.device_info())"
python -m mlxinfer.cli doctor --json > "$OUT/doctor.json" || true  # its findings are part of the record

echo "== parity on the tiny fixtures"
timeout 900 python -m pytest -q -p no:cacheprovider tests/test_parity.py | tee "$OUT/parity.txt"

echo "== the real model's answer"
python - <<'EOF' | tee "$OUT/answer.txt"
import mlxinfer
model = mlxinfer.load()
print(repr(model))
answer = model.chat("What is the capital of France?", max_tokens=16).text
print(answer)
assert "Paris" in answer, answer
EOF

echo "== speed: batch 1 (mlxinfer bench) and 1/2/4/8 streams, 8-bit"
eight=$(mktemp -d)/smollm2-8bit
python -m mlxinfer.cli convert "$(python -c 'from mlxinfer.default_model import default_model_path as p; print(p())')" \
  -o "$eight" --bits 8 --no-eval
python -m mlxinfer.cli bench "$eight" --json > "$OUT/bench-8bit.json"
python -m bench.batch_bench --model "$eight" --weights quantized --decode 128 --out "$OUT"

echo "== host work per token and pipelined batches (issue 37), dispatch-bound fixture"
python -m bench.host_bench --runs 3 --out "$OUT"
fixture=$(python -c 'from bench.host_bench import prepare_fixture as p; print(p())')
python -m bench.batch_bench --model "$fixture" --weights auto --decode 200 --rounds 3 --out "$OUT"

echo "== long prompts (issue 37): prefill at 1k/8k/32k against mlx-lm"
python -m bench.long_prefill_bench --runs 2 --out "$OUT"
echo "figures in $OUT"
