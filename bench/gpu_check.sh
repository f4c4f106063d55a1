#!/usr/bin/env bash
# The GPU check: everything to run when a machine with one CUDA GPU is lent, in < 8 minutes. It times the
# shipped defaults (every selection field of TinyServeConfig(): pages of 8, a sink page, two stages with
# extra candidates keeping single tokens, int8 bounds) first, then the paper's rule.
#
#   pip install -e '.[dev]'              # nothing else is installed; torch with CUDA and triton must be there
#   bash bench/gpu_check.sh              # JSON, logs and summary.json under ${OUT:-results/gpu}
#   bash bench/gpu_check.sh --dry-run    # CPU, tiny shapes, Triton interpreter: the script's logic only
#                                        # (tests/kernels/test_triton_bench_dry_run.py runs this)
#
# Steps, each under `timeout` (seconds; the sum stays under 8 minutes):
#   env           30  torch.cuda.is_available() (exit 2 otherwise), versions, device name
#   kernel_check  90  python -m bench gpu --check-only: the Triton path against the reference (or the op's
#                     PyTorch path where the reference does not fit) at every benchmark shape, both selection
#                     settings (defaults, paper)
#   kernel_bench  90  python -m bench gpu: timings vs SDPA flash/efficient, GB/s vs the device peak, the
#                     defaults first
#   decode_8k    150  python -m bench decode: eager HF, inductor, tinyserve with its defaults; random-init
#                     Llama of SmolLM2's shape, bf16, batch 1, 8K; compiles cold (compile_s comparable
#                     between providers)
#   decode_32k    90  the same at 32K, compiles reusing the caches of the 8K step (compile_s not comparable)
# then a summary (stdout and $OUT/summary.json), with the selection path of each kernel row (stages/kept:
# the defaults run 2/tokens). Exit status: 0 when every step passed, 1 otherwise, 2 without a GPU.
# TIMEOUT_SCALE=N multiplies every limit (the tests use it for --dry-run on a loaded CPU).
set -u
cd "$(dirname "$0")/.."
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; fi
PY=${PYTHON:-$(command -v python || command -v python3)}
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
: > "$OUT/steps.tsv"
T_START=$(date +%s)

# run NAME LIMIT CMD...: one guarded step, its output in $OUT/NAME.log, its status in $OUT/steps.tsv
run() {
    local name=$1 limit=$2
    shift 2
    local t0 rc cmd="$*"
    t0=$(date +%s)
    echo "=== $name (limit ${limit}s): ${cmd:0:200}"
    timeout -k 10 "$(( limit * ${TIMEOUT_SCALE:-1} ))" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    tail -n 25 "$OUT/$name.log"
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && echo "=== $name: TIMED OUT after ${limit}s"
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$limit" >> "$OUT/steps.tsv"
    return "$rc"
}

if [ "$DRY" = 1 ]; then
    export TRITON_INTERPRET=1
    CHECK_ARGS=(--dry-run --contexts 384 --batches 2 --dtypes bf16)
    BENCH_ARGS=(--dry-run --contexts 128 --batches 2 --dtypes bf16)
    DEC_ARGS=(--model tiny --device cpu --dtype bf16 --providers eager,tinyserve --steps 2 --rounds 1 --warmup 1
              --options '{"token_budget": 64, "lower": "eager"}' --prefill-cache "$OUT/prefill" --warm-compile)
    CTX_8K=384
    CTX_32K=512
else
    CHECK_ARGS=()
    BENCH_ARGS=()
    DEC_ARGS=(--model random --device cuda --dtype bf16 --steps 16 --rounds 3 --warmup 3)
    CTX_8K=8192
    CTX_32K=32768
fi

# ---- env: a CUDA GPU, or stop here
ENV_CODE='# env
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
ok = torch.cuda.is_available()
print("cuda available:", ok)
if ok:
    print("device:", torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory // 2**30, "GiB")
import triton, transformers, tinyserve_compile
print("triton", triton.__version__, "transformers", transformers.__version__)
sys.exit(0 if ok or sys.argv[1:] == ["dry"] else 3)
'
ENV_ARGS=()
if [ "$DRY" = 1 ]; then ENV_ARGS=(dry); fi
run env 30 "$PY" -c "$ENV_CODE" ${ENV_ARGS[@]+"${ENV_ARGS[@]}"}
rc=$?
if [ "$rc" != 0 ]; then
    echo "gpu_check: no usable CUDA GPU (torch.cuda.is_available() is False, or torch/triton/tinyserve_compile"
    echo "do not import; see $OUT/env.log). Run on a machine with one CUDA GPU, or use --dry-run."
    exit 2
fi
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.max.mem --format=csv \
    > "$OUT/nvidia_smi.csv" 2>&1

# the selection settings, the shipped defaults first (a step cut by its time limit has timed them)
SETTINGS=(--settings defaults paper)
run kernel_check 90 "$PY" -m bench gpu --check-only "${SETTINGS[@]}" ${CHECK_ARGS[@]+"${CHECK_ARGS[@]}"} \
    --out-dir "$OUT/kernel_check"
run kernel_bench 90 "$PY" -m bench gpu "${SETTINGS[@]}" ${BENCH_ARGS[@]+"${BENCH_ARGS[@]}"} --out-dir "$OUT/kernel_bench"
run decode_8k 150 "$PY" -m bench decode "${DEC_ARGS[@]}" --contexts "$CTX_8K" --batches 1 \
    --json "$OUT/decode_8k/decode.json"
run decode_32k 90 "$PY" -m bench decode "${DEC_ARGS[@]}" --contexts "$CTX_32K" --batches 1 --warm-compile \
    --json "$OUT/decode_32k/decode.json"

# ---- summary (stdout and $OUT/summary.json)
"$PY" - "$OUT" "$(( $(date +%s) - T_START ))" <<'PYEOF'
import csv, json, os, sys

out, total = sys.argv[1], float(sys.argv[2])


def load(path):
    path = os.path.join(out, path)
    return json.load(open(path)) if os.path.exists(path) else None


steps = [dict(step=r[0], rc=int(r[1]), seconds=int(r[2]), limit=int(r[3]))
         for r in csv.reader(open(os.path.join(out, "steps.tsv")), delimiter="\t")]
summary = dict(steps=steps, total_seconds=total, ok=all(s["rc"] == 0 for s in steps))
print(f"\n==== gpu_check summary ({total:.0f} s, output in {out})")
for s in steps:
    state = "ok" if s["rc"] == 0 else ("TIMED OUT" if s["rc"] in (124, 137) else f"FAILED (rc {s['rc']})")
    print(f"  {s['step']:<13} {state:<12} {s['seconds']:>4} s of {s['limit']}")
chk = load("kernel_check/bench_kernel_gpu.json")
if chk:
    rows = chk["rows"]
    summary["kernel_check"] = c = dict(device=chk["meta"]["device"], shapes=len(rows),
                                       failures=sum(not r["ok"] for r in rows),
                                       worst_tol_ratio=max(r["tol_ratio"] for r in rows),
                                       min_pages_agree=min(r["pages_agree"] for r in rows),
                                       paths={s: sorted({f"{r['stages']}/{r['kept']}" for r in rows
                                                         if r["setting"] == s})
                                              for s in dict.fromkeys(r["setting"] for r in rows)})
    print(f"  kernel check on {c['device']}: {c['shapes']} shapes, {c['failures']} failures, worst error "
          f"{c['worst_tol_ratio']:.2f}x tolerance, same pages as the reference in >= {c['min_pages_agree']:.0%} "
          "of KV heads")
    print("  selection paths (stages/kept): " + ", ".join(f"{k} {' '.join(v)}" for k, v in c["paths"].items()))
bench = load("kernel_bench/bench_kernel_gpu.json")
if bench:
    keys = ("setting", "stages", "kept", "bounds_dtype", "context", "batch", "dtype", "sparse_ms", "speedup_vs_sdpa",
            "speedup_vs_dense", "sparse_gbs",
            "sparse_pct_peak")
    summary["kernel_bench"] = [{k: r.get(k) for k in keys} for r in bench["rows"]]
    print("  kernel bench: sparse ms, speed-up vs the fastest SDPA backend, % of peak bandwidth")
    for r in summary["kernel_bench"]:
        sp = "n/a" if r["speedup_vs_sdpa"] is None else f"{r['speedup_vs_sdpa']:.2f}x"
        pk = "n/a" if r["sparse_pct_peak"] is None else f"{r['sparse_pct_peak']:.0f}%"
        print(f"    {r['setting']:>8} {r['stages']}/{r['kept']:<6} {r['context']:>7} B={r['batch']} {r['dtype']}: "
              f"{r['sparse_ms']:.3f} ms {sp:>7} {pk:>5}")
    summary["kernel_targets"] = bench["targets"]
    for t in bench["targets"]:
        print(f"    target {t['target']}: {t['worst']:.2f} -> {'met' if t['met'] else 'MISSED'}")
dec = (load("decode_8k/decode.json") or []) + (load("decode_32k/decode.json") or [])
if dec:
    keys = ("provider", "context", "batch", "ms_per_token", "vs_best_stock", "compile_s", "cold_compile", "floor_ms",
            "model", "dtype", "device")
    summary["decode"] = [{k: r.get(k) for k in keys} for r in dec]
    print("  decode: ms per token, speed-up vs the fastest stock provider, compile s")
    for r in summary["decode"]:
        warm = "" if r["cold_compile"] else " (warm caches)"
        print(f"    {r['context']:>6} B={r['batch']} {r['provider']:<12} {r['ms_per_token']:8.2f} ms "
              f"{r['vs_best_stock']:5.2f}x  compile {r['compile_s']:6.1f} s{warm}")
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
print("  all steps passed" if summary["ok"] else "  SOME STEPS FAILED: see the logs above and in " + out)
sys.exit(0 if summary["ok"] else 1)
PYEOF
