#!/usr/bin/env bash
# The device call (one call, about 7 minutes; paste as is):
#   run(command="bash tools/gpu_check.sh --budget 450 --out $OUT", carry=[".whl"], timeout_s=480)
# What is still missing after the H100 run of 2026-11-27 (benchmarks/gpu/, docs/benchmarks.md "GPU: ..."): the
# engine's decode figure. That call, first:
#   run(command="bash tools/gpu_check.sh --budget 450 --out $OUT install smoke build7b rtn7b decode7b kernels",
#       carry=[".whl"], timeout_s=480)
# Before it, here with network, once: bash tools/gpu_check.sh --fetch-wheels   (fills .whl/, about 2.8 MB)
#
# Issue 37: quantkit on a GPU (the Triton kernels, the engine's Triton backend, quantize --device cuda) in ONE call
# of a lent machine with no network (/work/.library/device/README.md: at most 10 minutes a call, 15 minutes of
# device time in all, files back from $OUT: at most 8, 16 MiB each).
#
#   tools/gpu_check.sh [--budget S] [--out DIR] [--dry-run] [STEP ...]   (default: every step, in the order below)
#   tools/gpu_check.sh --fetch-wheels                                    (here, with network: fill .whl/)
#
# One global deadline (--budget, default 450 s from the script's start): each step runs under min(its limit, the
# time left); a step that can no longer fit its floor, or whose prerequisite failed, is skipped and recorded as
# skipped. GPU_CHECK_LIMIT_<STEP>=S replaces a step's limit, GPU_CHECK_LIMIT_SCALE=F (0.5 is fine) scales every
# limit and floor. The steps (limits and floors: tools/gpu_check_run.py PLAN), by value and risk:
#   env        versions, GPU, df -h, nvidia-smi
#   install    the carried wheels (pydantic and its 4 dependencies) with pip --no-index, quantkit itself installed
#              without -e from a copy, then the CLI and the runtime imported from outside the tree
#   smoke      a random SmolLM2-135M-shape model built on the GPU; RTN W4 with --device cuda; the kernel
#              self-check; the engine's Triton backend against its torch backend (teacher-forced logits, greedy
#              tokens): the packed matmul and RMSNorm kernels as the engine calls them on CUDA; GPTQ W4 --device cuda
#   kernels    pytest tests/runtime/kernels on the GPU (-n 8 --timeout 120 where xdist and pytest-timeout exist)
#   bench      benchmarks/bench_kernels.py on 7B shapes (paged attention at context 4096, batch 16 is the goal
#              figure) W4 g128 (also inside CUDA graphs: no launch cost) and W8 per-channel, and a block-size
#              sweep of the W4 matmul per M bucket
#   parity     the engine (Triton, float16) against HF transformers on the float 135M-shape model: logits
#   build7b    a random float16 model of Llama-2-7B's widths drawn on the GPU, 16 blocks (GPU_CHECK_DECODE_LAYERS:
#              RTN of all 32 took ~6 s a block there, too long for one call beside the other steps)
#   rtn7b      quantize --method rtn W4 g128 --device cuda of it
#   decode7b   decode tokens/s at batch 1, 16, 64 (each warmed up first) against the bandwidth roofline, the
#              engine's stage profile and the GPU-kernel share of a decode step; then the 7B files are deleted
#   gptq8      GPTQ W4 g128 with --device cuda on 8 layers of 7B width: seconds per block, the 32-layer estimate
# Each step's output is appended live to $OUT/gpu_check.log; $OUT/gpu_check.json (every step's status, seconds,
# log tail and figures) is rewritten every few seconds; the run ends by printing one summary table of the figures.
# Work files (40 GB at most, the 7B model's) go to $GPU_CHECK_WORK: by default /tmp/gpu_check, or .gpu_check_work/
# beside the repository when /tmp has less than 40 GB free.
#
# A later call on a fresh machine names the steps it wants, install first (a machine comes back bare), e.g.
#   bash tools/gpu_check.sh --budget 450 --out $OUT install build7b rtn7b decode7b gptq8
# --dry-run runs the same steps on this machine's CPU with tiny shapes (the kernels under TRITON_INTERPRET=1, the
# GPU benchmarks skipped) to check the script itself: tests/tooling/test_gpu_check.py.
set -u

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SCRIPT=$REPO/tools/gpu_check.sh
WHEELS=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
        typing-extensions==4.16.0)

fetch_wheels() {
  local exclude
  exclude=$(git -C "$REPO" rev-parse --git-path info/exclude)  # a worktree's .git is a file: ask git
  case $exclude in /*) ;; *) exclude=$REPO/$exclude ;; esac
  mkdir -p "$(dirname "$exclude")"
  grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
  "${PYTHON:-python3}" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$REPO/.whl" "${WHEELS[@]}"
}

# ------------------------------------------------------------------ configuration (main run and each step)
configure() {
  if [ -z "${GPU_CHECK_WORK:-}" ]; then
    GPU_CHECK_WORK=/tmp/gpu_check
    local free_gb
    free_gb=$(df --output=avail -BG /tmp 2> /dev/null | tail -1 | tr -dc 0-9)
    if [ "${free_gb:-0}" -lt 40 ] && [ "$DRY" != 1 ]; then GPU_CHECK_WORK=$(dirname "$REPO")/.gpu_check_work; fi
    export GPU_CHECK_WORK  # the steps use the same folder
  fi
  WORK=$GPU_CHECK_WORK
  RESULTS=$WORK/results
  SITE=$WORK/site  # the carried wheels, installed by the install step
  if [ -z "${PYTHON:-}" ]; then
    if [ "$DRY" = 1 ] && [ -x "$REPO/.venv/bin/python" ]; then PYTHON=$REPO/.venv/bin/python; else PYTHON=python3; fi
  fi
  export PYTHONUNBUFFERED=1 QUANTKIT_CACHE=$WORK/cache HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  case ":${PYTHONPATH:-}:" in *":$SITE:"*) ;; *) export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} ;; esac
  if [ "$DRY" = 1 ]; then
    SMALL=tiny; BIG=tiny; BIG_LAYERS=; SMALL_GROUP=32; BIG_GROUP=32; DEVICE=cpu; MODEL_DTYPE=float32; ENGINE_DTYPE=float32
    PARITY_DTYPE=float32; BATCHES="1 2"; TOKENS=8; PROMPTS=2; SMALL_CAL="--num-samples 4 --seq-len 64"
    GPTQ_CAL="--num-samples 4 --seq-len 64"; GPTQ_LAYERS=3; KERNEL_TESTS=tests/runtime/kernels/test_selfcheck.py
    export TRITON_INTERPRET=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  else
    SMALL=smollm2-135m; BIG=llama2-7b; SMALL_GROUP=64; BIG_GROUP=128; DEVICE=cuda; MODEL_DTYPE=float16
    ENGINE_DTYPE=bfloat16; PARITY_DTYPE=float16; BATCHES="1 16 64"; TOKENS=32; PROMPTS=8
    SMALL_CAL="--num-samples 16 --seq-len 128"; GPTQ_CAL="--num-samples 128 --seq-len 512"; GPTQ_LAYERS=8
    KERNEL_TESTS=tests/runtime/kernels; unset TRITON_INTERPRET
    # the decode model: Llama-2-7B's widths with fewer blocks, so build, RTN and decode fit one call beside the
    # other steps (the roofline counts the checkpoint's own bytes, so the fraction stays comparable)
    BIG_LAYERS=${GPU_CHECK_DECODE_LAYERS:-16}
  fi
  SMALL_DIR=$WORK/models/$SMALL
  BIG_DIR=$WORK/models/$BIG
  CKPT=$WORK/checkpoints  # quantized models
  W4_DIR=$CKPT/$BIG-w4-rtn
  GPTQ_DIR=$WORK/models/$BIG-$GPTQ_LAYERS-layers
}

py() { "$PYTHON" "$@"; }

build() {  # preset dir seed [random_model options]: weights drawn on $DEVICE
  py -m tools.random_model "$1" "$2" --dtype "$MODEL_DTYPE" --device "$DEVICE" --seed "$3" --shard-mb 2000 "${@:4}"
}

# ------------------------------------------------------------------ the steps (each run as SCRIPT --run-step NAME)
step_env() {
  df -h / "$WORK" 2>&1
  if command -v nvidia-smi > /dev/null; then nvidia-smi 2>&1 | head -20; fi
  py -m tools.gpu_check env "$RESULTS/env/env.json"
}

step_install() {
  if [ "$DRY" = 1 ]; then
    echo "dry run: the carried wheels are built for the GPU machine's Python 3.12; not installed"
  elif compgen -G ".whl/*.whl" > /dev/null; then
    py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
      || return 1
  elif ! py -c "import pydantic" 2> /dev/null; then
    echo "no pydantic and no .whl/: run tools/gpu_check.sh --fetch-wheels here, then name .whl in the call's carry"
    return 1
  fi
  rm -rf "$WORK/src" "$WORK/pkg" && mkdir -p "$WORK/src"  # built from a copy: the tree gets no build/ folder
  cp -r pyproject.toml README.md quantkit "$WORK/src/"
  local pip_rc=0 where=$WORK/pkg
  py -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --target "$WORK/pkg" \
    "$WORK/src" || pip_rc=$?
  if [ $pip_rc != 0 ]; then
    echo "pip install of quantkit failed (rc $pip_rc): checking the tree instead"
    where=$REPO
  fi
  (cd /tmp && PYTHONPATH="$where:$PYTHONPATH:$REPO" "$PYTHON" -m tools.gpu_check imports \
    "$RESULTS/install/install.json" --expect "$where" --pip-rc $pip_rc)
}

step_smoke() {
  local rc=0
  build "$SMALL" "$SMALL_DIR" 0 || return 1
  py -m quantkit quantize "$SMALL_DIR" -o "$CKPT/small-rtn" --method rtn --bits 4 --group-size $SMALL_GROUP \
    --device $DEVICE --force --json "$RESULTS/smoke/rtn.json" || return 1
  py -m tools.gpu_check engines "$CKPT/small-rtn" "$RESULTS/smoke/engines.json" --dtype $ENGINE_DTYPE || rc=1
  # shellcheck disable=SC2086
  py -m quantkit quantize "$SMALL_DIR" -o "$CKPT/small-gptq" --method gptq --bits 4 --group-size $SMALL_GROUP \
    --device $DEVICE $SMALL_CAL --force --json "$RESULTS/smoke/gptq.json" || rc=1
  return $rc
}

step_kernels() {
  local options=()
  py -c "import xdist" 2> /dev/null && options+=(-n 8)
  py -c "import pytest_timeout" 2> /dev/null && options+=(--timeout 120)
  py -m pytest "$KERNEL_TESTS" -q -p no:cacheprovider "${options[@]}" --junitxml="$WORK/kernels.xml"
  local rc=$?
  py -m tools.gpu_check junit "$WORK/kernels.xml" "$RESULTS/kernels/kernels.json" || rc=1
  return $rc
}

step_bench() {
  if [ "$DEVICE" != cuda ]; then echo "no CUDA: the kernels are timed on a GPU only"; return 0; fi
  local rc=0
  py -m benchmarks.bench_kernels --models llama7b --batches 1 16 64 --prefill 256 --context 4096 --bits 4 \
    --group-size 128 --json "$WORK/bench_w4.json" && py -m tools.gpu_check bench-figures "$WORK/bench_w4.json" \
    "$RESULTS/bench/w4.json" || rc=1
  # the same W4 kernels timed inside a CUDA graph: their own time, without the host's launch cost
  py -m benchmarks.bench_kernels --models llama7b --kernels matmul attention --batches 1 16 --prefill 256 \
    --context 4096 --bits 4 --group-size 128 --graph --json "$WORK/bench_graph.json" \
    && py -m tools.gpu_check bench-figures "$WORK/bench_graph.json" "$RESULTS/bench/graph.json" || rc=1
  py -m tools.gpu_check sweep "$RESULTS/bench/sweep.json" || rc=1
  py -m benchmarks.bench_kernels --models llama7b --kernels matmul --batches 1 16 --prefill 256 --bits 8 \
    --group-size -1 --json "$WORK/bench_w8.json" && py -m tools.gpu_check bench-figures "$WORK/bench_w8.json" \
    "$RESULTS/bench/w8.json" || rc=1
  return $rc
}

step_parity() {
  build "$SMALL" "$SMALL_DIR" 0 || return 1  # the smoke step's model when it ran
  py -m tools.gpu_check parity "$SMALL_DIR" "$RESULTS/parity/parity.json" --prompts $PROMPTS --tokens $TOKENS \
    --dtype $PARITY_DTYPE
}

step_build7b() {
  py -m tools.gpu_check timed "$RESULTS/build7b/build.json" --size "$BIG_DIR" -- "$PYTHON" -m tools.random_model \
    "$BIG" "$BIG_DIR" --dtype "$MODEL_DTYPE" --device "$DEVICE" --seed 1 --shard-mb 2000 ${BIG_LAYERS:+--layers $BIG_LAYERS}
}

step_rtn7b() {
  py -m quantkit quantize "$BIG_DIR" -o "$W4_DIR" --method rtn --bits 4 --group-size $BIG_GROUP --device $DEVICE \
    --force --json "$RESULTS/rtn7b/rtn.json"
}

step_decode7b() {
  # shellcheck disable=SC2086
  py -m tools.gpu_check decode "$W4_DIR" "$RESULTS/decode7b/decode.json" --batches $BATCHES --tokens 64 \
    --prompt-len 64 --dtype $ENGINE_DTYPE
  local rc=$?
  rm -rf "$W4_DIR" "$BIG_DIR"  # the disk holds 64 GiB with the image
  return $rc
}

step_gptq8() {
  rm -rf "$W4_DIR" "$BIG_DIR"  # left behind when decode7b was killed at its limit
  build "$BIG" "$GPTQ_DIR" 2 --layers $GPTQ_LAYERS || return 1
  # shellcheck disable=SC2086
  py -m tools.gpu_check gptq "$GPTQ_DIR" "$CKPT/gptq8" "$RESULTS/gptq8/gptq.json" --device $DEVICE $GPTQ_CAL \
    --full-layers 32
  local rc=$?
  rm -rf "$CKPT/gptq8" "$GPTQ_DIR"
  return $rc
}

# ------------------------------------------------------------------ main
T0=${GPU_CHECK_T0:-$(date +%s.%N)}  # the budget counts from here
BUDGET=450
OUTDIR=${OUT:-}
STEPS=()
RUN_STEP=
DRY=${GPU_CHECK_DRY:-0}
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --budget) BUDGET=$2; shift ;;
    --out) OUTDIR=$2; shift ;;
    --run-step) RUN_STEP=$2; shift ;;
    --fetch-wheels) fetch_wheels; exit $? ;;
    -h|--help) awk 'NR > 1 && /^set -u/ {exit} NR > 1' "$0"; exit 0 ;;
    -*) echo "unknown option $1; see tools/gpu_check.sh --help" >&2; exit 2 ;;
    *) STEPS+=("$1") ;;
  esac
  shift
done
cd "$REPO" || exit 2
configure
export GPU_CHECK_DRY=$DRY  # the steps, run as SCRIPT --run-step NAME, configure themselves the same way

if [ -n "$RUN_STEP" ]; then  # one step, called by the scheduler
  mkdir -p "$RESULTS/$RUN_STEP"
  "step_$RUN_STEP"
  exit $?
fi

OUTDIR=${OUTDIR:-$WORK/result}
rm -rf "$RESULTS"  # this call's results only
mkdir -p "$OUTDIR" "$RESULTS"
DRY_FLAG=()
[ "$DRY" = 1 ] && DRY_FLAG=(--dry-run)
exec "$PYTHON" -m tools.gpu_check_run --budget "$BUDGET" --out "$OUTDIR" --results "$RESULTS" --script "$SCRIPT" \
  --t0 "$T0" "${DRY_FLAG[@]}" "${STEPS[@]}"
