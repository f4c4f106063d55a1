#!/usr/bin/env bash
# Build and time TensorRT engines from the two exported decode steps (dense and tinyserve) with trtexec.
#
# NOT RUN IN THIS PROJECT: TensorRT (and a GPU) cannot be installed on its machines. The ONNX files it
# consumes are verified here only by ONNX Runtime (CPU) and by a static check of every node against
# TensorRT's ONNX parser support matrix (tests/export/test_trt_check.py). Expect to adjust flags to your
# TensorRT version. Needs TensorRT >= 9.2 for bfloat16 bounds (the default bounds_dtype); export with
# '{"bounds_dtype": "float32"}' for older versions.
#
# Usage:
#   python -m tinyserve_compile.export --dense --out dense.onnx --max-cache-len 8192
#   python -m tinyserve_compile.export --out tinyserve.onnx --max-cache-len 8192 --options '{"token_budget": 2048}'
#   bench/trt_build.sh dense.onnx tinyserve.onnx [out_dir] [position]
#
# position (default: max-cache-len minus 64) is the cache slot the timed step writes, i.e. the context
# length being timed; the caches and bounds themselves are random, which does not change the work done.
# The in-place state update that OrtDecoder uses (output bound to the input buffer) is not reproduced
# by trtexec: each timed step also copies the state, as a plain engine call would.
set -euo pipefail

dense=${1:?usage: trt_build.sh dense.onnx tinyserve.onnx [out_dir] [position]}
sparse=${2:?usage: trt_build.sh dense.onnx tinyserve.onnx [out_dir] [position]}
out=${3:-trt_out}
position=${4:-}
command -v trtexec >/dev/null || { echo "trtexec not found: install TensorRT (not available on this project's machines)" >&2; exit 2; }
mkdir -p "$out"

for f in "$dense" "$sparse"; do
  name=$(basename "$f" .onnx)
  # inputs that must be valid: input_ids (a token id) and position (a slot inside the cache)
  python3 - "$f" "$out/$name" "$position" <<'EOF'
import sys, numpy as np, onnx
path, stem, pos = sys.argv[1], sys.argv[2], sys.argv[3]
g = onnx.load(path, load_external_data=False).graph
shape = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in g.input}
B, L = shape["position"][0], shape["key.0"][2]
p = int(pos) if pos else L - 64
np.full(shape["input_ids"], 100, np.int64).tofile(stem + ".input_ids.bin")
np.full([B], p, np.int64).tofile(stem + ".position.bin")
print(f"{path}: batch {B}, cache length {L}, timing the step that writes position {p}")
EOF
  trtexec --onnx="$f" --saveEngine="$out/$name.engine" --skipInference \
          --builderOptimizationLevel=3 2>&1 | tee "$out/$name.build.log" | tail -n 3
  trtexec --loadEngine="$out/$name.engine" \
          --loadInputs="input_ids:$out/$name.input_ids.bin,position:$out/$name.position.bin" \
          --warmUp=500 --iterations=200 --avgRuns=50 --useCudaGraph 2>&1 | tee "$out/$name.time.log" \
    | grep -E "GPU Compute Time|Latency|Throughput" || true
done
echo "engines and logs in $out/ (compare the 'GPU Compute Time: ... median' lines of the two .time.log files)"
