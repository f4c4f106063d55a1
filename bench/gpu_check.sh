#!/usr/bin/env bash
# The GPU check (issue 37): everything to run, unattended, when a machine with one CUDA GPU is lent, in < 8 minutes.
# The op alone against SDPA, then decode steps of whole models against the stock providers (eager, torch.compile,
# torch.compile with CUDA graphs), tinyserve with and without CUDA graphs; the shipped defaults first.
#
#   pip install --no-deps --no-build-isolation -e .   # torch with CUDA, triton and transformers must be there
#   bash bench/gpu_check.sh              # JSON, CSV, logs and summary.json under ${OUT:-docs/gpu}
#   bash bench/gpu_check.sh --dry-run [--device-name "NVIDIA H100 80GB HBM3"]
#                                        # CPU, tiny shapes, Triton interpreter: the script's logic only, written
#                                        # to ${OUT:-a new mktemp folder}, never docs/gpu; --device-name pretends
#                                        # to be that card (tests/kernels/test_triton_bench_dry_run.py runs this)
#
# The card (an H100 or an H200, by torch.cuda.get_device_name) sets the datasheet peak the kernel step quotes
# (3350 or 4800 GB/s) and the decode points: one whose model and static cache would not fit in 80% of the
# device's memory runs at a smaller batch (bench.gpu_check env writes the plan to $OUT/plan.env).
#
# Steps, each under `timeout` (seconds; the LIMIT_* below: 470 s in all, under 8 minutes):
#   env            20  versions, device, card, driver, commit -> env.json, plan.env; exit 2 without a usable GPU
#   kernel        150  python -m bench gpu: the Triton op checked against the reference, then timed with SDPA
#                      (flash/efficient/math, GQA) under CUDA graphs (do_bench_cudagraph) and plain (do_bench):
#                      Hq=32 Hkv=8 D=128 budget 2048 bf16, 4K/32K/128K x B8 and 32K/128K x B1, the defaults then
#                      the paper's setting (GPU_CHECK_COMPARE: another preset); % of the HBM peak a
#                      device-to-device copy reaches in the same run. The last H200 run took 84 s (cold caches)
#   decode_smollm 120  python -m bench decode, random-init Llama of SmolLM2-135M's shape (its first 10 of 30
#                      layers), bf16, B1, at 8K then 32K: eager, inductor-cudagraphs (torch.compile
#                      mode="reduce-overhead"), inductor-flex-cudagraphs (the same with transformers' FlexAttention:
#                      the GQA-native dense decode), tinyserve-cudagraphs, tinyserve, inductor; each provider compiled,
#                      timed and profiled once (kernels, launches, host syncs, CUDA graphs on/off and why) before
#                      the next, one more round interleaved at the end
#   decode_8b     170  the same with Llama-3-8B's shape (its first 8 of 32 layers, random init on the GPU in bf16,
#                      random K/V in the static cache, no prefill), 32K x B8 then 128K x B4, one cache at a time
#   summary        10  python -m bench.gpu_check summary: summary.json, summary.csv, the table (printed last)
# Compiles dominate (10-40 s per provider and point on an H200, cold caches): hence the layer counts, one process
# per model (imports once, Inductor's and Triton's caches warm for the second point), and --time-budget, which
# skips (and records) a provider whose compile would not fit in its point's share of the step. Every step
# writes its rows as they complete, so a step cut by its limit leaves what it measured.
# Environment: OUT (default docs/gpu; a dry run's: a new mktemp folder), PYTHON, TIMEOUT_SCALE=N (multiplies
# every limit; the tests use it for --dry-run on a loaded CPU), GPU_CHECK_STEPS="kernel decode_8b" (run only
# these steps), GPU_CHECK_SMOL_LAYERS and GPU_CHECK_8B_LAYERS (layer counts; "all" for the whole model, with a
# longer TIMEOUT_SCALE), GPU_CHECK_COMPARE (the kernel step's second setting, default paper).
# Exit status: 0 when every step passed, 1 otherwise, 2 without a GPU or on a bad argument.
set -u
cd "$(dirname "$0")/.."

# the step limits (seconds): tests/test_bench_gpu_check_plan.py checks that they add up to less than 480
LIMIT_ENV=20
LIMIT_KERNEL=150
LIMIT_SMOL=120
LIMIT_8B=170
LIMIT_SUMMARY=10

DRY=0
DEVICE_NAME=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --device-name) DEVICE_NAME=${2:-}; shift ;;
        --device-name=*) DEVICE_NAME=${1#--device-name=} ;;
        *) echo "gpu_check: unknown argument $1 (--dry-run, --device-name NAME)"; exit 2 ;;
    esac
    shift
done
if [ -n "$DEVICE_NAME" ] && [ "$DRY" != 1 ]; then
    echo "gpu_check: --device-name pretends a device in a dry run only (a GPU run detects its card)"; exit 2
fi
PY=${PYTHON:-$(command -v python || command -v python3)}
if [ "$DRY" = 1 ]; then
    OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_dry.XXXXXX")}
    case "$(realpath -m "$OUT")/" in  # before anything is made there
        "$(realpath -m docs/gpu)/"*)
            echo "gpu_check: a dry run never writes over the committed results in docs/gpu: set OUT to a scratch folder"
            exit 2 ;;
    esac
    echo "gpu_check: dry run, output in $OUT"
else
    OUT=${OUT:-docs/gpu}
fi
mkdir -p "$OUT"
: > "$OUT/steps.tsv"
rm -f "$OUT/plan.env"  # the env step writes this run's
export PYTHONUNBUFFERED=1  # a step killed at its limit keeps its log
T_START=$(date +%s)

# run NAME LIMIT CMD...: one guarded step, its output in $OUT/NAME.log, its status in $OUT/steps.tsv
run() {
    local name=$1 limit=$2
    shift 2
    if [ -n "${GPU_CHECK_STEPS:-}" ] && [ "$name" != env ] && [[ " ${GPU_CHECK_STEPS//,/ } " != *" $name "* ]]; then
        return 0
    fi
    local t0 rc cmd="$*"
    t0=$(date +%s)
    echo "=== $name (limit ${limit}s): ${cmd:0:160}"
    timeout -k 5 "$(( limit * ${TIMEOUT_SCALE:-1} ))" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    grep -v -e '^W[0-9]\{4\} ' -e 'torchao' -e '^USDT' -e 'warnings.warn' -e 'UserWarning' "$OUT/$name.log" | tail -n 6
    { [ "$rc" = 124 ] || [ "$rc" = 137 ]; } && echo "=== $name: TIMED OUT after ${limit}s"
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$limit" >> "$OUT/steps.tsv"
    return "$rc"
}

layers() {  # layers N|all -> the --layers argument
    if [ "$1" = all ]; then echo ""; else echo "--layers $1"; fi
}

# the order providers are compiled and timed in: what the targets compare first
# (inductor-flex-cudagraphs: the GQA-native dense decode, FlexAttention under CUDA graphs; plain inductor, never the
# fastest dense decode on a GPU, last, where the time budget may skip it and say so)
PROVIDERS=eager,inductor-cudagraphs,inductor-flex-cudagraphs,tinyserve-cudagraphs,tinyserve,inductor
ENV_ARGS=(--layers-8b "${GPU_CHECK_8B_LAYERS:-8}")
if [ "$DRY" = 1 ]; then
    export TRITON_INTERPRET=1
    ENV_ARGS+=(--dry-run)
    if [ -n "$DEVICE_NAME" ]; then ENV_ARGS+=(--device-name "$DEVICE_NAME"); fi
    KERNEL_ARGS=(--dry-run --contexts 128 --batches 2 --dtypes bf16)
    # stock Inductor compiles C++ on a CPU (minutes): the dry run leaves it out; the CUDA-graphs providers are
    # skipped off CUDA, with the reason in their records
    DEC_ARGS=(--device cpu --dtype bf16 --providers eager,inductor-cudagraphs,inductor-flex-cudagraphs,tinyserve-cudagraphs,tinyserve
              --steps 2 --rounds 2 --warmup 1 --warm-compile --keep-going
              --options '{"token_budget": 64, "lower": "eager"}' --prefill-cache "$OUT/prefill")
    SMOL=(--model tiny)
    BIG=(--model tiny --fill random --layers 3)
else
    KERNEL_ARGS=(--iters 50 --graph-rep 20)
    DEC_ARGS=(--device cuda --dtype bf16 --providers "$PROVIDERS" --rounds 2 --warmup 3 --warm-compile --keep-going
              --max-batch-tokens 1048576)
    # shellcheck disable=SC2207
    SMOL=(--model random --steps 8 --time-budget $(( LIMIT_SMOL - 25 )) $(layers "${GPU_CHECK_SMOL_LAYERS:-10}"))
    # shellcheck disable=SC2207
    BIG=(--model llama3-8b --steps 6 --time-budget $(( LIMIT_8B - 30 )) $(layers "${GPU_CHECK_8B_LAYERS:-8}"))
fi

# ---- env: a CUDA GPU (or a dry run), its card and the plan, or stop here
run env "$LIMIT_ENV" "$PY" -m bench.gpu_check env --out "$OUT" "${ENV_ARGS[@]}"
rc=$?
if [ "$rc" != 0 ] || [ ! -f "$OUT/plan.env" ]; then
    echo "gpu_check: no usable CUDA GPU (torch.cuda.is_available() is False, or torch/triton/transformers/"
    echo "tinyserve_compile do not import; see $OUT/env.log). Run on a machine with one CUDA GPU, or use --dry-run."
    exit 2
fi
# CARD DEVICE PEAK_GBS MEMORY_GB SMOL_POINTS BIG_POINTS PLAN_NOTES
# shellcheck disable=SC1091
. "$OUT/plan.env"
echo "=== card: $CARD ($DEVICE), datasheet ${PEAK_GBS:-?} GB/s, ${MEMORY_GB:-?} GB; decode points:" \
     "$SMOL_POINTS | $BIG_POINTS${PLAN_NOTES:+ ($PLAN_NOTES)}"
if [ -n "$PEAK_GBS" ]; then KERNEL_ARGS+=(--peak-gbs "$PEAK_GBS"); fi
# shellcheck disable=SC2206
SMOL+=(--points $SMOL_POINTS)
# shellcheck disable=SC2206
BIG+=(--points $BIG_POINTS)

# the selection settings, the shipped defaults first (a step cut by its time limit has timed them)
run kernel "$LIMIT_KERNEL" "$PY" -m bench gpu --compare "${GPU_CHECK_COMPARE:-paper}" "${KERNEL_ARGS[@]}" \
    --out "$OUT/kernel"
run decode_smollm "$LIMIT_SMOL" "$PY" -m bench decode "${DEC_ARGS[@]}" "${SMOL[@]}" \
    --out "$OUT/decode_smollm/decode.json"
run decode_8b "$LIMIT_8B" "$PY" -m bench decode "${DEC_ARGS[@]}" "${BIG[@]}" --out "$OUT/decode_8b/decode.json"

# ---- summary: summary.json, summary.csv and the table, printed last
timeout -k 5 "$(( LIMIT_SUMMARY * ${TIMEOUT_SCALE:-1} ))" "$PY" -m bench.gpu_check summary --out "$OUT" \
    --limit "$LIMIT_SUMMARY" --seconds "$(( $(date +%s) - T_START ))" 2> "$OUT/summary.log"
