#!/usr/bin/env bash
# The checks that need one GPU, in one command of under ten minutes:
#
#     bash scripts/gpu_checks.sh OUT_DIR [PART ...]            # on a machine with one GPU
#     PYTHON=.venv/bin/python bash scripts/gpu_checks.sh OUT_DIR   # without one: the stand-ins
#
# Runs from the source tree as it is, with nothing installed: the repository
# root goes on PYTHONPATH, and the Python (python3, or $PYTHON) needs JAX
# (0.11.2 or newer, with its CUDA plugin on the GPU machine), flax, optax,
# orbax-checkpoint, tensorstore, safetensors, ml_dtypes, tqdm and pytest with
# pytest-xdist; tensorboardX, wandb, pyarrow and matplotlib are not used.
# Each part writes OUT_DIR/PART.txt (the bench also OUT_DIR/bench.json) under
# its own time limit, so that one part that hangs costs only its own minutes;
# PART names run only those parts.
#
#   versions   Python, JAX and its backend, flax, optax, orbax; the devices
#   suite      the suite's core (tests/core.txt) against this JAX release, on
#              the CPU with 8 simulated devices: whether the code runs on what
#              is installed
#   moves      the compiled step's copies, transposes, fills and roundings on
#              the GPU (scripts/hlo_moves.py), beside the CPU's in
#              docs/observability.md: which of the CPU's copies XLA:GPU keeps
#   anatomy    a bf16 gpt-small step's time by category (scripts/anatomy.py)
#   attention  compiled temporaries against sequence length under cuDNN's
#              attention (scripts/check_attention.py): no T x T growth
#   bench      `zero-jax bench --suite gpu-1` on gpt-small and gpt-xl without
#              offload (tokens/s, MFU, step time, compiled bytes)
#   gemm       the published runs' layer GEMMs timed in bf16 and float32
#              (scripts/gemm_sweep.py), written as OUT_DIR/gemm.toml: the
#              `gemm_sweep` line a device kind's TOML takes as its measured curve
#   fp8        gpt-small and gpt-xl in FP8 against bf16 (scripts/fp8_check.py):
#              the compiled step's cuBLASLt FP8 GEMMs counted, and each one's
#              tokens/s in one run
#   experts    the dropless experts' grouped GEMMs, tiled against ragged_dot,
#              at DeepSeek-V3's expert shape (scripts/grouped_gemm.py): each
#              one's time and the FLOPs it runs over the routed ones
#
# Without a GPU the GPU parts run their CPU stand-ins (XLA's attention, the
# gpu-1 selection's dry run, gpt-tiny, a tiny GPT in FP8, a small grouped
# GEMM), which check the
# script itself.
set -u
OUT=${1:?usage: bash scripts/gpu_checks.sh OUT_DIR [PART ...]}
shift
PARTS=${*:-versions suite moves anatomy attention bench gemm fp8 experts}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

GPU=$($PY -c 'import jax; print(int(jax.default_backend() == "gpu"))' 2>/dev/null || echo 0)

run() {  # run PART SECONDS COMMAND...: the command's output in OUT/PART.txt and on stdout
    local part=$1 seconds=$2
    shift 2
    case " $PARTS " in *" $part "*) ;; *) return 0 ;; esac
    local command="$*"
    echo "== $part (at most ${seconds}s): ${command:0:160}"
    local start=$SECONDS
    timeout "$seconds" "$@" >"$OUT/$part.txt" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$part.txt"
    echo "== $part: exit $rc after $((SECONDS - start))s"
}

run versions 60 $PY -c '
import sys, importlib.metadata as md, jax
print("python", sys.version.split()[0])
for name in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "optax",
             "orbax-checkpoint", "tensorstore", "numpy", "ml_dtypes", "safetensors", "pytest"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
print("backend", jax.default_backend(), [d.device_kind for d in jax.devices()])'

run suite 180 env JAX_PLATFORMS=cpu $PY -m pytest -q -x -n 8 --dist loadfile -p no:cacheprovider \
    $(cat tests/core.txt)

# What the GPU parts run on the GPU, and their stand-ins without one.
if [ "$GPU" = 1 ]; then
    DEVICES=()
    ANATOMY=(--model gpt-small --precision bf16 --batch-size 8 --seq-len 1024)
    ATTENTION=(--attention cudnn --precision bf16)
    BENCH=(--cases 'gpt-small/none,gpt-xl/none')
    GEMM=()
    FP8=()
    EXPERTS=()
else
    DEVICES=(--devices 1)
    ANATOMY=()
    ATTENTION=(--attention xla --seq-lens 256,512)
    BENCH=(--dry-run --cases 'dry-d64/none')
    GEMM=(--shapes 256x256x256,512x128x256 --dtypes float32 --repeats 3)
    FP8=(--dry-run --steps 2)
    EXPERTS=(--rows 512 --groups 4 --d-model 64 --d-expert 32 --dtype float32 --repeats 3)
fi
run moves 90 $PY scripts/hlo_moves.py "${DEVICES[@]}" --mesh data=1 --zero-stage 0 --top 15
run anatomy 120 $PY scripts/anatomy.py "${DEVICES[@]}" --mesh data=1 "${ANATOMY[@]}" --top 20
run attention 90 $PY scripts/check_attention.py "${ATTENTION[@]}"
run bench 240 $PY scripts/bench.py --suite gpu-1 "${BENCH[@]}" --json-out "$OUT/bench.json"
run gemm 180 $PY scripts/gemm_sweep.py "${GEMM[@]}" --toml "$OUT/gemm.toml"
run fp8 240 $PY scripts/fp8_check.py "${FP8[@]}"
run experts 120 $PY scripts/grouped_gemm.py "${EXPERTS[@]}"
